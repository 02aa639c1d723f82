"""What is computed: one frozen description that travels API -> ops -> plan -> kernels.

A `Variant` names the parts of the formula (SPEC section 1) that change what a
kernel computes, not how fast: a weight or none, a fused residual add, a gate
with its activation and its order. The public functions build one from their
arguments; the custom ops carry its non-tensor part as a short string
(`Variant.spec`, part of the op's schema, so torch.compile and CUDA graphs see
a plain argument); the plan keys configurations on it; and it turns into the
kernels' constexprs (`Variant.constexprs`), each kernel taking only the ones
its form uses.

Whether a weight, residual or gate is present is read from the tensors (None
or not) at every layer, so a Variant can never disagree with its inputs; the
spec string holds only what the tensors do not say (the gate's activation and
order, the weight offset). A new field (a residual dtype, LayerNorm's mean)
goes here, into `spec`/`from_spec`, into `constexprs`, and into the
kernels that read it.

Gate activations: one name per function. The kernels' side is one branch of
`kernels/gate.py:gate_activation` (the value and its derivative); the maths'
side is one entry of `reference.GATE_ACTIVATIONS`. Those two are all a new
activation needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .reference import GATE_ACTIVATIONS


def check_activation(name) -> str:
    if not isinstance(name, str) or name not in GATE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(GATE_ACTIVATIONS)}, got {name!r}")
    return name


@dataclass(frozen=True)
class Variant:
    has_weight: bool = True
    has_residual: bool = False
    gate: str | None = None           # the gate's activation ("silu", ...), None without a gate
    norm_before_gate: bool = True     # y = norm(h) * w * a(z); False: y = norm(h * a(z)) * w
    weight_offset: float = 0.0        # y = norm(h) * (offset + w): 1.0 for zero-centred (Gemma-style) weights
    # dtypes that differ from the residual stream's (h): x's, when the residual stream
    # is float32 under 16-bit activations (dx in x's dtype, the stream's gradient in
    # float32); y's, when asked for one (out_dtype). None: h's dtype.
    x_dtype: str | None = None
    y_dtype: str | None = None

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def spec(self) -> str:
        """The non-tensor part, as the custom ops carry it: comma-separated parts, none
        by default: the gate's activation (with ":first" when the gate comes before the
        norm) and "w+<offset>" for a weight offset."""
        parts = []
        if self.gate is not None:
            parts.append(self.gate if self.norm_before_gate else self.gate + ":first")
        if self.weight_offset:
            parts.append(f"w+{self.weight_offset!r}")
        if self.x_dtype:
            parts.append(f"x:{self.x_dtype}")
        if self.y_dtype:
            parts.append(f"y:{self.y_dtype}")
        return ",".join(parts)

    @staticmethod
    def from_spec(spec: str, *, weight, residual, gate) -> "Variant":
        """The Variant of an op call: its spec string and which tensors are present."""
        return _from_spec(spec, weight is not None, residual is not None, gate is not None)

    def constexprs(self) -> dict:
        """The kernels' constexprs for this variant (each kernel takes those it uses)."""
        return dict(GATE=self.gate, GATE_FIRST=self.gated and not self.norm_before_gate,
                    W_OFFSET=float(self.weight_offset))


@lru_cache(maxsize=None)
def _from_spec(spec: str, has_weight: bool, has_residual: bool, has_gate: bool) -> Variant:
    act, order, offset, dtypes = "", "", 0.0, {}
    for part in spec.split(",") if spec else ():
        if part.startswith("w+"):
            offset = float(part[2:])
            check_weight_offset(offset)
        elif part[:2] in ("x:", "y:"):
            dtypes[part[0]] = part[2:]
        else:
            act, _, order = part.partition(":")
    if (has_gate != bool(act) or order not in ("", "first") or (offset and not has_weight)
            or any(d not in DTYPES for d in dtypes.values())):
        raise ValueError(f"variant spec {spec!r} does not match the inputs (gate given: {has_gate}, "
                         f"weight given: {has_weight})")
    if act:
        check_activation(act)
    return Variant(has_weight, has_residual, act or None, order != "first", offset, dtypes.get("x"),
                   dtypes.get("y"))


# float32's normal range: the kernels hold eps and the weight offset as float32
# scalars; a Python float outside it becomes a float64 constant in Triton (a
# subnormal) or rounds to inf in float32 (y then inf, dx NaN)
F32_TINY = float(torch.finfo(torch.float32).tiny)    # 1.1754944e-38
F32_MAX = float(torch.finfo(torch.float32).max)      # 3.4028235e+38


def check_weight_offset(offset: float) -> None:
    """ValueError unless the weight offset is 0 or a normal float32 number (of either sign)."""
    if offset != offset or abs(offset) == float("inf"):     # (math.isfinite breaks a dynamo graph)
        raise ValueError(f"weight_offset must be finite, got {offset}")
    if offset and not F32_TINY <= abs(offset) <= F32_MAX:
        raise ValueError(f"weight_offset must be 0 or a normal float32 number, |offset| in [{F32_TINY:.8g}, "
                         f"{F32_MAX:.8g}] (the kernels add it in float32), got {offset}")


# the dtypes a variant names, by their short names
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
