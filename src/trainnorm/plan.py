"""Plans: which kernel form runs, with which config, for a shape, a variant and a mode.

A plan is a function of (rows, H, dtypes, variant, mode, architecture) only:
never of the device's SM count, the tensors' addresses or timing. What the
layout of the actual tensors adds (tensor-descriptor loads where the rows
allow them, the grid from the SM count) is decided at launch (dispatch.py)
and changes no bit.

The backward's dw forms, the one named set (kernels/backward.py implements them):

    DwForm.NONE        no dw (no weight, or it needs no gradient)
    DwForm.DIRECT      all rows form one chunk: one program sums them and stores dw
                       (one launch, no workspace, both modes)
    DwForm.ROW         DIRECT over one row: its dw terms are dw, formed in float32
                       where that rounds them as the float64 terms are rounded
                       (16-bit h and dy, no gate): the same bits
    DwForm.COL_SLICES  dx by rows, then dw by column slices over all rows in the same
                       launch (bwd_col_slices_kernel; no workspace, both modes)
    DwForm.PARTIAL     each chunk's float64 partial to a workspace; a second launch
                       (combine.py) sums the chunks in a fixed order
    DwForm.ATOMIC      each program adds its float64 sum atomically into a zeroed
                       accumulator, the last to arrive rounds it into dw
                       (deterministic=False only: the order of additions varies)

and the row-count windows between them (configs.BwdWindows):

    rows <= direct_max_rows (and the row fits one tile)      -> DIRECT (ROW at one row)
    rows <= slices_max_rows                                  -> COL_SLICES
    deterministic=False, rows >= atomic_min_rows, one tile
                         of one piece (configs: block_n2 0)      -> ATOMIC
    otherwise                                                -> PARTIAL

Every form computes dx with the same tile, so dx is the same bits in every
form and both modes; dw's bits are a function of (rows, H, variant, table).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

import torch

from . import configs
from .configs import BwdConfig, FwdConfig, cdiv
from .variant import Variant


class DwForm(str, Enum):
    NONE = "none"
    DIRECT = "direct"
    ROW = "row"
    COL_SLICES = "col_slices"
    PARTIAL = "partial"
    ATOMIC = "atomic"


# --- forward ----------------------------------------------------------------------------

# Where a config names no weight_read (configs.FwdSchedule), the one-tile forward with
# plain loads (one program a row tile, no loop) reads the weight ahead of the rows
# (kernels/forward.py, WEIGHT "early") where that holds at most 16 weight values a thread,
# and beside the rows' loads ("rows") in wider tiles. H100, trainnorm.dev.tune
# --probe-defaults at 99e8565 (docs/benchmarks/tune/h100-defaults-99e8565.txt), us, the
# weight read after the sum of squares ("late", the rule before) -> beside the rows:
# H2304 T4096 18.98 -> 18.67, T16384 56.69 -> 55.68, T65536 205.82 -> 204.29; H2560 T4096
# 20.93 -> 19.66, T16384 62.46 -> 61.95; H3584 T4096 26.18 -> 25.41, T16384 84.69 -> 83.94;
# H3840 T4096 27.63 -> 26.59; H7168 T4096 45.54 -> 45.10 (early 44.62); H5376 T16384 122.51
# -> 122.13. "late" was the rule while the one-tile form ran its tile in the descriptor form's
# loop, where "early" meant a float32 weight converted before the loop and held through it:
# on the H200 (--sweep-fwd) H 2048 bm1 w4 (16 a thread) read so was the best plain tile (T1
# 4.45 us), while H 6144 bm1 w4 (64 a thread: 167 registers instead of 118,
# trainnorm.dev.compile_check) took 535.9 us at T 65536 against 388.5 read late.
# The descriptor form always reads it once per program, in float32: no row tile in registers.
# Not with a gate: z, a(z) and the weight held together took the gated H 4096
# bm2 w8 tile to 174-178 registers (trainnorm.dev.compile_check; 90-94 without the
# gate), one 8-warp program per SM, and `trainnorm bench` to 765 us at T 65536 (50% of
# the floor) where the weight read late had run 391 us (docs/benchmarks/h200.md).
EARLY_WEIGHT_COLS_PER_WARP = 512
# The weight beside the rows was measured in tiles up to 8192 columns (above). A tile of
# 16384 (rows past 8192 columns in one tile, 16 warps, at most 128 registers a thread)
# spills 8-16 bytes so under Triton 3.6 (trainnorm.dev.compile_check, H 8200) and was not
# timed: it keeps the read after the sum of squares.
ROWS_WEIGHT_MAX_COLS = 8192
# The gated forward's one-tile form (16-bit activations and weight: the "gated" key, the gate
# after the norm) reads the weight beside the rows' loads where its config names none
# (gate_weight_read), in tiles of up to 4096 columns; wider tiles, a float32 weight and the gate
# before the norm (unmeasured; read so, H 1000's gate-first tile at T 1 spilled 4 bytes under
# Triton 3.6, trainnorm.dev.compile_check) read it after the sum of squares. H100,
# trainnorm.dev.tune --probe-defaults --gated and the same configs interleaved again
# (docs/benchmarks/tune/h100-gated-weight.txt), us, after the sum -> beside the rows (ahead of
# them): H4096 bm1 w8 at 1024 rows 15.84 -> 14.37 (15.36), 4096 rows 41.22 -> 40.61 (41.36),
# 16384 rows 138.02 -> 138.11, 65536 rows 523.89 -> 525.28; 128 columns bm16 w4 at 32768
# rows 15.12 -> 14.66 (14.59), 131072 rows 39.97 -> 39.82 (39.49), 524288 rows 137.66 ->
# 137.23. The 765 us above was the weight held as float32 through a persistent loop; the
# one-tile form now has no loop, and holds it as stored until the sum is done.
GATED_ROWS_WEIGHT_MAX_COLS = 4096
# Rows walked in up to this many tiles have both walks unrolled (kernels/forward.py,
# COL_UNROLL): the widths trainnorm.dev.tune --sweep-fwd times these two-pass forms at
# (FWD_CHUNK_MAX_TILES). Wider rows keep rolled loops, an unmeasured choice.
FWD_COL_UNROLL_MAX = 8


@dataclass(frozen=True)
class ForwardPlan:
    cfg: FwdConfig
    col_tiles: int           # 1: fwd_one_tile_kernel; more: fwd_col_tiles_kernel
    weight: str              # when programs with plain loads read the weight: "early", "rows" or "late"
    col_unroll: int          # the column-tile form's unroll factor
    # the column-tile form holds a row's tiles between its walks from this many rows on: 0
    # always (FwdSchedule.hold_tiles), RESIDUAL_HOLD_MIN_ROWS with a residual; None never
    held_from: int | None = None
    # (block_m, num_warps) of the held walks from RESIDUAL_HOLD_MIN_ROWS rows (FwdSchedule.held_tile);
    # (): the tile's (hold_tiles holds at the tile's own)
    held_tile: tuple = ()
    held_weight: str = ""    # when the held tile's programs read the weight ("": `weight`)

    @property
    def one_tile(self) -> bool:
        return self.col_tiles == 1

    def holds(self, rows: int) -> bool:
        """Whether the column-tile form holds a row's tiles between its walks over `rows` rows."""
        return self.held_from is not None and rows >= self.held_from

    def tile_at(self, rows: int, loads_16_bytes: bool = True) -> tuple[int, int, str]:
        """(rows a tile, warps, weight read) of a launch over `rows` rows: the tile's, its rows
        by row count (FwdSchedule.rows_block_m), or where held from RESIDUAL_HOLD_MIN_ROWS the
        held tile's (FwdSchedule.held_tile, held_weight_read). The held tile splits a row over
        values, lanes and warps as the tile does where a thread reads 16 bytes of a row
        (compile_check --rows; rows.loads_16_bytes); where it reads fewer, Triton lays the two
        tiles' rows otherwise (a row over all of a tile's warps: compiled for sm_90 at H 1000),
        and the tile's own rows and warps keep the bits. The column layout, so the bits, never
        change with the row count."""
        if self.held_tile and loads_16_bytes and self.holds(rows):
            return self.held_tile[0], self.held_tile[1], self.held_weight or self.weight
        return self.cfg.tile_rows(rows), self.cfg.num_warps, self.weight

    def block_m(self, rows: int) -> int:
        """Rows per tile over `rows` rows of 16-byte loads (tile_at)."""
        return self.tile_at(rows)[0]

    def num_warps(self, rows: int) -> int:
        """Warps a program over `rows` rows of 16-byte loads (tile_at)."""
        return self.tile_at(rows)[1]

    def weight_halves(self, loads_16_bytes: bool, rows: int = 0) -> int:
        """How many of the row's pieces (the column tiles of a walked row count as one) read a
        float32 weight by halves with plain loads (common.weight_tile; the rule is halves_of's).
        Timing only: the same values in the same registers. H100, three probe runs
        (ONE_TILE_NO_DESCRIPTORS), us, bf16 x, read 4 a thread -> by halves: H 2048 T 1 4.83 /
        4.93 / 5.25 -> 4.67 / 4.69 / 4.96, H 4096 T 1 5.15 / 5.22 / 5.25 -> 4.99 / 5.01 / 5.15,
        H 8192 T 1 5.50 / 5.46 / 5.63 -> 5.20 / 5.22 / 5.39, H 6144 T 1 5.34 / 5.30 / 5.31 ->
        5.17 / 5.12 / 5.09, H 2048 T 1024 8.42 / 8.45 / 8.54 -> 7.87 / 7.90 / 8.03, H 4096 T
        4096 28.91 / 29.23 / 29.20 -> 28.21 / 28.58 / 28.46, H 4096 T 16384 95.46 / 95.23 /
        95.30 -> 94.78 / 94.66 / 94.78 (H 3072 T 64 within the spread). Compiled for sm_90
        (Triton 3.6), T 1-64: read 4 a thread the weight went through shared memory, 4-8 KB
        and 2-8 barriers more than a bf16 weight; by halves H 1024-4096 and 8192 take the
        bf16 weight's 16-64 bytes and barriers. H 5120's walked tiles (1024 columns, 8 warps:
        a row split over warps) are left as they are: 4 KB, 17 barriers against 5; their held
        tile (FwdSchedule.held_tile, one row over 4 warps over `rows` from RESIDUAL_HOLD_MIN_ROWS,
        with and without a residual) lays a row along its threads and reads it by halves, as timed."""
        return halves_of(self.cfg.block_n, self.cfg.block_n2 if self.one_tile else 0, self.num_warps(rows),
                         loads_16_bytes)


# With a residual, a row walked in unrolled column tiles may be held between its walks from
# RESIDUAL_HOLD_MIN_ROWS rows on, at the entry's rows a tile: its second walk would read x and r
# again and add them again. Held, the tile and its split of a row over values, lanes and warps
# are the entry's, so y and rstd keep their bits, and rms_norm(x, w, residual=r) stays
# rms_norm(h, w) bit for bit (SPEC). One row a tile would not keep them where the entry has
# more: H 5120's float32-weight tile, two rows of 1024-column tiles over 8 warps, splits a row
# over 4 warps at 8 values, one row over 8 at 4 (trainnorm.dev.compile_check --rows; 9f3b8e5..
# 67030d0 took one row a tile with a residual, and y of that key with a residual then differed
# from y of h). H100 at 1a8cb1f, trainnorm.dev.tune --probe-tiles --hidden 5120 --kinds
# plain,weight_fp32 (every tile and torch.compile of the reference interleaved in one process;
# docs/benchmarks/tune/h100-residual-hold.txt), with a residual, us at T 256 / 1024 / 4096 /
# 16384 / 65536, the entry's walks -> held at its rows: bf16 weight (bm1 w8 n2048, bm2 at 257-1024
# rows) 9.38 -> 9.49 (bm1), 22.69 -> 21.46 (bm2), 65.15 -> 62.08, 240.78 -> 228.24, 917.09 ->
# 888.16 (bm1); float32 weight (bm2 w8 n1024) 10.43 -> 11.23, 23.04 -> 23.15, 70.59 -> 65.82,
# 262.14 -> 235.46, 999.54 -> 905.95: behind at T256, level at T1024, 5-10% ahead from T4096, so
# from 1024 rows (1025-4095 not timed). Without a residual held was 0-11% behind the entries'
# walks at T 256-1024 and within 1.2% past them: the entries keep theirs (FwdSchedule.hold_tiles).
# Not timed with a gate. Rows of at most RESIDUAL_HOLD_MAX_ELEMS columns a thread: the timed
# tiles hold 20 (float32 weight) and 24; the default tile at H 65536 (8 x 8192 columns, 16
# warps) would hold 128, and compiled for sm_90 (Triton 3.6) its held residual forms spill
# 80-304 bytes. On by default: the GPU suite (tests/test_gpu.py::test_residual_equals_the_norm_of_h
# among it) and verify (residual_is_h on every shape) passed with it on and off at c628deb
# (H100; docs/reliability/gpu-runs.md); TRAINNORM_RESIDUAL_HOLD=0 in the environment turns it off.
# An entry with a held tile of its own (FwdSchedule.held_tile: its rows and warps, the tile's
# split of a row) holds from the same row count with and without a residual. H 5120's float32
# weight, bm1 w4 held against the entry's bm2 w8 walks, no residual (H100 at dea9d71; the
# entry's note has the residual rows), us: T 256 6.46 against 6.02, T1024 9.95 / 10.24, T4096
# 30.69 / 33.10, T16384 115.79 / 117.62, T65536 446.85 / 450.18.
RESIDUAL_HOLD = os.environ.get("TRAINNORM_RESIDUAL_HOLD", "1") != "0"
RESIDUAL_HOLD_MIN_ROWS = 1024
RESIDUAL_HOLD_MAX_ELEMS = 32


def _forward_plan(hidden: int, elt: int, weight_elt: int | None, gated: bool, gate_first: bool,
                  arch: str | None, residual: bool = False) -> ForwardPlan:
    key = configs.forward_key(hidden, elt, weight_elt, arch, gated)
    cfg = configs.forward_config(key)
    col_tiles = cfg.col_tiles(hidden)
    unrolled = 1 < col_tiles <= FWD_COL_UNROLL_MAX
    read = weight_read(cfg, col_tiles, gated, gate_after_16bit=key.kind == "gated" and elt < 4 and not gate_first)
    held = (unrolled and (residual or bool(cfg.held_tile)) and not gated and RESIDUAL_HOLD
            and col_tiles * cfg.block_n <= RESIDUAL_HOLD_MAX_ELEMS * 32 * cfg.num_warps)
    always = unrolled and cfg.hold_tiles
    held_from = 0 if always else RESIDUAL_HOLD_MIN_ROWS if held else None
    own = held and not always and bool(cfg.held_tile)
    return ForwardPlan(cfg, col_tiles, read, col_tiles if unrolled else 1, held_from,
                       cfg.held_tile if own else (), cfg.held_weight_read if own else "")


def weight_read(cfg: FwdConfig, col_tiles: int, gated: bool = False, gate_after_16bit: bool = False) -> str:
    """When programs with plain loads read the weight: the config's weight_read where its
    form takes it, else the rules above. With a gate (gated), the config's gate_weight_read
    where it names a one-tile read, else GATED_ROWS_WEIGHT_MAX_COLS's rule, whose read beside
    the rows applies where gate_after_16bit says the key is the measured one: 16-bit gated,
    the gate after the norm. The gated forward takes the plain entries' tiles
    (configs.gated_forward_from_plain, or a float32 weight's own entry), whose weight_read was
    timed without z and a(z) held beside the weight, so it has reads of its own (under Triton
    3.6 the H 2048 float32-weight gated tile read beside the rows spilled 4 bytes,
    compile_check)."""
    if gated:
        if col_tiles > 1:
            return "late"
        if cfg.gate_weight_read:
            return cfg.gate_weight_read
        return "rows" if gate_after_16bit and cfg.block_n + cfg.block_n2 <= GATED_ROWS_WEIGHT_MAX_COLS else "late"
    if col_tiles > 1:
        # the column-tile form holds the weight beside its first walk only where that walk is
        # unrolled (a tile's weight per tile of the row); "early" is the one-tile form's
        return "rows" if cfg.weight_read == "rows" and col_tiles <= FWD_COL_UNROLL_MAX else "late"
    if cfg.weight_read:
        return cfg.weight_read
    if cfg.block_n <= EARLY_WEIGHT_COLS_PER_WARP * cfg.num_warps:
        return "early"
    return "rows" if cfg.block_n <= ROWS_WEIGHT_MAX_COLS else "late"


# Plans are looked up on every call: cached, except inside configs.override(...)
_forward_plan_cached = lru_cache(maxsize=4096)(_forward_plan)


def halves_of(block_n: int, block_n2: int, num_warps: int, loads_16_bytes: bool) -> int:
    """The pieces (of block_n, then block_n2 columns) one row of which lays every thread of a
    num_warps tile along its columns, 8 values a thread, where rows are read 16 bytes a thread:
    those whose float32 weight a form reads as two runs of 4 a thread."""
    if not loads_16_bytes:
        return 0
    return sum(1 for n in (block_n, block_n2) if n and n >= 8 * 32 * num_warps)


def forward_plan(hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype | None, variant: Variant,
                 arch: str | None = None, residual: bool = False) -> ForwardPlan:
    args = (hidden, dtype.itemsize, weight_dtype.itemsize if weight_dtype else None, variant.gated,
            variant.gated and not variant.norm_before_gate, arch, residual)
    return _forward_plan(*args) if configs.overridden() else _forward_plan_cached(*args)


# --- backward ---------------------------------------------------------------------------

# CHUNK_STAGES: a chunk's row loop is software-pipelined on its own (kernels/backward.py: the
# loop over a chunk's row tiles; the next chunk starts a new one), so it never holds more row
# tiles in flight than the chunk has. Deeper descriptor stages then only hold shared memory
# and registers that keep other programs off the SM: the column-slice form at H 6144 with a
# residual, T 256 (chunks of 2 rows), compiled for sm_90 under Triton 3.6, took 157 registers
# and 147,532 bytes of shared memory at the entry's 4 stages (one 8-warp program an SM, as
# Nsight Compute found on an H100: 12% occupancy, 21% of DRAM; docs/benchmarks/tune/
# h100-ncu-misses.md) and 126 and 49,204 at 2 (two programs an SM). The depth stays at least
# 2, which keeps the descriptor loads the config chose (under 2 they turn plain:
# rows.descriptor_depth); the load forms compile to the same arithmetic (compile_check
# --load-forms), so no bit moves. Timed on an H100 (`trainnorm bench`, docs/benchmarks/
# h100-h6144-small): that row's backward ran 1.12x torch.compile (13.06 against 14.62 us),
# 1.10x with a float32 weight, where the 4 stages had run 0.81-0.87x.


# ONE_TILE_NO_DESCRIPTORS: a launch of one row tile (T 1-4 at most entries: one chunk of
# rows_per_chunk <= block_m) reads its rows without tensor descriptors, whatever the
# config's schedule asks of a chunk: there is no next tile to overlap a copy with. A
# prefetching entry keeps its prefetch. H100, three runs of one probe (every variant
# interleaved in one process, as `trainnorm bench` times; docs/benchmarks/tune/
# h100-one-tile-probe.md, where launches that are the same read up to 0.22 us apart), us,
# the untuned widths' descriptor loads (4 stages) -> none: H 1024 T 1 4.83 / 4.90 / 4.98 ->
# 4.54 / 4.67 / 4.74, H 3072 T 1 5.82 / 5.62 / 5.63 -> 5.47 / 5.12 / 4.99, H 8192 T 1 6.78 /
# 6.98 / 6.54 -> 6.43 / 6.62 / 6.11. The prefetching entries' loads made plain were slower
# in both runs that tried it (H 2048 T 2 5.18 / 5.39 against 5.47 / 5.76, H 4096 T 2 6.40 /
# 6.43 against 6.62 / 6.72). The load forms compile to the same arithmetic (compile_check
# --load-forms): no bit moves.


@dataclass(frozen=True)
class BackwardPlan:
    cfg: BwdConfig
    hidden: int
    col_tiles: int
    num_chunks: int
    rows_per_chunk: int
    dw: DwForm
    block_m: int             # rows per tile: the tile's, fewer where one chunk holds fewer rows


    @property
    def workspace_bytes(self) -> int:
        if self.dw is DwForm.PARTIAL:
            return self.num_chunks * self.hidden * 8        # float64 partials
        if self.dw is DwForm.ATOMIC:
            return self.hidden * 8 + 8                      # float64 accumulator + ticket counter
        return 0

    @property
    def dealt(self) -> bool:
        """Rows dealt to the chunks a tile at a time (configs.BwdTile.deal_rows); one chunk
        reads its rows in order either way."""
        return self.cfg.tile.deal_rows and self.num_chunks > 1

    def loads(self) -> tuple[bool, int]:
        """(prefetch, tma_stages) the config asks for at this chunking (rows that fit one tile),
        the stages no more than the row tiles a chunk holds, and at least 2 (CHUNK_STAGES)."""
        if self.col_tiles != 1:
            return False, 0
        prefetch, stages = self.cfg.schedule.loads(self.num_chunks == 1)
        if self.num_chunks == 1 and self.rows_per_chunk <= self.block_m:
            return prefetch, 0      # (one program of one row tile: ONE_TILE_NO_DESCRIPTORS)
        return prefetch, min(stages, max(2, cdiv(self.rows_per_chunk, self.block_m)))

    def weight_halves(self, loads_16_bytes: bool) -> int:
        """How many of the row's pieces a one-chunk form reads a float32 weight of by halves
        (common.weight_tile; the rule is halves_of's). Timing only: the same values in the
        same registers. Compiled for sm_90 (Triton 3.6), bf16 T 1-2, H 768-8192, the weight
        read 4 a thread was moved through shared memory (4-6 more barriers than a bf16
        weight). H100, three probe runs (ONE_TILE_NO_DESCRIPTORS), us, bf16 x T 1, read 4 a
        thread -> by halves: H 2048 5.34 / 5.34 / 5.31 -> 4.96 / 4.90 / 4.83, H 4096 5.81 /
        5.82 / 5.95 -> 5.47 / 5.38 / 5.12, H 6144 6.29 / 6.56 / 6.43 -> 6.32 / 6.37 / 5.89.
        dw itself, float32 in the same registers, is stored plainly (through shared memory):
        stored by halves it was no faster in the two runs that tried it (bf16 weight, T 1,
        plain -> halves: H 2048 4.64 / 4.66 -> 4.86 / 4.93, H 4096 5.15 / 5.12 -> 5.36 / 5.41,
        H 8192 5.97 / 6.08 -> 6.43 / 6.62)."""
        if self.dw not in (DwForm.DIRECT, DwForm.ROW):
            return 0
        return halves_of(self.cfg.block_n, self.cfg.block_n2, self.cfg.num_warps, loads_16_bytes)


def chunking(cfg: BwdConfig, rows: int) -> tuple[int, int]:
    """(num_chunks, rows_per_chunk): a function of rows and the config only."""
    tile = cfg.tile
    if rows == 0:
        return 0, 0
    if rows <= cfg.windows.direct_max_rows:
        return 1, cdiv(rows, tile.block_m) * tile.block_m
    rpc = max(tile.min_rows_per_chunk, cdiv(rows, tile.chunks_at_most(rows)))
    rpc = cdiv(rpc, tile.block_m) * tile.block_m
    return cdiv(rows, rpc), rpc


def one_chunk_block_m(cfg: BwdConfig, rows: int) -> int:
    """Rows a tile for one chunk of `rows` rows that fit one tile: the tile's, or down to
    next_pow2(rows) where fewer rows leave a tile's split of a row over values, lanes and
    warps as it is. Triton lays a [rows, block_n] tile's threads along the columns first, 16
    bytes a thread (8 values of 16 bits, the narrowest stream), so a tile of at least
    num_warps x 256 / block_n rows (block_n2 where the row's second piece is narrower) keeps
    the split: the same sums of a row in the same order, dx's bits (trainnorm.dev.compile_check
    --load-forms compares the planned forms' row sums); dw's sums lose only masked rows, whose
    terms are +0. Fewer rows a tile at T 1-4 cut the instructions of the one launch (sm_90,
    Triton 3.6: H 4096 T 1 424 -> 336, H 2048 280 -> 216). H100, three probe runs
    (ONE_TILE_NO_DESCRIPTORS), us, the entry's tile -> fewer rows: H 2048 T 2 5.79 / 6.10 /
    5.98 -> 5.47 / 5.76 / 5.50, H 2048 T 1 float32 weight 5.06 / 5.09 / 5.06 -> 4.96 / 4.90 /
    4.83; H 1024-4096 T 1 and H 4096 T 2 within the probe's spread."""
    tile = cfg.tile
    keep = max(1, tile.num_warps * 256 // min(tile.block_n, tile.block_n2 or tile.block_n))
    return min(tile.block_m, max(configs.next_pow2(rows), keep))


def backward_key_dtype(x_dtype: torch.dtype, dy_dtype: torch.dtype) -> torch.dtype:
    """The dtype the backward's tiles are keyed on: the narrowest activation stream, x's
    dtype or dy's where that is narrower. A float32 residual stream under 16-bit x reads h
    (and dh) in float32 beside dy in x's 16-bit dtype, through either entry point: the
    explicit backward, which sees only h, would otherwise key it on float32, whose tiles
    (one row, plain loads) ran it at 1.8-5.5x the bf16 residual pair's time, against
    1.6-2.3x on the 16-bit key's tiles with plain loads and 1.4-1.7x with descriptor loads
    (H200, H 1024-8192, T 4096-65536: docs/benchmarks/tune/h200-stream.txt). Both entry
    points then give the same dw bits. Every stream the backward reads is at least this
    wide (rows.descriptor_stages relies on it)."""
    return dy_dtype if dy_dtype.itemsize < x_dtype.itemsize else x_dtype


def backward_plan(rows: int, hidden: int, dtype: torch.dtype, variant: Variant, deterministic: bool,
                  need_dw: bool, arch: str | None = None) -> BackwardPlan:
    """The backward's form: a function of (rows, H, dtype, variant, mode, architecture) only."""
    args = (rows, hidden, dtype.itemsize, variant.gated, deterministic, need_dw, arch)
    return _backward_plan(*args) if configs.overridden() else _backward_plan_cached(*args)


def _backward_plan(rows: int, hidden: int, elt: int, gated: bool, deterministic: bool, need_dw: bool,
                   arch: str | None) -> BackwardPlan:
    cfg = configs.backward_config(configs.backward_key(hidden, elt, gated, arch))
    col_tiles = cfg.col_tiles(hidden)
    num_chunks, rpc = chunking(cfg, rows)
    win = cfg.windows
    if not need_dw or rows == 0:
        dw = DwForm.NONE
    elif col_tiles == 1 and num_chunks == 1:
        dw = DwForm.ROW if rows == 1 else DwForm.DIRECT
    elif rows <= win.slices_max_rows:
        dw = DwForm.COL_SLICES   # small T: dw by column slices in the same launch
    elif col_tiles > 1:
        dw = DwForm.PARTIAL      # wide rows accumulate each chunk's partial in place
    elif cfg.block_n2:
        dw = DwForm.PARTIAL      # the atomic form adds one piece: a two-piece row takes the partials
    elif deterministic or rows < win.atomic_min_rows:
        dw = DwForm.PARTIAL      # deterministic=False too, where the atomic form is not faster
    else:
        dw = DwForm.ATOMIC
    block_m = one_chunk_block_m(cfg, rows) if col_tiles == 1 and num_chunks == 1 else cfg.tile.block_m
    rpc = cdiv(rows, block_m) * block_m if num_chunks == 1 else rpc
    return BackwardPlan(cfg, hidden, col_tiles, num_chunks, rpc, dw, block_m)


_backward_plan_cached = lru_cache(maxsize=4096)(_backward_plan)


def clear_caches() -> None:
    """Forget cached plans and the configs they were made from (after a table file changes)."""
    configs.clear_caches()
    _forward_plan_cached.cache_clear()
    _backward_plan_cached.cache_clear()
