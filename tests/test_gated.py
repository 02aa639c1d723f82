"""The SiLU-gated RMSNorm: both orders of norm and gate, both dw modes."""
import pytest
import torch

import trainnorm
from trainnorm import configs, dispatch, reference
from trainnorm.configs import BwdConfig
from trainnorm.plan import DwForm
from trainnorm.rows import simulate_sm_count
from trainnorm.families import make_case

from helpers import assert_bits_equal, bwd_config, bwd_plan, check_gated, fwd_config, run_gated

EPS = 1e-6


def gated_case(lead, hidden, *, seed, device, family="normal", weight_dtype=torch.bfloat16, dtype=torch.bfloat16,
               query_view=False):
    case = make_case(family, lead, hidden, dtype=dtype, weight_dtype=weight_dtype, residual=True, seed=seed,
                     device=device, query_view=query_view)
    return case.x, case.residual, case.weight, case.dy     # residual's draw serves as the gate


def run(x, z, w, dy, nbg, det=True):
    return run_gated(x, z, w, dy, nbg, det, EPS)


def check(x, z, w, dy, nbg, det=True):
    return check_gated(x, z, w, dy, nbg, det, EPS)


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("hidden", [512, 1000, 2048, 6144])
def test_gated_accuracy(device, hidden, norm_before_gate):
    check(*gated_case((23,), hidden, seed=hidden, device=device), norm_before_gate)


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("deterministic", [True, False])
def test_gated_modes_and_chunks(device, norm_before_gate, deterministic, force_atomic):
    # 300 rows of H512: several chunks, partial + combine (det) or atomic (fast)
    x, z, w, dy = gated_case((300,), 512, seed=1, device=device, family="outlier", weight_dtype=torch.float32)
    det = check(x, z, w, dy, norm_before_gate, True)
    other = check(x, z, w, dy, norm_before_gate, deterministic)
    for a, b, n in zip(det[:4], other[:4], ("y", "rstd", "dx", "dgate")):
        assert_bits_equal(a, b, n)


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_wide_rows(device, norm_before_gate):
    check(*gated_case((7,), 8200, seed=2, device=device), norm_before_gate)


def test_gated_views_and_no_weight(device):
    x, z, w, dy = gated_case((5, 24), 256, seed=3, device=device, query_view=True)
    assert x.stride() == (24 * 512, 512, 1)
    check(x, z.transpose(0, 1).contiguous().transpose(0, 1), None, dy, True)   # gate in another layout
    check(x, z, None, dy, False)


def test_gated_batch_invariance_and_sm_counts(device):
    x, z, w, dy = gated_case((150,), 2048, seed=4, device=device)
    ref = run(x, z, w, dy, True)
    sub = run(x[7:60], z[7:60], w, dy[7:60], True)
    for a, b, n in zip(ref[:4], sub[:4], ("y", "rstd", "dx", "dgate")):
        assert_bits_equal(a[7:60], b, n)
    for sms in (1, 5, 300):
        with simulate_sm_count(sms):
            for a, b in zip(ref, run(x, z, w, dy, True)):
                assert_bits_equal(a, b, f"{sms} SMs")


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_autograd_and_module(device, norm_before_gate):
    x, z, w, dy = gated_case((4, 9), 512, seed=5, device=device, weight_dtype=torch.float32)
    m = trainnorm.RMSNormGated(512, eps=EPS, norm_before_gate=norm_before_gate, device=device)
    with torch.no_grad():
        m.weight.copy_(w)
    xr, zr = x.clone().requires_grad_(), z.clone().requires_grad_()
    y = m(xr, zr)
    y.backward(dy)
    _, _, dx, dz, dw = run(x, z, w, dy, norm_before_gate)
    assert_bits_equal(xr.grad, dx, "x.grad")
    assert_bits_equal(zr.grad, dz, "gate.grad")
    assert_bits_equal(m.weight.grad, dw, "weight.grad")
    assert f"norm_before_gate={norm_before_gate}" in repr(m)
    assert list(m.state_dict()) == ["weight"]


def test_gated_reference_gradcheck():
    torch.manual_seed(0)
    for nbg in (True, False):
        x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
        z = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
        w = torch.randn(16, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, z, w: reference.RMSNormGatedFP64.apply(x, z, w, 1e-5, nbg), (x, z, w))


def test_gated_bad_input(device, monkeypatch):
    monkeypatch.setattr(dispatch, "forward", lambda *a, **k: pytest.fail("launched"))
    x = torch.randn(4, 64, device=device).to(torch.bfloat16)
    w = torch.ones(64, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="gate must be a torch.Tensor"):
        trainnorm.rms_norm_gated(x, None, w)
    with pytest.raises(ValueError, match="gate must have the shape of x"):
        trainnorm.rms_norm_gated(x, x[:, :32], w)
    with pytest.raises(TypeError, match="gate must have dtype"):
        trainnorm.rms_norm_gated(x, x.float(), w)
    with pytest.raises(TypeError, match="norm_before_gate must be a bool"):
        trainnorm.rms_norm_gated(x, x, w, norm_before_gate=None)


def test_gated_cpu_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, z, w, dy = gated_case((6,), 384, seed=6, device="cpu")
    for nbg in (True, False):
        check(x, z, w, dy, nbg)


def entries(**by_kind):
    """A configs.override that answers the backward's lookups of H 64 by kind ("plain", "gated")."""
    return configs.override(backward=lambda key, cfg: by_kind.get(key.kind) if key.hidden == 64 else None)


def test_gated_table_entry_and_its_workspace(device):
    # a gated table entry (trainnorm.dev.tune --gated) replaces the plain tile for the gated backward
    # only; its chunking differs from the plain entry's, so the workspace is sized with gated=True
    hidden, rows = 64, 200
    with entries(gated=BwdConfig.from_fields(block_m=2, block_n=64, num_warps=2, min_rows_per_chunk=2,
                                             max_chunks=64)):
        gated = bwd_plan(rows, hidden, torch.bfloat16, True, True, True)
        plain = bwd_plan(rows, hidden, torch.bfloat16, True, True, False)
        assert (gated.cfg.block_m, gated.cfg.num_warps, gated.num_chunks) == (2, 2, 50)
        assert plain.num_chunks < gated.num_chunks
        assert trainnorm.backward_workspace_bytes(rows, hidden, gated=True) == gated.workspace_bytes
        x, z, w, dy = gated_case((rows,), hidden, seed=5, device=device)
        _, rstd = trainnorm.rms_norm_gated_forward(x, z, w, EPS)
        small = trainnorm.backward_workspace(rows, hidden, device=device)
        with pytest.raises(ValueError, match="workspace"):
            trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, workspace=small)
        ws = trainnorm.backward_workspace(rows, hidden, device=device, gated=True)
        got = trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, workspace=ws)
        ref = trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd)
        for a, b, what in zip(got, ref, ("dx", "dgate", "dw")):
            assert_bits_equal(a, b, what)
        check(x, z, w, dy, True)
        with pytest.raises(TypeError, match="gated"):
            trainnorm.backward_workspace_bytes(rows, hidden, gated=1)


def test_gated_workspace_smaller_than_the_plain_one(device):
    # the gated backward's workspace is checked against the gated plan: a gated entry whose fast
    # mode is the atomic form needs H * 8 + 8 bytes where the plain entry's chunked form needs
    # far more; the gated size is accepted, and one byte less is refused before any launch
    hidden, rows = 64, 200
    tile = dict(block_m=2, block_n=64, num_warps=2, min_rows_per_chunk=2, max_chunks=64)
    with entries(gated=BwdConfig.from_fields(**tile, atomic_min_rows=0),
                 plain=BwdConfig.from_fields(**tile, atomic_min_rows=1 << 40)):
        need = trainnorm.backward_workspace_bytes(rows, hidden, deterministic=False, gated=True)
        assert need == hidden * 8 + 8 < trainnorm.backward_workspace_bytes(rows, hidden, deterministic=False)
        x, z, w, dy = gated_case((rows,), hidden, seed=7, device=device)
        _, rstd = trainnorm.rms_norm_gated_forward(x, z, w, EPS)
        ws = trainnorm.backward_workspace(rows, hidden, deterministic=False, device=device, gated=True)
        got = trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, deterministic=False, workspace=ws)
        ref = trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd)
        assert_bits_equal(got[0], ref[0], "dx")
        with pytest.raises(ValueError, match=f"workspace must hold {need} bytes"):
            trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, deterministic=False, workspace=ws[:need - 8])


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_cols_form(device, norm_before_gate):
    # the column-slice dw (DwForm.COL_SLICES) with a gate in either order: within the budget, dx
    # and dgate bit-equal to the chunked form, dw the same in both modes
    hidden, rows = 96, 37
    base = bwd_config(hidden, torch.bfloat16, True).replace(block_m=4, min_rows_per_chunk=4, max_chunks=8,
                                                            tma_stages=0, dw_2d=False)
    x, z, w, dy = gated_case((rows,), hidden, seed=21, device=device, family="outlier")
    outs = {}
    for name, cfg in (("chunked", base), ("cols", base.replace(slices_max_rows=rows, slice_block_n=32))):
        with configs.override(backward=cfg):
            assert (bwd_plan(rows, hidden, torch.bfloat16, True, True, True).dw
                    == (DwForm.COL_SLICES if name == "cols" else DwForm.PARTIAL))
            outs[name] = check(x, z, w, dy, norm_before_gate)
            outs[name, False] = run(x, z, w, dy, norm_before_gate, det=False)
    for i, what in ((2, "dx"), (3, "dgate")):
        assert_bits_equal(outs["chunked"][i], outs["cols"][i], f"{what}: cols vs chunked")
    assert_bits_equal(outs["cols"][4], outs["cols", False][4], "cols dw in both modes")


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("hidden,block_n", [(96, None), (96, 32)])
def test_second_activation(device, use_configs, hidden, block_n, norm_before_gate):
    # a sigmoid gate: one branch of kernels/gate.py and one entry of reference.GATE_ACTIVATIONS.
    # Every backward form (one tile, column tiles, column slices) and both forward forms
    # against FP64, both modes; the variant reaches the kernels (a silu gate gives other bits)
    if block_n:
        use_configs(forward=fwd_config(hidden).replace(block_n=block_n, tma_stages=0),
                    backward=bwd_config(hidden, gated=True).replace(block_n=block_n))
    x, z, w, dy = gated_case((37,), hidden, seed=31, device=device, family="outlier")
    sig = check_gated(x, z, w, dy, norm_before_gate, True, EPS, "sigmoid")
    fast = check_gated(x, z, w, dy, norm_before_gate, False, EPS, "sigmoid")
    for a, b, n in zip(sig[:4], fast[:4], ("y", "rstd", "dx", "dgate")):
        assert_bits_equal(a, b, n)
    with configs.override(backward=lambda key, cfg: cfg.replace(slices_max_rows=64, slice_block_n=32)):
        assert bwd_plan(37, hidden, gated=True).dw == DwForm.COL_SLICES
        slices = check_gated(x, z, w, dy, norm_before_gate, True, EPS, "sigmoid")
    for a, b, n in zip(sig[:4], slices[:4], ("y", "rstd", "dx", "dgate")):
        assert_bits_equal(a, b, n)
    silu = run(x, z, w, dy, norm_before_gate)
    assert not torch.equal(silu[0], sig[0])
    y = trainnorm.rms_norm_gated(x, z, w, EPS, norm_before_gate=norm_before_gate, activation="sigmoid")
    assert_bits_equal(y, sig[0], "rms_norm_gated(activation='sigmoid') vs the explicit forward")


def test_second_activation_module_and_cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, z, w, dy = gated_case((5,), 64, seed=4, device="cpu")
    norm = trainnorm.RMSNormGated(64, eps=EPS, activation="sigmoid", dtype=torch.bfloat16)
    assert "activation='sigmoid'" in repr(norm)
    xx = x.clone().requires_grad_()
    y = norm(xx, z)
    y64, _, _ = reference.forward_fp64(x, norm.weight.detach(), EPS, None, z, True, activation="sigmoid")
    torch.testing.assert_close(y.double(), y64, atol=1e-2, rtol=1e-2)
    y.float().sum().backward()
    assert xx.grad is not None and torch.isfinite(xx.grad).all()
    with pytest.raises(ValueError, match="activation"):
        trainnorm.rms_norm_gated(x, z, w, activation="tanh")
    with pytest.raises(ValueError, match="activation"):
        trainnorm.RMSNormGated(64, activation="relu")
