"""Assertions shared by the tests."""
import torch

from trainnorm import reference

# the assertions the soak applies too (one copy, in the package)
from trainnorm.dev.checks import (DW_BUDGET, TOL, assert_bits_equal, assert_close64, bits,  # noqa: F401
                                  overflowed_with_ref, run_entry_points)


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
