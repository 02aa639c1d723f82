"""The input families the accuracy budget is checked on (SPEC section 2).

- ``normal``:  x, dy standard normal.
- ``outlier``: x standard normal with a few channels scaled x30, like the
  activation outliers of large language models.
- ``offset``:  dy of small magnitude around a common offset, so that dw_j =
  offset * sum(xhat_j) + small nearly cancels while its running sums are large.

Inputs are drawn on the target device from a seeded generator of that device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FAMILIES = ("normal", "outlier", "offset")
OUTLIER_SCALE = 30.0
OFFSET = 0.05
OFFSET_NOISE = 1e-3


@dataclass
class Case:
    x: torch.Tensor
    weight: torch.Tensor
    dy: torch.Tensor
    residual: torch.Tensor | None = None
    dh: torch.Tensor | None = None


def _draw(shape, gen, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).to(dtype)


def make_case(family: str, lead: tuple, hidden: int, *, dtype=torch.bfloat16, weight_dtype=None,
              residual: bool = False, seed: int = 0, device="cpu", query_view: bool = False) -> Case:
    """A case of shape [*lead, hidden]. With query_view the activations are the
    every-other-slice view of a twice-wider projection ([T, NH, H] with strides
    (2*NH*H, 2*H, 1)), read in place by the kernels."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_dtype = weight_dtype or dtype
    shape = tuple(lead) + (hidden,)
    if query_view:
        base_shape = tuple(lead[:-1]) + (lead[-1], 2 * hidden)
        x = _draw(base_shape, gen, torch.float32)
    else:
        x = _draw(shape, gen, torch.float32)
    if family == "outlier":
        k = max(1, hidden // 512)
        ch = torch.randperm(hidden, generator=gen, device=gen.device)[:k]
        x[..., ch] *= OUTLIER_SCALE
    x = x.to(dtype)
    if query_view:
        x = x[..., :hidden]
    weight = (1.0 + _draw((hidden,), gen, torch.float32, 0.1)).to(weight_dtype)
    if family == "offset":
        dy = (OFFSET + _draw(shape, gen, torch.float32, OFFSET_NOISE)).to(dtype)
    else:
        dy = _draw(shape, gen, dtype)
    case = Case(x, weight, dy)
    if residual:
        case.residual = _draw(shape, gen, dtype)
        case.dh = _draw(shape, gen, dtype, 0.5)
    return case
