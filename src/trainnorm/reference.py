"""Pure-PyTorch references of every formula in the contract (SPEC section 1).

- ``forward_fp64`` / ``backward_fp64``: the formulas evaluated in float64 from
  the float32 values of the inputs. They are the accuracy references of the
  tests, ``trainnorm verify`` and ``trainnorm bench``, and, rounded to the
  output dtypes, the CPU path of the package (slow and exact).
- ``dw_fp32_eager``: the FP32 eager reduction ``(dy.float() * xhat).sum(0)``
  that the dw accuracy of the kernels is held against as well.
- ``RMSNormFP64``: an autograd Function whose backward is the formula; the
  tests check it against numerical derivatives with ``gradcheck``.

Shapes: ``x[..., H]``, ``weight[H]`` or None, ``rstd[...]``.
"""
from __future__ import annotations

import torch

DW_ATOL = 1e-4
DW_RTOL = 1e-4


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    # bf16 / fp16 / fp32 values are exact in float64, so this is f32() widened
    return None if t is None else t.double()


def residual_sum(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """h = x, or round(f32(x) + f32(r)) into x's dtype."""
    if residual is None:
        return x
    return (x.float() + residual.float()).to(x.dtype)


def forward_fp64(x, weight, eps, residual=None):
    """(y, rstd, h): y and rstd in float64, h in x's dtype (it is rounded by definition)."""
    h = residual_sum(x, residual)
    h64 = _f64(h)
    rstd = torch.rsqrt(h64.square().mean(-1) + eps)
    y = h64 * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    return y, rstd, h


def backward_fp64(dy, h, weight, rstd, dh=None):
    """(dx, dw) in float64, at the given rstd (the kernel's float32 rstd in the tests)."""
    hidden = h.shape[-1]
    dy64 = _f64(dy)
    xhat = _f64(h) * _f64(rstd)[..., None]
    g = dy64 * _f64(weight) if weight is not None else dy64
    c = (g * xhat).sum(-1, keepdim=True) / hidden
    dx = _f64(rstd)[..., None] * (g - xhat * c)
    if dh is not None:
        dx = dx + _f64(dh)
    dw = (dy64 * xhat).reshape(-1, hidden).sum(0) if weight is not None else None
    return dx, dw


def dw_fp32_eager(dy, h, rstd):
    """The FP32 eager reduction: (dy.float() * xhat).sum over rows, in float32."""
    hidden = h.shape[-1]
    xhat = h.float() * rstd.float()[..., None]
    return (dy.float() * xhat).reshape(-1, hidden).sum(0)


def dw_err_over_tol(dw, ref, atol=DW_ATOL, rtol=DW_RTOL) -> float:
    """max_j |dw_j - ref_j| / (atol + rtol * |ref_j|); the budget is met when <= B."""
    if ref.numel() == 0:
        return 0.0
    ref = ref.double()
    err = (dw.double() - ref).abs() / (atol + rtol * ref.abs())
    return float(err.max())


class RMSNormFP64(torch.autograd.Function):
    """y = rmsnorm(x + r) * w in float64 with the formula backward (for gradcheck)."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        h = x if residual is None else x + residual
        rstd = torch.rsqrt(h.square().mean(-1) + eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.has_residual = residual is not None
        y = h * rstd[..., None] * weight
        return (y, h) if ctx.has_residual else y

    @staticmethod
    def backward(ctx, dy, *rest):
        h, weight, rstd = ctx.saved_tensors
        dh = rest[0] if rest else None
        dx, dw = backward_fp64(dy, h, weight, rstd, dh)
        return dx, dw, (dx if ctx.has_residual else None), None
