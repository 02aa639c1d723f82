"""torch.library custom ops (with fake implementations) and the autograd Function.

The ops take the caller's tensors as they are (per-head views included) and
return fresh outputs: no output aliases an input, so torch.compile traces them
with fullgraph=True and torch.library.opcheck passes.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch


@torch.library.custom_op("trainnorm::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, rstd, h); h is empty without a residual (the caller's x is h then)."""
    return dispatch.forward(x, weight, residual, eps)


@rms_norm_fwd.register_fake
def _(x, weight, residual, eps):
    y = x.new_empty(x.shape)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    h = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    return y, rstd, h


@torch.library.custom_op("trainnorm::rms_norm_bwd", mutates_args=("workspace",))
def rms_norm_bwd(dy: Tensor, h: Tensor, weight: Optional[Tensor], rstd: Tensor, dh: Optional[Tensor],
                 deterministic: bool, need_dw: bool, workspace: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(dx, dw); dw is float32 [H], or empty when need_dw is False or there is no weight."""
    return dispatch.backward(dy, h, weight, rstd, dh, deterministic, need_dw, workspace)


@rms_norm_bwd.register_fake
def _(dy, h, weight, rstd, dh, deterministic, need_dw, workspace):
    dx = h.new_empty(h.shape)
    n = h.shape[-1] if (need_dw and weight is not None) else 0
    return dx, h.new_empty(n, dtype=torch.float32)


class RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x [+ residual]) * weight; returns y, or (y, h) with a residual.

    apply(x, weight, eps, residual, deterministic). Gradients flow to x, weight
    and residual; the residual's gradient is the same tensor as x's.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, residual, deterministic):
        y, rstd, h = torch.ops.trainnorm.rms_norm_fwd(x, weight, residual, eps)
        has_residual = residual is not None
        ctx.save_for_backward(h if has_residual else x, weight, rstd)
        ctx.has_residual = has_residual
        ctx.deterministic = deterministic
        ctx.set_materialize_grads(False)
        return (y, h) if has_residual else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, rstd = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[1]
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dw = torch.ops.trainnorm.rms_norm_bwd(dy, h, weight, rstd, dh, ctx.deterministic, need_dw, None)
        dres = dx if ctx.has_residual and ctx.needs_input_grad[3] else None
        return (dx if ctx.needs_input_grad[0] else None), (dw if need_dw else None), None, dres, None
