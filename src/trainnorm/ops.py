"""The torch.library ops (schemas, fake implementations) and the autograd Function.

The ops take the caller's tensors as they are (per-head views included) and
return fresh outputs: no output aliases an input, so torch.compile traces them
with fullgraph=True and torch.library.opcheck passes.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from .variant import DTYPE_NAMES, DTYPES, F32_MAX, F32_TINY, Variant

# The kernels add eps in float32: an eps outside float32's normal range would be
# rounded to 0 or a subnormal (1e-50: a zero row's rstd becomes inf, y NaN) or to
# inf (1e39: rstd 0, y all zeros). Such an eps is an error on every path.
EPS_MIN, EPS_MAX = F32_TINY, F32_MAX                # 1.1754944e-38, 3.4028235e+38


def check_eps(eps: float) -> None:
    """ValueError unless eps is finite, > 0 and a normal float32 number.

    The public functions check eps as they are called; the forward op checks
    it again when it runs, for an eps that torch.compile traced as a symbolic
    value (dynamic shapes), whose range is known only then."""
    if not EPS_MIN <= eps <= EPS_MAX:
        if not math.isfinite(eps) or eps <= 0.0:
            raise ValueError(f"eps must be finite and > 0, got {eps}")
        raise ValueError(f"eps must be a normal float32 number, in [{EPS_MIN:.8g}, {EPS_MAX:.8g}] (the kernels "
                         f"add it in float32, where {eps} is {'0 or a subnormal' if eps < EPS_MIN else 'inf'}), "
                         f"got {eps}")


# Registered with torch.library's low-level API (define + impl + register_fake)
# rather than torch.library.custom_op: the autograd Function below is the only
# autograd there is, and custom_op's Python wrappers (its autograd and
# ADInplaceOrView layers) cost host time on every call. One forward + backward
# through autograd at [2048, 512], launches stubbed out, on one x86 CPU core
# (no GPU): 222-273 us through custom_op, 138-142 us with these registrations
# (the two ops alone: 135-161 vs 88-100 us; dispatch.py alone 35-40 us).
_lib = torch.library.Library("trainnorm", "DEF")
# `variant` is Variant.spec: the part of what is computed that the tensors do not say
# (variant.py); a new kind of variant changes no schema.
_lib.define("rms_norm_fwd(Tensor x, Tensor? weight, Tensor? residual, Tensor? gate, float eps, "
            "str variant) -> (Tensor, Tensor, Tensor)")
_lib.define("rms_norm_bwd(Tensor dy, Tensor h, Tensor? weight, Tensor rstd, Tensor? dh, Tensor? gate, "
            "str variant, bool deterministic, bool need_dw, Tensor(a!)? workspace) "
            "-> (Tensor, Tensor, Tensor, Tensor)")


def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], gate: Optional[Tensor],
                 eps: float, variant: str) -> tuple[Tensor, Tensor, Tensor]:
    """(y, rstd, h); h is empty without a residual (the caller's x is h then)."""
    check_eps(eps)
    v = Variant.from_spec(variant, weight=weight, residual=residual, gate=gate)
    return dispatch.forward(x, weight, residual, gate, eps, v)


def rms_norm_bwd(dy: Tensor, h: Tensor, weight: Optional[Tensor], rstd: Tensor, dh: Optional[Tensor],
                 gate: Optional[Tensor], variant: str, deterministic: bool, need_dw: bool,
                 workspace: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw, dgate, dresidual); dw is float32 [H], or empty when need_dw is False or
    there is no weight; dgate is empty without a gate; dresidual (in h's dtype) is empty
    unless the variant names an x dtype other than h's (a float32 residual stream)."""
    v = Variant.from_spec(variant, weight=weight, residual=dh, gate=gate)
    return dispatch.backward(dy, h, weight, rstd, dh, gate, v, deterministic, need_dw, workspace)


_lib.impl("rms_norm_fwd", rms_norm_fwd, "CompositeExplicitAutograd")
_lib.impl("rms_norm_bwd", rms_norm_bwd, "CompositeExplicitAutograd")


class _NoFormula(torch.autograd.Function):
    """A direct call of an op on tensors that require grad: the outputs keep a
    graph whose backward is a clear error (the op's autograd is RMSNormFunction)."""

    @staticmethod
    def forward(ctx, name, *args):
        ctx.name = name
        with torch._C._AutoDispatchBelowAutograd():
            return getattr(torch.ops.trainnorm, name).default(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"Trying to backward through trainnorm.{ctx.name}, which has no autograd formula: "
                           "use trainnorm.rms_norm / RMSNormFunction for autograd")


def _autograd_kernel(name: str):
    """The ops' Autograd-key kernel. RMSNormFunction calls the ops with grad off
    and takes the fast branch: straight on below autograd."""
    op = getattr(torch.ops.trainnorm, name).default

    def kernel(*args):
        if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
            return _NoFormula.apply(name, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)
    return kernel


_lib.impl("rms_norm_fwd", _autograd_kernel("rms_norm_fwd"), "Autograd")
_lib.impl("rms_norm_bwd", _autograd_kernel("rms_norm_bwd"), "Autograd")


@torch.library.register_fake("trainnorm::rms_norm_fwd")
def _(x, weight, residual, gate, eps, variant):
    v = Variant.from_spec(variant, weight=weight, residual=residual, gate=gate)
    y = x.new_empty(x.shape, dtype=DTYPES[v.y_dtype] if v.y_dtype else x.dtype)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    h = x.new_empty(x.shape, dtype=residual.dtype) if residual is not None else x.new_empty(0)
    return y, rstd, h


@torch.library.register_fake("trainnorm::rms_norm_bwd")
def _(dy, h, weight, rstd, dh, gate, variant, deterministic, need_dw, workspace):
    v = Variant.from_spec(variant, weight=weight, residual=dh, gate=gate)
    x_dtype = DTYPES[v.x_dtype] if v.x_dtype else h.dtype
    dx = h.new_empty(h.shape, dtype=x_dtype)
    n = h.shape[-1] if (need_dw and weight is not None) else 0
    dz = gate.new_empty(gate.shape) if gate is not None else h.new_empty(0)
    dres = h.new_empty(h.shape) if x_dtype != h.dtype else h.new_empty(0)
    return dx, h.new_empty(n, dtype=torch.float32), dz, dres


class RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x [+ residual]) * weight [gated]; returns y, or (y, h) with a residual.

    apply(x, weight, eps, residual, deterministic[, gate, variant]), variant a
    Variant (variant.py) or its spec string ("" without a gate; default: a
    SiLU gate after the norm when a gate is given). Gradients flow to x,
    weight, residual and gate; the residual's gradient is the same tensor as
    x's. With a gate: y = rms_norm(h) * weight * a(gate) (norm_before_gate) or
    rms_norm(h * a(gate)) * weight.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, residual, deterministic, gate=None, variant=None):
        if isinstance(variant, Variant):
            variant = variant.spec
        elif variant is None:
            variant = "silu" if gate is not None else ""
        has_residual = residual is not None
        if has_residual and residual.dtype != x.dtype:
            # a float32 residual stream: the backward gives x's gradient in x's dtype
            variant = ",".join(p for p in (variant, f"x:{DTYPE_NAMES[x.dtype]}") if p)
        y, rstd, h = torch.ops.trainnorm.rms_norm_fwd(x, weight, residual, gate, eps, variant)
        ctx.save_for_backward(h if has_residual else x, weight, rstd, gate)
        ctx.has_residual = has_residual
        ctx.deterministic = deterministic
        ctx.variant = variant
        ctx.set_materialize_grads(False)
        return (y, h) if has_residual else y

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, rstd, gate = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[1]
        if dy is None:
            dy = torch.zeros_like(h)
        with torch.no_grad():
            dx, dw, dz, dr = torch.ops.trainnorm.rms_norm_bwd(dy, h, weight, rstd, dh, gate, ctx.variant,
                                                              ctx.deterministic, need_dw, None)
        needs = ctx.needs_input_grad
        # the residual's gradient: x's (the same tensor) when both share a dtype, else the
        # float32 stream's own
        dres = (dr if dr.numel() else dx) if ctx.has_residual and needs[3] else None
        dgate = dz if gate is not None and needs[5] else None
        grads = [(dx if needs[0] else None), (dw if need_dw else None), None, dres, None, dgate, None]
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dy, dh, h, weight, gate)):
            grads = _no_double_backward(grads)      # backward(create_graph=True)
        return tuple(grads)


DOUBLE_BACKWARD = ("trainnorm does not support double backward: the backward of rms_norm / rms_norm_gated / "
                   "RMSNorm is not differentiable, so a gradient of their gradients (create_graph=True, then a "
                   "second backward) cannot be taken. torch.nn.functional.rms_norm supports it.")


class _NoDoubleBackward(torch.autograd.Function):
    """The gradients, unchanged, as outputs whose own backward is a clear error."""

    @staticmethod
    def forward(ctx, *grads):
        return grads

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(DOUBLE_BACKWARD)


def _no_double_backward(grads: list) -> list:
    unique = list({id(g): g for g in grads if g is not None}.values())   # dx may also be the residual's
    # inputs that require grad, so that the outputs get _NoDoubleBackward as their grad_fn
    wrapped = _NoDoubleBackward.apply(*(g.detach().requires_grad_() for g in unique))
    by_id = dict(zip(map(id, unique), wrapped))
    return [None if g is None else by_id[id(g)] for g in grads]
