"""The assertions the soak applies to one case: FP64 closeness (SPEC tolerances)
and bitwise equality, and the explicit entry points a case runs through."""
from __future__ import annotations

import torch

TOL = dict(atol=1e-2, rtol=1e-2)
DW_BUDGET = 0.5


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bitwise comparisons (NaN == NaN, -0 != +0). The copy
    has unit stride: `.contiguous()` keeps a size-1 dim's stride (a one-element [1, 1] view
    of stride 2, which the soak met at H 1), and a byte view needs stride 1."""
    return t.detach().reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def assert_bits_equal(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: bits differ"


def overflowed_with_ref(out, ref):
    """Elements of out that are the infinity of the reference's sign where the float64
    reference lies within rtol of out's dtype's largest finite value (a correct rounding)."""
    ref = ref.double()
    edge = ref.abs() >= torch.finfo(out.dtype).max * (1 - TOL["rtol"])
    return edge & torch.isinf(out) & (torch.sign(out.double()) == torch.sign(ref))


def assert_close64(out, ref, what=""):
    """out (any dtype) within atol = rtol = 1e-2 of a float64 reference, and finite,
    except where the reference itself lies within rtol of out's dtype's largest
    finite value: there the rounding may overflow (e.g. an fp16 dx of rstd * g
    with rstd = 1/sqrt(eps)), and out may also be the infinity of the reference's
    sign. NaN (what an unwritten, NaN-poisoned element reads as) never passes."""
    ref = ref.double()
    overflowed = overflowed_with_ref(out, ref)
    assert (torch.isfinite(out) | overflowed).all(), f"{what}: non-finite (unwritten?) elements"
    torch.testing.assert_close(torch.where(overflowed, ref, out.double()), ref, **TOL,
                               msg=lambda m: f"{what}: {m}")


def run_entry_points(x, dy, other, dh, weight, eps, extra, deterministic, weight_offset=0.0, out_dtype=None):
    """(y, rstd, h, dx, dw, dgate) of one case through the explicit entry points.

    extra: "" / "none" (plain), "residual" (other is the residual, dh its gradient;
    a float32 residual under 16-bit x is a float32 stream: h, dh and dx float32),
    "gate" (other is the gate, norm then gate) or "gate_first" (gate, then norm);
    dgate is None without a gate, h is x without a residual. weight_offset and
    out_dtype as in trainnorm.rms_norm (dy then comes in out_dtype)."""
    import trainnorm
    kw = dict(weight_offset=weight_offset)
    if extra in ("gate", "gate_first"):
        nbg = extra == "gate"
        y, rstd = trainnorm.rms_norm_gated_forward(x, other, weight, eps, norm_before_gate=nbg, out_dtype=out_dtype,
                                                   **kw)
        dx, dz, dw = trainnorm.rms_norm_gated_backward(dy, x, other, weight, rstd, norm_before_gate=nbg,
                                                       deterministic=deterministic, **kw)
        return y, rstd, x, dx, dw, dz
    res = other if extra == "residual" else None
    y, rstd, h = trainnorm.rms_norm_forward(x, weight, eps, residual=res, out_dtype=out_dtype, **kw)
    dx, dw = trainnorm.rms_norm_backward(dy, h, weight, rstd, dh=dh if res is not None else None,
                                         deterministic=deterministic, **kw)
    return y, rstd, h, dx, dw, None
