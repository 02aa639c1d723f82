"""Kernel configurations: frozen dataclasses, an analytical default for every H,
and measured overrides (configs/tuned.py) for the shape families that matter.

Invariants the numerics rely on (tests check them):
- the forward and backward tiles are a function of (H, activation dtype) only
  (the forward's also of the weight's dtype),
  never of the number of rows, the residual, the mode or the device: a row's
  reductions (sum of squares, c) keep one order, so y, rstd, h and dx are
  batch-invariant and identical across modes;
- the backward's row chunking is a function of (rows, H, dtype) only, never of
  the SM count: dw's reduction tree is the same on every GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from . import tuned

MAX_HIDDEN = 65536


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FwdConfig:
    block_m: int        # rows per tile
    block_n: int        # columns per tile (power of two)
    num_warps: int
    # rows that fit one tile: read x (and r) through tensor descriptors, the
    # tile loop pipelined this many tiles deep, ctas_per_sm programs per SM
    # (persistent); 0: plain loads, one program per tile. Applies where the
    # layout allows it (dispatch.py); timing only, the bits do not change
    tma_stages: int = 0
    ctas_per_sm: int = 2

    def col_tiles(self, hidden: int) -> int:
        return cdiv(hidden, self.block_n)


@dataclass(frozen=True)
class BwdConfig:
    block_m: int              # rows per tile
    block_n: int              # columns per tile (power of two)
    num_warps: int
    min_rows_per_chunk: int   # a dw chunk covers at least this many rows
    max_chunks: int           # and there are at most this many chunks
    ctas_per_sm: int = 2      # persistent grid: programs per SM (speed only, never numerics)
    # deterministic=False takes the one-launch atomic form from this many rows
    # on (where it was measured faster); below, the deterministic form
    atomic_min_rows: int = 0
    # issue the next row tile's loads before computing the current one (rows
    # that fit one tile): timing only, the same operations in the same order
    prefetch: bool = False
    # read h and dy through tensor descriptors (bulk copies into shared memory),
    # the row loop pipelined this many tiles deep; 0: plain loads. Applies where
    # the layout allows it (dispatch.py); timing only, the bits do not change
    tma_stages: int = 0
    # keep a float64 dw sum per tile position, added across the tile's rows once
    # per chunk (kernels/backward.py, DW_2D): changes dw's addition order
    dw_2d: bool = False
    # up to this many rows, all rows form one chunk: one program, dw stored
    # directly (one launch and no workspace, in both modes). Changes dw's
    # addition order there (a function of rows only); dx is untouched
    direct_max_rows: int = 0
    # row-tile loads of the one-chunk form (any rows that form one chunk):
    # tma_stages / prefetch of their own, None: the fields above. Timing only
    direct_tma_stages: int | None = None
    direct_prefetch: bool | None = None
    # rows past the one-chunk window up to this many: dw summed by column slices of
    # cols_block_n columns, cols_block_m rows at a time (kernels/backward.py, DW_COLS):
    # one launch and no workspace, in both modes. A function of rows only; dx is untouched
    cols_max_rows: int = 0
    cols_block_m: int = 16
    cols_block_n: int = 128

    def col_tiles(self, hidden: int) -> int:
        return cdiv(hidden, self.block_n)

    def loads(self, num_chunks: int) -> tuple[bool, int]:
        """(prefetch, tma_stages) requested for a launch of num_chunks chunks."""
        if num_chunks == 1:
            return (self.prefetch if self.direct_prefetch is None else self.direct_prefetch,
                    self.tma_stages if self.direct_tma_stages is None else self.direct_tma_stages)
        return self.prefetch, self.tma_stages

    def chunking(self, rows: int) -> tuple[int, int]:
        """(num_chunks, rows_per_chunk): a function of rows (and this config) only."""
        if rows == 0:
            return 0, 0
        if rows <= self.direct_max_rows:
            return 1, cdiv(rows, self.block_m) * self.block_m
        rpc = max(self.min_rows_per_chunk, cdiv(rows, self.max_chunks))
        rpc = cdiv(rpc, self.block_m) * self.block_m
        return cdiv(rows, rpc), rpc


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


# Widest row held in registers as one tile; wider rows are walked in tiles.
FWD_MAX_TILE = 16384
BWD_MAX_TILE = 8192


def _default_fwd(hidden: int, elt: int) -> FwdConfig:
    block_n = next_pow2(hidden)
    if block_n > FWD_MAX_TILE:
        block_n = 8192
    block_m = max(1, min(16, 4096 // block_n))
    num_warps = min(16, max(4, block_m * block_n // 512))
    return FwdConfig(block_m, block_n, num_warps)


def _default_bwd(hidden: int, elt: int) -> BwdConfig:
    block_n = next_pow2(hidden)
    if block_n > BWD_MAX_TILE:
        block_n = 4096
    block_m = max(1, min(16, 2048 // block_n))
    num_warps = min(16, max(4, block_m * block_n // 256))
    # unmeasured widths: the atomic form only on large problems (2**27 elements),
    # where every measured width had it at least as fast (configs/tuned.py)
    return BwdConfig(block_m, block_n, num_warps, min_rows_per_chunk=max(16, block_m), max_chunks=256,
                     atomic_min_rows=cdiv(1 << 27, hidden))


@lru_cache(maxsize=None)
def forward_config(hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> FwdConfig:
    """The forward tile of (H, activation dtype, weight dtype): never of the rows."""
    elt = dtype.itemsize
    entry = None
    if weight_dtype is not None and weight_dtype.itemsize == 4 and elt < 4:
        entry = tuned.FWD_W32.get((hidden, elt))
    entry = entry or tuned.FWD.get((hidden, elt))
    return FwdConfig(**entry) if entry else _default_fwd(hidden, elt)


@lru_cache(maxsize=None)
def backward_config(hidden: int, dtype: torch.dtype, gated: bool = False) -> BwdConfig:
    elt = dtype.itemsize
    if gated and (hidden, elt) in tuned.BWD_GATED:
        return BwdConfig(**tuned.BWD_GATED[(hidden, elt)])    # measured with the gate (tune.py --gated)
    entry = tuned.BWD.get((hidden, elt))
    cfg = BwdConfig(**entry) if entry else _default_bwd(hidden, elt)
    if not gated and (hidden, elt) in tuned.BWD_DIRECT:
        cfg = replace(cfg, **tuned.BWD_DIRECT[(hidden, elt)])   # the one-chunk window (tune.py --sweep-small)
    if gated:
        # Unmeasured gated widths: the gated backward also holds z, sigmoid(z)
        # and dz per element: with the plain tiles ptxas (CUDA 13.4, via Triton
        # 3.9) spills up to ~8 KB per thread (H512 bm16 w4;
        # tools/compile_check.py). Twice the warps halve each thread's share of
        # the tile. On the H200 this rule left H 128 (the default 16 x 128 tile
        # at 16 warps) at 17-18% of the copy floor and H 4096 at 51-61%
        # (docs/benchmarks/h200.md): tune.py --gated measures entries instead.
        cfg = replace(cfg, num_warps=min(16, 2 * cfg.num_warps))
    return cfg
