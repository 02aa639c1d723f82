"""nn.Module wrappers: parameters and state only, the work is in functional.py."""
from __future__ import annotations

import numbers

import torch
from torch import nn

from .functional import rms_norm, rms_norm_gated
from .variant import check_activation


class RMSNorm(nn.Module):
    """Drop-in for torch.nn.RMSNorm: same constructor, parameter name (`weight`)
    and state_dict; normalises over the last dimension.

    ``forward(x, residual=None)`` returns y, or (y, h) with a residual.
    """

    def __init__(self, normalized_shape, eps=1e-6, elementwise_affine=True, device=None, dtype=None,
                 *, deterministic=True):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (int(normalized_shape),)
        normalized_shape = tuple(normalized_shape)
        if len(normalized_shape) != 1:
            raise ValueError(f"normalized_shape must be one dimension (the last), got {normalized_shape}")
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.deterministic = deterministic
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.eps, residual=residual, deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"deterministic={self.deterministic}")


class RMSNormGated(RMSNorm):
    """SiLU-gated RMSNorm with a `weight` parameter like RMSNorm.

    ``forward(x, gate)``: rms_norm(x) * weight * a(gate) with
    norm_before_gate=True (the default), else rms_norm(x * a(gate)) * weight;
    a = silu (the default) or sigmoid (``activation="sigmoid"``).
    """

    def __init__(self, normalized_shape, eps=1e-6, norm_before_gate=True, elementwise_affine=True, device=None,
                 dtype=None, *, activation="silu", deterministic=True):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, deterministic=deterministic)
        self.norm_before_gate = norm_before_gate
        self.activation = check_activation(activation)

    def forward(self, x, gate):
        return rms_norm_gated(x, gate, self.weight, self.eps, norm_before_gate=self.norm_before_gate,
                              activation=self.activation, deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", norm_before_gate={self.norm_before_gate}, activation={self.activation!r}"
