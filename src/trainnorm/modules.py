"""nn.Module wrappers: parameters and state only, the work is in functional.py.

The constructors check their arguments (a TypeError or ValueError naming the
argument), so a wrong module fails where it is built, not at its first call.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .configs import MAX_HIDDEN
from .functional import (ACTIVATION_DTYPES, _check_eps, _check_flag, _check_weight_offset, _dtype_names, _type_name,
                         rms_norm, rms_norm_gated)
from .variant import check_activation


def _check_normalized_shape(normalized_shape, *, one_dim: bool) -> tuple[int, ...]:
    if isinstance(normalized_shape, bool):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {_type_name(normalized_shape)}")
    if isinstance(normalized_shape, numbers.Integral):
        shape = (int(normalized_shape),)
    else:
        try:
            shape = tuple(normalized_shape)
        except TypeError:
            raise TypeError("normalized_shape must be an int or a sequence of ints, "
                            f"got {_type_name(normalized_shape)}") from None
        for d in shape:
            if isinstance(d, bool) or not isinstance(d, numbers.Integral):
                raise TypeError(f"normalized_shape must hold ints, got {_type_name(d)} in {normalized_shape!r}")
        shape = tuple(int(d) for d in shape)
    if one_dim and len(shape) != 1:
        raise ValueError(f"normalized_shape must be one dimension (the last), got {shape}")
    if not shape or not 1 <= math.prod(shape) <= MAX_HIDDEN or min(shape) < 1:
        raise ValueError(f"normalized_shape must hold sizes >= 1 whose product (the elements normalised together) "
                         f"is in [1, {MAX_HIDDEN}], got {shape}")
    return shape


def _check_module_args(normalized_shape, eps, elementwise_affine, dtype, deterministic, *, one_dim: bool):
    """(normalized_shape as a tuple, eps as a float or None, elementwise_affine, deterministic)."""
    shape = _check_normalized_shape(normalized_shape, one_dim=one_dim)
    if eps is not None:
        eps = _check_eps(eps, torch.float32)
    elementwise_affine = _check_flag("elementwise_affine", elementwise_affine)
    if dtype is not None and dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"dtype must be None or one of {_dtype_names(ACTIVATION_DTYPES)}, got {dtype}")
    deterministic = _check_flag("deterministic", deterministic)
    return shape, eps, elementwise_affine, deterministic


def _check_module_offset(weight_offset, elementwise_affine) -> float:
    offset = _check_weight_offset(weight_offset, True)
    if offset and not elementwise_affine:
        raise ValueError(f"weight_offset={offset} needs elementwise_affine=True (a weight to offset)")
    return offset


class RMSNorm(nn.RMSNorm):
    """Drop-in for torch.nn.RMSNorm, and an instance of it: the same
    constructor, defaults (``eps=None``: torch's, the float32 machine epsilon),
    parameter name (``weight``) and state_dict, both ways.

    ``forward(x, residual=None)`` returns y, or (y, h) with a residual, where
    h = x + residual is the next residual stream. normalized_shape may have
    several dimensions, as in torch (their product at most 65,536): the last
    dimensions are normalised together. ``deterministic=False`` takes the
    faster dw (see trainnorm.rms_norm). ``weight_offset=1.0`` gives the
    zero-centred weight of Gemma-style norms, y = norm(x) * (1 + weight),
    computed inside the kernels; the weight then starts at 1 - weight_offset
    (zeros), so that the norm starts as the identity scale, as torch's does.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None,
                 *, deterministic=True, weight_offset=0.0):
        shape, eps, elementwise_affine, deterministic = _check_module_args(
            normalized_shape, eps, elementwise_affine, dtype, deterministic, one_dim=False)
        self.weight_offset = _check_module_offset(weight_offset, elementwise_affine)
        super().__init__(shape, eps, elementwise_affine, device, dtype)
        self.deterministic = deterministic

    def reset_parameters(self) -> None:
        _reset_weight(self)

    def forward(self, x, residual=None):
        shape = self.normalized_shape
        if isinstance(x, torch.Tensor) and tuple(x.shape[-len(shape):]) != shape:
            raise ValueError(f"x must have shape [..., {', '.join(map(str, shape))}] (normalized_shape), "
                             f"got {list(x.shape)}")
        kw = dict(deterministic=self.deterministic, weight_offset=self.weight_offset)
        if len(shape) == 1:
            return rms_norm(x, self.weight, self.eps, residual=residual, **kw)
        # several normalised dimensions: one row of their product
        rows = tuple(x.shape[:-len(shape)]) + (math.prod(shape),)
        weight = self.weight.reshape(-1) if self.weight is not None else None
        if isinstance(residual, torch.Tensor):
            if residual.shape != x.shape:
                raise ValueError(f"residual must have the shape of x, {list(x.shape)}, got {list(residual.shape)}")
            residual = residual.reshape(rows)
        out = rms_norm(x.reshape(rows), weight, self.eps, residual=residual, **kw)
        if residual is not None:
            return out[0].view(x.shape), out[1].view(x.shape)
        return out.view(x.shape)

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return super().extra_repr() + f", deterministic={self.deterministic}" + offset


def _reset_weight(module) -> None:
    """The weight that makes (weight_offset + weight) one: ones, or zeros for offset 1."""
    if module.weight is not None:
        nn.init.constant_(module.weight, 1.0 - getattr(module, "weight_offset", 0.0))


class RMSNormGated(nn.Module):
    """Gated RMSNorm with a `weight` parameter like RMSNorm.

    ``forward(x, gate)``: rms_norm(x) * weight * a(gate) with
    norm_before_gate=True (the default), else rms_norm(x * a(gate)) * weight;
    a = silu (the default) or sigmoid (``activation="sigmoid"``). It takes two
    inputs, so it is not a torch.nn.RMSNorm.
    """

    def __init__(self, normalized_shape, eps=1e-6, norm_before_gate=True, elementwise_affine=True, device=None,
                 dtype=None, *, activation="silu", deterministic=True, weight_offset=0.0):
        super().__init__()
        shape, eps, elementwise_affine, deterministic = _check_module_args(
            normalized_shape, eps, elementwise_affine, dtype, deterministic, one_dim=True)
        self.weight_offset = _check_module_offset(weight_offset, elementwise_affine)
        self.normalized_shape = shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.deterministic = deterministic
        self.norm_before_gate = _check_flag("norm_before_gate", norm_before_gate)
        self.activation = check_activation(activation)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _reset_weight(self)

    def forward(self, x, gate):
        return rms_norm_gated(x, gate, self.weight, self.eps, norm_before_gate=self.norm_before_gate,
                              activation=self.activation, deterministic=self.deterministic,
                              weight_offset=self.weight_offset)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"deterministic={self.deterministic}, norm_before_gate={self.norm_before_gate}, "
                f"activation={self.activation!r}" + (f", weight_offset={self.weight_offset}" if self.weight_offset else ""))
