"""The benchmark's rows: which shapes are timed, their ids, and the bytes each op must move.

The 78 shapes ("seed" rows, the list SPEC section 6 names):
- H 512, 1536, 2048, 4096, 5120, 6144 at the seven token counts SEED_T,
  BF16 activations and BF16 weight (42 rows);
- FP32 weight on H 5120 and 6144 (14 rows);
- a residual on H 6144, with BF16 and with FP32 weight (14 rows);
- per-head H 256: the strided query view ``[T, 24, 256]`` (strides
  (12288, 512, 1): every other 256-slice of a 12288-wide projection) and the
  contiguous key ``[T, 4, 256]``, at four token counts (8 rows).
Small-T rows (20): T 1, 4, 16, 64 of H 2048, 4096, 5120, 6144 and residual H 6144,
where launch latency and the dw reduction's fixed cost dominate.

Gated rows (7, outside the 78): the SiLU-gated norm y = rmsnorm(x) * w * silu(z),
H 4096 at T 1024, 4096, 16384, 65536 and the per-head [T, 32, 128] at T 1024,
4096, 16384 (contiguous), against the peers that have a gated norm.

These 105 rows are the default set. Three more sets are timed on request
(``trainnorm bench --set beyond`` / ``--set block`` / ``--set stack``, ``ROW_SETS``):

- "beyond" (42 rows): hidden sizes of public models that the measured table
  (configs/sm_90.json) holds no entry for, and per-head views with other head
  counts and widths, at T 4096, 16384, 65536, BF16 activations and weight:
  their configs come from the general rules alone;
- "block" (2 rows): a Qwen3-style decoder block (bench/block.py) compiled whole
  with torch.compile, with trainnorm's norms against torch.nn.RMSNorm, at
  T 4096 and 16384. Its ops time the block: fwd (the training forward, which
  saves what the backward needs) and step = fwd + bwd (no recompute); bwd
  alone is not timed (compiled, the backward runs once per forward). No copy
  floor;
- "stack" (20 rows): two features of training stacks, each row beside the plain
  BF16 row of its shape (its "pair"), so the report shows what the feature
  costs: a float32 residual stream under BF16 activations ("res r32": r, h = f32(x)
  + r, dh and the stream's gradient dx in float32, y and dy BF16), paired with the
  BF16 residual row; and zero-centred weights y = x_hat * (1 + w) ("1+w"), paired
  with the plain row. H 4096 at T 4096, 16384, 65536 and H 2048, 5120 at T 16384;
  the plain pairs are the seed rows of those shapes.

Ops: ``fwd``; ``bwd``; ``step`` = fwd + fwd + bwd in one graph (activation
checkpointing recomputes the forward before the backward).

The floor of a row is the bytes the op must move divided by the measured
device-to-device copy bandwidth: no implementation can be faster than that
without skipping a read or a write.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Callable

OPS = ("fwd", "bwd", "step")

SEED_T = (256, 1024, 4096, 14928, 16384, 32768, 65536)
SMALL_T = (1, 4, 16, 64)
PER_HEAD_T = (1024, 4096, 16384, 65536)
SEED_H = (512, 1536, 2048, 4096, 5120, 6144)
W32_H = (5120, 6144)
SMALL_T_H = (2048, 4096, 5120, 6144)

HEAD_DIM = 256
STRIDED_HEADS = 24     # [T, 24, 256] read out of a [T, 12288] projection
STRIDED_ROW = 12288
CONTIGUOUS_HEADS = 4   # [T, 4, 256] contiguous

ACT_BYTES = 2          # BF16 activations: x, r, y, h, dy, dh, dx
STREAM32_BYTES = 4     # the float32 residual stream of "res r32" rows: r, h, dh, dx
RSTD_BYTES = 4
DW_BYTES = 4

# A representative subset for --quick: every kind of series, small and large T.
QUICK_IDS = (
    "H512 T16384",
    "H2048 T1024",
    "H4096 T4096",
    "H4096 T65536",
    "H6144 T16",
    "H6144 T14928",
    "H5120 T4096 w32",
    "H6144 T16384 res",
    "[T,24,256] T16384",
    "[T,4,256] T4096",
)


@dataclass(frozen=True)
class Row:
    """One benchmarked shape.

    ``hidden`` is the normalized width H (256 for the per-head rows), ``tokens``
    is T, ``heads`` the number of per-head rows per token (1 for plain rows).
    """

    hidden: int
    tokens: int
    heads: int = 1
    strided: bool = False   # the [T, 24, 256] view of a wider projection
    residual: bool = False
    w32: bool = False       # FP32 weight (BF16 otherwise)
    small_t: bool = False   # one of the 20 small-T rows, not one of the 78
    gated: bool = False     # the SiLU-gated norm (gate z like x), not one of the 78
    beyond: bool = False    # a width or head count the measured table does not hold
    block: bool = False     # the decoder block of width `hidden` (bench/block.py), not a norm alone
    r32: bool = False       # the residual stream (r, h, dh, dx) in float32 under BF16 x, y, dy
    weight_offset: float = 0.0  # y = x_hat * (weight_offset + w); 1.0: zero-centred (1 + w) weights
    stack: bool = False     # a row of the stack set outside the 78 (a feature row or a BF16 pair)

    def __post_init__(self):
        if self.r32 and not self.residual:
            raise ValueError("r32 (a float32 residual stream) needs residual=True")
        if not math.isfinite(self.weight_offset):
            raise ValueError(f"weight_offset must be a finite number, got {self.weight_offset}")

    @property
    def per_head(self) -> bool:
        return self.heads > 1

    @property
    def stack_feature(self) -> bool:
        """Whether the row times a training-stack feature (float32 stream, weight offset)."""
        return self.r32 or self.weight_offset != 0.0

    @property
    def _feature_parts(self) -> list[str]:
        parts = ["r32"] if self.r32 else []
        if self.weight_offset != 0.0:
            parts.append(f"{self.weight_offset:g}+w")
        return parts

    @property
    def series(self) -> str:
        """The row's series, one line of the plots: 'H4096', 'H6144 res w32', '[T,24,256]', 'block'."""
        if self.block:
            return "block"
        if self.per_head:
            return f"[T,{self.heads},{self.hidden}]" + (" gate" if self.gated else "")
        name = f"H{self.hidden}"
        if self.residual:
            name += " res"
        if self.w32:
            name += " w32"
        if self.gated:
            name += " gate"
        return " ".join([name] + self._feature_parts)

    @property
    def id(self) -> str:
        """Stable id: 'H4096 T1024', 'H6144 T1024 res w32', '[T,24,256] T1024', 'block T4096',
        'H4096 T16384 res r32' (float32 residual stream), 'H4096 T16384 1+w' (weight offset 1)."""
        if self.per_head or self.block:
            return f"{self.series} T{self.tokens}"
        parts = [f"H{self.hidden}", f"T{self.tokens}"]
        if self.residual:
            parts.append("res")
        if self.w32:
            parts.append("w32")
        if self.gated:
            parts.append("gate")
        return " ".join(parts + self._feature_parts)

    @property
    def pair(self) -> "Row | None":
        """The BF16 row of the same shape without the stack feature (None for rows without
        one); its id, op_bytes and floor are those of the stack set's pair row."""
        return replace(self, r32=False, weight_offset=0.0) if self.stack_feature else None

    @property
    def pair_id(self) -> str | None:
        """The pair's id: 'H4096 T16384 res' for 'H4096 T16384 res r32', 'H4096 T16384'
        for 'H4096 T16384 1+w' (None for rows without a stack feature)."""
        return None if self.pair is None else self.pair.id

    @property
    def stream_bytes(self) -> int:
        """Bytes per element of the residual stream h (and r, dh, dx): x's without a residual."""
        return STREAM32_BYTES if self.r32 else ACT_BYTES

    @property
    def rows(self) -> int:
        """Number of normalized rows (T for plain rows, T * heads per head)."""
        return self.tokens * self.heads

    @property
    def shape(self) -> tuple[int, ...]:
        """The input's shape: [T, H], [T, heads, H], or the block's [1, T, H] (batch 1)."""
        if self.block:
            return (1, self.tokens, self.hidden)
        if self.per_head:
            return (self.tokens, self.heads, self.hidden)
        return (self.tokens, self.hidden)

    @property
    def weight_bytes(self) -> int:
        return 4 if self.w32 else 2

    @property
    def group(self) -> str:
        """The summary group: 'seed' (the 78), 'small_t', 'gated', 'beyond', 'block' or 'stack'."""
        if self.stack or self.stack_feature:
            return "stack"
        for name in ("block", "beyond", "gated", "small_t"):
            if getattr(self, name):
                return name
        return "seed"

    @property
    def has_floor(self) -> bool:
        """Whether the row has a copy floor (the block rows are mostly matrix products: none)."""
        return not self.block

    @property
    def seed(self) -> bool:
        return self.group == "seed"


def _series_rows(hidden: int, tokens, **kw) -> list[Row]:
    return [Row(hidden, t, **kw) for t in tokens]


def seed_rows() -> list[Row]:
    """The 78 shapes, series by series, T ascending."""
    rows: list[Row] = []
    for h in SEED_H:
        rows += _series_rows(h, SEED_T)
    for h in W32_H:
        rows += _series_rows(h, SEED_T, w32=True)
    rows += _series_rows(6144, SEED_T, residual=True)
    rows += _series_rows(6144, SEED_T, residual=True, w32=True)
    rows += _series_rows(HEAD_DIM, PER_HEAD_T, heads=STRIDED_HEADS, strided=True)
    rows += _series_rows(HEAD_DIM, PER_HEAD_T, heads=CONTIGUOUS_HEADS)
    return rows


def small_t_rows() -> list[Row]:
    """T 1, 4, 16, 64 of H 2048, 4096, 5120, 6144 and residual H 6144 (20 rows)."""
    rows: list[Row] = []
    for h in SMALL_T_H:
        rows += _series_rows(h, SMALL_T, small_t=True)
    rows += _series_rows(6144, SMALL_T, residual=True, small_t=True)
    return rows


GATED_T = (1024, 4096, 16384, 65536)
GATED_HEAD_T = (1024, 4096, 16384)


def gated_rows() -> list[Row]:
    """The SiLU-gated norm: H 4096 and the per-head [T, 32, 128] (7 rows)."""
    return (_series_rows(4096, GATED_T, gated=True)
            + _series_rows(128, GATED_HEAD_T, heads=32, gated=True))


# Beyond the table: hidden sizes of public models (RMSNorm over the residual stream)
# between 128 and 8192 that configs/sm_90.json holds no entry for (it holds 256,
# 512, 1536, 2048, 4096, 5120, 6144, and 128 for the gated backward only).
BEYOND_H = (
    768,    # T5-base / Flan-T5-base (d_model 768; T5's layer norm is an RMSNorm)
    896,    # Qwen2.5-0.5B
    1024,   # Qwen3-0.6B
    2304,   # Gemma-2-2B
    2560,   # Qwen3-4B
    3072,   # Llama-3.2-3B
    3584,   # Qwen2.5-7B
    3840,   # Gemma-3-12B
    5376,   # Gemma-3-27B
    7168,   # DeepSeek-V3
    8192,   # Llama-3.1-70B
)
# Per-head q/k norms over head_dim with other head counts and widths (contiguous views).
BEYOND_HEADS = (
    (32, 128),   # Qwen3-8B queries: 32 heads of 128
    (8, 128),    # Qwen3-8B keys: 8 heads of 128
    (24, 64),    # Stable Diffusion 3.5 Medium's attention (QK RMSNorm): 24 heads of 64
)
BEYOND_T = (4096, 16384, 65536)
BLOCK_H = 4096          # the width of bench/block.py's QWEN3_8B
BLOCK_T = (4096, 16384)
QUICK_BEYOND_IDS = ("H2560 T16384", "H7168 T4096", "[T,8,128] T16384")
QUICK_BLOCK_IDS = ("block T4096",)


def beyond_rows() -> list[Row]:
    """Widths and head counts the measured table does not hold (42 rows)."""
    rows: list[Row] = []
    for h in BEYOND_H:
        rows += _series_rows(h, BEYOND_T, beyond=True)
    for heads, h in BEYOND_HEADS:
        rows += _series_rows(h, BEYOND_T, heads=heads, beyond=True)
    return rows


def block_rows() -> list[Row]:
    """The Qwen3-style decoder block compiled whole, T 4096 and 16384 (2 rows)."""
    return _series_rows(BLOCK_H, BLOCK_T, block=True)


# The stack set: a float32 residual stream and (1 + w) weights at H 4096 across T, and
# H 2048 and 5120 at T 16384; each feature row beside its BF16 pair (STACK_SHAPES x 4).
STACK_SHAPES = ((4096, 4096), (4096, 16384), (4096, 65536), (2048, 16384), (5120, 16384))
STACK_OFFSET = 1.0      # zero-centred weights: y = x_hat * (1 + w)
QUICK_STACK_IDS = ("H4096 T16384 res r32", "H4096 T16384 res", "H4096 T16384 1+w", "H4096 T16384")


def stack_rows() -> list[Row]:
    """Per shape of STACK_SHAPES: the BF16 residual row and the float32-stream row, the plain
    row (the seed row of that shape, timed in both sets) and the (1 + w) row (20 rows);
    in the report each pair's series are adjacent, the BF16 one first."""
    rows: list[Row] = []
    for h, t in STACK_SHAPES:
        rows += [Row(h, t, residual=True, stack=True), Row(h, t, residual=True, r32=True, stack=True),
                 Row(h, t), Row(h, t, weight_offset=STACK_OFFSET, stack=True)]
    return rows


def _default_set() -> list[Row]:
    return seed_rows() + small_t_rows() + gated_rows()


@dataclass(frozen=True)
class RowSet:
    """A named set of rows for `trainnorm bench --set`, with its --quick subset."""

    name: str
    description: str
    make: Callable[[], list[Row]]
    quick_ids: tuple[str, ...]

    def rows(self) -> list[Row]:
        return _ordered(self.make())

    def quick(self) -> list[Row]:
        by_id = {r.id: r for r in self.rows()}
        return [by_id[i] for i in self.quick_ids]


ROW_SETS = {s.name: s for s in (
    RowSet("default", "the 78 shapes, 20 small-T and 7 gated rows", _default_set, QUICK_IDS),
    RowSet("beyond", "widths and head counts the measured table does not hold", beyond_rows, QUICK_BEYOND_IDS),
    RowSet("block", "a Qwen3-style decoder block compiled whole", block_rows, QUICK_BLOCK_IDS),
    RowSet("stack", "a float32 residual stream and (1 + w) weights, each beside its bf16 row",
           stack_rows, QUICK_STACK_IDS),
)}
ALL_SETS = "all"


def series_order() -> list[str]:
    """The series in the order of the report and the plots: the default set's, then the others'."""
    out: list[str] = []
    for s in ROW_SETS.values():
        for r in s.make():
            if r.series not in out:
                out.append(r.series)
    return out


def _ordered(rows: list[Row]) -> list[Row]:
    """The rows once each (a row may be in several sets), series by series, T ascending."""
    order = {f: i for i, f in enumerate(series_order())}
    unique = {r.id: r for r in rows}
    return sorted(unique.values(), key=lambda r: (order[r.series], r.tokens))


def default_rows() -> list[Row]:
    """The 105 rows timed by default: the 78 shapes, the small-T and the gated rows,
    series by series, T ascending."""
    return ROW_SETS["default"].rows()


def all_rows() -> list[Row]:
    """Every row of every set once, in the report's order (for looking rows up by id)."""
    return _ordered([r for s in ROW_SETS.values() for r in s.make()])


def parse_sets(text: str) -> list[str]:
    """Set names from a comma-separated list ('default,beyond', 'all'); ValueError for unknown names."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if ALL_SETS in names:
        return list(ROW_SETS)
    bad = [n for n in names if n not in ROW_SETS]
    if not names or bad:
        raise ValueError(f"--set must be a comma-separated list of {', '.join(ROW_SETS)} or {ALL_SETS}, "
                         f"got {text!r}")
    return list(dict.fromkeys(names))


def set_rows(names: list[str], quick: bool = False) -> list[Row]:
    """The rows of the named sets (their --quick subsets with quick) once each, in the report's order."""
    rows = [r for n in names for r in (ROW_SETS[n].quick() if quick else ROW_SETS[n].rows())]
    return _ordered(rows)


def quick_rows() -> list[Row]:
    return ROW_SETS["default"].quick()


def select_rows(rows: list[Row], patterns: list[str] | None) -> list[Row]:
    """Rows selected by any of the patterns, in their original order.

    A pattern that is a substring of some row id selects the rows containing
    it (so '[T,24,256]' or 'res w32' can be given literally); any other
    pattern is a regular expression searched in the ids ('^H4096 T(1|4)$')."""
    if not patterns:
        return list(rows)
    keep: set[str] = set()
    for p in patterns:
        hits = [r.id for r in rows if p in r.id]
        if not hits:
            try:
                rx = re.compile(p)
            except re.error:
                continue
            hits = [r.id for r in rows if rx.search(r.id)]
        keep.update(hits)
    return [r for r in rows if r.id in keep]


def op_bytes(row: Row, op: str) -> int:
    """Bytes an op must move between DRAM and the SMs, at least.

    fwd:  x read, y written (+ residual read, h written; + gate read), weight read, rstd written.
    bwd:  h read, dy read, dx written (+ dh read; + gate read, its gradient written), weight
          read, rstd read, dw written.
    step: 2 x fwd + bwd.
    x, y, dy and the gate are BF16 (2 B); the residual stream r, h, dh and dx is too, or
    float32 (4 B) on "res r32" rows, where the explicit backward writes dx (the stream's
    gradient, x's too) once, in float32. A weight offset moves no more bytes.
    The block rows have no such count (ValueError).
    """
    if not row.has_floor:
        raise ValueError(f"row {row.id!r} has no copy floor: the block's ops are mostly matrix products")
    n = row.rows * row.hidden
    weight = row.hidden * row.weight_bytes
    rstd = row.rows * RSTD_BYTES
    act, stream = ACT_BYTES, row.stream_bytes
    if op == "fwd":
        per_elem = 2 * act + (2 * stream if row.residual else 0) + act * row.gated     # x, y; r, h; z
        return n * per_elem + weight + rstd
    if op == "bwd":
        per_elem = act + 2 * stream + (stream if row.residual else 0) + 2 * act * row.gated  # dy; h, dx; dh; z, dz
        return n * per_elem + weight + rstd + row.hidden * DW_BYTES
    if op == "step":
        return 2 * op_bytes(row, "fwd") + op_bytes(row, "bwd")
    raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")


def floor_us(row: Row, op: str, copy_bytes_per_s: float) -> float:
    """The copy-bandwidth floor of an op, in microseconds."""
    return op_bytes(row, op) / copy_bytes_per_s * 1e6


def describe(rows: list[Row]) -> str:
    """The header's count of rows: "N (S seed, K small-T)", then the other sets' counts where present."""
    text = f"{len(rows)} ({sum(r.seed for r in rows)} seed, {sum(r.small_t for r in rows)} small-T"
    for label, n in (("beyond the table", sum(r.beyond for r in rows)), ("block", sum(r.block for r in rows)),
                     ("training stack", sum(r.group == "stack" for r in rows))):
        if n:
            text += f", {n} {label}"
    return text + ")"
