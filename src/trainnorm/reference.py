"""Pure-PyTorch references of every formula in the contract (SPEC section 1):
the one place the RMSNorm maths is written.

- ``GATE_ACTIVATIONS``: the gate's activations by name, each a (value,
  derivative) pair; every gated formula here takes ``activation=`` and picks
  from it (the kernels' side is ``kernels/gate.py``).
- ``forward_fp64`` / ``backward_fp64``: the formulas evaluated in float64 from
  the float32 values of the inputs. They are the accuracy references of the
  tests, ``trainnorm verify`` and ``trainnorm bench``, and, rounded to the
  output dtypes, the CPU path of the package (slow and exact).
- ``forward_fp32`` / ``forward_gated_fp32`` / ``backward_fp32`` /
  ``backward_gated_fp32``: the explicit FP32-statistics reference in PyTorch
  eager (one op per step, statistics in float32, outputs rounded once to the
  input dtype). ``trainnorm bench`` times them eager and under torch.compile,
  and ``trainnorm.integrations`` holds recognised modules against
  ``forward_fp64``.
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
    """h = x, or round(f32(x) + f32(r)) into the residual's dtype (x's, or float32: a
    float32 residual stream under 16-bit activations)."""
    if residual is None:
        return x
    return (x.float() + residual.float()).to(residual.dtype)


# --- gate activations ------------------------------------------------------------------------
# Each function takes z and, optionally, sig = sigmoid(z) when the caller has
# computed it already (the FP32 eager backward shares one sigmoid between the
# value and the derivative, as the kernels do); the result is the same either way.

def silu(z, sig=None):
    return z * (torch.sigmoid(z) if sig is None else sig)


def silu_grad(z, sig=None):
    s = torch.sigmoid(z) if sig is None else sig
    return s * (1 + z * (1 - s))


def sigmoid(z, sig=None):
    return torch.sigmoid(z) if sig is None else sig


def sigmoid_grad(z, sig=None):
    s = torch.sigmoid(z) if sig is None else sig
    return s * (1 - s)


# name -> (a, a'): the gate's activation and its derivative
GATE_ACTIVATIONS = {
    "silu": (silu, silu_grad),
    "sigmoid": (sigmoid, sigmoid_grad),
}


def gate_functions(activation: str):
    """(a, a') of the named gate activation; ValueError for a name not in GATE_ACTIVATIONS."""
    try:
        return GATE_ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"activation must be one of {sorted(GATE_ACTIVATIONS)}, got {activation!r}") from None


# --- float64 -----------------------------------------------------------------------------------

def forward_fp64(x, weight, eps, residual=None, gate=None, norm_before_gate=True, *, activation="silu",
                 weight_offset=0.0):
    """(y, rstd, h): y and rstd in float64, h in the residual's dtype (it is rounded by
    definition; see residual_sum).

    With a gate and a = GATE_ACTIVATIONS[activation]: y = rmsnorm(h) * w * a(gate)
    (norm_before_gate), or rmsnorm(h * a(gate)) * w, where rstd is that of h * a(gate).
    With weight_offset, w is (weight_offset + weight) throughout (1.0: zero-centred weights)."""
    act, _ = gate_functions(activation)
    h = residual_sum(x, residual)
    u = _f64(h)
    if gate is not None and not norm_before_gate:
        u = u * act(_f64(gate))
    rstd = torch.rsqrt(u.square().mean(-1) + eps)
    y = u * rstd[..., None]
    if weight is not None:
        y = y * (_f64(weight) + weight_offset)
    if gate is not None and norm_before_gate:
        y = y * act(_f64(gate))
    return y, rstd, h


def backward_fp64(dy, h, weight, rstd, dh=None, gate=None, norm_before_gate=True, *, activation="silu",
                  weight_offset=0.0):
    """(dx, dw) in float64, at the given rstd (the kernel's float32 rstd in the
    tests); with a gate, (dx, dw, dgate). dw is the same with a weight offset (the
    offset is a constant)."""
    act, act_grad = gate_functions(activation)
    hidden = h.shape[-1]
    dy64 = _f64(dy)
    rstd64 = _f64(rstd)[..., None]
    w64 = _f64(weight) + weight_offset if weight is not None else None
    u = _f64(h)
    if gate is not None:
        z = _f64(gate)
        if norm_before_gate:
            dy64 = dy64 * act(z)           # y = norm(h) * w * a(z): the norm sees dy * a(z)
        else:
            u = u * act(z)                 # y = norm(h * a(z)) * w
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
        dz = _f64(dy) * wy * act_grad(z)
    else:
        dx = du * act(z)
        dz = du * _f64(h) * act_grad(z)
    if dh is not None:
        dx = dx + _f64(dh)
    return (dx, dw) if gate is None else (dx, dw, dz)


# --- the explicit FP32-statistics reference (eager; torch.compile traces it as is) ------------
# Statistics and arithmetic in float32, outputs rounded once to the input dtype, dw in
# float32. Written op by op as an eager PyTorch user would; the benchmark times exactly
# these ops, so a change here changes its eager and torch.compile numbers.

# torch's single fused op for an activation's value, where it has one: the eager forward
# runs it instead of the table's composition (same function, one kernel)
_FUSED_VALUE = {"silu": torch.nn.functional.silu}


def rstd_fp32(hf, eps):
    """rsqrt(mean(h^2) + eps) over the last dim of a float32 h."""
    return torch.rsqrt(hf.square().mean(-1) + eps)


def forward_fp32(x, weight, eps, residual=None):
    """(y, rstd, h): h = round(f32(x) + f32(r)) into x's dtype (x itself without a
    residual), y = round(f32(h) * rstd * f32(w)) with rstd in float32."""
    h = residual_sum(x, residual)
    hf = h.float()
    rstd = rstd_fp32(hf, eps)
    y = hf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), rstd, h


def forward_gated_fp32(x, gate, weight, eps, norm_before_gate=True, *, activation="silu"):
    """(y, rstd): y = round(f32(x) * rstd * f32(w) * a(f32(z))) (norm_before_gate),
    or round(u * rstd * f32(w)) with u = f32(x) * a(f32(z)) and rstd that of u."""
    act = _FUSED_VALUE.get(activation, gate_functions(activation)[0])
    hf = x.float()
    if not norm_before_gate:
        hf = hf * act(gate.float())
    rstd = rstd_fp32(hf, eps)
    y = hf * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if norm_before_gate:
        y = y * act(gate.float())
    return y.to(x.dtype), rstd


def backward_fp32(dy, h, weight, rstd, dh=None):
    """(dx, dw) in float32 at the given rstd, dx rounded to h's dtype; dw is float32 [H]."""
    hidden = h.shape[-1]
    g = dy.float() * weight.float() if weight is not None else dy.float()
    xhat = h.float() * rstd.unsqueeze(-1)
    c = (g * xhat).mean(-1, keepdim=True)
    dx = rstd.unsqueeze(-1) * (g - xhat * c)
    if dh is not None:
        dx = dx + dh.float()
    dw = (dy.float() * xhat).reshape(-1, hidden).sum(0) if weight is not None else None
    return dx.to(h.dtype), dw


def backward_gated_fp32(dy, x, gate, weight, rstd, norm_before_gate=True, *, activation="silu"):
    """(dx, dw, dgate) of the gated norm in float32 at the given rstd; dx and dgate
    rounded to their inputs' dtypes, dw float32 [H] (None without a weight)."""
    act, act_grad = gate_functions(activation)
    hidden = x.shape[-1]
    zf = gate.float()
    sig = torch.sigmoid(zf)
    a = act(zf, sig)
    if norm_before_gate:
        # y = norm(x) * w * a(z): the norm sees dy * a(z)
        xhat = x.float() * rstd.unsqueeze(-1)
        dys = dy.float() * a
        g = dys * weight.float() if weight is not None else dys
        c = (g * xhat).mean(-1, keepdim=True)
        dx = rstd.unsqueeze(-1) * (g - xhat * c)
        dyw = dy.float() * xhat * weight.float() if weight is not None else dy.float() * xhat
        dz = dyw * act_grad(zf, sig)
        dw = (dys * xhat).reshape(-1, hidden).sum(0) if weight is not None else None
    else:
        # y = norm(u) * w with u = x * a(z)
        xf = x.float()
        uhat = xf * a * rstd.unsqueeze(-1)
        g = dy.float() * weight.float() if weight is not None else dy.float()
        c = (g * uhat).mean(-1, keepdim=True)
        du = rstd.unsqueeze(-1) * (g - uhat * c)
        dx = du * a
        dz = du * xf * act_grad(zf, sig)
        dw = (dy.float() * uhat).reshape(-1, hidden).sum(0) if weight is not None else None
    return dx.to(x.dtype), dw, dz.to(gate.dtype)


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
    def forward(ctx, x, gate, weight, eps, norm_before_gate, activation="silu"):
        act, _ = gate_functions(activation)
        u = x if norm_before_gate else x * act(gate)
        rstd = torch.rsqrt(u.square().mean(-1) + eps)
        y = u * rstd[..., None] * weight
        if norm_before_gate:
            y = y * act(gate)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.norm_before_gate = norm_before_gate
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        dx, dw, dz = backward_fp64(dy, x, weight, rstd, None, gate, ctx.norm_before_gate,
                                   activation=ctx.activation)
        return dx, dz, dw, None, None, None


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
