"""Property-based fuzzing against reference.py (hypothesis, a fixed budget of examples).

Shapes, layouts (views into larger buffers, transposed leading dims), dtypes,
weight dtype or no weight, a (1 + w) weight, residual (a float32 stream under
16-bit x), gate in both orders, y's dtype, eps, mode and row count are drawn
at random; every output must match the FP64 reference within
the contract's tolerances, repeat bit for bit, and y / rstd / dx must be the
same bits in both modes. On a CPU the kernels run in Triton's interpreter, so
the sizes stay small; the GPU soak runs the same property at large sizes.
"""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainnorm import reference

from helpers import DW_BUDGET, assert_bits_equal, assert_close64, run_entry_points

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _layout(t: torch.Tensor, kind: int, gen) -> torch.Tensor:
    """The same values in another memory layout: 0 contiguous, 1 a slice of a
    wider buffer (row stride > H, offset), 2 leading dims transposed, 3 a
    strided last dim (copied once by the package)."""
    if kind == 1:
        buf = torch.empty(t.shape[:-1] + (t.shape[-1] * 2 + 3,), dtype=t.dtype)
        buf.normal_(generator=gen)
        view = buf[..., 3:3 + t.shape[-1]]
        view.copy_(t)
        return view
    if kind == 2 and t.dim() >= 3:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == 3:
        buf = torch.zeros(t.shape[:-1] + (t.shape[-1] * 2,), dtype=t.dtype)
        view = buf[..., ::2]
        view.copy_(t)
        return view
    return t


@st.composite
def problems(draw):
    hidden = draw(st.one_of(st.integers(1, 70), st.sampled_from([128, 255, 256, 512, 1000])))
    lead = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=3)))
    return dict(
        hidden=hidden, lead=lead,
        dtype=draw(st.sampled_from(DTYPES)),
        weight=draw(st.sampled_from(["same", "fp32", None])),
        extra=draw(st.sampled_from(["none", "residual", "gate", "gate_first"])),
        eps=draw(st.sampled_from([1e-6, 1e-5, 0.1, None])),
        layouts=[draw(st.integers(0, 3)) for _ in range(4)],
        scale=draw(st.sampled_from([1.0, 30.0, 1e-3])),
        seed=draw(st.integers(0, 2**31 - 1)),
        stream32=draw(st.booleans()),          # with a residual under 16-bit x: a float32 stream
        offset=draw(st.sampled_from([0.0, 0.0, 1.0])),
        out=draw(st.sampled_from([None, None, *DTYPES])),
    )


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(p=problems())
def test_fuzz_against_reference(p):
    gen = torch.Generator().manual_seed(p["seed"])
    shape = p["lead"] + (p["hidden"],)
    dtype = p["dtype"]
    extra = p["extra"]
    stream = torch.float32 if extra == "residual" and p["stream32"] and dtype != torch.float32 else dtype
    out = p["out"] or dtype
    rnd = lambda scale=1.0, dt=dtype: (torch.randn(shape, generator=gen) * scale).to(dt)
    x = _layout(rnd(p["scale"]), p["layouts"][0], gen)
    dy = _layout(rnd(dt=out), p["layouts"][1], gen)
    other = _layout(rnd(dt=stream), p["layouts"][2], gen)
    dh = _layout(rnd(dt=stream), p["layouts"][3], gen)
    weight, offset = None, 0.0
    if p["weight"] is not None:
        offset = p["offset"]        # zero-centred weights: (1 + w) around 1 as the others
        weight = (1 - offset + 0.1 * torch.randn(p["hidden"], generator=gen)).to(
            dtype if p["weight"] == "same" else torch.float32)
    eps = p["eps"] if p["eps"] is not None else torch.finfo(torch.float32).eps   # torch's default

    def run(det):
        return run_entry_points(x, dy, other, dh, weight, p["eps"], extra, det, offset, p["out"])

    det = run(True)
    y, rstd, h, dx, dw, dz = det
    gate = other if extra.startswith("gate") else None
    nbg = extra != "gate_first"
    res = other if extra == "residual" else None
    y64, rstd64, h_ref = reference.forward_fp64(x, weight, eps, res, gate, nbg, weight_offset=offset)
    assert y.shape == x.shape and rstd.shape == x.shape[:-1] and y.dtype == out and h.dtype == stream
    if y.numel():
        assert_close64(y, y64, "y")
        assert float((rstd.double() / rstd64 - 1).abs().max()) <= 1e-4
        if res is not None:
            assert_bits_equal(h, h_ref, "h")
    back = reference.backward_fp64(dy, h, weight, rstd, dh if res is not None else None, gate, nbg,
                                   weight_offset=offset)
    if dx.numel():
        assert_close64(dx, back[0], "dx")
        if gate is not None:
            assert_close64(dz, back[2], "dgate")
    if weight is not None:
        assert dw.dtype == torch.float32 and dw.shape == (p["hidden"],)
        assert reference.dw_err_over_tol(dw, back[1]) <= DW_BUDGET
    again = run(True)
    for a, b in zip(det, again):
        if a is not None:
            assert_bits_equal(a, b, "repeat")
    fast = run(False)
    for i in (0, 1, 3, 5):
        if det[i] is not None:
            assert_bits_equal(det[i], fast[i], f"mode equality of output {i}")
    if weight is not None:
        assert reference.dw_err_over_tol(fast[4], back[1]) <= DW_BUDGET
