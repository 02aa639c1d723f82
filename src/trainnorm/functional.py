"""Public functions: validate the arguments, then call the custom ops.

Every check here runs before any kernel is launched; a bad argument raises a
TypeError (wrong kind or dtype) or ValueError (wrong shape, device or value)
that names the argument.
"""
from __future__ import annotations

import numbers

import torch

from . import plan
from .configs import MAX_HIDDEN
from .ops import RMSNormFunction, check_eps
from .rows import arch_of
from .variant import DTYPE_NAMES, Variant, check_activation, check_weight_offset

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DEVICE_TYPES = ("cuda", "cpu")


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_activation(name: str, t) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"{name} must have dtype {_dtype_names(ACTIVATION_DTYPES)}, got {t.dtype}")
    if t.dim() < 1:
        raise ValueError(f"{name} must have shape [..., H] with at least one dimension, got a 0-d tensor")
    if t.device.type not in _DEVICE_TYPES:
        raise ValueError(f"{name} must be on a CUDA or CPU device, got {t.device}")
    hidden = t.shape[-1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"{name}: the hidden size H = {name}.shape[-1] must be in [1, {MAX_HIDDEN}], got {hidden}")
    return hidden


def _check_like(name: str, t, ref: torch.Tensor, ref_name: str, *, dtype: torch.dtype | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    want = ref.dtype if dtype is None else dtype
    if t.dtype != want:
        raise TypeError(f"{name} must have dtype {want} (as {ref_name}), got {t.dtype}")
    if t.shape != ref.shape:
        raise ValueError(f"{name} must have the shape of {ref_name}, {tuple(ref.shape)}, got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def _check_weight(weight, x: torch.Tensor, x_name: str = "x"):
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
    if x_name == "h" and x.dtype == torch.float32 and weight.dtype in ACTIVATION_DTYPES:
        pass        # a float32 residual stream h under 16-bit x: the weight is x's dtype or float32
    elif weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"weight must have {x_name}'s dtype ({x.dtype}) or float32, got {weight.dtype}")
    hidden = x.shape[-1]
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must have shape [H] = [{hidden}], got {list(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on {x_name}'s device {x.device}, got {weight.device}")
    return weight if weight.stride(-1) == 1 else weight.contiguous()


def default_eps(dtype: torch.dtype) -> float:
    """The eps that ``eps=None`` stands for, as in torch.nn.RMSNorm and
    torch.nn.functional.rms_norm: the machine epsilon of the type the norm is
    computed in, float32 for bf16, fp16 and fp32 inputs (1.1920929e-07), not the
    epsilon of the input dtype."""
    return float(torch.finfo(torch.float32).eps) if dtype.itemsize <= 4 else float(torch.finfo(dtype).eps)


def _type_name(value) -> str:
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_eps(eps, dtype: torch.dtype):
    """eps as a float (None: default_eps(dtype)). Under torch.compile a Python
    float may be traced as a symbolic value, whose range cannot be read here
    without a guard on it: the custom op checks it when it runs, before any
    kernel (ops.check_eps). Tracing it needs no guard on its range, so the graph
    neither breaks nor recompiles per token count; each distinct eps value still
    compiles once, because the op takes eps as a concrete float (as
    torch.nn.functional.rms_norm's aten op does)."""
    if eps is None:
        return default_eps(dtype)
    if isinstance(eps, bool) or not isinstance(eps, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"eps must be a real number or None, got {_type_name(eps)}")
    if torch.compiler.is_compiling():
        return eps
    eps = float(eps)
    check_eps(eps)
    return eps


def _is_numpy_bool(value) -> bool:
    t = type(value)
    return t.__module__ == "numpy" and t.__name__ in ("bool", "bool_")


def _check_flag(name: str, value) -> bool:
    """A bool (numpy's bool too, returned as a Python bool)."""
    if isinstance(value, bool):
        return value
    if _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {_type_name(value)}")


def _check_weight_offset(weight_offset, weight) -> float:
    """weight_offset as a float: y = norm(h) * (weight_offset + weight), 1.0 for the
    zero-centred weights of Gemma-style norms; the offset is added in float32 inside
    the kernels, so dw is the same sum as without it."""
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"weight_offset must be a real number, got {_type_name(weight_offset)}")
    offset = float(weight_offset)     # under torch.compile: specialised, one graph per offset
    check_weight_offset(offset)
    if offset and weight is None:
        raise ValueError(f"weight_offset={offset} needs a weight (y = norm(x) * (weight_offset + weight)), "
                         "got weight=None")
    return offset


def _check_out_dtype(out_dtype, x) -> str | None:
    """The spec's name of y's dtype, or None for x's own."""
    if out_dtype is None or out_dtype == x.dtype:
        return None
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"out_dtype must be None or one of {_dtype_names(ACTIVATION_DTYPES)}, got {out_dtype!r}")
    return DTYPE_NAMES[out_dtype]


def rms_norm(x, weight, eps=1e-6, *, residual=None, deterministic=True, weight_offset=0.0, out_dtype=None):
    """RMSNorm over the last dimension, differentiable in x, weight and residual.

    Returns y, or (y, h) with a residual, where h = x + residual (rounded to
    the residual's dtype: x's, or float32 for a float32 residual stream under
    16-bit x) is the next residual stream. ``weight=None`` means no affine;
    ``eps=None`` means torch's default, the float32 machine epsilon
    (``default_eps``). ``deterministic=False`` allows a faster dw whose last
    bits may vary between calls. ``weight_offset``: y = norm(h) * (offset +
    weight), 1.0 for zero-centred (Gemma-style) weights, added inside the
    kernels. ``out_dtype``: y's dtype (bf16, fp16 or fp32), x's by default.
    """
    _check_activation("x", x)
    weight = _check_weight(weight, x)
    _check_residual(residual, x)
    eps = _check_eps(eps, x.dtype)
    deterministic = _check_flag("deterministic", deterministic)
    variant = _plain_variant(weight, residual, weight_offset, out_dtype, x)
    return RMSNormFunction.apply(x, weight, eps, residual, deterministic, None, variant)


def _plain_variant(weight, residual, weight_offset, out_dtype, x) -> Variant:
    return Variant(weight is not None, residual is not None, weight_offset=_check_weight_offset(weight_offset, weight),
                   y_dtype=_check_out_dtype(out_dtype, x))


def _check_residual(residual, x):
    """The residual: x's dtype, or float32 under 16-bit x (a float32 residual stream)."""
    if residual is None:
        return
    if isinstance(residual, torch.Tensor) and residual.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"residual must have x's dtype ({x.dtype}) or float32 (a float32 residual "
                        f"stream), got {residual.dtype}")
    _check_like("residual", residual, x, "x", dtype=getattr(residual, "dtype", None))


def _check_gate(gate, x):
    if not isinstance(gate, torch.Tensor):
        raise TypeError(f"gate must be a torch.Tensor, got {type(gate).__name__}")
    _check_like("gate", gate, x, "x")


def _gated_variant(weight, norm_before_gate, activation, weight_offset=0.0, out_dtype=None, x=None) -> Variant:
    norm_before_gate = _check_flag("norm_before_gate", norm_before_gate)
    return Variant(weight is not None, False, check_activation(activation), norm_before_gate,
                   _check_weight_offset(weight_offset, weight), y_dtype=_check_out_dtype(out_dtype, x))


def rms_norm_gated(x, gate, weight, eps=1e-6, *, norm_before_gate=True, activation="silu", deterministic=True,
                   weight_offset=0.0, out_dtype=None):
    """Gated RMSNorm, differentiable in x, gate and weight; a = the activation
    ("silu", the default, or "sigmoid").

    norm_before_gate=True:  y = rms_norm(x) * weight * a(gate)   (Qwen3-Next,
                                flash-linear-attention's fused_norm_gate)
    norm_before_gate=False: y = rms_norm(x * a(gate)) * weight   (Mamba2)

    weight_offset and out_dtype as in rms_norm (Qwen3-Next's gated norm: 1.0).
    """
    _check_activation("x", x)
    _check_gate(gate, x)
    weight = _check_weight(weight, x)
    eps = _check_eps(eps, x.dtype)
    variant = _gated_variant(weight, norm_before_gate, activation, weight_offset, out_dtype, x)
    deterministic = _check_flag("deterministic", deterministic)
    return RMSNormFunction.apply(x, weight, eps, None, deterministic, gate, variant)


def rms_norm_gated_forward(x, gate, weight, eps=1e-6, *, norm_before_gate=True, activation="silu",
                           weight_offset=0.0, out_dtype=None):
    """Explicit gated forward: (y, rstd); rstd is that of x, or of x * a(gate)
    when the gate comes first."""
    _check_activation("x", x)
    _check_gate(gate, x)
    weight = _check_weight(weight, x)
    eps = _check_eps(eps, x.dtype)
    variant = _gated_variant(weight, norm_before_gate, activation, weight_offset, out_dtype, x)
    y, rstd, _ = torch.ops.trainnorm.rms_norm_fwd(x, weight, None, gate, eps, variant.spec)
    return y, rstd


def rms_norm_gated_backward(dy, x, gate, weight, rstd, *, norm_before_gate=True, activation="silu",
                            deterministic=True, workspace=None, weight_offset=0.0):
    """Explicit gated backward: (dx, dgate, dw); dw is float32 [H], or None
    without a weight. dy may have any activation dtype (y's, with out_dtype)."""
    deterministic = _check_backward_args(dy, x, weight, rstd, None, deterministic, workspace, "x", gated=True)
    _check_gate(gate, x)
    weight = _check_weight(weight, x)
    variant = _gated_variant(weight, norm_before_gate, activation, weight_offset)
    dx, dw, dz, _ = torch.ops.trainnorm.rms_norm_bwd(dy, x, weight, rstd, None, gate, variant.spec,
                                                  deterministic, True, workspace)
    return dx, dz, (dw if weight is not None else None)


def rms_norm_forward(x, weight, eps=1e-6, *, residual=None, weight_offset=0.0, out_dtype=None):
    """Explicit forward: (y, rstd, h). y has x's dtype (or out_dtype), rstd is
    float32 [...], h is x + residual in the residual's dtype (or x itself
    without a residual)."""
    _check_activation("x", x)
    weight = _check_weight(weight, x)
    _check_residual(residual, x)
    eps = _check_eps(eps, x.dtype)
    variant = _plain_variant(weight, residual, weight_offset, out_dtype, x)
    y, rstd, h = torch.ops.trainnorm.rms_norm_fwd(x, weight, residual, None, eps, variant.spec)
    return y, rstd, (h if residual is not None else x)


def rms_norm_backward(dy, h, weight, rstd, *, dh=None, deterministic=True, workspace=None, weight_offset=0.0):
    """Explicit backward: (dx, dw). dx has h's dtype (it is also the residual's
    gradient); dw is float32 [H], or None without a weight. dy may have any
    activation dtype (y's, with out_dtype); dh has h's. With a workspace (see
    backward_workspace) nothing but the outputs is allocated."""
    deterministic = _check_backward_args(dy, h, weight, rstd, dh, deterministic, workspace)
    weight = _check_weight(weight, h, "h")
    variant = Variant(weight is not None, dh is not None, weight_offset=_check_weight_offset(weight_offset, weight))
    dx, dw, _, _ = torch.ops.trainnorm.rms_norm_bwd(dy, h, weight, rstd, dh, None, variant.spec, deterministic,
                                                    True, workspace)
    return dx, (dw if weight is not None else None)


def _check_backward_args(dy, h, weight, rstd, dh, deterministic, workspace, h_name="h", gated=False):
    n = h_name
    _check_activation(n, h)
    if isinstance(dy, torch.Tensor) and dy.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"dy must have dtype {_dtype_names(ACTIVATION_DTYPES)} (y's: {n}'s, or out_dtype), "
                        f"got {dy.dtype}")
    _check_like("dy", dy, h, n, dtype=getattr(dy, "dtype", None))
    _check_weight(weight, h, n)
    if not isinstance(rstd, torch.Tensor):
        raise TypeError(f"rstd must be a torch.Tensor, got {type(rstd).__name__}")
    if rstd.dtype != torch.float32:
        raise TypeError(f"rstd must be float32, got {rstd.dtype}")
    if tuple(rstd.shape) != tuple(h.shape[:-1]):
        raise ValueError(f"rstd must have shape {n}.shape[:-1] = {list(h.shape[:-1])}, got {list(rstd.shape)}")
    if rstd.device != h.device:
        raise ValueError(f"rstd must be on {n}'s device {h.device}, got {rstd.device}")
    if dh is not None:
        _check_like("dh", dh, h, n)
    deterministic = _check_flag("deterministic", deterministic)
    if workspace is not None:
        if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
            raise TypeError("workspace must be a torch.uint8 tensor from backward_workspace()")
        if workspace.device != h.device or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous tensor on {n}'s device {h.device}")
        if workspace.data_ptr() % 8:
            raise ValueError("workspace must start at an 8-byte aligned address (it holds float64 "
                             "partials); a slice of backward_workspace() at an offset of 8k bytes is")
        # sized for the backward's key (h is x on this entry point)
        need = backward_workspace_bytes(rstd.numel(), h.shape[-1], deterministic=deterministic,
                                        dtype=plan.backward_key_dtype(h.dtype, dy.dtype),
                                        gated=gated, device=h.device)
        if workspace.numel() < need:
            raise ValueError(f"workspace must hold {need} bytes for rows={rstd.numel()}, "
                             f"H={h.shape[-1]}, got {workspace.numel()}")
    return deterministic


def backward_workspace_bytes(rows, hidden, *, deterministic=True, device=None, dtype=torch.bfloat16,
                             gated=False) -> int:
    """Bytes of scratch the backward needs for `rows` rows of width `hidden`
    and activations of `dtype` (0 when it needs none): x's dtype, also under a
    float32 residual stream; gated=True sizes it for rms_norm_gated_backward,
    whose tiles (and so chunking) may differ. The backward's tiles follow the
    narrower of h's and dy's dtypes, so float32 sizes for a 16-bit dy too (float32
    x with a 16-bit y, or a float32 stream h passed as float32)."""
    for name, v in (("rows", rows), ("hidden", hidden)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden must be in [1, {MAX_HIDDEN}], got {hidden}")
    if dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"dtype must be one of {_dtype_names(ACTIVATION_DTYPES)}, got {dtype}")
    deterministic = _check_flag("deterministic", deterministic)
    gated = _check_flag("gated", gated)
    variant = Variant(gate="silu" if gated else None)
    arch = arch_of(device) if device is not None else _default_arch()
    keys = (dtype, torch.bfloat16) if dtype == torch.float32 else (dtype,)
    return max(plan.backward_plan(int(rows), int(hidden), k, variant, deterministic, True, arch).workspace_bytes
               for k in keys)


def _default_arch():
    return arch_of(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else None


def backward_workspace(rows, hidden, *, deterministic=True, device=None, dtype=torch.bfloat16,
                       gated=False) -> torch.Tensor:
    """A uint8 scratch tensor for rms_norm_backward(..., workspace=...), reusable
    across calls that fit it (backward_workspace_bytes), in either mode, one
    stream at a time; what it held before a call does not matter (the
    deterministic=False form zeroes its accumulator at every call)."""
    nbytes = backward_workspace_bytes(rows, hidden, deterministic=deterministic, dtype=dtype, gated=gated)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)
