"""Small-to-medium cases of every kernel form, for compute-sanitizer (tools/sanitize.sh).

One case per form: the forward with and without residual and gate (both
orders), one tile and column tiles (H > 16384); the backward's dw forms none,
partial + combine, atomic, direct and column slices, wide rows (column tiles), the gated
backward, two-level row strides, T = 0 and H = 1. Each checks its outputs
against the FP64 reference, so the file also runs as an ordinary GPU test.
"""
import pytest
import torch

import trainnorm
from trainnorm.plan import DwForm
from trainnorm.rows import row_views

from trainnorm.families import make_case

from helpers import bwd_plan, check_backward, check_forward, check_gated

# the fast mode's atomic form wherever it applies, whatever the tuned edges (conftest.force_atomic)
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("force_atomic")]
EPS = 1e-6
MODE = {"none": DwForm.NONE, "partial": DwForm.PARTIAL, "atomic": DwForm.ATOMIC,
        "direct": DwForm.DIRECT, "row": DwForm.ROW}


def _run(case, deterministic, weight=True, workspace=None):
    w = case.weight if weight else None
    y, rstd, h = trainnorm.rms_norm_forward(case.x, w, EPS, residual=case.residual)
    dx, dw = trainnorm.rms_norm_backward(case.dy, h, w, rstd, dh=case.dh, deterministic=deterministic,
                                         workspace=workspace)
    torch.cuda.synchronize()
    check_forward(case.x, w, EPS, case.residual, y, rstd, h)
    check_backward(case.dy, h, w, rstd, case.dh, dx, dw)


@pytest.mark.parametrize("lead,hidden,deterministic,weight,residual,form", [
    ((300,), 512, True, True, False, "partial"),       # partial + fixed-order combine
    ((300,), 512, False, True, True, "atomic"),        # one launch, float64 atomics, last program finishes
    ((1,), 4096, True, True, True, "row"),             # one row, its terms straight to dw
    ((2,), 4096, True, True, True, "direct"),          # one chunk, stored straight to dw
    ((37,), 1536, True, False, False, "none"),         # no weight: no dw
    ((40,), 8200, True, True, True, "partial"),        # backward column tiles (H > 8192)
    ((9,), 20000, False, True, False, "partial"),      # forward column tiles too (H > 16384)
    ((3,), 65536, True, True, True, "partial"),        # the widest row
    ((16,), 1, True, True, False, "direct"),           # H = 1
    ((80,), 1, False, True, False, "atomic"),          # H = 1, two chunks (of 64 rows)
    ((70,), 1000, True, True, False, "partial"),       # odd width, fp32 weight below
])
def test_forms(lead, hidden, deterministic, weight, residual, form):
    case = make_case("outlier", lead, hidden, residual=residual, seed=hidden, device="cuda",
                     weight_dtype=torch.float32 if hidden == 1000 else None)
    rows = case.x.numel() // hidden
    assert bwd_plan(rows, hidden, torch.bfloat16, deterministic, weight).dw == MODE[form]
    _run(case, deterministic, weight)


@pytest.mark.parametrize("deterministic", [True, False])
def test_workspace_forms(deterministic):
    case = make_case("normal", (300,), 512, seed=1, device="cuda")
    ws = trainnorm.backward_workspace(300, 512, deterministic=deterministic, device="cuda")
    for _ in range(2):
        _run(case, deterministic, workspace=ws)


@pytest.mark.parametrize("deterministic", [True, False])
def test_two_level_rows(deterministic):
    # q = proj.view(T, 32, 256)[:, :24]: strides (8192, 256, 1), two levels; dy transposed leading dims
    base = make_case("normal", (64, 32), 256, residual=True, seed=2, device="cuda")
    x = base.x[:, :24]
    assert row_views(x)[0] == 24
    dy = base.dy[:, :24].transpose(0, 1).contiguous().transpose(0, 1)
    case = type(base)(x, base.weight, dy, base.residual[:, :24], base.dh[:, :24])
    _run(case, deterministic)
    q = make_case("outlier", (128, 24), 256, query_view=True, seed=3, device="cuda")
    assert q.x.stride() == (12288, 512, 1)
    _run(q, deterministic)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    _run(make_case("normal", (300,), 2048, dtype=dtype, residual=True, seed=4, device="cuda"), True)


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("lead,hidden,deterministic", [((300,), 512, False), ((20,), 8200, True), ((33, 4), 128, True)])
def test_gated(lead, hidden, deterministic, norm_before_gate):
    c = make_case("normal", lead, hidden, residual=True, seed=5, device="cuda")
    check_gated(c.x, c.residual, c.weight, c.dy, norm_before_gate, deterministic, EPS)


def test_empty_rows():
    x = torch.empty(0, 4, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(2048, dtype=torch.bfloat16, device="cuda")
    y, rstd, h = trainnorm.rms_norm_forward(x, w)
    for deterministic in (True, False):
        dx, dw = trainnorm.rms_norm_backward(torch.empty_like(x), x, w, rstd, deterministic=deterministic)
        torch.cuda.synchronize()
        assert dx.shape == x.shape and not dw.any()


@pytest.mark.parametrize("lead,hidden,residual,query", [
    ((64,), 4096, True, False),       # one tile per row, slices of 128 columns
    ((40,), 8200, False, False),      # column tiles for dx, slices past the last full one
    ((16, 24), 256, False, True),     # two-level rows read in place
])
@pytest.mark.parametrize("split,stages", [(False, 0), (True, 3)])
def test_cols_form(lead, hidden, residual, query, split, stages):
    # the column-slice dw (DwForm.COL_SLICES), forced on: plain and gated, both modes, every
    # program both roles or the roles split and a slice's walk pipelined
    from trainnorm import configs
    with configs.override(backward=lambda key, cfg: cfg.replace(slices_max_rows=1 << 40, slice_block_n=128,
                                                                split_roles=split, slice_stages=stages)):
        case = make_case("outlier", lead, hidden, residual=residual, query_view=query, seed=5, device="cuda")
        rows = case.x.numel() // hidden
        assert bwd_plan(rows, hidden, torch.bfloat16, True, True).dw == DwForm.COL_SLICES
        for det in (True, False):
            _run(case, det)
        gate = torch.randn(case.x.shape, device="cuda").to(torch.bfloat16)
        check_gated(case.x, gate, case.weight, case.dy, True)
