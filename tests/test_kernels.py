"""The kernels against reference.py on small shapes of every family.

On a machine without a GPU these run the real Triton kernels on CPU tensors
through Triton's interpreter (conftest.py); on a GPU they run compiled.
"""
import contextlib

import pytest
import torch

import trainnorm
from trainnorm import configs, dispatch, plan, reference
from trainnorm import rows as rows_mod
from trainnorm.families import FAMILIES, make_case
from trainnorm.plan import FWD_COL_UNROLL_MAX, DwForm
from trainnorm.rows import row_views, simulate_sm_count
from trainnorm.variant import Variant

from helpers import (DW_BUDGET, assert_bits_equal, assert_close64, bwd_config, bwd_plan, check_backward,
                     check_forward, fwd_config)

EPS = 1e-6
# H of the tuned families, odd widths, and widths past one tile (forward 16384, backward 8192)
HIDDEN = [512, 1536, 2048, 4096, 5120, 6144, 1000, 1, 33, 257]
WIDE = [8200, 20000]


def run_both(case, *, deterministic=True, eps=EPS):
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, eps, residual=case.residual)
    dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh, deterministic=deterministic)
    return y, rstd, h, dx, dw


def check_case(case, deterministic=True):
    y, rstd, h, dx, dw = run_both(case, deterministic=deterministic)
    check_forward(case.x, case.weight, EPS, case.residual, y, rstd, h)
    check_backward(case.dy, h, case.weight, rstd, case.dh, dx, dw)
    return y, rstd, h, dx, dw


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_plain_rows(device, hidden, dtype):
    case = make_case("normal", (37,), hidden, dtype=dtype, seed=hidden, device=device)
    check_case(case)


@pytest.mark.parametrize("lead,hidden,residual", [((4,), 245, True), ((41, 2), 5120, False), ((3,), 20000, False)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_float32_dw_is_one_rounding(device, lead, hidden, residual, deterministic, force_atomic):
    # float32 dy * h does not fit a float32 (48 bits): the terms are taken in float64, so dw
    # is the exact sum rounded once, err/tol <= 2**-24 / 1e-4 (= 6e-4). Rounding the product
    # in float32 gave up to 0.037 here, worse than the FP32 eager reduction (soak, H200).
    case = make_case("outlier", lead, hidden, dtype=torch.float32, residual=residual, seed=hidden, device=device)
    _, _, _, _, dw = check_case(case, deterministic)
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
    _, dw64 = reference.backward_fp64(case.dy, h, case.weight, rstd, case.dh)
    assert reference.dw_err_over_tol(dw, dw64) <= 2.0**-24 / 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("deterministic", [True, False])
def test_families_both_modes(device, family, weight_dtype, deterministic, force_atomic):
    # 300 rows of H512: several dw chunks, so the partial + combine (det) or atomic (fast) form runs
    case = make_case(family, (300,), 512, weight_dtype=weight_dtype, seed=7, device=device)
    plan = bwd_plan(300, 512, torch.bfloat16, deterministic, True)
    assert plan.num_chunks > 1
    assert plan.dw == (DwForm.PARTIAL if deterministic else DwForm.ATOMIC)
    check_case(case, deterministic)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_residual(device, weight_dtype):
    case = make_case("normal", (3, 41), 6144, weight_dtype=weight_dtype, residual=True, seed=3, device=device)
    y, rstd, h, dx, dw = check_case(case)
    # y is computed from the rounded h: the same bits as normalising h itself
    y2, rstd2, _ = trainnorm.rms_norm_forward(h, case.weight, EPS)
    assert_bits_equal(y, y2, "y(x, r) vs y(h)")
    assert_bits_equal(rstd, rstd2, "rstd(x, r) vs rstd(h)")


@pytest.mark.parametrize("hidden", WIDE)
def test_wide_rows_tile_loop(device, hidden):
    # rows wider than one register tile take the two-pass loop (and fp64 in-place partials)
    assert bwd_config(hidden, torch.bfloat16).col_tiles(hidden) > 1
    for deterministic in (True, False):
        case = make_case("outlier", (19,), hidden, residual=True, seed=hidden, device=device)
        check_case(case, deterministic)


@pytest.mark.parametrize("residual,gate", [(False, None), (True, None), (False, "after"), (False, "first")])
def test_wide_rows_held_dw_same_bits(device, residual, gate):
    # configs.BwdTile.hold_dw: the walked row's dw partial held in registers a chunk (the
    # second walk unrolled) against the partial added in place after every row tile: the
    # same bits (dx, dw, dz) in every form the plans take as T grows (column slices at 3
    # rows, several chunks of partials at 41) and in both modes; and dx, dw, dz near FP64
    hidden = 1000
    base = bwd_config(hidden).replace(block_m=1, block_n=256, block_n2=0, num_warps=2, dw_2d=False,
                                      min_rows_per_chunk=4, max_chunks=8, rows_max_chunks=(), tma_stages=0,
                                      prefetch=False, direct_prefetch=False, direct_tma_stages=0, loop_stages=0,
                                      direct_max_rows=0, slices_max_rows=8)
    held = base.replace(hold_dw=True)
    for rows, form in ((3, DwForm.COL_SLICES), (41, DwForm.PARTIAL)):
        case = make_case("outlier", (rows,), hidden, residual=residual, seed=rows, device=device)
        z = torch.randn(case.x.shape, dtype=case.x.dtype, device=device) if gate else None
        y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
        if gate:
            y, rstd = trainnorm.rms_norm_gated_forward(case.x, z, case.weight, EPS, norm_before_gate=gate == "after")
        for det in (True, False):
            outs = {}
            for name, cfg in (("in place", base), ("held", held)):
                with configs.override(backward=cfg):
                    plan_ = bwd_plan(rows, hidden, deterministic=det, gated=bool(gate))
                    assert (plan_.col_tiles, plan_.dw) == (4, form), name
                    if gate:
                        outs[name] = trainnorm.rms_norm_gated_backward(case.dy, case.x, z, case.weight, rstd,
                                                                       norm_before_gate=gate == "after",
                                                                       deterministic=det)
                    else:
                        outs[name] = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh,
                                                                 deterministic=det)
            if not gate:
                check_backward(case.dy, h, case.weight, rstd, case.dh, *outs["held"])
            for a, b in zip(outs["in place"], outs["held"]):
                assert_bits_equal(a, b, f"T {rows} det {det}: held dw against in place")


DEAL_FORMS = {   # name: (hidden, config overrides, the plan's dw form)
    "plain loads": (256, dict(tma_stages=0, prefetch=False), DwForm.PARTIAL),
    "prefetch": (256, dict(tma_stages=0, prefetch=True), DwForm.PARTIAL),
    "descriptors": (256, dict(tma_stages=3, prefetch=False), DwForm.PARTIAL),
    "dw_2d": (256, dict(tma_stages=0, prefetch=False, dw_2d=True), DwForm.PARTIAL),
    "walked": (200, dict(block_n=64, tma_stages=0, prefetch=False), DwForm.PARTIAL),
    "column slices": (256, dict(tma_stages=0, prefetch=False, slices_max_rows=400), DwForm.COL_SLICES),
}


@pytest.mark.parametrize("form", list(DEAL_FORMS))
def test_dealt_rows(device, form):
    # configs.BwdTile.deal_rows: the rows dealt to the chunks a row tile at a time. Each
    # chunk's float64 partial of dw (read back from the workspace) is the sum over its own
    # tiles, every num_chunks-th, and not over a run of rows; dx (and dw from column slices)
    # is the chunked form's bit for bit; dw is within the budget, and its bits follow neither
    # the SM count nor, from partials, the call
    hidden, over, form_dw = DEAL_FORMS[form]
    rows, block_m = 301, 4
    base = bwd_config(hidden).replace(block_m=block_m, min_rows_per_chunk=block_m, max_chunks=8, rows_max_chunks=(),
                                      direct_max_rows=0, **{"slices_max_rows": 0, "dw_2d": False, **over})
    dealt = base.replace(deal_rows=True)
    case = make_case("outlier", (rows,), hidden, seed=11, device=device)
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS)

    def run(cfg, det=True, sms=None):
        with configs.override(backward=cfg), (simulate_sm_count(sms) if sms else contextlib.nullcontext()):
            p = bwd_plan(rows, hidden, deterministic=det)
            ws = torch.zeros(max(p.workspace_bytes, 1), dtype=torch.uint8, device=device)
            out = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, deterministic=det, workspace=ws)
        return p, out, ws

    p0, chunked, _ = run(base)
    p1, out, ws = run(dealt)
    assert (p0.dealt, p1.dealt, p1.dw, p1.num_chunks, p1.rows_per_chunk) == (False, True, form_dw, 8, 40)
    check_backward(case.dy, h, case.weight, rstd, None, *out)
    assert_bits_equal(out[0], chunked[0], f"{form}: dx dealt vs chunked")
    for det, sms in ((True, 1), (True, 3), (True, 264), (False, 264)):
        again = run(dealt, det, sms)[1]
        assert_bits_equal(out[0], again[0], f"{form}: dx det={det} sms={sms}")
        if det:
            assert_bits_equal(out[1], again[1], f"{form}: dw sms={sms}")
    if form_dw is DwForm.COL_SLICES:
        assert_bits_equal(out[1], chunked[1], f"{form}: dw by column slices")
        return
    terms = case.dy.double() * h.double() * rstd.reshape(-1, 1).double()
    tiles = torch.arange(rows, device=device) // block_m
    partial = ws[:p1.workspace_bytes].view(torch.float64).view(8, hidden)
    for c in range(8):
        mine = terms[tiles % 8 == c].sum(0)
        run_ = terms[c * 40:(c + 1) * 40].sum(0)
        assert torch.allclose(partial[c], mine, rtol=1e-12, atol=1e-12 * mine.abs().max().item()), f"chunk {c}"
        assert not torch.allclose(partial[c], run_, rtol=1e-3), f"chunk {c}: a run of rows"


def test_weight_none(device):
    case = make_case("normal", (20,), 1536, seed=1, device=device)
    case.weight = None
    y, rstd, h, dx, dw = check_case(case)
    assert dw is None


@pytest.mark.parametrize("eps", [1e-6, 1e-2, None])
def test_eps(device, eps):
    case = make_case("normal", (9,), 512, dtype=torch.float16, seed=2, device=device)
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, eps)
    # eps=None: torch's default, the float32 machine epsilon (for fp16 x too)
    check_forward(case.x, case.weight, eps if eps is not None else torch.finfo(torch.float32).eps, None, y, rstd, h)


def test_empty_rows(device):
    x = torch.empty(0, 4, 2048, dtype=torch.bfloat16, device=device)
    w = torch.ones(2048, dtype=torch.bfloat16, device=device)
    y, rstd, h = trainnorm.rms_norm_forward(x, w)
    assert y.shape == x.shape and rstd.shape == (0, 4)
    for deterministic in (True, False):
        dx, dw = trainnorm.rms_norm_backward(torch.empty_like(x), x, w, rstd, deterministic=deterministic)
        assert dx.shape == x.shape
        assert dw.dtype == torch.float32 and torch.equal(dw, torch.zeros_like(dw))


def test_single_row_and_1d(device):
    case = make_case("normal", (1,), 4096, seed=4, device=device)
    check_case(case)
    y1, rstd1, _ = trainnorm.rms_norm_forward(case.x[0], case.weight)
    assert y1.shape == (4096,) and rstd1.shape == ()
    assert_bits_equal(y1, trainnorm.rms_norm_forward(case.x, case.weight)[0][0])


def test_three_d_and_noncontiguous_grads(device):
    case = make_case("normal", (3, 5), 512, seed=5, device=device)
    # dy arrives as the transpose of a [S, B, H] tensor: a two-level row layout
    case.dy = case.dy.transpose(0, 1).contiguous().transpose(0, 1)
    assert not case.dy.is_contiguous()
    check_case(case)


def test_query_view_read_in_place(device):
    case = make_case("outlier", (33, 24), 256, query_view=True, seed=6, device=device)
    assert case.x.stride() == (24 * 512, 512, 1)
    # rows of the query view sit 512 elements apart: one stride, read in place
    nh, ((t, st, sh),) = row_views(case.x)
    assert t is case.x and (nh, st) == (1, 512), "the query view must not be copied"
    y, rstd, h, dx, dw = check_case(case)
    assert y.shape == (33, 24, 256) and rstd.shape == (33, 24)
    # the same rows, contiguous, give the same bits
    y2, rstd2, _, dx2, dw2 = run_both(type(case)(case.x.contiguous(), case.weight, case.dy))
    for a, b, n in ((y, y2, "y"), (rstd, rstd2, "rstd"), (dx, dx2, "dx"), (dw, dw2, "dw")):
        assert_bits_equal(a, b, n)


@pytest.mark.parametrize("hidden,pad,copied", [(1024, 0, False), (1024, 16, False), (1024, 4, True),
                                               (1000, 0, False), (1000, 8, True), (1000, 12, False)])
def test_rows_specialised_as_contiguous(device, hidden, pad, copied):
    # Triton specialises a row stride divisible by 16 (and a 16-byte aligned base) and the
    # compiler lays the tile out from the loads, which fixes a row sum's order: rows whose
    # stride is specialised otherwise than contiguous rows' are copied once (rows.row_views)
    # and give contiguous rows' bits; one row takes a contiguous row's stride
    gen = torch.Generator(device=device).manual_seed(12)
    buf = torch.randn(7, hidden + pad, generator=gen, device=device).to(torch.bfloat16)
    x = buf[:, :hidden]
    nh, ((t, st, sh),) = row_views(x)
    assert (t is not x) == copied and st == (hidden if copied or pad == 0 else hidden + pad)
    assert row_views(x[2:3])[1][0][1] == hidden, "one row: a contiguous row's stride"
    w = torch.randn(hidden, generator=gen, device=device).to(torch.bfloat16)
    y, rstd, _ = trainnorm.rms_norm_forward(x, w)
    y2, rstd2, _ = trainnorm.rms_norm_forward(x.contiguous(), w)
    assert_bits_equal(y, y2, "y")
    assert_bits_equal(rstd, rstd2, "rstd")


def test_key_view(device):
    case = make_case("normal", (29, 4), 256, residual=True, seed=8, device=device)
    check_case(case)


def test_last_dim_stride_copied(device):
    case = make_case("normal", (7,), 512, seed=9, device=device)
    x = torch.empty(7, 1024, dtype=case.x.dtype, device=device)[:, ::2]
    x.copy_(case.x)
    assert x.stride(-1) == 2
    y, rstd, _ = trainnorm.rms_norm_forward(x, case.weight)
    assert_bits_equal(y, trainnorm.rms_norm_forward(case.x, case.weight)[0], "strided last dim")


# --- determinism, modes, batch invariance ---------------------------------------------------

def test_repeat_bitwise(device):
    case = make_case("outlier", (150,), 1536, weight_dtype=torch.float32, residual=True, seed=10, device=device)
    first = run_both(case)
    for _ in range(2):
        for a, b in zip(first, run_both(case)):
            assert_bits_equal(a, b, "repeat")


@pytest.mark.parametrize("hidden,rows", [(2048, 200), (256, 700), (8200, 40)])
def test_sm_count_independent(device, hidden, rows):
    case = make_case("normal", (rows,), hidden, seed=11, device=device)
    with simulate_sm_count(132):
        ref = run_both(case)
    for sms in (1, 3, 7, 1000):
        with simulate_sm_count(sms):
            out = run_both(case)
        for a, b, n in zip(ref, out, ("y", "rstd", "h", "dx", "dw")):
            assert_bits_equal(a, b, f"{n} with {sms} SMs")


@pytest.mark.parametrize("hidden,rows", [(512, 300), (5120, 120), (8200, 40)])
def test_modes_equal_except_dw(device, hidden, rows, force_atomic):
    # H512: the atomic form; H5120 at 120 rows: the fast mode takes the deterministic
    # form (atomic_min_rows); H8200: the wide-row form
    case = make_case("normal", (rows,), hidden, residual=True, seed=12, device=device)
    det = run_both(case, deterministic=True)
    fast = run_both(case, deterministic=False)
    for a, b, n in zip(det[:4], fast[:4], ("y", "rstd", "h", "dx")):
        assert_bits_equal(a, b, n)
    torch.testing.assert_close(det[4], fast[4], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("hidden,rows", [(512, 257), (2048, 150), (6144, 90)])
def test_batch_invariance(device, hidden, rows):
    big = make_case("normal", (rows,), hidden, residual=True, seed=13, device=device)
    out_big = run_both(big)
    for lo, hi in ((0, 1), (5, 21), (40, rows)):
        sub = type(big)(big.x[lo:hi], big.weight, big.dy[lo:hi], big.residual[lo:hi], big.dh[lo:hi])
        out = run_both(sub)
        for a, b, n in zip(out_big[:4], out[:4], ("y", "rstd", "h", "dx")):
            assert_bits_equal(a[lo:hi], b, f"{n} rows {lo}:{hi}")
    # a row's outputs do not depend on what the other rows hold
    other = type(big)(big.x.clone(), big.weight, big.dy.clone(), big.residual.clone(), big.dh.clone())
    other.x[1:] = torch.randn_like(other.x[1:], dtype=torch.float32).to(other.x.dtype) * 7
    other.dy[1:] = 0
    out = run_both(other)
    for a, b, n in zip(out_big[:4], out[:4], ("y", "rstd", "h", "dx")):
        assert_bits_equal(a[:1], b[:1], f"{n} row 0 with other rows changed")


@pytest.mark.parametrize("prefetch", [False, True])
def test_chunk_stages_no_deeper_than_its_tiles(device, use_configs, prefetch):
    # a chunk's row loop is pipelined on its own: descriptor stages past the row tiles a chunk
    # holds only take shared memory (plan.CHUNK_STAGES); the launch takes fewer, down to 2 (the
    # config's descriptor loads kept), with the same bits as the config's depth
    hidden = 256
    cfg = bwd_config(hidden).replace(block_m=2, tma_stages=4, prefetch=prefetch, direct_max_rows=0,
                                     slices_max_rows=0, min_rows_per_chunk=2, max_chunks=8,
                                     rows_max_chunks=())
    use_configs(backward=cfg)
    got = {}
    for rows in (2, 6, 16, 24, 64, 300):
        p = bwd_plan(rows, hidden)
        got[rows] = (p.rows_per_chunk, p.loads())
    # (one program of one row tile reads without descriptors: plan.ONE_TILE_NO_DESCRIPTORS)
    assert got[2] == (2, (prefetch, 0)) and got[6] == (2, (prefetch, 2)) and got[16] == (2, (prefetch, 2))
    assert got[24] == (4, (prefetch, 2)) and got[64] == (8, (prefetch, 4)) and got[300] == (38, (prefetch, 4))
    use_configs(backward=cfg.replace(min_rows_per_chunk=6))
    assert bwd_plan(24, hidden).loads() == (prefetch, 3)            # 4 chunks of 6 rows: 3 tiles
    use_configs(backward=cfg.replace(tma_stages=0))
    assert bwd_plan(16, hidden).loads() == (prefetch, 0)            # plain loads stay plain
    use_configs(backward=cfg)
    assert bwd_plan(16, hidden).dw is DwForm.PARTIAL
    case = make_case("outlier", (16,), hidden, seed=5, device=device)
    dy = torch.randn_like(case.x)
    rstd = trainnorm.rms_norm_forward(case.x, case.weight, EPS)[1]
    capped = trainnorm.rms_norm_backward(dy, case.x, case.weight, rstd)
    use_configs(backward=cfg.replace(min_rows_per_chunk=8))     # one chunk of 16 rows: 4 stages
    assert bwd_plan(16, hidden).loads() == (prefetch, 4) and bwd_plan(16, hidden).num_chunks == 2
    deep = trainnorm.rms_norm_backward(dy, case.x, case.weight, rstd)
    assert_bits_equal(capped[0], deep[0], "dx, stages capped against 4")


def test_workspace_reuse(device, use_configs):
    # the chunked form (its float64 partials in the workspace) at 300 rows: the measured
    # windows may take 300 rows to a form without one (H 2048's column slices reach 512)
    use_configs(backward=bwd_config(2048).replace(direct_max_rows=0, slices_max_rows=0))
    case = make_case("normal", (300,), 2048, seed=14, device=device)
    rows = 300
    nbytes = trainnorm.backward_workspace_bytes(rows, 2048)
    assert nbytes > 0
    ws = trainnorm.backward_workspace(rows, 2048, device=device)
    assert ws.numel() == nbytes and ws.dtype == torch.uint8
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight)
    ref = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd)
    for _ in range(2):
        out = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, workspace=ws)
        assert_bits_equal(ref[0], out[0], "dx")
        assert_bits_equal(ref[1], out[1], "dw")
    # a smaller problem fits in the same workspace
    small = trainnorm.rms_norm_backward(case.dy[:100], h[:100], case.weight, rstd[:100], workspace=ws)
    check_backward(case.dy[:100], h[:100], case.weight, rstd[:100], None, *small)


def test_fast_workspace_left_zeroed(device, force_atomic):
    # the one-launch fast form adds into a float64 accumulator that its last
    # program rounds into dw and zeroes again: reuse must not leak a call into the next
    case = make_case("outlier", (300,), 512, seed=15, device=device)
    assert bwd_plan(300, 512, torch.bfloat16, False, True).dw == DwForm.ATOMIC
    ws = trainnorm.backward_workspace(300, 512, deterministic=False, device=device)
    assert ws.numel() == 512 * 8 + 8 and not ws.any()
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight)
    det = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd)
    for _ in range(3):
        dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, deterministic=False, workspace=ws)
        assert not ws.any(), "the fast form must leave its workspace zeroed"
        assert_bits_equal(det[0], dx, "dx")
        check_backward(case.dy, h, case.weight, rstd, None, dx, dw)


@pytest.mark.parametrize("last_use", ["deterministic", "garbage"])
def test_fast_workspace_any_prior_contents(device, force_atomic, last_use):
    # a workspace last used by the deterministic form (its float64 partials left in it), or
    # holding arbitrary bytes, gives the fast form the same dx and a dw within the budget,
    # the same bits as a fresh workspace's where the additions' order is fixed (one program)
    hidden, rows = 512, 300
    case = make_case("outlier", (rows,), hidden, seed=16, device=device)
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight)
    ws = trainnorm.backward_workspace(rows, hidden, deterministic=True, device=device)
    assert ws.numel() >= trainnorm.backward_workspace_bytes(rows, hidden, deterministic=False)
    if last_use == "deterministic":
        trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, workspace=ws)
        assert ws.any()
    else:
        ws.copy_(torch.randint(0, 256, ws.shape, dtype=torch.uint8, device=device))
    assert bwd_plan(rows, hidden, torch.bfloat16, False, True).dw == DwForm.ATOMIC
    dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, deterministic=False, workspace=ws)
    check_backward(case.dy, h, case.weight, rstd, None, dx, dw)
    with simulate_sm_count(1):
        one = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, deterministic=False)
        ws.copy_(torch.randint(0, 256, ws.shape, dtype=torch.uint8, device=device))
        again = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, deterministic=False, workspace=ws)
    assert_bits_equal(dx, again[0], "dx")
    assert_bits_equal(one[1], again[1], "dw, one program, fresh vs garbage workspace")


def test_fast_mode_form_windows():
    # deterministic=False runs its atomic form only from the measured edge on (configs/sm_90.json)
    form = lambda rows, h, det: bwd_plan(rows, h, torch.bfloat16, det, True).dw
    assert form(16384, 5120, False) == DwForm.PARTIAL
    assert form(65536, 5120, False) == DwForm.ATOMIC
    assert form(65536, 5120, True) == DwForm.PARTIAL
    assert form(65536, 6144, False) == DwForm.PARTIAL       # measured slower with the TMA loads
    assert form(65536, 4096, False) == DwForm.PARTIAL       # never measured faster at H 4096
    assert form(1, 4096, False) == form(1, 4096, True) == DwForm.ROW
    assert form(100, 8200, False) == DwForm.PARTIAL          # wide rows: one form for both modes


def record_descriptors(monkeypatch) -> list:
    """The arguments of every tensor descriptor the dispatcher makes from now on."""
    made = []
    real = dispatch.row_descriptor
    monkeypatch.setattr(dispatch, "row_descriptor", lambda *a: made.append(a) or real(*a))
    return made


LOAD_FORMS = {"plain": {"tma_stages": 0}, "prefetch": {"prefetch": True, "tma_stages": 0}, "tma2": {"tma_stages": 2},
              "tma3": {"tma_stages": 3}}


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_load_forms_same_bits(device, monkeypatch, gated, residual):
    # PREFETCH and the tensor-descriptor loads (TMA_STAGES) only change when and how the
    # row tiles are read: every output keeps its bits, including a chunk whose last tile
    # is partial (rows 0..40 in chunks of 12, tiles of 4)
    hidden = 96
    base = bwd_config(hidden, torch.bfloat16, gated).replace(block_m=4, min_rows_per_chunk=12, max_chunks=8)
    case = make_case("outlier", (41,), hidden, residual=residual, seed=11, device=device)
    gate = torch.randn(case.x.shape, dtype=case.x.dtype, device=device) if gated else None
    made = record_descriptors(monkeypatch)
    outs = {}
    for name, kw in LOAD_FORMS.items():
        with configs.override(backward=base.replace(**kw)):
            if gated:
                y, rstd = trainnorm.rms_norm_gated_forward(case.x, gate, case.weight, EPS)
                outs[name] = trainnorm.rms_norm_gated_backward(case.dy, case.x, gate, case.weight, rstd)
            else:
                y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
                dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh)
                outs[name] = (dx, dw)
                check_backward(case.dy, h, case.weight, rstd, case.dh, dx, dw)
            assert bwd_plan(41, hidden, torch.bfloat16, True, True, gated).num_chunks == 4
    assert len(made) == 4         # tma2 and tma3 read dy and h through descriptors
    for name in LOAD_FORMS:
        for a, b in zip(outs["plain"], outs[name]):
            assert_bits_equal(a, b, f"{name} vs plain loads")


def test_tma_needs_aligned_rows(device, monkeypatch):
    # rows whose stride is not a multiple of 16 bytes cannot be described: such a view of
    # a 16-multiple width is copied once (rows.row_views: Triton would specialise it
    # otherwise than contiguous rows) and the copy is read through descriptors; same bits.
    # 100 rows: more than one program of one tile, which reads without descriptors (plan.ONE_TILE_NO_DESCRIPTORS)
    hidden = 96
    buf = torch.randn(100, hidden + 1, device=device).to(torch.bfloat16)
    x, dy = buf[:, 1:], torch.randn(100, hidden, device=device).to(torch.bfloat16)
    w = torch.randn(hidden, device=device).to(torch.bfloat16)
    made = record_descriptors(monkeypatch)
    outs = []
    for stages in (0, 3):
        with configs.override(backward=bwd_config(hidden, torch.bfloat16).replace(tma_stages=stages)):
            y, rstd, h = trainnorm.rms_norm_forward(x, w, EPS)
            outs.append(trainnorm.rms_norm_backward(dy, x, w, rstd))
    assert made and all(a[0].is_contiguous() and a[0].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
                        for a in made), "descriptors only of contiguous copies"
    for a, b in zip(*outs):
        assert_bits_equal(a, b, "tma_stages on a misaligned view vs off")


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("hidden", [2, 4, 8, 16])
def test_tma_needs_16_byte_block_rows(device, monkeypatch, hidden, gated):
    # a bulk copy's block row holds at least 16 bytes: narrower tiles (H 1-4 in bf16, whose
    # default config asks for descriptor loads) read plainly even where the rows are aligned,
    # here slices of a buffer 16 wide; the soak found H 2 and 4 raising from the descriptor.
    # 200 rows: more than one program of one tile, which reads without descriptors (plan.ONE_TILE_NO_DESCRIPTORS)
    buf = torch.randn(2, 200, 16, device=device).to(torch.bfloat16)
    x, dy = buf[0, :, :hidden], buf[1, :, :hidden]
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    z = torch.randn(200, 16, device=device).to(torch.bfloat16)[:, :hidden] if gated else None
    made = record_descriptors(monkeypatch)
    for det in (True, False):
        if gated:
            y, rstd = trainnorm.rms_norm_gated_forward(x, z, w, EPS)
            trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, deterministic=det)
        else:
            y, rstd, h = trainnorm.rms_norm_forward(x, w, EPS)
            dx, dw = trainnorm.rms_norm_backward(dy, x, w, rstd, deterministic=det)
            check_backward(dy, x, w, rstd, None, dx, dw)
    cfg = bwd_config(hidden, torch.bfloat16, gated)
    assert cfg.tma_stages > 0, "the default asks for descriptors"
    # and rows whose width is not a multiple of 16 values are read plainly (H 8)
    assert bool(made) == (cfg.block_n * 2 >= 16 and hidden % 16 == 0)


@pytest.mark.parametrize("hidden,streams,stages,expect", [
    (1024, "bf16 dy, bf16 h", 3, 3), (1024, "bf16 dy, fp32 h", 3, 2), (1024, "bf16 dy, fp32 h", 4, 2),
    (1024, "fp32 dy, fp32 h", 3, 0), (1024, "fp32 dy, fp32 h", 4, 0), (1024, "fp32 dy, bf16 h", 4, 0),
    (96, "bf16 dy, bf16 h", 3, 3), (96, "bf16 dy, fp32 h", 4, 0), (96, "fp32 dy, bf16 h", 4, 0),
    (1000, "bf16 dy, bf16 h", 3, 0)])
def test_descriptor_stages_keep_the_footprint(device, monkeypatch, hidden, streams, stages, expect):
    # the config's stages are sized for the key's (x's) element size: a float32 stream
    # under bf16 x (h of a float32 residual stream, dy of a float32 y) makes each stage
    # wider, so fewer are pipelined in the same shared memory (4 bf16 stages of dy and h:
    # 2 with h or both in float32), and under 2 none (plain loads). Tiles narrower than
    # 1024 columns read a float32 h beside bf16 dy plainly, a float32 dy is always read
    # plainly, and so are rows whose width is not a multiple of 16 values
    # (rows.descriptor_depth: there the compiler laid the tile out otherwise under
    # descriptors). Every form, the same bits. One chunk of 128 rows, several tiles at every
    # width: plan.CHUNK_STAGES leaves the config's depth
    rows = 128
    dy_dtype, h_dtype = ({"bf16": torch.bfloat16, "fp32": torch.float32}[s.split()[0]] for s in streams.split(", "))
    gen = torch.Generator(device=device).manual_seed(31)
    dy = torch.randn(rows, hidden, generator=gen, device=device).to(dy_dtype)
    h = torch.randn(rows, hidden, generator=gen, device=device).to(h_dtype)
    dh = torch.randn(rows, hidden, generator=gen, device=device).to(h_dtype)
    w = torch.randn(hidden, generator=gen, device=device).to(torch.bfloat16)
    rstd = torch.rand(rows, generator=gen, device=device) + 0.5
    spec = "x:bf16" if h_dtype == torch.float32 else ""
    made = record_descriptors(monkeypatch)
    real, seen = dispatch.descriptor_stages, []
    monkeypatch.setattr(dispatch, "descriptor_stages", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    outs = []
    for st in (0, stages):
        with configs.override(backward=bwd_config(hidden, torch.bfloat16).replace(tma_stages=st, prefetch=False,
                                                                                  min_rows_per_chunk=rows)):
            outs.append(torch.ops.trainnorm.rms_norm_bwd(dy, h, w, rstd, dh, None, spec, True, True, None))
    assert seen == [0, expect]
    assert len(made) == (2 if expect else 0), f"descriptors made: {len(made)}"
    for a, b in zip(*outs):
        assert_bits_equal(a, b, f"{expect} stages vs plain loads")


def test_forward_reads_a_float32_stream_plainly(device, monkeypatch):
    # the forward keeps plain loads for a float32 residual beside bf16 x even where its
    # config asks for descriptors (only the backward's descriptor form of the stream was
    # measured); a bf16 residual of the same layout is read through them
    hidden = 96
    x = torch.randn(41, hidden, device=device).to(torch.bfloat16)
    r = torch.randn(41, hidden, device=device)
    w = torch.randn(hidden, device=device).to(torch.bfloat16)
    made = record_descriptors(monkeypatch)
    # 41 rows in tiles of 4 over one program (a simulated 1-SM GPU): the descriptor form's
    # launch, several tiles a program
    cfg = fwd_config(hidden).replace(tma_stages=3, block_m=4, ctas_per_sm=1)
    with configs.override(forward=cfg), simulate_sm_count(1):
        y, rstd, h = trainnorm.rms_norm_forward(x, w, EPS, residual=r)
        assert not made
        check_forward(x, w, EPS, r, y, rstd, h)
        trainnorm.rms_norm_forward(x, w, EPS, residual=r.to(torch.bfloat16))
    assert len(made) == 2


@pytest.mark.parametrize("hidden", [96, 4096])
def test_float32_stream_backward_keyed_on_the_activations(device, hidden):
    # the explicit backward sees only h (float32) and dy (bf16): its tiles follow dy's
    # 16-bit dtype, as the autograd path's follow x's, so both give the same dw bits; the
    # workspace is sized for x's dtype, and one sized for float32 (h's) fits as well.
    # dx (the stream's gradient) agrees to float32 rounding, not to the bit: the explicit
    # kernel stores one float32 dx, the autograd one x's 16-bit gradient beside it, and
    # for those stores the compiler may lay the tile out in other registers, so the row
    # sum c is taken in another order (on an H100 at H 96: bits differed; compiled for
    # sm_90, 40 float32 adds against 16 at H 64-512, the same counts at H 1000 and 1024)
    rows = 300
    key16 = bwd_plan(rows, hidden, torch.bfloat16, True, True)
    key32 = bwd_plan(rows, hidden, torch.float32, True, True)
    assert (key16.num_chunks, key16.cfg.tile) != (key32.num_chunks, key32.cfg.tile), "the keys' plans differ"
    case = make_case("outlier", (rows,), hidden, seed=37, device=device)
    r = 4 * torch.randn(case.x.shape, device=device)
    dh = torch.randn(case.x.shape, device=device)
    x = case.x.clone().requires_grad_()
    res = r.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    y, h = trainnorm.rms_norm(x, w, EPS, residual=res)
    torch.autograd.backward((y, h), (case.dy, dh))
    _, rstd, h2 = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=r)
    ws = trainnorm.backward_workspace(rows, hidden, dtype=case.x.dtype, device=device)
    assert ws.numel() == key16.workspace_bytes
    dx, dw = trainnorm.rms_norm_backward(case.dy, h2, case.weight, rstd, dh=dh, workspace=ws)
    odx, odw, _, odres = torch.ops.trainnorm.rms_norm_bwd(case.dy, h2, case.weight, rstd, dh, None, "x:bf16",
                                                          True, True, None)
    assert dx.dtype == torch.float32
    # a workspace sized for float32 activations serves the 16-bit dy's key too
    ws32 = trainnorm.backward_workspace(rows, hidden, dtype=torch.float32, device=device)
    assert ws32.numel() >= key16.workspace_bytes
    dx32, dw32 = trainnorm.rms_norm_backward(case.dy, h2, case.weight, rstd, dh=dh, workspace=ws32)
    assert_bits_equal(dw32, dw, "dw with the float32-sized workspace")
    assert_bits_equal(dw, odw, "explicit dw vs the op's under x:bf16")
    assert_bits_equal(dw.to(w.grad.dtype), w.grad, "explicit dw vs autograd's")
    # one kernel gives x's gradient as the stream's rounded
    assert_bits_equal(res.grad.to(x.grad.dtype), x.grad, "x's gradient vs the stream's, rounded")
    assert_bits_equal(odres, res.grad, "the op's stream gradient vs autograd's")
    scale = res.grad.abs().max().item()
    torch.testing.assert_close(dx, res.grad, rtol=2.0 ** -16, atol=scale * 2.0 ** -16,
                               msg=lambda m: f"explicit dx vs the stream's gradient through autograd: {m}")


FWD_FORMS = {"plain": {}, "tma2": {"tma_stages": 2}, "tma3": {"tma_stages": 3}}


@pytest.mark.parametrize("residual,gate", [(False, None), (True, None), (False, "after"), (False, "first")])
def test_forward_load_forms_same_bits(device, monkeypatch, residual, gate):
    # The forward through tensor descriptors, its grid one program per SM on a simulated
    # 2-SM GPU so that each program walks several row tiles (41 rows in tiles of 4, the
    # last one partial): every output keeps the bits of the plain one-tile-per-program form
    hidden = 96
    case = make_case("outlier", (41,), hidden, residual=residual, seed=5, device=device)
    z = torch.randn(case.x.shape, dtype=case.x.dtype, device=device) if gate else None
    base = fwd_config(hidden, case.x.dtype, case.weight.dtype).replace(block_m=4, ctas_per_sm=1)
    made = record_descriptors(monkeypatch)
    outs = {}
    for name, kw in FWD_FORMS.items():
        with configs.override(forward=base.replace(**kw)), simulate_sm_count(2):
            if gate:
                outs[name] = trainnorm.rms_norm_gated_forward(case.x, z, case.weight, EPS,
                                                              norm_before_gate=gate == "after")
            else:
                outs[name] = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
                check_forward(case.x, case.weight, EPS, case.residual, *outs[name])
    assert len(made) == 2 * (1 + residual)      # tma2 and tma3 read x (and r) through descriptors
    for name in FWD_FORMS:
        for a, b in zip(outs["plain"], outs[name]):
            assert_bits_equal(a, b, f"forward {name} vs plain loads")


def test_forward_descriptors_only_where_a_program_takes_several_tiles(device, monkeypatch):
    # a descriptor config over rows of at most one tile a program (tiles <= programs per SM x
    # SMs) reads them with plain loads, one program a tile: nothing to pipeline. One tile
    # more and the descriptors are back. The bits are those of the plain form either way
    hidden = 96
    case = make_case("outlier", (9,), hidden, residual=True, seed=7, device=device)
    cfg = fwd_config(hidden, case.x.dtype, case.weight.dtype).replace(block_m=2, ctas_per_sm=2, tma_stages=3)
    made = record_descriptors(monkeypatch)
    got = {}
    for rows, descriptors in ((8, False), (9, True)):       # 4 tiles and 5 tiles, 2 SMs x 2 programs
        with configs.override(forward=cfg), simulate_sm_count(2):
            got[rows] = trainnorm.rms_norm_forward(case.x[:rows], case.weight, EPS, residual=case.residual[:rows])
        assert len(made) == 2 * descriptors, f"{rows} rows: descriptors made {len(made)}"
        made.clear()
        with configs.override(forward=cfg.replace(tma_stages=0)):
            want = trainnorm.rms_norm_forward(case.x[:rows], case.weight, EPS, residual=case.residual[:rows])
        for a, b in zip(got[rows], want):
            assert_bits_equal(a, b, f"{rows} rows vs plain loads")
    for a, b in zip(got[8], got[9]):
        assert_bits_equal(a, b[:8], "8 rows alone vs the same rows in 9")


def test_forward_residual_plain(device, monkeypatch):
    # residual_plain: a descriptor config reads the rows plainly, one program a tile, when a
    # residual is read beside x, and through descriptors without one; the bits are those of
    # the descriptor form either way (41 rows in tiles of 4 over a simulated 2-SM GPU of one
    # program each: several tiles a program, so the descriptor form would run)
    hidden = 96
    case = make_case("outlier", (41,), hidden, residual=True, seed=11, device=device)
    cfg = fwd_config(hidden, case.x.dtype, case.weight.dtype).replace(block_m=4, ctas_per_sm=1, tma_stages=3)
    made = record_descriptors(monkeypatch)
    for residual in (case.residual, None):
        outs = {}
        for name, c in (("residual_plain", cfg.replace(residual_plain=True)), ("descriptors", cfg)):
            with configs.override(forward=c), simulate_sm_count(2):
                outs[name] = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=residual)
            check_forward(case.x, case.weight, EPS, residual, *outs[name])
            descriptors = name == "descriptors" or residual is None
            assert len(made) == descriptors * (1 + (residual is not None)), \
                f"{name}, residual {residual is not None}: descriptors made {len(made)}"
            made.clear()
        for a, b in zip(outs["residual_plain"], outs["descriptors"]):
            assert_bits_equal(a, b, f"residual_plain vs descriptors (residual {residual is not None})")


def test_forward_tma_needs_aligned_rows(device, monkeypatch):
    # a view whose row stride is not a multiple of 16 bytes is copied once and the copy
    # read through descriptors (rows.row_views); per-head rows (two-level strides) are
    # read in place with plain loads: same bits as a contiguous copy
    hidden = 96
    w = torch.randn(hidden, device=device).to(torch.bfloat16)
    buf = torch.randn(30, hidden + 1, device=device).to(torch.bfloat16)
    # heads of 2H in rows of 3 heads plus 64 columns: strides (640, 192, 1), two levels
    heads = torch.randn(10, 3 * 2 * hidden + 64, device=device).to(torch.bfloat16)[:, :6 * hidden].unflatten(1, (3, 2 * hidden))
    # 30 rows in tiles of 4 over one program (a simulated 1-SM GPU): several tiles a program
    cfg = fwd_config(hidden, torch.bfloat16, torch.bfloat16).replace(tma_stages=3, block_m=4, ctas_per_sm=1)
    made = record_descriptors(monkeypatch)
    for x, copied in ((buf[:, 1:], True), (heads[..., :hidden], False)):
        with configs.override(forward=cfg), simulate_sm_count(1):
            got = trainnorm.rms_norm_forward(x, w, EPS)
            assert len(made) == copied and all(a[0].is_contiguous() for a in made)
            made.clear()
            want = trainnorm.rms_norm_forward(x.contiguous(), w, EPS)
        assert len(made) == 1
        made.clear()
        for a, b in zip(got, want):
            assert_bits_equal(a, b, "forward on a view vs its contiguous copy")


@pytest.mark.parametrize("form", ["partial", "atomic", "direct"])
def test_dw_2d(device, form):
    # a dw sum per tile position changes only the order of dw's float64 additions:
    # dx keeps its bits, dw stays within the budget and reproduces in deterministic mode
    hidden = 96
    base = bwd_config(hidden, torch.bfloat16).replace(
        block_m=4, min_rows_per_chunk=12, max_chunks=1 if form == "direct" else 8,
        atomic_min_rows=0 if form == "atomic" else 1 << 40)
    case = make_case("offset", (41,), hidden, seed=5, device=device)
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS)
    outs = []
    for d2 in (False, True, True):
        with configs.override(backward=base.replace(dw_2d=d2)):
            outs.append(trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, deterministic=form != "atomic"))
            check_backward(case.dy, h, case.weight, rstd, None, *outs[-1])
            mode = bwd_plan(41, hidden, torch.bfloat16, form != "atomic", True).dw
    assert mode == {"partial": DwForm.PARTIAL, "atomic": DwForm.ATOMIC, "direct": DwForm.DIRECT}[form]
    assert_bits_equal(outs[0][0], outs[1][0], "dx with dw_2d vs without")
    if form != "atomic":
        assert_bits_equal(outs[1][1], outs[2][1], "dw_2d repeat")


def test_direct_window(device):
    # rows up to direct_max_rows form one chunk: one launch, no workspace, the same form in both
    # modes; its own load fields apply to any one-chunk launch. dx keeps its bits (same tile);
    # dw is within the budget and reproduces; above the window the chunking is the usual one
    hidden = 96
    base = bwd_config(hidden, torch.bfloat16).replace(block_m=4, min_rows_per_chunk=4, max_chunks=8,
                                                      atomic_min_rows=0)
    win = base.replace(direct_max_rows=41, direct_tma_stages=2, direct_prefetch=False)
    assert plan.chunking(win, 41) == (1, 44) and plan.chunking(win, 42) == plan.chunking(base, 42) == (6, 8)
    assert win.schedule.loads(True) == (False, 2)
    assert win.schedule.loads(False) == (base.prefetch, base.tma_stages)
    assert base.replace(prefetch=True).schedule.loads(True) == (True, base.tma_stages)
    case = make_case("outlier", (41,), hidden, seed=3, device=device)
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS)
    outs = {}
    for name, cfg in (("chunked", base), ("direct", win)):
        with configs.override(backward=cfg):
            for det in (True, False):
                p = bwd_plan(41, hidden, torch.bfloat16, det, True)
                assert p.dw == ((DwForm.PARTIAL if det else DwForm.ATOMIC) if name == "chunked"
                                else DwForm.DIRECT)
                assert (p.workspace_bytes == 0) == (name == "direct")
                outs[name, det] = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, deterministic=det)
                check_backward(case.dy, h, case.weight, rstd, None, *outs[name, det])
    for det in (True, False):
        assert_bits_equal(outs["chunked", det][0], outs["direct", det][0], "dx direct vs chunked")
    assert_bits_equal(outs["direct", True][1], outs["direct", False][1], "direct dw: both modes one form")


@pytest.mark.parametrize("hidden,block_m", [(96, 8), (512, 8), (2048, 4), (4096, 2)])
def test_one_chunk_of_few_rows_takes_fewer_rows_a_tile(device, hidden, block_m):
    # one chunk of fewer rows than the tile holds runs a tile of next_pow2(rows) rows: the
    # same columns, warps and split of a row, so dx is the full tile's bits, and dw too (the
    # rows it drops are masked, their terms +0). The full tile runs here on block_m rows whose
    # rows past n are zeros (dy = 0 and x = 0: terms +0, as the masked rows')
    base = bwd_config(hidden).replace(block_m=block_m, min_rows_per_chunk=block_m,
                                      direct_max_rows=block_m, slices_max_rows=0)
    case = make_case("outlier", (block_m,), hidden, seed=block_m, device=device)
    with configs.override(backward=base):
        assert bwd_plan(1, hidden).block_m == {96: 8, 512: 2, 2048: 1, 4096: 1}[hidden]
        for n in range(1, block_m):
            p = bwd_plan(n, hidden)
            # at least as many rows as lay the full tile's threads along its columns (16 bytes a thread)
            keep = max(1, base.tile.num_warps * 256 // base.tile.block_n)
            assert p.num_chunks == 1 and p.block_m == min(block_m, max(configs.next_pow2(n), keep))
            assert p.rows_per_chunk == -(-n // p.block_m) * p.block_m
            assert p.dw is (DwForm.ROW if n == 1 else DwForm.DIRECT)
            x, dy = case.x.clone(), case.dy.clone()
            x[n:], dy[n:] = 0, 0
            y, rstd, _ = trainnorm.rms_norm_forward(x, case.weight, EPS)
            assert bwd_plan(block_m, hidden).block_m == block_m
            dx_full, dw_full = trainnorm.rms_norm_backward(dy, x, case.weight, rstd)
            dx, dw = trainnorm.rms_norm_backward(dy[:n], x[:n], case.weight, rstd[:n])
            assert_bits_equal(dx, dx_full[:n], f"dx of {n} rows against the {block_m}-row tile")
            # (one row forms its terms in float32, DwForm.ROW: the same bits, the test below)
            assert_bits_equal(dw, dw_full, f"dw of {n} rows against the {block_m}-row tile")


@pytest.mark.parametrize("hidden,rows", [(1024, 2), (2048, 1), (2048, 3), (3072, 4), (4096, 1), (6144, 1)])
def test_backward_float32_weight_read_by_halves_is_the_plain_read(device, hidden, rows):
    # a one-chunk form over 16-bit rows read 16 bytes a thread reads a float32 weight as two
    # runs of 4 a thread (plan.BackwardPlan.weight_halves): dx and dw the plain read's bits
    case = make_case("outlier", (rows,), hidden, seed=rows, device=device, weight_dtype=torch.float32)
    nh, views = row_views(case.dy, case.x)
    assert rows_mod.loads_16_bytes(hidden, nh, *views)
    assert not rows_mod.loads_16_bytes(hidden + 8, nh, *views) and not rows_mod.loads_16_bytes(hidden, 2, *views)
    p = bwd_plan(rows, hidden)
    assert p.weight_halves(False) == 0
    assert p.weight_halves(True) == plan.halves_of(p.cfg.block_n, p.cfg.block_n2, p.cfg.num_warps, True) >= 1
    _, rstd, _ = trainnorm.rms_norm_forward(case.x, case.weight, EPS)
    dx, dw = trainnorm.rms_norm_backward(case.dy, case.x, case.weight, rstd)
    plain = plan.BackwardPlan.weight_halves
    try:
        plan.BackwardPlan.weight_halves = lambda self, loads: 0
        dx_plain, dw_plain = trainnorm.rms_norm_backward(case.dy, case.x, case.weight, rstd)
    finally:
        plan.BackwardPlan.weight_halves = plain
    assert_bits_equal(dx, dx_plain, "dx with the weight read by halves against the plain read")
    assert_bits_equal(dw, dw_plain, "dw with the weight read by halves against the plain read")
    check_backward(case.dy, case.x, case.weight, rstd, None, dx, dw)


@pytest.mark.parametrize("hidden,rows,residual", [(1024, 3, False), (2048, 1, True), (4096, 5, False),
                                                   (6144, 2, False), (8192, 1, False)])
def test_float32_weight_read_by_halves_is_the_plain_read(device, hidden, rows, residual):
    # the forward over 16-bit rows read 16 bytes a thread reads a float32 weight as two runs
    # of 4 a thread (plan.ForwardPlan.weight_halves): y, rstd and h the bits of the plain read
    case = make_case("outlier", (rows,), hidden, seed=hidden, device=device, weight_dtype=torch.float32,
                     residual=residual)
    p = plan.forward_plan(hidden, case.x.dtype, torch.float32, Variant(), None, residual=residual)
    assert p.weight_halves(True) == plan.halves_of(p.cfg.block_n, p.cfg.block_n2 if p.one_tile else 0,
                                                   p.cfg.num_warps, True) >= 1
    assert p.weight_halves(False) == 0
    by_halves = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
    plain = plan.ForwardPlan.weight_halves
    try:
        plan.ForwardPlan.weight_halves = lambda self, loads, rows=0: 0
        read_plainly = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
    finally:
        plan.ForwardPlan.weight_halves = plain
    for a, b, name in zip(by_halves, read_plainly, ("y", "rstd", "h")):
        if a is not None:
            assert_bits_equal(a, b, f"{name} with the weight read by halves against the plain read")


def test_dispatch_reads_a_weight_by_halves_only_where_it_may():
    # dispatch._weight_halves: the launches take W_HALVES from the plan only for a float32
    # weight beside rows read 16 bytes a thread (rows.loads_16_bytes): not for a bf16
    # weight, rows of 2 heads (two-level), a row of H 2040 (not 16 values a multiple) or rows
    # 2 bytes off a 16-byte boundary. Recorded on the CPU, nothing run
    from trainnorm.dev.compile_check import recording

    class Launched(list):
        def add(self, kernel, args, kw, grid=None):
            self.append((kernel.fn.__name__, kw.get("W_HALVES")))

    def halves(x, weight, dy):
        launched = Launched()
        with recording(launched):
            rstd = torch.empty(x.shape[:-1], dtype=torch.float32)
            trainnorm.rms_norm_forward(x, weight)
            trainnorm.rms_norm_backward(dy, x, weight, rstd)
        return {k: v for k, v in launched if k != "dw_combine_kernel"}

    bf16, f32 = torch.bfloat16, torch.float32
    e = lambda *shape, dt=bf16: torch.empty(shape, dtype=dt)
    x, dy = e(1, 2048), e(1, 2048)
    fwd = plan.forward_plan(2048, bf16, f32, Variant()).weight_halves(True)
    bwd = bwd_plan(1, 2048).weight_halves(True)
    assert fwd >= 1 and bwd >= 1
    assert halves(x, e(2048, dt=f32), dy) == {"fwd_one_tile_kernel": fwd, "bwd_one_tile_kernel": bwd}
    assert set(halves(x, e(2048), dy).values()) == {0}
    heads = e(2, 4, 1024)[:, :2]        # 2 of 4 heads: rows of two levels
    assert set(halves(e(2, 2, 1024), e(1024, dt=f32), e(2, 2, 1024)).values()) - {0}
    assert set(halves(heads, e(1024, dt=f32), e(2, 2, 1024)).values()) == {0}
    assert plan.forward_plan(2040, bf16, f32, Variant()).weight_halves(True) >= 1
    assert set(halves(e(1, 2040), e(2040, dt=f32), e(1, 2040)).values()) == {0}
    off = e(2 * 2048 + 8)[1:2049].view(1, 2048)         # 2 bytes past a 16-byte boundary
    assert set(halves(off, e(2048, dt=f32), dy).values()) == {0}


@pytest.mark.parametrize("hidden", [96, 1000, 4096, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_dw_is_the_float64_terms_bits(device, hidden, dtype):
    # DwForm.ROW: one row's dw terms formed in float32 (16-bit h and dy, no gate) are the
    # float64 terms' bits: dy * h is exact in float32 and one float32 multiply by rstd rounds
    # the exact product once, as float64 does before its rounding to float32. The same row
    # beside a second row whose dy is zero (terms +0, so the float64 sum is that row's terms)
    # runs the float64 path of the direct form. Among the terms: large, tiny (float32
    # subnormal products) and signed zeros
    torch.manual_seed(hidden)
    x = (torch.randn(2, hidden) * 3).to(dtype)
    dy = torch.randn(2, hidden).to(dtype)
    dy[0, 5::13] = -0.0
    if dtype == torch.bfloat16:
        dy[0, ::7] = torch.tensor(2e-39).to(dtype)            # products below float32's normal range
        dy[0, 3::11] = torch.tensor(-2.5e-33).to(dtype)
    dy[1] = 0.0
    x, dy = x.to(device), dy.to(device)
    w = torch.randn(hidden, device=device).to(dtype)
    _, rstd, _ = trainnorm.rms_norm_forward(x, w, EPS)
    assert bwd_plan(1, hidden, dtype, True, True).dw is DwForm.ROW
    base = bwd_config(hidden, dtype)
    with configs.override(backward=base.replace(direct_max_rows=max(base.windows.direct_max_rows, 2))):
        assert bwd_plan(2, hidden, dtype, True, True).dw is DwForm.DIRECT
        dx2, dw2 = trainnorm.rms_norm_backward(dy, x, w, rstd)
    dx1, dw1 = trainnorm.rms_norm_backward(dy[:1], x[:1], w, rstd[:1])
    assert_bits_equal(dw1, dw2, "dw of one row: float32 terms against float64")
    assert_bits_equal(dx1, dx2[:1], "dx of the row")
    if dtype == torch.bfloat16:
        subnormal = (dw1 != 0) & (dw1.abs() < 2.0 ** -126)
        assert subnormal.sum() >= hidden // 10, "the case must hold subnormal dw values"


COLS_CASES = {   # name: (lead, hidden, make_case kwargs, config overrides)
    "plain": ((37,), 96, {}, {}),
    "residual fp32 weight": ((37,), 96, {"residual": True, "weight_dtype": torch.float32}, {}),
    "per-head view": ((9, 4), 64, {"query_view": True}, {}),
    "float32": ((37,), 96, {"dtype": torch.float32}, {}),
    "wide rows": ((37,), 96, {}, {"block_n": 32}),       # three column tiles per row
}


@pytest.mark.parametrize("name", list(COLS_CASES))
def test_cols_form(device, name):
    # small T: dw summed by column slices in the same launch (DwForm.COL_SLICES). dx keeps the
    # chunked form's bits (same tile); dw is within the budget, the same in both modes, on every
    # simulated SM count and for every slice width; no workspace is needed
    lead, hidden, kw, over = COLS_CASES[name]
    case = make_case("outlier", lead, hidden, seed=13, device=device, **kw)
    dtype = case.x.dtype
    base = bwd_config(hidden, dtype).replace(block_m=4, min_rows_per_chunk=4, max_chunks=8, tma_stages=0,
                                             dw_2d=False, **over)
    rows = case.x.numel() // hidden
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)

    def run(cfg, det=True, sms=None):
        with configs.override(backward=cfg), (simulate_sm_count(sms) if sms else contextlib.nullcontext()):
            return trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh, deterministic=det)

    chunked = run(base)
    dws = {}
    for bm, bn, split, stages in ((16, 32, False, 0), (8, 128, False, 0), (4, 16, False, 0), (16, 32, True, 0),
                                  (4, 16, True, 3)):
        cfg = base.replace(slices_max_rows=rows, slice_block_m=bm, slice_block_n=bn, split_roles=split,
                           slice_stages=stages)
        with configs.override(backward=cfg):
            for det in (True, False):
                p = bwd_plan(rows, hidden, dtype, det, True)
                assert p.dw == DwForm.COL_SLICES and p.workspace_bytes == 0 and p.num_chunks > 1
        out = run(cfg)
        check_backward(case.dy, h, case.weight, rstd, case.dh, *out)
        assert_bits_equal(out[0], chunked[0], "dx: column-slice dw vs chunked")
        for det, sms in ((False, None), (True, 1), (True, 3), (False, 264)):
            assert_bits_equal(out[1], run(cfg, det, sms)[1], f"dw bm{bm} bn{bn} det={det} sms={sms}")
        # split roles and a pipelined slice walk add in the same order as the shared roles
        if (bm, bn) in dws:
            assert_bits_equal(out[1], dws[bm, bn], f"dw bm{bm} bn{bn} split={split} stages={stages}")
        dws.setdefault((bm, bn), out[1])
    assert len(dws) == 3
    # one row past the window: the chunked form again
    with configs.override(backward=base.replace(slices_max_rows=rows - 1)):
        assert bwd_plan(rows, hidden, dtype, True, True).dw == DwForm.PARTIAL



@pytest.mark.parametrize("block_m,block_n", [(1, 128), (2, 256), (4, 64)])
@pytest.mark.parametrize("residual,gate", [(False, None), (True, None), (False, "after"), (False, "first")])
def test_forward_two_pass_forms(device, use_configs, block_m, block_n, residual, gate):
    # H 1000 walked in 8 tiles of 128 (both walks unrolled), 4 of 256 (unrolled) and
    # 16 of 64 (past FWD_COL_UNROLL_MAX: rolled loops), one row with a float32 sum of
    # squares that overflows: each form against FP64, and a row's bits independent of the rows beside it
    hidden, rows = 1000, 23
    cfg = fwd_config(hidden, torch.bfloat16, torch.bfloat16).replace(block_m=block_m, block_n=block_n,
                                                                     tma_stages=0)
    tiles = cfg.col_tiles(hidden)
    assert tiles > 1 and (tiles <= FWD_COL_UNROLL_MAX) == (block_n > 64)
    use_configs(forward=cfg)
    case = make_case("outlier", (rows,), hidden, residual=residual, seed=block_n, device=device)
    case.x[4] *= 1e20               # its float32 sum of squares overflows: summed again scaled down
    z = torch.randn(case.x.shape, dtype=case.x.dtype, device=device) if gate else None

    def fwd(x, r, zz):
        if gate:
            return trainnorm.rms_norm_gated_forward(x, zz, case.weight, EPS, norm_before_gate=gate == "after")
        return trainnorm.rms_norm_forward(x, case.weight, EPS, residual=r)[:2]

    y, rstd = fwd(case.x, case.residual, z)
    y64, rstd64, _ = reference.forward_fp64(case.x, case.weight, EPS, case.residual, z, gate != "first")
    assert_close64(y, y64, "y")
    assert float((rstd.double() / rstd64 - 1).abs().max()) <= 1e-4
    if not gate:
        check_forward(case.x, case.weight, EPS, case.residual, *trainnorm.rms_norm_forward(
            case.x, case.weight, EPS, residual=case.residual))
    lo, hi = 3, 10
    sub = fwd(case.x[lo:hi], None if case.residual is None else case.residual[lo:hi],
              None if z is None else z[lo:hi])
    for a, b, n in zip((y, rstd), sub, ("y", "rstd")):
        assert_bits_equal(a[lo:hi], b, f"{n} rows {lo}:{hi}")
    # the row's tiles held in registers between the walks (unrolled walks): the same bits, h too
    use_configs(forward=cfg.replace(hold_tiles=True))
    assert plan.forward_plan(hidden, torch.bfloat16, torch.bfloat16, Variant()).holds(1) == (tiles <= FWD_COL_UNROLL_MAX)
    for a, b, n in zip((y, rstd), fwd(case.x, case.residual, z), ("y", "rstd")):
        assert_bits_equal(a, b, f"{n}, tiles held")
    # the weight's tiles read before the first walk and held (unrolled walks; rolled ones read it late)
    for hold in (False, True):
        use_configs(forward=cfg.replace(hold_tiles=hold, weight_read="rows"))
        fp = plan.forward_plan(hidden, torch.bfloat16, torch.bfloat16, Variant(gate="silu" if gate else None))
        assert fp.weight == ("rows" if tiles <= FWD_COL_UNROLL_MAX and not gate else "late")
        for a, b, n in zip((y, rstd), fwd(case.x, case.residual, z), ("y", "rstd")):
            assert_bits_equal(a, b, f"{n}, weight read with the rows, held {hold}")
    if residual:
        h = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)[2]
        use_configs(forward=cfg)
        assert_bits_equal(h, trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)[2],
                          "h, tiles held")


@pytest.mark.parametrize("block_n", [128, 64])
def test_forward_residual_holds_its_tiles(device, use_configs, monkeypatch, block_n):
    # plan.RESIDUAL_HOLD: with a residual, from RESIDUAL_HOLD_MIN_ROWS rows on, unrolled walks
    # (8 tiles of 128) hold the row's tiles at the entry's rows a tile; rolled walks (16 of 64),
    # rows without a residual and the gated forward keep the entry's walks. The same bits (y,
    # rstd, h) below and above the edge, and y, rstd those of rms_norm(h, w) (SPEC)
    hidden, edge = 1000, 12
    bf16 = torch.bfloat16
    monkeypatch.setattr(plan, "RESIDUAL_HOLD", True)
    monkeypatch.setattr(plan, "RESIDUAL_HOLD_MIN_ROWS", edge)
    cfg = fwd_config(hidden, bf16, bf16).replace(block_m=4, block_n=block_n, tma_stages=0, hold_tiles=False)
    use_configs(forward=cfg)
    unrolled = cfg.col_tiles(hidden) <= FWD_COL_UNROLL_MAX
    assert unrolled == (block_n == 128)
    fp = plan.forward_plan(hidden, bf16, bf16, Variant(), residual=True)
    assert [(fp.holds(n), fp.block_m(n)) for n in (edge - 1, edge)] == [(False, 4), (unrolled, 4)]
    for variant, residual in ((Variant(), False), (Variant(gate="silu"), True)):
        assert not plan.forward_plan(hidden, bf16, bf16, variant, residual=residual).holds(edge)
    # more columns a thread than RESIDUAL_HOLD_MAX_ELEMS: the entry's walks
    elems = cfg.col_tiles(hidden) * cfg.block_n // (32 * cfg.num_warps)
    for bound in (elems, elems - 1):
        monkeypatch.setattr(plan, "RESIDUAL_HOLD_MAX_ELEMS", bound)
        assert plan.forward_plan(hidden, bf16, bf16, Variant(), residual=True).holds(edge) == \
            (unrolled and bound == elems)
    case = make_case("outlier", (23,), hidden, residual=True, seed=block_n, device=device)
    case.x[14] *= 1e20              # its float32 sum of squares overflows: summed again scaled down
    held = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
    below = trainnorm.rms_norm_forward(case.x[:edge - 1], case.weight, EPS, residual=case.residual[:edge - 1])
    for a, b, n in zip(held, below, ("y", "rstd", "h")):
        assert_bits_equal(a[:edge - 1], b, f"{n}: rows below the edge alone and in a held batch")
    for a, b, n in zip(held, trainnorm.rms_norm_forward(held[2], case.weight, EPS)[:2], ("y", "rstd")):
        assert_bits_equal(a, b, f"{n}: with the residual, held, against the norm of h")
    monkeypatch.setattr(plan, "RESIDUAL_HOLD", False)
    for a, b, n in zip(held, trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual),
                       ("y", "rstd", "h")):
        assert_bits_equal(a, b, f"{n}: held against the entry's walks")
    check_forward(case.x, case.weight, EPS, case.residual, *held)


def test_forward_held_tile_takes_its_rows_and_warps_from_the_edge(device, use_configs, monkeypatch):
    # FwdSchedule.held_tile: from RESIDUAL_HOLD_MIN_ROWS rows, with and without a residual, the
    # unrolled walks hold a row's tiles at the held tile's rows and warps (one row over 2 warps
    # where the tile has two rows over 4: the same warps a row at 8 values a thread, compiled
    # for sm_90 the same sums at H 1024) and read the weight when held_weight_read says, by
    # halves where a row then lays every thread along its columns; below the edge, under a gate
    # and where a thread reads fewer than 16 bytes of a row (H 1000: Triton lays a row of the
    # two tiles otherwise) the tile's own. The same bits below and above the edge (y, rstd, h),
    # y and rstd those of rms_norm(h, w), within the budget of FP64
    edge = 12
    bf16, f32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(plan, "RESIDUAL_HOLD", True)
    monkeypatch.setattr(plan, "RESIDUAL_HOLD_MIN_ROWS", edge)
    cfg = fwd_config(1024, bf16, f32).replace(block_m=2, block_n=512, num_warps=4, tma_stages=0, hold_tiles=False,
                                              weight_read="rows", held_tile=(1, 2), held_weight_read="late")
    use_configs(forward=cfg)
    for residual in (False, True):
        fp = plan.forward_plan(1024, bf16, f32, Variant(), residual=residual)
        assert [fp.tile_at(n) for n in (edge - 1, edge)] == [(2, 4, "rows"), (1, 2, "late")]
        assert fp.tile_at(edge, loads_16_bytes=False) == (2, 4, "rows") and fp.holds(edge)
        assert (fp.weight_halves(True, rows=edge - 1), fp.weight_halves(True, rows=edge)) == (0, 1)
    assert not plan.forward_plan(1024, bf16, f32, Variant(gate="silu")).holds(edge)
    use_configs(forward=cfg.replace(hold_tiles=True))      # held at every row count: the tile's own
    fp = plan.forward_plan(1024, bf16, f32, Variant(gate="silu"))
    assert [(fp.holds(n), fp.tile_at(n)) for n in (1, edge)] == [(True, (2, 4, fp.weight))] * 2
    use_configs(forward=cfg)
    monkeypatch.setattr(plan, "RESIDUAL_HOLD", False)
    fp = plan.forward_plan(1024, bf16, f32, Variant(), residual=True)
    assert (fp.holds(edge), fp.tile_at(edge)) == (False, (2, 4, "rows"))
    monkeypatch.setattr(plan, "RESIDUAL_HOLD", True)
    for hidden in (1024, 1000):
        case = make_case("outlier", (23,), hidden, residual=True, weight_dtype=f32, seed=5, device=device)
        held = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
        below = trainnorm.rms_norm_forward(case.x[:edge - 1], case.weight, EPS, residual=case.residual[:edge - 1])
        for a, b, n in zip(held, below, ("y", "rstd", "h")):
            assert_bits_equal(a[:edge - 1], b, f"H {hidden} {n}: rows below the edge alone and in a held batch")
        plain = trainnorm.rms_norm_forward(held[2], case.weight, EPS)
        for a, b, n in zip(held, plain[:2], ("y", "rstd")):
            assert_bits_equal(a, b, f"H {hidden} {n}: with the residual, held, against the norm of h")
        for a, b, n in zip(plain, trainnorm.rms_norm_forward(held[2][:edge - 1], case.weight, EPS), ("y", "rstd")):
            assert_bits_equal(a[:edge - 1], b, f"H {hidden} {n}: no residual, rows below the edge alone and held")
        check_forward(case.x, case.weight, EPS, case.residual, *held)
    with pytest.raises(ValueError, match="held_tile"):
        cfg.replace(held_tile=(1, 4))           # 4 warps a row where the tile has 2
    with pytest.raises(ValueError, match="held_tile"):
        cfg.replace(held_tile=(1, 3))
    with pytest.raises(ValueError, match="held_weight_read"):
        cfg.replace(held_weight_read="sometimes")


@pytest.mark.parametrize("hidden,pieces", [(100, False), (96, True)])
@pytest.mark.parametrize("residual,gate,offset", [(False, None, False), (True, None, True), (False, "after", False)])
def test_forward_weight_reads(device, use_configs, hidden, pieces, residual, gate, offset):
    # the one-tile form (one tile of 128, or 64 + 32 columns as two pieces) with the weight
    # read before the tile loop, beside the rows' loads and after the sum of squares: the same
    # bits (y, rstd, h), and within the budget of FP64; a weight_read outside the set is refused
    rows = 37
    w_dtype = torch.float32 if residual else torch.bfloat16
    b1, b2 = configs.row_pieces(hidden) if pieces else (128, 0)
    cfg = fwd_config(hidden, torch.bfloat16, w_dtype).replace(block_m=2, block_n=b1, block_n2=b2, num_warps=2,
                                                              tma_stages=0, hold_tiles=False)
    case = make_case("outlier", (rows,), hidden, residual=residual, weight_dtype=w_dtype, seed=hidden,
                     device=device)
    z = torch.randn(case.x.shape, dtype=case.x.dtype, device=device) if gate else None
    variant = Variant(gate="silu" if gate else None, weight_offset=1.0 if offset else 0.0)

    def fwd():
        if gate:
            return trainnorm.rms_norm_gated_forward(case.x, z, case.weight, EPS)
        return trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual,
                                          weight_offset=1.0 if offset else 0.0)

    outs = {}
    for read in ("early", "rows", "late"):
        use_configs(forward=cfg.replace(weight_read=read))
        # with a gate whatever weight_read says: beside the rows in this 16-bit gated tile of
        # at most 4096 columns (plan.weight_read)
        assert plan.forward_plan(hidden, torch.bfloat16, w_dtype, variant).weight == ("rows" if gate else read)
        if gate:
            # ... and where gate_weight_read says
            use_configs(forward=cfg.replace(weight_read=read, gate_weight_read=read))
            assert plan.forward_plan(hidden, torch.bfloat16, w_dtype, variant).weight == read
        outs[read] = fwd()
    for read in ("rows", "late"):
        for a, b, n in zip(outs["early"], outs[read], ("y", "rstd", "h")):
            assert_bits_equal(a, b, f"{n}, weight read {read}")
    if not gate:
        y64, _, _ = reference.forward_fp64(case.x, case.weight, EPS, case.residual, None, True,
                                           weight_offset=1.0 if offset else 0.0)
        assert_close64(outs["rows"][0], y64, "y")
    with pytest.raises(ValueError, match="weight_read"):
        cfg.replace(weight_read="first")
    with pytest.raises(ValueError, match="gate_weight_read"):
        cfg.replace(gate_weight_read="first")


def test_forward_weight_read_rule():
    # where a config names no weight read, the one-tile form reads the weight ahead of the rows
    # in tiles of at most 512 columns a warp and beside the rows' loads past that, up to 8192
    # columns (plan.py's measurements); with a gate beside the rows in tiles of up to 4096
    # columns of the 16-bit gated key, else after the sum
    base = configs.FwdConfig(configs.FwdTile(block_m=1, block_n=2048, num_warps=4))
    assert plan.weight_read(base, 1) == "early"
    assert plan.weight_read(base.replace(block_n=4096), 1) == "rows"
    assert plan.weight_read(base.replace(block_n=8192, num_warps=8), 1) == "rows"
    assert plan.weight_read(base.replace(block_n=16384, num_warps=16), 1) == "late"   # unmeasured, spills
    assert plan.weight_read(base.replace(block_n=8192), 1, gated=True) == "late"
    assert plan.weight_read(base.replace(block_n=8192), 1, gated=True, gate_after_16bit=True) == "late"
    assert plan.weight_read(base.replace(block_n=4096), 1, gated=True, gate_after_16bit=True) == "rows"
    assert plan.weight_read(base.replace(block_n=4096), 1, gated=True) == "late"      # a float32 weight's key
    assert plan.weight_read(base.replace(block_n=4096), 2, gated=True, gate_after_16bit=True) == "late"
    assert plan.weight_read(base.replace(block_n=4096, gate_weight_read="early"), 1, gated=True) == "early"
    # through the plan: the gated bench widths (H 4096, and 128 columns) read beside the rows
    for hidden in (4096, 128):
        assert plan.forward_plan(hidden, torch.bfloat16, torch.bfloat16, Variant(gate="silu")).weight == "rows"
        assert plan.forward_plan(hidden, torch.bfloat16, torch.float32, Variant(gate="silu")).weight == "late"
        gate_first = Variant(gate="silu", norm_before_gate=False)
        assert plan.forward_plan(hidden, torch.bfloat16, torch.bfloat16, gate_first).weight == "late"
    assert plan.weight_read(base.replace(block_n=4096, weight_read="late"), 1) == "late"
    # the unseen widths' rule configs (configs.default_forward) that hold a row in one tile
    for hidden in (768, 2304, 3584, 5376, 7168):
        cfg = configs.default_forward(hidden, 2)
        assert plan.weight_read(cfg, cfg.col_tiles(hidden)) in ("early", "rows"), hidden


PIECES_CASES = {   # name: (lead, hidden, make_case kwargs, gate)
    "plain": ((37,), 96, {}, None),                      # 64 + 32 columns, none masked
    "masked second piece": ((37,), 80, {}, None),        # 64 + 32 holding 80
    "residual fp32 weight": ((37,), 96, {"residual": True, "weight_dtype": torch.float32}, None),
    "per-head view": ((9, 4), 48, {"query_view": True}, None),
    "float32": ((37,), 96, {"dtype": torch.float32}, None),
    "gate after": ((37,), 96, {}, "after"),
    "gate first": ((37,), 96, {}, "first"),
}


def pieces_configs(hidden, dtype, gated=False):
    """Forward and backward configs holding a row as two pieces (configs.row_pieces)."""
    b1, b2 = configs.row_pieces(hidden)
    fwd = fwd_config(hidden, dtype, dtype).replace(block_m=2, block_n=b1, block_n2=b2, num_warps=4, tma_stages=0)
    bwd = bwd_config(hidden, dtype, gated).replace(
        block_m=4, block_n=b1, block_n2=b2, min_rows_per_chunk=4, max_chunks=8, dw_2d=False, prefetch=False,
        tma_stages=0, direct_prefetch=None, direct_tma_stages=None, direct_max_rows=0, slices_max_rows=0,
        atomic_min_rows=0)
    return fwd, bwd


@pytest.mark.parametrize("name", list(PIECES_CASES))
def test_two_piece_rows(device, use_configs, name):
    # a row held as two power-of-two pieces (block_n2): forward and backward against FP64
    # (one row whose float32 sum of squares overflows), dx the same bits in every dw form
    # (one chunk, column slices, chunked) and both modes, dw reproducible on any SM count,
    # y, rstd and dx of a row independent of the rows beside it
    lead, hidden, kw, gate = PIECES_CASES[name]
    case = make_case("outlier", lead, hidden, seed=17, device=device, **kw)
    if not gate:
        case.x.view(-1, hidden)[5] *= 1e20       # its float32 sum of squares overflows
    dtype = case.x.dtype
    rows = case.x.numel() // hidden
    fwd, bwd = pieces_configs(hidden, dtype, gated=gate is not None)
    assert fwd.col_tiles(hidden) == bwd.col_tiles(hidden) == 1 and bwd.block_n2 > 0
    use_configs(forward=fwd, backward=bwd)
    z = torch.randn(case.x.shape, dtype=dtype, device=device) if gate else None
    nbg = gate == "after"

    def forward(lo=0, hi=rows):
        x2 = case.x.view(-1, hidden)[lo:hi] if case.x.dim() == 2 else case.x[lo:hi]
        if gate:
            return trainnorm.rms_norm_gated_forward(x2, z[lo:hi], case.weight, EPS, norm_before_gate=nbg) + (x2,)
        r = None if case.residual is None else case.residual[lo:hi]
        y, rstd, h = trainnorm.rms_norm_forward(x2, case.weight, EPS, residual=r)
        return y, rstd, h if r is not None else x2

    def backward(h, rstd, det=True, sms=None, **win):
        ctx = simulate_sm_count(sms) if sms else contextlib.nullcontext()
        with configs.override(backward=bwd.replace(**win)), ctx:
            if gate:
                dx, dz, dw = trainnorm.rms_norm_gated_backward(case.dy, h, z, case.weight, rstd,
                                                               norm_before_gate=nbg, deterministic=det)
                return dx, dw, dz
            return trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh, deterministic=det)

    y, rstd, h = forward()
    if gate:
        y64, rstd64, _ = reference.forward_fp64(case.x, case.weight, EPS, None, z, nbg)
        assert_close64(y, y64, "y")
        assert float((rstd.double() / rstd64 - 1).abs().max()) <= 1e-4
    else:
        check_forward(case.x, case.weight, EPS, case.residual, y, rstd,
                      h if case.residual is not None else torch.empty(0))
    sub = forward(3, 10) if case.x.dim() == 2 else None
    if sub is not None:
        assert_bits_equal(y[3:10], sub[0], "y rows 3:10")
        assert_bits_equal(rstd[3:10], sub[1], "rstd rows 3:10")

    chunked = backward(h, rstd)
    assert bwd_plan(rows, hidden, dtype, True, True, gate is not None).dw == DwForm.PARTIAL
    # the atomic form takes no two-piece row: deterministic=False also sums the partials
    assert bwd_plan(rows, hidden, dtype, False, True, gate is not None).dw == DwForm.PARTIAL
    if gate:
        dx64, dw64, dz64 = reference.backward_fp64(case.dy, h, case.weight, rstd, None, z, nbg)
        assert_close64(chunked[0], dx64, "dx")
        assert_close64(chunked[2], dz64, "dz")
        assert reference.dw_err_over_tol(chunked[1], dw64) <= DW_BUDGET
    else:
        check_backward(case.dy, h, case.weight, rstd, case.dh, *chunked)
    for win in ({"direct_max_rows": rows}, {"slices_max_rows": rows, "slice_block_n": 32},
                {"slices_max_rows": rows, "split_roles": True}):
        out = backward(h, rstd, **win)
        for a, b, n in zip(chunked, out, ("dx", "dw", "dz")):
            if n != "dw":
                assert_bits_equal(a, b, f"{n} with {win} vs chunked")
        assert float((out[1].double() - chunked[1].double()).norm() / chunked[1].double().norm()) < 1e-6
    for det, sms in ((False, None), (True, 1), (True, 3)):
        out = backward(h, rstd, det, sms)
        for a, b, n in zip(chunked, out, ("dx", "dw", "dz")):
            assert_bits_equal(a, b, f"{n} det={det} sms={sms}")


def test_two_piece_configs():
    # pieces are powers of two; a two-piece tile must hold the row and reads it with plain loads
    assert configs.row_pieces(5120) == (4096, 1024) and configs.row_pieces(6144) == (4096, 2048)
    assert configs.row_pieces(1000) == (512, 512) and configs.row_pieces(4096) == (4096, 0)
    assert configs.row_pieces(1) == (1, 0)
    tile = dict(block_m=1, block_n=4096, num_warps=8, min_rows_per_chunk=1, max_chunks=132)
    with pytest.raises(ValueError, match="block_n2"):
        configs.BwdConfig.from_fields(**tile, block_n2=1000)
    with pytest.raises(ValueError, match="block_n2"):
        configs.BwdConfig.from_fields(**tile, block_n2=8192)
    with pytest.raises(ValueError, match="dw_2d"):
        configs.BwdConfig.from_fields(**tile, block_n2=1024, dw_2d=True)
    with pytest.raises(ValueError, match="plain loads"):
        configs.BwdConfig.from_fields(**tile, block_n2=1024, tma_stages=3)
    with pytest.raises(ValueError, match="plain loads"):
        configs.FwdConfig.from_fields(block_m=1, block_n=4096, block_n2=1024, num_warps=8, tma_stages=3)
    cfg = configs.BwdConfig.from_fields(**tile, block_n2=1024, loop_stages=3)
    assert cfg.col_tiles(5120) == 1
    with pytest.raises(ValueError, match="cannot hold H 5121"):
        cfg.col_tiles(5121)


def test_gated_forward_has_its_own_key(monkeypatch):
    # a gated launch looks up the "gated" forward key: a table entry where one is measured,
    # else the plain tile with half the rows (at one row: its own warps up to
    # GATED_ONE_ROW_ELEMS elements a thread, twice them past that) and none of the plain
    # entry's rows per tile by row count (measured without a gate); plain launches keep the
    # plain tile
    from trainnorm.configs import table
    from trainnorm.variant import Variant
    gate, none = Variant(gate="silu"), Variant()
    assert configs.forward_config(configs.forward_key(4096, 2)).rows_block_m     # the table's windows
    for hidden in (64, 128, 1000, 4096, 5120, 6144):
        plain = configs.forward_config(configs.forward_key(hidden, 2))
        gated = configs.forward_config(configs.forward_key(hidden, 2, gated=True))
        t = plain.tile
        half = (plain.replace(block_m=t.block_m // 2) if t.block_m >= 2 else
                plain if t.block_n // (32 * t.num_warps) <= configs.GATED_ONE_ROW_ELEMS else
                plain.replace(num_warps=min(16, 2 * t.num_warps)))
        assert gated == half.replace(rows_block_m=()) != plain, hidden    # 5120 keeps its tile, not its windows
        assert plan.forward_plan(hidden, torch.bfloat16, torch.bfloat16, gate).cfg == gated
        assert plan.forward_plan(hidden, torch.bfloat16, torch.bfloat16, none).cfg == plain
        # a float32 weight keeps the weight_fp32 lookup, gated or not (the rule: 16-bit weights)
        w32 = plan.forward_plan(hidden, torch.bfloat16, torch.float32, none).cfg
        assert plan.forward_plan(hidden, torch.bfloat16, torch.float32, gate).cfg == w32
    entry = configs.FwdConfig.from_fields(block_m=4, block_n=4096, num_warps=16)
    lookup = table.lookup
    monkeypatch.setattr(table, "lookup", lambda op, key: entry if (op, key.kind) == ("forward", "gated")
                        else lookup(op, key))
    configs.clear_caches()
    plan.clear_caches()
    try:
        assert configs.forward_config(configs.forward_key(4096, 2, gated=True)) == entry
        assert configs.forward_config(configs.forward_key(4096, 2)) != entry
    finally:
        monkeypatch.undo()
        configs.clear_caches()
        plan.clear_caches()


def test_narrow_rows_take_tiles_of_4096_elements():
    # 16-bit rows of 128 columns or fewer: up to 64 rows a tile, 4 warps (the rules'
    # measurements: docs/benchmarks/tune/h100-narrow.txt); float32 keeps 16 rows
    for hidden, rows in ((64, 64), (96, 32), (128, 32), (16, 64)):
        f, b = configs.default_forward(hidden, 2), configs.default_backward(hidden, 2)
        assert (f.block_m, f.num_warps) == (rows, 4) and (b.block_m, b.num_warps, b.dw_2d) == (rows, 4, True)
    assert configs.default_forward(64, 4).block_m == 16 and configs.default_backward(64, 4).block_m == 16


@pytest.mark.parametrize("gated", [False, True])
def test_split_roles_and_loop_stages_same_bits(device, use_configs, gated):
    # the column-slice form's programs taking one role each (split_roles), and the row loop
    # pipelined by the compiler (loop_stages), only change when the work is done: same bits
    hidden, rows = 96, 37
    case = make_case("outlier", (rows,), hidden, seed=19, device=device)
    z = torch.randn(case.x.shape, dtype=case.x.dtype, device=device) if gated else None
    base = bwd_config(hidden, torch.bfloat16, gated).replace(
        block_m=4, min_rows_per_chunk=4, max_chunks=8, tma_stages=0, prefetch=False, dw_2d=False,
        direct_max_rows=0, slices_max_rows=rows, slice_block_n=32)
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS)
    outs = {}
    for name, kw in (("shared", {}), ("split", {"split_roles": True}), ("stages", {"loop_stages": 3}),
                     ("chunked stages", {"slices_max_rows": 0, "loop_stages": 2}),
                     ("chunked", {"slices_max_rows": 0})):
        with configs.override(backward=base.replace(**kw)):
            if gated:
                outs[name] = trainnorm.rms_norm_gated_backward(case.dy, h, z, case.weight, rstd)
            else:
                outs[name] = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd)
    for a, b in (("shared", "split"), ("shared", "stages"), ("chunked", "chunked stages")):
        for u, v in zip(outs[a], outs[b]):
            assert_bits_equal(u, v, f"{b} vs {a}")
    if not gated:
        check_backward(case.dy, h, case.weight, rstd, None, *outs["split"])


@pytest.mark.parametrize("form", ["one tile", "two pieces", "column tiles"])
@pytest.mark.parametrize("spec", ["w+1.0", "silu,w+1.0", "silu:first,w+1.0", "w+0.5"])
def test_weight_offset_in_kernels(device, use_configs, form, spec):
    # y = norm(h) * (offset + w) computed inside every forward and backward form (the ops'
    # variant spec "w+<offset>"), against FP64; dw is the same sum as without an offset
    hidden, rows = 96, 21
    offset = float(spec.split("w+")[1])
    b1, b2 = configs.row_pieces(hidden)
    shape = {"one tile": {}, "two pieces": {"block_n": b1, "block_n2": b2},
             "column tiles": {"block_n": 32}}[form]
    use_configs(forward=fwd_config(hidden).replace(tma_stages=0, **shape),
                backward=bwd_config(hidden).replace(tma_stages=0, prefetch=False, direct_prefetch=None,
                                                    direct_tma_stages=None, dw_2d=False, **shape))
    case = make_case("outlier", (rows,), hidden, seed=23, device=device)
    w = (0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)      # zero-centred weights
    z = torch.randn(case.x.shape, device=device).to(torch.bfloat16) if "silu" in spec else None
    nbg = ":first" not in spec
    y, rstd, _ = torch.ops.trainnorm.rms_norm_fwd(case.x, w, None, z, EPS, spec)
    y64, _, _ = reference.forward_fp64(case.x, w, EPS, None, z, nbg, weight_offset=offset)
    assert_close64(y, y64, "y")
    for slices in (0, rows):
        with configs.override(backward=lambda key, cfg: cfg.replace(direct_max_rows=0, slices_max_rows=slices)):
            dx, dw, dz, _ = torch.ops.trainnorm.rms_norm_bwd(case.dy, case.x, w, rstd, None, z, spec, True, True, None)
        dx64, dw64, *dz64 = reference.backward_fp64(case.dy, case.x, w, rstd, None, z, nbg, weight_offset=offset)
        assert_close64(dx, dx64, "dx")
        if z is not None:
            assert_close64(dz, dz64[0], "dgate")
        assert reference.dw_err_over_tol(dw, dw64) <= DW_BUDGET
    # the offset matters: the same call without it is another function
    y0, _, _ = torch.ops.trainnorm.rms_norm_fwd(case.x, w, None, z, EPS, spec.replace(f"w+{offset!r}", "").strip(","))
    assert not torch.allclose(y0.float(), y.float(), atol=0.05)


@pytest.mark.parametrize("form", ["one tile", "two pieces", "column tiles"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_float32_residual_stream(device, use_configs, form, weight_dtype):
    # bf16 x with a float32 residual: h = f32(x) + r in float32 (one rounding), y in x's
    # dtype from that h; the backward gives x's gradient in bf16 and the stream's in
    # float32 (the same value rounded), dw within the budget, both modes the same dx
    hidden, rows = 96, 37
    b1, b2 = configs.row_pieces(hidden)
    shape = {"one tile": {}, "two pieces": {"block_n": b1, "block_n2": b2}, "column tiles": {"block_n": 32}}[form]
    use_configs(forward=fwd_config(hidden).replace(tma_stages=0, **shape),
                backward=bwd_config(hidden).replace(tma_stages=0, prefetch=False, direct_prefetch=None,
                                                    direct_tma_stages=None, dw_2d=False, **shape))
    case = make_case("outlier", (rows,), hidden, seed=29, weight_dtype=weight_dtype, device=device)
    r = 4 * torch.randn(case.x.shape, device=device)                   # float32 stream
    dh = torch.randn(case.x.shape, device=device)
    grads = {}
    for det in (True, False):
        x = case.x.clone().requires_grad_()
        res = r.clone().requires_grad_()
        w = case.weight.clone().requires_grad_()
        y, h = trainnorm.rms_norm(x, w, EPS, residual=res, deterministic=det)
        assert y.dtype == case.x.dtype and h.dtype == torch.float32
        assert_bits_equal(h, case.x.float() + r, "h = f32(x) + r")
        y64, rstd64, _ = reference.forward_fp64(case.x, case.weight, EPS, r)
        assert_close64(y, y64, "y")
        torch.autograd.backward((y, h), (case.dy, dh))
        assert x.grad.dtype == case.x.dtype and res.grad.dtype == torch.float32
        grads[det] = (x.grad, res.grad, w.grad)
    _, rstd, _ = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=r)
    dx64, dw64 = reference.backward_fp64(case.dy, h.detach(), case.weight, rstd, dh)
    dx, dres, dw = grads[True]
    assert_close64(dx, dx64, "dx")
    assert float((dres.double() - dx64).norm() / dx64.norm()) < 1e-6, "the float32 stream's gradient"
    assert_bits_equal(dx, dres.to(dx.dtype), "dx is the stream's gradient rounded")
    # dw before autograd rounds it to the weight's dtype: the op's float32 dw
    odx, odw, _, odres = torch.ops.trainnorm.rms_norm_bwd(case.dy, h.detach(), case.weight, rstd, dh, None,
                                                          f"x:{'bf16'}", True, True, None)
    assert reference.dw_err_over_tol(odw, dw64) <= DW_BUDGET
    assert_bits_equal(odw.to(dw.dtype), dw, "dw")
    assert_bits_equal(odx, dx, "dx through the op")
    assert_bits_equal(odres, dres, "dres through the op")
    for a, b, n in zip(grads[True][:2], grads[False][:2], ("dx", "dres")):
        assert_bits_equal(a, b, f"{n}: both modes")


def test_residual_dtype_checked(device):
    x = torch.randn(3, 64, device=device).to(torch.bfloat16)
    w = torch.ones(64, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="residual must have x's dtype .* or float32"):
        trainnorm.rms_norm(x, w, residual=torch.randn(3, 64, device=device).to(torch.float16))
    with pytest.raises(TypeError, match="residual must have x's dtype .* or float32"):
        trainnorm.rms_norm(x.float(), w.float(), residual=torch.randn(3, 64, device=device).to(torch.bfloat16))


@pytest.mark.parametrize("residual", [None, "bf16", "fp32"])
def test_weight_offset_api(device, residual):
    # rms_norm(..., weight_offset=1) and RMSNorm(weight_offset=1): (1 + w) inside the
    # kernels, the op's "w+1.0" variant, gradients to the zero-centred weight
    hidden, rows = 96, 19
    case = make_case("outlier", (rows,), hidden, seed=31, device=device)
    r = {None: None, "bf16": torch.randn(case.x.shape, device=device).to(torch.bfloat16),
         "fp32": torch.randn(case.x.shape, device=device)}[residual]
    w = (0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    m = trainnorm.RMSNorm(hidden, EPS, weight_offset=1.0, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(w)
    x = case.x.clone().requires_grad_()
    out = m(x, r)
    y, h = out if r is not None else (out, case.x)
    spec = "w+1.0" + (",x:bf16" if residual == "fp32" else "")
    y_op, rstd, _ = torch.ops.trainnorm.rms_norm_fwd(case.x, w, r, None, EPS, spec)
    assert_bits_equal(y, y_op, "y: the module and the op's offset variant")
    y64, _, _ = reference.forward_fp64(case.x, w, EPS, r, weight_offset=1.0)
    assert_close64(y, y64, "y")
    y.backward(case.dy)
    dx64, dw64 = reference.backward_fp64(case.dy, h.detach(), w, rstd, None, weight_offset=1.0)
    assert_close64(x.grad, dx64, "dx")
    dx, dw = trainnorm.rms_norm_backward(case.dy, h.detach(), w, rstd, weight_offset=1.0)
    assert reference.dw_err_over_tol(dw, dw64) <= DW_BUDGET
    assert_bits_equal(dw.to(torch.bfloat16), m.weight.grad, "dw: autograd and the explicit backward")
    # the explicit forward takes it too, and the gated forms
    assert_bits_equal(trainnorm.rms_norm_forward(case.x, w, EPS, residual=r, weight_offset=1.0)[0], y, "y")
    z = torch.randn(case.x.shape, device=device).to(torch.bfloat16)
    g = trainnorm.rms_norm_gated(case.x, z, w, EPS, weight_offset=1.0)
    g64, _, _ = reference.forward_fp64(case.x, w, EPS, None, z, weight_offset=1.0)
    assert_close64(g, g64, "gated y")
    gm = trainnorm.RMSNormGated(hidden, EPS, weight_offset=1.0, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        gm.weight.copy_(w)
    assert_bits_equal(gm(case.x, z), g, "gated module")


@pytest.mark.parametrize("x_dtype,residual,out_dtype", [
    (torch.bfloat16, False, torch.float32), (torch.bfloat16, True, torch.float32),
    (torch.float32, False, torch.bfloat16), (torch.float16, False, torch.bfloat16)])
def test_out_dtype(device, x_dtype, residual, out_dtype):
    # y stored in out_dtype from the same float32 value: rounded to x's dtype it is the
    # default call's y bit for bit; dy arrives in out_dtype and the gradients are those of
    # the same function
    hidden, rows = 96, 23
    case = make_case("outlier", (rows,), hidden, dtype=x_dtype, seed=37, device=device)
    r = torch.randn(case.x.shape, device=device) if residual else None      # a float32 stream
    grads = {}
    for det in (True, False):
        x = case.x.clone().requires_grad_()
        w = case.weight.clone().requires_grad_()
        out = trainnorm.rms_norm(x, w, EPS, residual=r, deterministic=det, out_dtype=out_dtype)
        y = out[0] if residual else out
        assert y.dtype == out_dtype
        y.backward(case.dy.to(out_dtype))
        grads[det] = (x.grad, w.grad)
    base = trainnorm.rms_norm(case.x, case.weight, EPS, residual=r)
    base = base[0] if residual else base
    h = case.x.float() + r if residual else case.x
    y64, _, _ = reference.forward_fp64(case.x, case.weight, EPS, r)
    assert_close64(y, y64, "y")
    if out_dtype.itemsize > x_dtype.itemsize:
        assert_bits_equal(y.to(x_dtype), base, "y rounded to x's dtype")
    # the rstd autograd saved: the same call's (for float32 x stored as bf16 the GPU kernel
    # compiled for the narrower store gave rstd one ulp off the default call's on an H100)
    _, rstd, _ = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=r, out_dtype=out_dtype)
    dx64, dw64 = reference.backward_fp64(case.dy.to(out_dtype), h, case.weight, rstd)
    assert_close64(grads[True][0], dx64, "dx")
    assert_bits_equal(grads[True][0], grads[False][0], "dx: both modes")
    _, dw = trainnorm.rms_norm_backward(case.dy.to(out_dtype), h, case.weight, rstd)
    assert reference.dw_err_over_tol(dw, dw64) <= DW_BUDGET
    assert_bits_equal(dw.to(case.weight.dtype), grads[True][1], "dw")


def test_gated_out_dtype_and_offset_through_autograd(device):
    # the gated forms take out_dtype and weight_offset too: y in float32, dy in float32,
    # gradients of the same function (FP64), and the integrations' OffsetRMSNormGated
    from trainnorm.integrations import OffsetRMSNormGated
    hidden, rows = 64, 13
    case = make_case("normal", (rows,), hidden, seed=41, device=device)
    z = torch.randn(case.x.shape, device=device).to(torch.bfloat16)
    w = (0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    for nbg in (True, False):
        x, g, wp = (t.clone().requires_grad_() for t in (case.x, z, w))
        y = trainnorm.rms_norm_gated(x, g, wp, EPS, norm_before_gate=nbg, weight_offset=1.0, out_dtype=torch.float32)
        assert y.dtype == torch.float32
        dy = case.dy.float()
        y.backward(dy)
        y64, rstd64, _ = reference.forward_fp64(case.x, w, EPS, None, z, nbg, weight_offset=1.0)
        assert_close64(y, y64, "y")
        _, rstd = trainnorm.rms_norm_gated_forward(case.x, z, w, EPS, norm_before_gate=nbg, weight_offset=1.0)
        dx64, dw64, dz64 = reference.backward_fp64(dy, case.x, w, rstd, None, z, nbg, weight_offset=1.0)
        assert_close64(x.grad, dx64, "dx")
        assert_close64(g.grad, dz64, "dgate")
        mod = OffsetRMSNormGated(torch.nn.Parameter(w.clone()), EPS, norm_before_gate=nbg)
        assert_bits_equal(mod(case.x, z), trainnorm.rms_norm_gated(case.x, z, w, EPS, norm_before_gate=nbg,
                                                                   weight_offset=1.0), "OffsetRMSNormGated")
