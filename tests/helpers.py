"""Assertions shared by the tests."""
import torch

from trainnorm import reference

TOL = dict(atol=1e-2, rtol=1e-2)
DW_BUDGET = 0.5


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bitwise comparisons (NaN == NaN, -0 != +0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


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


def check_forward(x, weight, eps, residual, y, rstd, h):
    y64, rstd64, h_ref = reference.forward_fp64(x, weight, eps, residual)
    assert y.dtype == x.dtype and rstd.dtype == torch.float32
    assert y.shape == x.shape and rstd.shape == x.shape[:-1]
    assert_close64(y, y64, "y")
    assert torch.isfinite(rstd).all()
    if rstd.numel():
        assert float((rstd.double() / rstd64 - 1).abs().max()) <= 1e-4, "rstd"
    if residual is not None:
        assert_bits_equal(h, h_ref, "h")


def check_backward(dy, h, weight, rstd, dh, dx, dw, budget=DW_BUDGET):
    """dx within 1e-2, dw within budget B and no worse than the FP32 eager
    reduction (with a margin of 1e-3 of the budget for the tiny sizes where
    both are a few product roundings). Returns dw's err/tol."""
    dx64, dw64 = reference.backward_fp64(dy, h, weight, rstd, dh)
    assert dx.dtype == h.dtype and dx.shape == h.shape
    assert_close64(dx, dx64, "dx")
    if weight is None:
        return 0.0
    assert dw.dtype == torch.float32 and dw.shape == weight.shape
    assert torch.isfinite(dw).all(), "dw: non-finite elements"
    err = reference.dw_err_over_tol(dw, dw64)
    eager = reference.dw_err_over_tol(reference.dw_fp32_eager(dy, h, rstd), dw64)
    assert err <= budget, f"dw err/tol {err:.4f} > {budget}"
    assert err <= eager + 1e-3, f"dw err/tol {err:.4f} worse than the FP32 eager reduction's {eager:.4f}"
    return err


def run_entry_points(x, dy, other, dh, weight, eps, extra, deterministic):
    """(y, rstd, h, dx, dw, dgate) of one case through the explicit entry points.

    extra: "" (plain), "residual" (other is the residual, dh its gradient),
    "gate" (other is the gate, norm then gate) or "gate_first" (gate, then norm);
    dgate is None without a gate, h is x without a residual."""
    import trainnorm
    if extra in ("gate", "gate_first"):
        nbg = extra == "gate"
        y, rstd = trainnorm.rms_norm_gated_forward(x, other, weight, eps, norm_before_gate=nbg)
        dx, dz, dw = trainnorm.rms_norm_gated_backward(dy, x, other, weight, rstd, norm_before_gate=nbg,
                                                       deterministic=deterministic)
        return y, rstd, x, dx, dw, dz
    res = other if extra == "residual" else None
    y, rstd, h = trainnorm.rms_norm_forward(x, weight, eps, residual=res)
    dx, dw = trainnorm.rms_norm_backward(dy, h, weight, rstd, dh=dh if res is not None else None,
                                         deterministic=deterministic)
    return y, rstd, h, dx, dw, None


def run_gated(x, z, w, dy, nbg, det=True, eps=1e-6, activation="silu"):
    """(y, rstd, dx, dgate, dw) of the gated norm through its explicit entry points."""
    import trainnorm
    y, rstd = trainnorm.rms_norm_gated_forward(x, z, w, eps, norm_before_gate=nbg, activation=activation)
    dx, dz, dw = trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, norm_before_gate=nbg, activation=activation,
                                                   deterministic=det)
    return y, rstd, dx, dz, dw


def check_gated(x, z, w, dy, nbg, det=True, eps=1e-6, activation="silu"):
    """run_gated's outputs against FP64 (SPEC tolerances, dw within the budget); returns them."""
    y, rstd, dx, dz, dw = out = run_gated(x, z, w, dy, nbg, det, eps, activation)
    y64, rstd64, _ = reference.forward_fp64(x, w, eps, None, z, nbg, activation=activation)
    assert y.dtype == x.dtype and rstd.dtype == torch.float32
    assert_close64(y, y64, "y")
    assert float((rstd.double() / rstd64 - 1).abs().max()) <= 1e-4
    dx64, dw64, dz64 = reference.backward_fp64(dy, x, w, rstd, None, z, nbg, activation=activation)
    assert dz.dtype == z.dtype and dz.shape == z.shape
    assert_close64(dx, dx64, "dx")
    assert_close64(dz, dz64, "dgate")
    if w is not None:
        err = reference.dw_err_over_tol(dw, dw64)
        assert err <= DW_BUDGET, f"dw err/tol {err:.4f}"
    return out


# --- configs and plans as the tests ask for them ---------------------------------------------

def fwd_config(hidden, dtype=torch.bfloat16, weight_dtype=None):
    """The forward config the dispatcher looks up (outside any configs.override)."""
    from trainnorm import configs
    return configs.forward_config(configs.forward_key(hidden, dtype.itemsize,
                                                      weight_dtype.itemsize if weight_dtype else None))


def bwd_config(hidden, dtype=torch.bfloat16, gated=False):
    from trainnorm import configs
    return configs.backward_config(configs.backward_key(hidden, dtype.itemsize, gated))


def bwd_plan(rows, hidden, dtype=torch.bfloat16, deterministic=True, need_dw=True, gated=False):
    """The backward plan of a launch (inside configs.override, of the overridden config)."""
    from trainnorm import plan
    from trainnorm.variant import Variant
    return plan.backward_plan(rows, hidden, dtype, Variant(gate="silu" if gated else None), deterministic, need_dw)
