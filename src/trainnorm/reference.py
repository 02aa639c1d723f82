"""Pure-PyTorch references of every formula in the contract (SPEC section 1).

- ``forward_fp64`` / ``backward_fp64``: the formulas evaluated in float64 from
  the float32 values of the inputs. They are the accuracy references of the
  tests, ``trainnorm verify`` and ``trainnorm bench``, and, rounded to the
  output dtypes, the CPU path of the package (slow and exact).
- ``dw_fp32_eager``: the FP32 eager reduction ``(dy.float() * xhat).sum(0)``
  that the dw accuracy of the kernels is held against as well.
- ``RMSNormFP64`` / ``RMSNormGatedFP64``: autograd Functions whose backward
  is the formula; the tests check them against numerical derivatives with
  ``gradcheck``.

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


def silu(z):
    return z * torch.sigmoid(z)


def silu_grad(z):
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def forward_fp64(x, weight, eps, residual=None, gate=None, norm_before_gate=True):
    """(y, rstd, h): y and rstd in float64, h in x's dtype (it is rounded by definition).

    With a gate: y = rmsnorm(h) * w * silu(gate) (norm_before_gate), or
    rmsnorm(h * silu(gate)) * w, where rstd is that of h * silu(gate)."""
    h = residual_sum(x, residual)
    u = _f64(h)
    if gate is not None and not norm_before_gate:
        u = u * silu(_f64(gate))
    rstd = torch.rsqrt(u.square().mean(-1) + eps)
    y = u * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    if gate is not None and norm_before_gate:
        y = y * silu(_f64(gate))
    return y, rstd, h


def backward_fp64(dy, h, weight, rstd, dh=None, gate=None, norm_before_gate=True):
    """(dx, dw) in float64, at the given rstd (the kernel's float32 rstd in the
    tests); with a gate, (dx, dw, dgate)."""
    hidden = h.shape[-1]
    dy64 = _f64(dy)
    rstd64 = _f64(rstd)[..., None]
    w64 = _f64(weight) if weight is not None else None
    u = _f64(h)
    if gate is not None:
        z = _f64(gate)
        if norm_before_gate:
            dy64 = dy64 * silu(z)          # y = norm(h) * w * silu(z): the norm sees dy * silu(z)
        else:
            u = u * silu(z)                # y = norm(h * silu(z)) * w
    uhat = u * rstd64
    g = dy64 * w64 if w64 is not None else dy64
    c = (g * uhat).sum(-1, keepdim=True) / hidden
    du = rstd64 * (g - uhat * c)
    dw = (dy64 * uhat).reshape(-1, hidden).sum(0) if weight is not None else None
    if gate is None:
        dx = du
    elif norm_before_gate:
        dx = du
        wy = uhat * w64 if w64 is not None else uhat
        dz = _f64(dy) * wy * silu_grad(z)
    else:
        dx = du * silu(z)
        dz = du * _f64(h) * silu_grad(z)
    if dh is not None:
        dx = dx + _f64(dh)
    return (dx, dw) if gate is None else (dx, dw, dz)


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


class RMSNormGatedFP64(torch.autograd.Function):
    """The gated forms in float64 with the formula backward (for gradcheck)."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, norm_before_gate):
        u = x if norm_before_gate else x * silu(gate)
        rstd = torch.rsqrt(u.square().mean(-1) + eps)
        y = u * rstd[..., None] * weight
        if norm_before_gate:
            y = y * silu(gate)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.norm_before_gate = norm_before_gate
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        dx, dw, dz = backward_fp64(dy, x, weight, rstd, None, gate, ctx.norm_before_gate)
        return dx, dz, dw, None, None


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
