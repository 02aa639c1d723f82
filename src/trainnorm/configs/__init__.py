"""Kernel configurations as data: what changes bits, apart from what only changes time.

A config is three frozen parts:

- the *tile* (`FwdTile`, `BwdTile`): rows and columns per tile, warps, the
  backward's chunking and dw layout. It fixes the order of every reduction,
  so it changes bits: a change of tile is a numerics change, re-verified with
  `trainnorm verify` and the GPU suite;
- the *windows* (`BwdWindows`): the row counts between the backward's forms
  (one chunk; dw by column slices; the atomic form of deterministic=False).
  Which form runs changes dw's bits as a function of the row count only;
- the *schedule* (`FwdSchedule`, `BwdSchedule`): programs per SM, load forms
  (prefetch, tensor descriptors and their stages). Timing only: the same
  operations in the same order, never a different bit.

Lookup is by `Key` (architecture, H, activation element size, variant kind).
Measured entries live in one JSON table per architecture (`sm_90.json`,
written by `trainnorm.dev.tune` through `table.save`), each with the
measurements that chose it; every width the tables do not hold gets the
analytical default below, whose rules carry their measurements too. An
architecture without a table of its own uses sm_90's (the one measured), as do
CPU tensors under Triton's interpreter, so the CPU tests run the H200's plans.

Invariants the numerics rely on (tests check them):
- the forward and backward tiles are a function of the key only, never of
  the number of rows, the residual, the mode or the device: a row's
  reductions (sum of squares, c) keep one order, so y, rstd, h and dx are
  batch-invariant and identical across modes. The one exception is the
  forward's rows per tile (FwdSchedule.rows_block_m), which may follow the
  row count because it keeps the tile's columns and warps, and with them the
  order of a row's sum (`compile_check --rows`, the GPU suite);
- the backward's row chunking is a function of (rows, key) only, never of
  the SM count: dw's reduction tree is the same on every GPU of an
  architecture.

Tools and tests replace configs with `override(...)`, never by patching this
module.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Callable, NamedTuple, Union

MAX_HIDDEN = 65536
DEFAULT_ARCH = "sm_90"      # the architecture whose table serves those without one


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Key(NamedTuple):
    arch: str           # "sm_90": the table's architecture
    hidden: int
    elt: int            # activation element size in bytes (bf16 and fp16 share entries)
    kind: str           # forward: "plain" | "weight_fp32" | "gated"; backward: "plain" | "gated"


# --- the parts ---------------------------------------------------------------------------

class _Parts:
    """Flat access to a config's parts: cfg.block_m, cfg.replace(block_m=2, tma_stages=3)."""

    def __post_init__(self):
        # the parts' fields as plain attributes of the config: read on every launch, so
        # looked up like any attribute (a __getattr__ walk cost ~50 us per forward + backward)
        for part in self._parts():
            for f in fields(part):
                object.__setattr__(self, f.name, getattr(part, f.name))

    def replace(self, **flat):
        """A copy with the named fields of any part changed."""
        parts = {}
        left = dict(flat)
        for f in fields(self):
            part = getattr(self, f.name)
            mine = {k: left.pop(k) for k in list(left) if k in part.__dataclass_fields__}
            parts[f.name] = replace(part, **mine) if mine else part
        if left:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(left)}")
        return type(self)(**parts)

    @classmethod
    def from_fields(cls, **flat):
        """A config from the flat fields of its parts (those not given take their defaults)."""
        parts = {}
        for f in fields(cls):
            part_cls = f.type if isinstance(f.type, type) else _PART_TYPES[f.type]
            mine = {k: flat.pop(k) for k in list(flat) if k in part_cls.__dataclass_fields__}
            parts[f.name] = part_cls(**mine)
        if flat:
            raise TypeError(f"{cls.__name__} has no fields {sorted(flat)}")
        return cls(**parts)

    def fields(self) -> dict:
        """The flat fields of every part."""
        out = {}
        for part in self._parts():
            out.update({f.name: getattr(part, f.name) for f in fields(part)})
        return out

    def _parts(self):
        return [getattr(self, f.name) for f in fields(self)]


def prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def row_pieces(hidden: int) -> tuple[int, int]:
    """(block_n, block_n2): a row held as two power-of-two pieces with the fewest
    masked columns, 5120 = 4096 + 1024, 6144 = 4096 + 2048, 1000 = 512 + 512;
    (H, 0) for a power of two."""
    first = prev_pow2(hidden)
    return (first, 0) if first == hidden else (first, next_pow2(hidden - first))


def _check_pieces(tile) -> None:
    if tile.block_n2 and (tile.block_n2 & (tile.block_n2 - 1) or tile.block_n2 > tile.block_n):
        raise ValueError(f"block_n2 must be 0 or a power of two no wider than block_n ({tile.block_n}), "
                         f"got {tile.block_n2}")


def _row_windows(part, name: str, what: str, power_of_two: bool) -> None:
    """Check and normalise a field of row-count windows: ((max_rows, value), ...) in rising max_rows."""
    windows = tuple(tuple(int(v) for v in w) for w in getattr(part, name))
    object.__setattr__(part, name, windows)
    if any(len(w) != 2 or w[0] < 1 or w[1] < 1 or (power_of_two and w[1] & (w[1] - 1)) for w in windows) or \
            any(a[0] >= b[0] for a, b in zip(windows, windows[1:])):
        raise ValueError(f"{name} must be (max_rows, {what}) pairs in rising max_rows with {what} "
                         f"{'a power of two' if power_of_two else 'at least 1'}, got {getattr(part, name)}")


def _in_windows(windows: tuple, rows: int, default: int) -> int:
    """The value of the first ((max_rows, value), ...) window holding `rows`, else `default`."""
    return next((v for top, v in windows if rows <= top), default)


def _col_tiles(tile, hidden: int) -> int:
    if tile.block_n2:
        if hidden > tile.block_n + tile.block_n2:
            raise ValueError(f"a two-piece tile of {tile.block_n} + {tile.block_n2} columns cannot hold H {hidden}")
        return 1
    return cdiv(hidden, tile.block_n)


@dataclass(frozen=True)
class FwdTile:
    block_m: int        # rows per tile
    block_n: int        # columns per tile (power of two); narrower than H: rows walked in column tiles
    num_warps: int
    # the row's second piece: block_n2 columns after the first block_n (power of two; 0:
    # none). A row of 5120 is held as 4096 + 1024 columns, none masked, instead of one
    # tile of 8192 (kernels: BLOCK_N2)
    block_n2: int = 0

    def __post_init__(self):
        _check_pieces(self)

    def col_tiles(self, hidden: int) -> int:
        return _col_tiles(self, hidden)


WEIGHT_READS = ("", "rows", "late", "early")


@dataclass(frozen=True)
class FwdSchedule:
    # rows that fit one tile: read x (and r) through tensor descriptors, the
    # tile loop pipelined this many tiles deep, ctas_per_sm programs per SM
    # (persistent); 0: plain loads, one program per tile. Applies where the
    # layout allows it (rows.descriptor_stages)
    tma_stages: int = 0
    ctas_per_sm: int = 2
    # rows per tile by row count: ((max_rows, block_m), ...) in rising max_rows; up to
    # max_rows rows the tile holds block_m rows, past the last window the tile's own.
    # Only the rows change: block_n and num_warps, and with them the split of a row's
    # columns over a thread's values, the lanes and the warps that fixes the order of its
    # sum, stay the tile's, so y and rstd are the same bits at every row count
    # (trainnorm.dev.compile_check --rows compares the forms' row-sum trees; the GPU
    # suite their bits). Timing only: fewer rows a program where there are few rows.
    rows_block_m: tuple = ()
    # rows walked in column tiles (up to plan.FWD_COL_UNROLL_MAX of them): hold every tile
    # of a row in registers between the two walks rather than read x (and r) again from
    # L1 / L2 (the same additions in the same order: timing only)
    hold_tiles: bool = False
    # when a program with plain loads reads the weight (kernels/forward.py, WEIGHT):
    # "rows" beside the first row tile's loads (both in flight together; a row walked in
    # column tiles then walks statically, holding the weight), "late" after the row's sum
    # of squares (no registers held for it while the rows are in flight), "early" ahead of
    # the rows' loads, as stored (one-tile form: one tile a program, no loop). "": plan.py's
    # rule. Descriptor loads always read it once per program, in float32.
    # Timing only: the same products in the same order.
    weight_read: str = ""
    # the same for the gated forward's one-tile form ("": plan.weight_read's gated rule, beside
    # the rows or after the sum of squares). Its own field: the gated forward takes the plain
    # entries' tiles, whose weight_read was timed without z and a(z) beside the weight. Timing only.
    gate_weight_read: str = ""
    # with a residual stream (x and r read, h written beside y): plain loads, one program a
    # row tile, where tma_stages would read the rows through descriptors. A row then moves
    # twice the bytes, and the probes of H 6144's float32-weight entry had plain loads ahead
    # with a residual and behind without one (dispatch.forward). Timing only: the same
    # products in the same order.
    residual_plain: bool = False
    # (block_m, num_warps): from plan.RESIDUAL_HOLD_MIN_ROWS rows on, with and without a
    # residual, a walked row's tiles held between its walks at this many rows over this many
    # warps (plan.RESIDUAL_HOLD); (): held with a residual only, at the tile's. block_n is the
    # tile's and so are the warps a row (FwdConfig checks), so a row's columns split over values,
    # lanes and warps as in the tile and y with a residual keeps y of h's bits (compile_check
    # --rows compares the compiled sums, the GPU suite the bits). Timing only.
    held_tile: tuple = ()
    # when the held tile's programs read the weight (as weight_read; "": weight_read's). Timing only
    held_weight_read: str = ""

    def __post_init__(self):
        held = tuple(int(v) for v in self.held_tile)
        object.__setattr__(self, "held_tile", held)
        if held and (len(held) != 2 or any(v < 1 or v & (v - 1) for v in held)):
            raise ValueError(f"held_tile must be () or (block_m, num_warps), powers of two, got {self.held_tile}")
        for name in ("weight_read", "gate_weight_read", "held_weight_read"):
            if getattr(self, name) not in WEIGHT_READS:
                raise ValueError(f"{name} must be one of {WEIGHT_READS}, got {getattr(self, name)!r}")
        _row_windows(self, "rows_block_m", "block_m", power_of_two=True)


@dataclass(frozen=True)
class FwdConfig(_Parts):
    tile: FwdTile
    schedule: FwdSchedule = FwdSchedule()

    def __post_init__(self):
        super().__post_init__()
        if self.tile.block_n2 and self.schedule.tma_stages:
            raise ValueError("a two-piece tile (block_n2) reads its rows with plain loads: no tensor descriptors")
        if self.schedule.held_tile:
            bm, nw = self.schedule.held_tile
            if nw * self.tile.block_m != self.tile.num_warps * bm:
                raise ValueError(f"held_tile {self.schedule.held_tile} must keep the tile's warps a row "
                                 f"({self.tile.num_warps} over {self.tile.block_m} rows)")

    def col_tiles(self, hidden: int) -> int:
        return self.tile.col_tiles(hidden)

    def tile_rows(self, rows: int) -> int:
        """Rows per tile for a launch over `rows` rows (FwdSchedule.rows_block_m)."""
        return _in_windows(self.schedule.rows_block_m, rows, self.tile.block_m)


@dataclass(frozen=True)
class BwdTile:
    block_m: int              # rows per tile
    block_n: int              # columns per tile (power of two); narrower than H: rows walked in column tiles
    num_warps: int
    min_rows_per_chunk: int   # a dw chunk covers at least this many rows
    max_chunks: int           # and there are at most this many chunks
    # keep a float64 dw sum per tile position, added across the tile's rows once
    # per chunk (kernels/backward.py, DW_2D): changes dw's addition order
    dw_2d: bool = False
    # the column-slice dw form's tile: slice_block_m rows at a time over
    # slices of slice_block_n columns (kernels/backward.py, bwd_col_slices_kernel)
    slice_block_m: int = 16
    slice_block_n: int = 128
    # the row's second piece, as FwdTile.block_n2 (not with dw_2d)
    block_n2: int = 0
    # at most this many chunks by row count: ((max_rows, max_chunks), ...) in rising
    # max_rows; up to max_rows rows at most that many chunks, past the last window
    # max_chunks. Fewer chunks where rows are few: each chunk's float64 partial of dw is
    # H x 8 bytes written and read again by the combine, against 3 x H x 2 bytes a row for
    # the rows themselves. Like the chunking itself, a function of the row count only: dw's
    # reduction tree stays independent of the SM count
    rows_max_chunks: tuple = ()
    # rows walked in column tiles (block_n narrower than H): the second walk unrolled over
    # the row's tiles, and the chunk's float64 dw partial held in registers across the
    # chunk's rows and stored once, where it is otherwise added in place in the workspace
    # after every row tile (a load and a store of H x 8 bytes, and a barrier). The same
    # additions in the same order: timing only. The column-slice form unrolls its rows'
    # second walk alike (a row's dx compiles to the same instructions at every T). No entry
    # takes it: at H 5120 on an H100 (trainnorm.dev.tune --probe-bwd-tiles at dea9d71,
    # docs/benchmarks/tune/h100-bwd-walk.txt) the fastest walk, 2048-column tiles of one row
    # over 8 warps held, ran 0.665x / 0.713x the entry's one tile at T 16384 / 65536 (0.509x /
    # 0.521x not held), 0.747x at T 4096; at H 6144 0.808x, H 5376 0.718x, H 2560 0.761x at
    # T 65536; level at one row (1.006x)
    hold_dw: bool = False
    # rows dealt to the chunks a row tile at a time (tile t to chunk t mod num_chunks;
    # kernels/backward.py, DEAL_ROWS) where they are otherwise cut into runs of
    # rows_per_chunk: the same chunk count and row tiles, so at any moment the programs
    # read neighbouring rows instead of one run each, rows_per_chunk x H x 2 bytes apart
    # (1.3-6.1 MB at H 5120-6144, T 16384-65536). Another order of dw's additions, a
    # function of the rows and the config only, as before; dx does not move. No entry takes
    # it: it is a candidate of `trainnorm.dev.tune --probe-placement` and --probe-bwd-tiles.
    # Where the chunks read contiguous runs, the time of one launch followed its data's
    # addresses: H 5120 T 16384 on an H100 at dea9d71 ran 188.7-189.3 us on one copy of its
    # data and 197.0-201.0 on three others (docs/benchmarks/tune/h100-placement.txt)
    deal_rows: bool = False

    def __post_init__(self):
        _check_pieces(self)
        if self.block_n2 and self.dw_2d:
            raise ValueError("a two-piece tile (block_n2) keeps no dw_2d sums")
        _row_windows(self, "rows_max_chunks", "max_chunks", power_of_two=False)

    def chunks_at_most(self, rows: int) -> int:
        """The most chunks a launch over `rows` rows takes (rows_max_chunks, else max_chunks)."""
        return _in_windows(self.rows_max_chunks, rows, self.max_chunks)

    def col_tiles(self, hidden: int) -> int:
        return _col_tiles(self, hidden)


@dataclass(frozen=True)
class BwdWindows:
    # up to this many rows, all rows form one chunk: one program, dw stored
    # directly (one launch and no workspace, in both modes)
    direct_max_rows: int = 0
    # rows past the one-chunk window up to this many: dw by column slices (one
    # launch and no workspace, in both modes)
    slices_max_rows: int = 0
    # deterministic=False takes the one-launch atomic form from this many rows
    # on (where it was measured faster); below, the deterministic form
    atomic_min_rows: int = 0


@dataclass(frozen=True)
class BwdSchedule:
    ctas_per_sm: int = 2      # persistent grid: programs per SM
    # issue the next row tile's loads before computing the current one (rows that fit one tile)
    prefetch: bool = False
    # read h and dy through tensor descriptors (bulk copies into shared memory),
    # the row loop pipelined this many tiles deep; 0: plain loads. Applies where
    # the layout allows it (rows.descriptor_stages)
    tma_stages: int = 0
    # the one-chunk form's own loads; None: the fields above
    direct_prefetch: bool | None = None
    direct_tma_stages: int | None = None
    # plain loads (no tensor descriptors): the row loop software-pipelined this
    # many stages by the compiler (num_stages); 0: not pipelined
    loop_stages: int = 0
    # the column-slice form: programs that take rows and programs that take dw's
    # column slices, rather than every program both in turn (the launch's critical
    # path the longer of the two roles, not their sum)
    split_roles: bool = False
    # the column-slice form: a slice's walk over the rows (slice_block_m at a time)
    # software-pipelined this many steps by the compiler; 0: not (each step's loads
    # then wait for the step before)
    slice_stages: int = 0

    def loads(self, one_chunk: bool) -> tuple[bool, int]:
        """(prefetch, tma_stages) requested for a launch of one chunk or of several."""
        if one_chunk:
            return (self.prefetch if self.direct_prefetch is None else self.direct_prefetch,
                    self.tma_stages if self.direct_tma_stages is None else self.direct_tma_stages)
        return self.prefetch, self.tma_stages


@dataclass(frozen=True)
class BwdConfig(_Parts):
    tile: BwdTile
    windows: BwdWindows = BwdWindows()
    schedule: BwdSchedule = BwdSchedule()

    def __post_init__(self):
        super().__post_init__()
        s = self.schedule
        if self.tile.block_n2 and (s.prefetch or s.tma_stages or s.direct_prefetch or s.direct_tma_stages):
            raise ValueError("a two-piece tile (block_n2) reads its rows with plain loads: no prefetch or "
                             "tensor descriptors (loop_stages pipelines them)")

    def col_tiles(self, hidden: int) -> int:
        return self.tile.col_tiles(hidden)


_PART_TYPES = {"FwdTile": FwdTile, "FwdSchedule": FwdSchedule, "BwdTile": BwdTile, "BwdWindows": BwdWindows,
               "BwdSchedule": BwdSchedule}


@dataclass(frozen=True)
class CombineConfig:
    """Tile of the fixed-order dw combine: a function of H only, so the order
    in which the chunks' partials are added never moves."""
    block_p: int       # chunks added per step
    block_n: int       # columns per program
    num_warps: int = 4


@lru_cache(maxsize=None)
def combine_config(hidden: int) -> CombineConfig:
    # Enough programs to spread the partials' read over the GPU (about 2 per
    # SM of an H200 at H 4096-6144: one program per 128 columns left 32-48
    # programs reading 8 MB of partials), and 4096 float64 per step.
    block_n = min(128, max(16, next_pow2(cdiv(hidden, 256))))
    return CombineConfig(block_p=max(32, min(256, 4096 // block_n)), block_n=block_n)


# --- analytical defaults: any width ----------------------------------------------------------

# Widest row held in registers as one tile; wider rows are walked in tiles.
FWD_MAX_TILE = 16384
BWD_MAX_TILE = 8192


def default_forward(hidden: int, elt: int) -> FwdConfig:
    block_n = next_pow2(hidden)
    if block_n > FWD_MAX_TILE:
        return FwdConfig(FwdTile(1, 8192, 16))       # walked in column tiles (unmeasured)
    # Tiles of 4096 elements. 16-bit activations take up to 64 rows a tile, float32 up to
    # 16: at 16 rows of 64 columns the forward ran 1.11x behind 64 rows on an H100, bf16
    # (us, bm16 w4 vs bm64 w4: 98,304 rows 15.3 vs 14.1, 393,216 rows 43.9 vs 39.4,
    # 1,572,864 rows 156.1 vs 140.5: [T,24,64] at T 4096-65536); at 128 columns 16 and 32
    # rows tied (131,072 rows 28.2 vs 28.1; docs/benchmarks/tune/h100-narrow.txt). Rows of
    # 32 columns or fewer: unmeasured.
    block_m = max(1, min(64 if elt < 4 else 16, 4096 // block_n))
    # 16-bit activations: 32 elements a thread (fewer in tiles under 4096 elements, at the
    # 4-warp minimum). At 16 a thread the forward ran behind 32 a thread at every unseen
    # width probed on an H100, bf16, T 16384 (us, 16 vs 32 a thread): H768 26.5 vs 22.9,
    # H1024 30.0 vs 28.2, H2560 69.6 vs 61.8, H5376 153.2 vs 121.7; H1024 T65536 99.6 vs
    # 94.9 (docs/benchmarks/tune/h100-unseen.txt). Float32 activations keep 16 a thread
    # (not measured against it).
    per_thread = 32 if elt < 4 else 16
    num_warps = min(16, max(4, block_m * block_n // (32 * per_thread)))
    return FwdConfig(FwdTile(block_m, block_n, num_warps))


def default_backward(hidden: int, elt: int) -> BwdConfig:
    """The backward of a width the table does not hold.

    Measured on an H100 at unseen widths, T 16384 (docs/benchmarks/tune/h100-unseen.txt;
    us, the earlier rule -> this one): H768 171.5 -> 43.3, H1024 170.4 -> 48.5 (65536:
    648.9 -> 155.6), H2560 188.4 -> 118.4, H3584 206.3 -> 137.7, H5376 266.4 -> 206.5,
    [T,8,128] as 131072 rows of 128 136.0 -> 50.1. The earlier rule gave each thread 8
    elements of a tile of 2048 with plain loads: up to 4x behind torch.compile. Now:
    - 16 elements a thread, with the rows of a tile fed by tensor descriptors (plain loads
      where the rows do not allow descriptors), as every measured entry, 4 deep: against
      3 deep on an H100 at T 4096-65536 (docs/benchmarks/tune/h100-defaults.txt; us, 3 -> 4
      deep) H768 T4096 17.4 -> 17.0, H896 18.8 -> 17.9, H1024 19.5 -> 19.3, H1024 T65536
      155.2 -> 151.7, H2304 T16384 104.5 -> 96.6, H2560 115.6 -> 112.4, H5376 207.0 -> 203.1,
      [T,24,64] T4096 24.6 -> 24.7, H3584 137.5 -> 139.2, H7168 259.5 -> 262.5;
    - rows of 2048-4096 columns two at a time (bm1 w8: 139.2 us at H2560, bm2 w16 118.4;
      2048 unmeasured);
    - tiles of 512 columns or fewer sum dw over the tile's rows in float64 per element
      (dw_2d, 8 elements a thread: H128 50.1 us against 88.0 without it);
    - rows of 8192 columns 4 programs per SM over at most 132 chunks (H5376 206.5 us
      against 217.7 at 2 per SM over 256);
    - rows of 4096 columns at most 132 chunks up to 16384 rows, 256 past them
      (rows_max_chunks). Each chunk's float64 partial is H x 8 bytes written and read
      back, against 6 x H bytes a row for the rows themselves: 256 partials cost about
      4096 / (6 T) of the rows' traffic, 17% at T 4096. On an H100 (docs/benchmarks/tune/
      h100-defaults-99e8565.txt; us, 256 -> 132 chunks at 4 programs per SM): T 4096 H2304
      36.19 -> 32.18, H2560 38.30 -> 34.53, H3584 47.52 -> 42.90, H3840 50.29 -> 45.55;
      T 16384 H2304 96.50 -> 92.14, H2560 110.67 -> 104.58, H3584 140.00 -> 136.40; at
      T 65536 132 one-program-per-SM chunks ran behind (H2304 329.52 -> 344.85), as they
      did with tiles of 1024 columns (H1024 T16384 46.61 -> 53.97) and 2048 (H1280
      T4096 22.91 -> 23.31; H1792 26.90 -> 26.80), which keep 256;
    - rows of 128 columns or fewer in tiles of 4096 elements (up to 64 rows) at 4 warps
      (docs/benchmarks/tune/h100-narrow.txt, us, the 16-row tile -> this one: 64 columns
      over 393,216 rows 78.6 -> 65.6 and over 1,572,864 rows 272.3 -> 226.4, [T,24,64]
      at T 16384 and 65536; 128 columns over 131,072 rows 50.6 -> 48.3, [T,8,128] at
      T 16384; 8 warps 65.7, 226.1 and 49.4). 32 columns or fewer: unmeasured.
    Rows wider than BWD_MAX_TILE are walked in column tiles of 4096 as before. Float32
    activations keep the earlier rule: the new one was measured at bf16 only, and with
    float32 rows its descriptor loads spill at H 4096-6144 (compile-check, Triton 3.6,
    sm_90: 4-20 bytes a thread without a gate, 88-308 with one)."""
    block_n = next_pow2(hidden)
    # the atomic form only on large problems (2**27 elements), where every measured
    # width had it at least as fast (sm_90.json)
    windows = BwdWindows(atomic_min_rows=cdiv(1 << 27, hidden))
    if block_n > BWD_MAX_TILE:
        return BwdConfig(BwdTile(1, 4096, 16, min_rows_per_chunk=16, max_chunks=256), windows)
    block_m = max(1, min(16, 2048 // block_n))          # tiles of 2048 elements
    if elt >= 4:
        return BwdConfig(BwdTile(block_m, block_n, min(16, max(4, block_m * block_n // 256)),
                                 min_rows_per_chunk=max(16, block_m), max_chunks=256), windows)
    dw_2d = block_n <= 512
    if block_n <= 128:
        # narrow rows (head dims): tiles of 4096 elements, up to 64 rows, at 4 warps (a float32
        # residual stream under this 16-bit key spills 8 bytes a thread at 128 columns:
        # compile-check, Triton 3.6; 8 warps ran 2% behind with bf16, 49.4 against 48.3 us)
        block_m, num_warps = min(64, 4096 // block_n), 4
    else:
        block_m = {2048: 2, 4096: 2, 8192: 1}.get(block_n, block_m)
        num_warps = min(16, max(4, block_m * block_n // (256 if dw_2d else 512)))
    wide = block_n >= 8192
    few_chunks = ((16384, 132),) if block_n == 4096 else ()
    return BwdConfig(BwdTile(block_m, block_n, num_warps, min_rows_per_chunk=block_m if wide else max(16, block_m),
                             max_chunks=132 if wide else 256, dw_2d=dw_2d, rows_max_chunks=few_chunks),
                     windows, BwdSchedule(ctas_per_sm=4 if wide else 2, tma_stages=4))


# the most elements of its row a thread of a gated one-row forward tile holds without twice the
# plain tile's warps (gated_forward_from_plain)
GATED_ONE_ROW_ELEMS = 32


def gated_forward_from_plain(cfg: FwdConfig) -> FwdConfig:
    """The gated forward (16-bit weight) of a width the table holds no gated forward entry
    for: the plain tile with half the rows (twice the warps where it has one row), so each
    thread holds half as many elements beside z and a(z). A float32 weight keeps the
    weight_fp32 lookup, gate or not (forward_key): not measured with a gate.

    Measured on an H100, bf16 (docs/benchmarks/tune/h100-narrow.txt; us, the plain tile ->
    this one, and the best of 18-29 tiles): H4096 bm2 w8 -> bm1 w8 at T 4096, 16384,
    65536: 53.6 -> 43.2, 180.4 -> 141.3, 676.3 -> 532.9 (best 42.5, 141.3, 532.9); 128
    columns ([T,32,128] at T 4096 and 16384) bm32 w4 -> bm16 w4: 50.0 -> 41.4, 172.3 ->
    139.9 (the best of 29). The plain tile had run 0.81-0.86x torch.compile of the gated
    reference at H4096 (`trainnorm bench`, H100).

    A one-row tile keeps its warps where each thread holds at most GATED_ONE_ROW_ELEMS of
    the row (no spill: 80 registers at 4096 columns and 4 warps, compile_check, Triton
    3.6): on an H100 (docs/benchmarks/tune/h100-defaults-cb872d0.txt; us, twice the warps
    -> the plain tile) H2304 T4096 30.88 -> 29.68, T16384 95.90 -> 91.09; H3584 T4096
    37.66 -> 36.99, T65536 472.58 -> 461.33. Measured there (4096 columns, 4 warps, 32
    elements a thread); the other tiles it keeps (H2048's 2048 columns at 4 warps, 16
    elements; the 8192-column default at 8 warps, 32) take 52 and 69 registers and are
    unmeasured. More than that (H6144's 8192 columns at 4 warps, 64: 141 registers) still
    takes twice the warps."""
    t = cfg.tile
    # the plain entry's rows per tile by row count were measured without a gate: none carry over
    cfg = cfg.replace(rows_block_m=())
    if t.block_m >= 2:
        return cfg.replace(block_m=t.block_m // 2)
    if t.block_n // (32 * t.num_warps) <= GATED_ONE_ROW_ELEMS:
        return cfg
    return cfg.replace(num_warps=min(16, 2 * t.num_warps))


def gated_from_plain(cfg: BwdConfig) -> BwdConfig:
    """The gated backward of a width the table measured only without a gate.

    The gated backward also holds z, a(z) and dz per element: with the plain
    tiles ptxas (CUDA 13.4, via Triton 3.9) spills up to ~8 KB per thread (H512
    bm16 w4; `trainnorm.dev.compile_check`). The gated tile halves each thread's
    share: half the rows where the plain tile has two or more, else (one row) twice
    the warps, up to 16. Halving the rows keeps the warps, so the programs per SM the
    plain entry was measured with still fit; twice the warps at 4 programs per SM
    (H2048's bm4 w8 entry) asked for 64 warps an SM. On the H200 (trainnorm.dev.tune
    --probe-defaults --gated, docs/benchmarks/tune/h200-probes-8e91def.txt; us, H2048
    over 16384 rows): bm4 w16 (twice the warps, the rule before) 316.58, the plain
    bm4 w8 142.21, bm2 w8 (half the rows) 109.82. The rule before had already taken
    half the rows for a plain tile of 16 warps (the default's two rows of 2049-4096
    columns): its gated tile at 16 warps spilled 120-172 bytes a thread (compile_check,
    Triton 3.6, H 2304 and 3584), one row at 16 warps none (127 registers); on an H100
    (docs/benchmarks/tune/h100-defaults-cb872d0.txt; us, two rows -> one row, both at 16
    warps): H2304 T4096 74.94 -> 54.75, T16384 254.67 -> 183.04; H3584 T4096 91.68 ->
    65.41, T65536 1202.90 -> 839.33 (one row at 8 warps: 54.34, 180.69, 65.18, 848.06;
    on the H200 53.97 against 54.40 at H2304 T4096, 718.85 against 748.18 at H3584
    T65536: timing only, kept). On the H200 this file's first rule (twice the warps
    everywhere) left H 128 (the default 16 x 128 tile at 16 warps) at 17-18% of the copy
    floor and H 4096 at 35-61% (docs/benchmarks/h200.md): `trainnorm.dev.tune --sweep-bwd
    --gated` measures entries instead. The small-T windows were measured without a gate
    and do not carry over."""
    t = cfg.tile
    share = dict(block_m=t.block_m // 2) if t.block_m >= 2 else \
        dict(num_warps=2 * t.num_warps) if t.num_warps < 16 else {}
    return BwdConfig(replace(t, slice_block_m=16, slice_block_n=128, **share),
                     BwdWindows(atomic_min_rows=cfg.windows.atomic_min_rows),
                     replace(cfg.schedule, direct_prefetch=None, direct_tma_stages=None))


# --- lookup ------------------------------------------------------------------------------------

Override = Union[FwdConfig, BwdConfig, Callable[[Key, object], object]]
_overrides: list[tuple[str, Override]] = []


@contextlib.contextmanager
def override(*, forward: Override | None = None, backward: Override | None = None):
    """Within the block, forward / backward lookups return `forward` / `backward`:
    a config (for every key), or a function (key, config) -> config that sees
    what the lookup would have returned (None: keep it). Nested blocks apply
    innermost last. For tools and tests; not thread-safe."""
    added = [(op, o) for op, o in (("forward", forward), ("backward", backward)) if o is not None]
    _overrides.extend(added)
    try:
        yield
    finally:
        for item in added:
            _overrides.remove(item)


def overridden() -> bool:
    """Whether an override(...) block is active (plans are not cached then)."""
    return bool(_overrides)


def _apply(op: str, key: Key, cfg):
    for o_op, o in _overrides:
        if o_op == op:
            new = o(key, cfg) if callable(o) else o
            cfg = cfg if new is None else new
    return cfg


def table_arch(arch: str | None) -> str:
    from . import table
    return arch if arch in table.archs() else DEFAULT_ARCH


def forward_key(hidden: int, elt: int, weight_elt: int | None = None, arch: str | None = None,
                gated: bool = False) -> Key:
    # a float32 weight keeps its own entries with a gate too: the gated rule below was
    # measured with 16-bit weights only
    kind = "weight_fp32" if weight_elt == 4 and elt < 4 else "gated" if gated else "plain"
    return Key(table_arch(arch), hidden, elt, kind)


def backward_key(hidden: int, elt: int, gated: bool = False, arch: str | None = None) -> Key:
    return Key(table_arch(arch), hidden, elt, "gated" if gated else "plain")


@lru_cache(maxsize=None)
def _forward(key: Key) -> FwdConfig:
    from . import table
    cfg = table.lookup("forward", key)
    if cfg is None:
        # a float32 weight: the plain tile; a gate: the plain tile halved
        plain = table.lookup("forward", key._replace(kind="plain")) or default_forward(key.hidden, key.elt)
        cfg = gated_forward_from_plain(plain) if key.kind == "gated" else plain
    return cfg


@lru_cache(maxsize=None)
def _backward(key: Key) -> BwdConfig:
    from . import table
    cfg = table.lookup("backward", key)
    if cfg is None:
        plain = table.lookup("backward", key._replace(kind="plain")) or default_backward(key.hidden, key.elt)
        cfg = gated_from_plain(plain) if key.kind == "gated" else plain
    return cfg


def forward_config(key: Key) -> FwdConfig:
    """The forward's config for a key: never a function of the rows."""
    cfg = _forward(key)
    return _apply("forward", key, cfg) if _overrides else cfg


def backward_config(key: Key) -> BwdConfig:
    """The backward's config for a key: never a function of the rows."""
    cfg = _backward(key)
    return _apply("backward", key, cfg) if _overrides else cfg


def clear_caches() -> None:
    """Forget looked-up configs (after the tables' files change; plan.clear_caches() also
    forgets the plans made from them)."""
    from . import table
    table.clear()
    _forward.cache_clear()
    _backward.cache_clear()
