"""Reliability (bad input is tested in test_api.py): NaN / Inf, extreme magnitudes, zero rows,
canaries around workspaces and inputs, and (on a GPU) streams, workspace
reuse, tensors past 2**31 elements and out-of-memory.

On a CPU the kernels run under Triton's interpreter (conftest.py) on small
shapes; the `gpu` tests need a CUDA GPU.
"""
import gc

import pytest
import torch

import trainnorm
from trainnorm import reference
from trainnorm.plan import DwForm
from trainnorm.rows import runs_kernels

from helpers import DW_BUDGET, bwd_plan, assert_bits_equal, assert_close64, check_backward, check_forward

# the fast mode's atomic form wherever it applies, whatever the tuned edges (conftest.force_atomic)
pytestmark = pytest.mark.usefixtures("force_atomic")

H = 64


def _rand(shape, dtype=torch.bfloat16, device="cpu", seed=0, scale=1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def _w(device, dtype=torch.bfloat16, n=H):
    return torch.ones(n, dtype=dtype, device=device)


# --- NaN and Inf propagate as the math says ----------------------------------------------------

def _fwd_bwd(x, w, dy, deterministic, residual=None, dh=None, eps=1e-6):
    y, rstd, h = trainnorm.rms_norm_forward(x, w, eps, residual=residual)
    dx, dw = trainnorm.rms_norm_backward(dy, h, w, rstd, dh=dh, deterministic=deterministic)
    return y, rstd, h, dx, dw


def _close_nan(out, ref, what):
    """The same NaN / Inf pattern as the FP64 reference, and the finite part within 1e-2."""
    torch.testing.assert_close(out.double(), ref.double(), atol=1e-2, rtol=1e-2, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("rows,hidden", [(300, 512), (21, 8200)])
def test_nan_row_is_contained(device, deterministic, rows, hidden):
    # 300 x 512: several dw chunks (partial + combine, or the atomic form); 8200: column tiles
    x = _rand((rows, hidden), device=device, seed=1)
    dy = _rand((rows, hidden), device=device, seed=2)
    w = (1 + 0.1 * _rand((hidden,), torch.float32, device, seed=3))
    clean = _fwd_bwd(x, w, dy, deterministic)
    bad = x.clone()
    r = rows // 2
    bad[r, 7] = float("nan")
    y, rstd, _, dx, dw = _fwd_bwd(bad, w, dy, deterministic)
    assert torch.isnan(rstd[r]) and torch.isnan(y[r]).all() and torch.isnan(dx[r]).all()
    others = torch.arange(rows, device=device) != r
    # batch invariance: the other rows are the same bits as without the NaN
    for a, b, n in ((y, clean[0], "y"), (rstd, clean[1], "rstd"), (dx, clean[3], "dx")):
        assert_bits_equal(a[others], b[others], f"{n} of the clean rows")
    assert torch.isnan(dw).all(), "the NaN row reaches every column of dw"
    if bwd_plan(rows, hidden, torch.bfloat16, deterministic, True).dw == DwForm.ATOMIC:
        # the fast form's float64 accumulator is left zeroed, NaN or not
        ws = trainnorm.backward_workspace(rows, hidden, deterministic=False, device=device)
        trainnorm.rms_norm_backward(dy, bad, w, rstd, deterministic=False, workspace=ws)
        assert not ws.any(), "the workspace must be zeroed after a NaN"
        dx2, dw2 = trainnorm.rms_norm_backward(dy, x, w, clean[1], deterministic=False, workspace=ws)
        assert torch.isfinite(dw2).all(), "a NaN leaked into the next call through the workspace"
        assert_bits_equal(dx2, clean[3], "dx after a NaN call")


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("where", ["x_inf", "x_neg_inf", "dy_nan", "dy_inf", "weight_nan", "residual_inf"])
def test_nan_inf_follow_the_math(device, deterministic, where):
    rows, hidden = 40, 256
    x = _rand((rows, hidden), device=device, seed=4)
    dy = _rand((rows, hidden), device=device, seed=5)
    res = _rand((rows, hidden), device=device, seed=6) if where == "residual_inf" else None
    dh = _rand((rows, hidden), device=device, seed=7) if res is not None else None
    w = 1 + 0.1 * _rand((hidden,), torch.float32, device, seed=8)
    if where == "x_inf":
        x[3, 10] = float("inf")
    elif where == "x_neg_inf":
        x[3, 10] = float("-inf")
    elif where == "dy_nan":
        dy[5, 2] = float("nan")
    elif where == "dy_inf":
        dy[5, 2] = float("inf")
    elif where == "weight_nan":
        w[9] = float("nan")
    else:
        res[2, 0] = float("inf")
    y, rstd, h, dx, dw = _fwd_bwd(x, w, dy, deterministic, res, dh)
    y64, rstd64, h_ref = reference.forward_fp64(x, w, 1e-6, res)
    _close_nan(y, y64, "y")
    _close_nan(rstd, rstd64, "rstd")
    if res is not None:
        assert_bits_equal(h, h_ref, "h")
    dx64, dw64 = reference.backward_fp64(dy, h, w, rstd, dh)
    _close_nan(dx, dx64, "dx")
    assert torch.equal(torch.isnan(dw), torch.isnan(dw64)), "dw NaN pattern"
    fin = torch.isfinite(dw64)
    assert reference.dw_err_over_tol(dw[fin], dw64[fin]) <= DW_BUDGET
    # the rows untouched by the bad value stay finite
    bad_rows = ~torch.isfinite(y64.double()).all(-1) | ~torch.isfinite(dx64).all(-1)
    assert torch.isfinite(y[~bad_rows]).all() and torch.isfinite(dx[~bad_rows]).all()


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_nan_gate_follows_the_math(device, norm_before_gate):
    rows, hidden = 12, 128
    x = _rand((rows, hidden), device=device, seed=9)
    z = _rand((rows, hidden), device=device, seed=10)
    dy = _rand((rows, hidden), device=device, seed=11)
    w = _w(device, n=hidden)
    z[4, 3] = float("nan")
    y, rstd = trainnorm.rms_norm_gated_forward(x, z, w, 1e-6, norm_before_gate=norm_before_gate)
    dx, dz, dw = trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, norm_before_gate=norm_before_gate)
    y64, rstd64, _ = reference.forward_fp64(x, w, 1e-6, None, z, norm_before_gate)
    dx64, dw64, dz64 = reference.backward_fp64(dy, x, w, rstd, None, z, norm_before_gate)
    for out, ref, n in ((y, y64, "y"), (rstd, rstd64, "rstd"), (dx, dx64, "dx"), (dz, dz64, "dgate")):
        _close_nan(out, ref, n)
    assert torch.equal(torch.isnan(dw), torch.isnan(dw64))
    if norm_before_gate:      # the gate acts after the norm: only that element of y is NaN
        assert torch.isfinite(rstd).all() and int(torch.isnan(y).sum()) == 1


# --- extreme magnitudes -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,value", [
    (torch.float16, 1e-6), (torch.float16, 6e-8),          # fp16 subnormals
    (torch.float32, 1e-40), (torch.float32, 1e-44),        # fp32 subnormals
    (torch.bfloat16, 1e-39),                               # bf16 subnormal
])
def test_subnormal_inputs(device, dtype, value):
    rows, hidden = 6, 96
    x = torch.full((rows, hidden), value, dtype=dtype, device=device)
    x[1] = -x[1]
    x[2, ::2] = 0
    x[3] = _rand((hidden,), dtype, device, seed=12)          # an ordinary row next to them
    assert (x[0].float().abs() < torch.finfo(dtype).tiny).all()
    dy = _rand((rows, hidden), dtype, device, seed=13)
    w = _w(device, dtype, hidden)
    y, rstd, h, dx, dw = _fwd_bwd(x, w, dy, True)
    check_forward(x, w, 1e-6, None, y, rstd, h)
    check_backward(dy, h, w, rstd, None, dx, dw)


@pytest.mark.parametrize("value", [1e15, 1e18, -1.5e18])
def test_large_values_within_fp32_sum(device, value):
    # sum_j h_j^2 = H * value^2 < fp32 max: rstd and y as FP64 says
    rows, hidden = 4, 64
    x = torch.full((rows, hidden), value, dtype=torch.bfloat16, device=device)
    x[1] = _rand((hidden,), device=device, seed=14) * value
    dy = _rand((rows, hidden), device=device, seed=15)
    w = _w(device, n=hidden)
    y, rstd, h, dx, dw = _fwd_bwd(x, w, dy, True)
    check_forward(x, w, 1e-6, None, y, rstd, h)
    check_backward(dy, h, w, rstd, None, dx, dw)


# the float32 sum of squares of these rows overflows: the kernels sum them again scaled down
@pytest.mark.parametrize("value", [3e38, 1e20])
def test_values_near_bf16_max(device, value):
    rows, hidden = 3, 64
    x = torch.full((rows, hidden), value, dtype=torch.bfloat16, device=device)
    x[1] = -x[1]
    w = _w(device, n=hidden)
    y, rstd, h = trainnorm.rms_norm_forward(x, w, 1e-6)
    y64, rstd64, _ = reference.forward_fp64(x, w, 1e-6)
    assert torch.isfinite(rstd).all() and (rstd > 0).all(), f"rstd {rstd.tolist()}"
    assert float((rstd.double() / rstd64 - 1).abs().max()) <= 1e-4
    assert_close64(y, y64, "y")


@pytest.mark.parametrize("deterministic", [True, False])
def test_fp16_dx_overflow_is_the_math(device, deterministic):
    # H = 1, x a subnormal fp16 (6e-8) and eps 1e-12: rstd ~ 1e6 and dx = rstd * g * (1 - xhat**2)
    # ~ 9.9e5, past fp16's 65504, so the rounded dx is inf (the soak drew such a row, H200)
    x = torch.tensor([[6e-8], [1.0], [-3e-8]], dtype=torch.float16, device=device)
    w = torch.ones(1, dtype=torch.float16, device=device)
    dy = torch.tensor([[1.0], [1.0], [-0.5]], dtype=torch.float16, device=device)
    y, rstd, h, dx, dw = _fwd_bwd(x, w, dy, deterministic, eps=1e-12)
    dx64, _ = reference.backward_fp64(dy, h, w, rstd, None)
    assert dx64[0, 0] > 65504 and dx64[2, 0] < -65504 and abs(float(dx64[1, 0])) < 1
    assert dx[0, 0] == float("inf") and dx[2, 0] == float("-inf") and torch.isfinite(dx[1]).all()
    check_forward(x, w, 1e-12, None, y, rstd, h)
    check_backward(dy, h, w, rstd, None, dx, dw)
    # the check still rejects a NaN (an unwritten element) or a wrong sign there
    for bad in (float("nan"), float("-inf")):
        with pytest.raises(AssertionError):
            assert_close64(torch.where(torch.arange(3, device=device)[:, None] == 0, bad, dx), dx64, "dx")


# --- zero rows --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.1, 1e-12, None])
def test_zero_rows_exact(device, dtype, eps):
    rows, hidden = 5, 40
    x = _rand((rows, hidden), dtype, device, seed=16)
    x[1] = 0
    x[3] = -0.0
    dy = _rand((rows, hidden), dtype, device, seed=17)
    dy[3] = 0
    dy[1] *= 1e-3     # dx of a zero row is rstd * g: with eps = 1e-12 (rstd = 1e6) it must fit fp16
    w = 1 + 0.1 * _rand((hidden,), torch.float32, device, seed=18)
    y, rstd, h, dx, dw = _fwd_bwd(x, w, dy, True, eps=eps)
    e = eps if eps is not None else torch.finfo(torch.float32).eps     # torch's default, whatever x's dtype
    # the float32 formula on a zero row: 1 / sqrt(f32(0 / H + eps)) with IEEE sqrt and division
    want = 1.0 / torch.sqrt(torch.tensor(e, dtype=torch.float32))
    if runs_kernels(x):
        assert torch.equal(rstd[[1, 3]].cpu(), want.expand(2)), f"{rstd[[1, 3]].tolist()} vs {want.item()}"
    else:   # the CPU path evaluates in float64 and rounds once
        torch.testing.assert_close(rstd[[1, 3]].cpu(), want.expand(2), atol=0, rtol=1e-6)
    assert not y[[1, 3]].any() and torch.isfinite(y).all()
    assert not dx[3].any(), "dx = 0 where the row and dy are zero"
    # a zero row with dy != 0: dx = rstd * g (xhat = 0), finite; it adds nothing to dw
    torch.testing.assert_close(dx[1].double(), (rstd[1].double() * dy[1].double() * w.double()).to(dtype).double(),
                               atol=0, rtol=1e-2)
    check_forward(x, w, e, None, y, rstd, h)
    check_backward(dy, h, w, rstd, None, dx, dw)
    rest = torch.tensor([0, 2, 4], device=device)
    dw_rest = trainnorm.rms_norm_backward(dy[rest], h[rest], w, rstd[rest])[1]
    assert torch.allclose(dw, dw_rest, atol=1e-6, rtol=1e-6), "zero rows contribute to dw"


def test_all_zero_input_both_modes(device):
    x = torch.zeros(300, 512, dtype=torch.bfloat16, device=device)
    w = _w(device, n=512)
    for det in (True, False):
        y, rstd, h, dx, dw = _fwd_bwd(x, w, torch.zeros_like(x), det)
        assert not y.any() and not dx.any() and not dw.any() and torch.isfinite(rstd).all()


# --- canaries: nothing outside the outputs and the workspace is written ---------------------------

CANARY = 0xA5


@pytest.mark.parametrize("deterministic,rows,hidden,mode", [
    (True, 300, 512, DwForm.PARTIAL),
    (False, 300, 512, DwForm.ATOMIC),
    (True, 40, 8200, DwForm.PARTIAL),
])
def test_workspace_canary(device, deterministic, rows, hidden, mode):
    assert bwd_plan(rows, hidden, torch.bfloat16, deterministic, True).dw == mode
    need = trainnorm.backward_workspace_bytes(rows, hidden, deterministic=deterministic)
    pad = 256
    big = torch.full((pad + need + pad,), CANARY, dtype=torch.uint8, device=device)
    ws = big[pad:pad + need]
    ws.zero_()                    # the fast form needs it zeroed; the partial form overwrites it
    x = _rand((rows, hidden), device=device, seed=19)
    dy = _rand((rows, hidden), device=device, seed=20)
    w = 1 + 0.1 * _rand((hidden,), torch.float32, device, seed=21)
    y, rstd, h = trainnorm.rms_norm_forward(x, w)
    ref = trainnorm.rms_norm_backward(dy, h, w, rstd, deterministic=deterministic)
    for _ in range(2):
        dx, dw = trainnorm.rms_norm_backward(dy, h, w, rstd, deterministic=deterministic, workspace=ws)
        assert (big[:pad] == CANARY).all() and (big[pad + need:] == CANARY).all(), "wrote outside the workspace"
        assert_bits_equal(dx, ref[0], "dx")
        if deterministic:
            assert_bits_equal(dw, ref[1], "dw")
        else:
            assert not ws.any(), "the fast form leaves its workspace zeroed"
        check_backward(dy, h, w, rstd, None, dx, dw)


def _in_canary_buffer(t, pad_cols, gen_seed):
    """t's values as a view into a larger buffer of canary values: [rows, H + pad][:, off:off + H]."""
    rows, hidden = t.shape
    buf = torch.full((rows + 2, hidden + pad_cols), -7.25, dtype=t.dtype, device=t.device)
    view = buf[1:rows + 1, 3:3 + hidden]
    view.copy_(t)
    return buf, view


@pytest.mark.parametrize("extra", ["none", "residual", "gate", "gate_first"])
def test_inputs_untouched_and_outputs_exact(device, extra):
    rows, hidden = 37, 200
    vals = [_rand((rows, hidden), device=device, seed=30 + i) for i in range(4)]
    bufs, views = zip(*(_in_canary_buffer(v, 11, i) for i, v in enumerate(vals)))
    x, dy, other, dh = views
    w = 1 + 0.1 * _rand((hidden,), torch.bfloat16, device, seed=40)
    snap = [b.clone() for b in bufs] + [w.clone()]
    if extra.startswith("gate"):
        nbg = extra == "gate"
        y, rstd = trainnorm.rms_norm_gated_forward(x, other, w, norm_before_gate=nbg)
        rstd_snap = rstd.clone()
        dx, dz, dw = trainnorm.rms_norm_gated_backward(dy, x, other, w, rstd, norm_before_gate=nbg)
        outs = (y, dx, dz)
    else:
        res = other if extra == "residual" else None
        y, rstd, h = trainnorm.rms_norm_forward(x, w, residual=res)
        rstd_snap = rstd.clone()
        dx, dw = trainnorm.rms_norm_backward(dy, h, w, rstd, dh=dh if res is not None else None)
        outs = (y, dx) + ((h,) if res is not None else ())
        if res is None:
            assert h is x
    for b, s in zip(list(bufs) + [w], snap):
        assert_bits_equal(b, s, "an input (or the memory around its view) was written")
    assert_bits_equal(rstd, rstd_snap, "rstd was written by the backward")
    for o in outs + (rstd, dw):
        # outputs: fresh, dense, exactly their own size, no alias of an input
        assert o.is_contiguous()
        assert o.untyped_storage().nbytes() == o.numel() * o.element_size()
        assert all(o.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() for b in bufs)
        assert torch.isfinite(o).all(), "an output element was left unwritten"
    assert dw.shape == (hidden,) and rstd.shape == (rows,)


def test_broadcast_rows_read_in_place(device):
    # an expanded x (row stride 0): every row is the same row
    row = _rand((1, 384), device=device, seed=41)
    x = row.expand(50, 384)
    dy = _rand((50, 384), device=device, seed=42)
    w = _w(device, n=384)
    y, rstd, h, dx, dw = _fwd_bwd(x, w, dy, True)
    y1, rstd1, _ = trainnorm.rms_norm_forward(row, w)
    assert_bits_equal(y, y1.expand(50, 384).contiguous(), "y")
    assert_bits_equal(rstd, rstd1.expand(50).contiguous(), "rstd")
    check_backward(dy, h, w, rstd, None, dx, dw)


# --- GPU only -----------------------------------------------------------------------------------

def _cleanup():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture
def gpu_clean():
    _cleanup()
    yield
    _cleanup()


def _step(x, w, dy, deterministic, ws):
    y, rstd, h = trainnorm.rms_norm_forward(x, w, 1e-6)
    dx, dw = trainnorm.rms_norm_backward(dy, h, w, rstd, deterministic=deterministic, workspace=ws)
    return y, rstd, dx, dw


@pytest.mark.gpu
def test_two_streams_match_sequential(gpu_clean):
    from trainnorm.families import make_case
    a = make_case("outlier", (16384,), 4096, weight_dtype=torch.float32, seed=50, device="cuda")
    b = make_case("normal", (4096, 24), 256, query_view=True, seed=51, device="cuda")
    c = make_case("normal", (32768,), 512, seed=52, device="cuda")      # the fast mode's atomic form
    assert bwd_plan(32768, 512, torch.bfloat16, False, True).dw == DwForm.ATOMIC
    jobs = [(a, True), (b, True), (c, False)]
    wss = [trainnorm.backward_workspace(k.dy.numel() // k.dy.shape[-1], k.x.shape[-1], deterministic=d,
                                        device="cuda") for k, d in jobs]
    seq = [_step(k.x, k.weight, k.dy, d, ws) for (k, d), ws in zip(jobs, wss)]
    torch.cuda.synchronize()
    dw64 = reference.backward_fp64(c.dy, c.x, c.weight, seq[2][1])[1]
    streams = [torch.cuda.Stream() for _ in jobs]
    for it in range(10):
        outs = []
        for (k, d), ws, s in zip(jobs, wss, streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs.append(_step(k.x, k.weight, k.dy, d, ws))
        torch.cuda.synchronize()
        for j, ((k, d), ref, out) in enumerate(zip(jobs, seq, outs)):
            n = 4 if d else 3            # the fast mode's dw may differ in its last bits
            for i in range(n):
                assert_bits_equal(out[i], ref[i], f"job {j} output {i} iteration {it}")
        assert not wss[2].any(), "the fast workspace must be zeroed after each call"
        assert reference.dw_err_over_tol(outs[2][3], dw64) <= DW_BUDGET
    del outs, seq


@pytest.mark.gpu
@pytest.mark.bigmem
def test_workspace_reused_many_calls(gpu_clean):
    from trainnorm.families import make_case
    for rows, hidden in ((65536, 4096), (4096, 2048), (16384, 512), (300, 8200)):
        case = make_case("offset", (rows,), hidden, seed=rows, device="cuda")
        y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight)
        ws_det = trainnorm.backward_workspace(rows, hidden, deterministic=True, device="cuda")
        ws_fast = trainnorm.backward_workspace(rows, hidden, deterministic=False, device="cuda")
        atomic = bwd_plan(rows, hidden, torch.bfloat16, False, True).dw == DwForm.ATOMIC
        assert atomic == (hidden != 8200)          # wide rows: the partial form in both modes
        ref = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd)
        dw64 = reference.backward_fp64(case.dy, h, case.weight, rstd)[1]
        for _ in range(25):
            dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, workspace=ws_det)
            assert_bits_equal(dx, ref[0], "dx")
            assert_bits_equal(dw, ref[1], "dw")
            dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, deterministic=False,
                                                 workspace=ws_fast)
            torch.cuda.synchronize()
            if atomic:
                assert not ws_fast.any(), "the fast workspace must stay zeroed"
            assert_bits_equal(dx, ref[0], "dx (fast)")
            assert reference.dw_err_over_tol(dw, dw64) <= DW_BUDGET
        # a smaller problem in the same workspaces
        half = rows // 2
        small = trainnorm.rms_norm_backward(case.dy[:half], h[:half], case.weight, rstd[:half], workspace=ws_det)
        check_backward(case.dy[:half], h[:half], case.weight, rstd[:half], None, *small)
        del case, y, rstd, h, ws_det, ws_fast, ref, dw64, dx, dw, small
        _cleanup()


@pytest.mark.gpu
@pytest.mark.bigmem
def test_more_than_2_31_elements(gpu_clean):
    rows, hidden = 600_000, 4096
    assert rows * hidden > 2**31
    free, _ = torch.cuda.mem_get_info()
    if free < 60 * 2**30:
        pytest.skip(f"needs 60 GB of free GPU memory, {free / 2**30:.0f} GB free")
    gen = torch.Generator(device="cuda").manual_seed(60)
    x = torch.empty(rows, hidden, dtype=torch.bfloat16, device="cuda")
    dy = torch.empty_like(x)
    step = 65536
    for r0 in range(0, rows, step):
        x[r0:r0 + step] = torch.randn(min(step, rows - r0), hidden, generator=gen, device="cuda")
        dy[r0:r0 + step] = torch.randn(min(step, rows - r0), hidden, generator=gen, device="cuda")
    w = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).to(torch.bfloat16)
    y, rstd, _ = trainnorm.rms_norm_forward(x, w, 1e-6)
    dx, dw = trainnorm.rms_norm_backward(dy, x, w, rstd, deterministic=True)
    torch.cuda.synchronize()
    # rows on both sides of the 2**31-element mark, the first and the last
    mark = 2**31 // hidden
    sample = torch.tensor(sorted({0, 1, mark - 2, mark - 1, mark, mark + 1, rows - 2, rows - 1}
                                 | set(torch.randint(0, rows, (120,), generator=gen, device="cuda").tolist())),
                          device="cuda")
    check_forward(x[sample], w, 1e-6, None, y[sample], rstd[sample], x[sample])
    dx64 = reference.backward_fp64(dy[sample], x[sample], w, rstd[sample])[0]
    assert_close64(dx[sample], dx64, "dx")
    dw64 = torch.zeros(hidden, dtype=torch.float64, device="cuda")
    for r0 in range(0, rows, step):
        sl = slice(r0, r0 + step)
        dw64 += reference.backward_fp64(dy[sl], x[sl], w, rstd[sl])[1]
    err = reference.dw_err_over_tol(dw, dw64)
    assert err <= DW_BUDGET, f"dw err/tol {err:.4f}"
    again = trainnorm.rms_norm_backward(dy, x, w, rstd, deterministic=True)
    assert_bits_equal(again[1], dw, "dw repeat")
    assert torch.equal(again[0][-1000:], dx[-1000:])
    del x, dy, y, rstd, dx, dw, dw64, again


@pytest.mark.gpu
@pytest.mark.bigmem
def test_out_of_memory_is_an_exception(gpu_clean):
    hidden = 4096
    free, _ = torch.cuda.mem_get_info()
    rows = free // (hidden * 2) * 2 + 1024           # y alone would need twice the free memory
    x = torch.ones(1, hidden, dtype=torch.bfloat16, device="cuda").expand(rows, hidden)   # a row-stride-0 view
    w = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(torch.OutOfMemoryError):
        trainnorm.rms_norm_forward(x, w)
    rstd = torch.ones(1, device="cuda").expand(rows)
    with pytest.raises(torch.OutOfMemoryError):
        trainnorm.rms_norm_backward(x, x, w, rstd)
    del x, rstd
    _cleanup()
    # the device still works
    x = torch.randn(64, hidden, device="cuda").to(torch.bfloat16)
    y, rstd, h = trainnorm.rms_norm_forward(x, w)
    check_forward(x, w, 1e-6, None, y, rstd, h)


def test_bit_comparison_of_odd_strided_views():
    # the checks compare raw bytes: a one-element view of stride 2 (a size-1 last dim, met by
    # the soak at H 1) and a transposed view compare by value, NaN to NaN, and -0 not to +0
    from trainnorm.dev.checks import bits
    a = torch.tensor([[1.5, -0.0], [float("nan"), 2.0]], dtype=torch.float16)
    one = a[:1, :1].as_strided((1, 1), (2, 2))
    assert torch.equal(bits(one), bits(torch.tensor([[1.5]], dtype=torch.float16)))
    assert torch.equal(bits(a.t()), bits(a.t().contiguous()))
    assert torch.equal(bits(a[1:, :1]), bits(torch.tensor([[float("nan")]], dtype=torch.float16)))
    assert not torch.equal(bits(a[:1, 1:]), bits(torch.zeros(1, 1, dtype=torch.float16)))
    assert_bits_equal(one, one.clone())


def test_bits_fingerprint_sees_one_bit_and_a_swap(monkeypatch):
    # trainnorm.dev.bits fingerprints outputs on their device by exact position-weighted
    # byte sums per block: one flipped bit, two values trading places (in one block and
    # across blocks) and the byte count each change it; equal bytes (a view or a copy) do not
    from trainnorm.dev import bits as bits_tool
    monkeypatch.setattr(bits_tool, "DIGEST_CHUNK", 3 * bits_tool.DIGEST_BLOCK)   # several chunks
    x = torch.randn(700, 333).to(torch.bfloat16)
    x[3, 4], x[3, 9], x[650, 2] = 1.0, 2.0, 3.0
    d = bits_tool._digest(x)
    assert d == bits_tool._digest(x.clone()) == bits_tool._digest(x.t().contiguous().t())
    flipped = x.clone()
    flipped.view(torch.int16)[123, 45] ^= 1
    assert bits_tool._digest(flipped) != d
    for (i, j), (k, m) in (((3, 4), (3, 9)), ((3, 4), (650, 2))):
        swapped = x.clone()
        swapped[i, j], swapped[k, m] = x[k, m], x[i, j]
        assert bits_tool._digest(swapped) != d
    assert bits_tool._digest(torch.zeros(10)) != bits_tool._digest(torch.zeros(11))
    assert bits_tool._digest(None) is None
