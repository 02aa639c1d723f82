"""nn.Module wrappers: parameters and state only, the work is in functional.py."""
from __future__ import annotations

import numbers

import torch
from torch import nn

from .functional import rms_norm


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
