"""The one place that branches on shape, dtype, mode and device.

It turns tensors into rows (a two-level stride, no copies for per-head views),
picks the kernel configuration and the dw form, allocates outputs and
workspace views, and launches the kernels, or runs the float64 reference on
CPU tensors when Triton's interpreter is not enabled.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from . import configs, reference
from .configs import BwdConfig, cdiv
from .kernels import dw_combine_kernel, rms_norm_bwd_kernel, rms_norm_fwd_kernel

# dw forms of the backward kernel (see kernels/backward.py)
DW_NONE, DW_PARTIAL, DW_ATOMIC, DW_DIRECT, DW_COLS = 0, 1, 2, 3, 4


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_kernels(t: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors too under TRITON_INTERPRET=1."""
    return t.is_cuda or (t.device.type == "cpu" and interpreter_enabled())


# --- SM count: sizes the persistent grids, never the numerics ---------------------------

_sm_override: int | None = None
_sm_cache: dict[int, int] = {}


@contextlib.contextmanager
def simulate_sm_count(n: int):
    """Run the dispatcher as if the GPU had `n` multiprocessors (tests, verify)."""
    global _sm_override
    old, _sm_override = _sm_override, int(n)
    try:
        yield
    finally:
        _sm_override = old


def sm_count(device: torch.device) -> int:
    if _sm_override is not None:
        return _sm_override
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_cache:
        _sm_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_cache[idx]


def _device_guard(t: torch.Tensor):
    # Triton launches on the current device: make it the tensor's.
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# --- rows -----------------------------------------------------------------------------------

def _row_view(t: torch.Tensor):
    """(tensor, [(size, stride), ...]) with unit and mergeable leading dims collapsed.

    A last dim whose stride is not 1 is copied once (the only copy this makes)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    merged: list[tuple[int, int]] = []
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return t, merged


def row_views(*tensors):
    """Express every tensor's rows with one inner count NH.

    Returns (NH, [(tensor, stride_t, stride_h), ...]); row r of a tensor sits at
    (r // NH) * stride_t + (r % NH) * stride_h. A one-level view fits any NH; a
    tensor whose two-level layout disagrees with the first one's is copied."""
    views = [_row_view(t) for t in tensors]
    nh = 1
    for _, dims in views:
        if len(dims) == 2:
            nh = dims[1][0]
            break
    out = []
    for t, dims in views:
        if len(dims) > 2 or (len(dims) == 2 and dims[1][0] != nh):
            t = t.contiguous()
            dims = [(t.numel() // t.shape[-1], t.shape[-1])]
        if len(dims) == 2:
            out.append((t, dims[0][1], dims[1][1]))
        else:
            stride = dims[0][1] if dims else 0
            out.append((t, stride * nh, stride))
    return nh, out


# --- tensor descriptors ----------------------------------------------------------------

def _tma_capable(device: torch.device) -> bool:
    """Tensor descriptors need the bulk copy engine (sm_90 and later); Triton's
    interpreter emulates them on the CPU."""
    if device.type != "cuda":
        return True
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx)[0] >= 9


def _descriptor_stages(stages: int, col_tiles: int, nh: int, *views) -> int:
    """`stages` where the rows can be read through tensor descriptors (rows that fit
    one tile, one level, base and row stride 16-byte aligned: the bulk copy's
    rules), else 0. The layout is only inspected when a config asks for them."""
    if not stages or col_tiles != 1 or nh != 1:
        return 0
    for t, stride in views:
        e = t.element_size()
        if t.data_ptr() % 16 or (stride * e) % 16 or not _tma_capable(t.device):
            return 0
    return stages


def _row_descriptor(t: torch.Tensor, stride: int, rows: int, hidden: int, block_m: int, block_n: int):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, [rows, hidden], [stride, 1], [block_m, block_n])


# --- forward ----------------------------------------------------------------------------

# The plain forward reads the weight before the rows (kernels/forward.py, EARLY_WEIGHT)
# where that holds at most 16 weight values a thread: on the H200 (tools/tune.py
# --sweep-fwd) H 2048 bm1 w4 (16 a thread) read early was the best plain tile
# (T1 4.45 us), while H 6144 bm1 w4 (64 a thread: 167 registers instead of 118,
# tools/compile_check.py) took 535.9 us at T 65536 against 388.5 read late. The
# descriptor form always reads it early: once per program, no row tile in registers.
# Not with a gate: z, silu(z) and the weight held together took the gated H 4096
# bm2 w8 tile to 174-178 registers (tools/compile_check.py; 90-94 without the gate),
# one 8-warp program per SM, and `trainnorm bench` to 765 us at T 65536 (50% of the
# floor) where the weight read late had run 391 us (docs/benchmarks/h200.md).
EARLY_WEIGHT_COLS_PER_WARP = 512
# Rows walked in up to this many tiles have both walks unrolled (kernels/forward.py,
# COL_UNROLL): the widths tools/tune.py --sweep-fwd times these two-pass forms at
# (FWD_CHUNK_MAX_TILES). Wider rows keep rolled loops, an unmeasured choice.
FWD_COL_UNROLL_MAX = 8

def forward(x, weight, residual, eps, gate=None, norm_before_gate=True):
    """(y, rstd, h); h is an empty tensor when there is no residual."""
    hidden = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x.new_empty(0)
    rows = rstd.numel()
    if rows == 0:
        return y, rstd, h
    if not runs_kernels(x):
        y64, rstd64, h_ref = reference.forward_fp64(x, weight, eps, residual, gate, norm_before_gate)
        y.copy_(y64)
        rstd.copy_(rstd64)
        if residual is not None:
            h.copy_(h_ref)
        return y, rstd, h

    cfg = configs.forward_config(hidden, x.dtype, weight.dtype if weight is not None else None)
    nh, views = row_views(*(t for t in (x, residual, gate) if t is not None))
    (xv, sxt, sxh), rest = views[0], iter(views[1:])
    rv, srt, srh = next(rest) if residual is not None else (xv, 0, 0)
    zv, szt, szh = next(rest) if gate is not None else (xv, 0, 0)
    col_tiles = cfg.col_tiles(hidden)
    tiles = cdiv(rows, cfg.block_m)
    stages = _descriptor_stages(cfg.tma_stages, col_tiles, nh, (xv, sxt), (rv, srt))
    if stages:
        desc_x = _row_descriptor(xv, sxt, rows, hidden, cfg.block_m, cfg.block_n)
        desc_r = _row_descriptor(rv, srt, rows, hidden, cfg.block_m, cfg.block_n) if residual is not None else desc_x
        grid = min(tiles, cfg.ctas_per_sm * sm_count(x.device))
    else:
        desc_x, desc_r, grid = xv, rv, tiles
    with _device_guard(x):
        rms_norm_fwd_kernel[(grid,)](
            xv, rv, zv, weight if weight is not None else xv, y, h if residual is not None else y, rstd,
            desc_x, desc_r, rows, hidden, nh, sxt, sxh, srt, srh, szt, szh, eps,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, COL_TILES=col_tiles,
            HAS_WEIGHT=weight is not None, HAS_RESIDUAL=residual is not None, TWO_LEVEL=nh > 1,
            HAS_GATE=gate is not None, GATE_FIRST=not norm_before_gate, TMA_STAGES=stages or None,
            EARLY_WEIGHT=bool(stages) or (gate is None and cfg.block_n <= EARLY_WEIGHT_COLS_PER_WARP * cfg.num_warps),
            COL_UNROLL=col_tiles if col_tiles <= FWD_COL_UNROLL_MAX else 1,
            INTERPRETED=not x.is_cuda, num_warps=cfg.num_warps,
        )
    return y, rstd, h


# --- backward ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BackwardPlan:
    cfg: BwdConfig
    hidden: int
    col_tiles: int
    num_chunks: int
    rows_per_chunk: int
    dw_mode: int

    @property
    def workspace_bytes(self) -> int:
        if self.dw_mode == DW_PARTIAL:
            return self.num_chunks * self.hidden * 8        # float64 partials
        if self.dw_mode == DW_ATOMIC:
            return self.hidden * 8 + 8                      # float64 accumulator + ticket counter
        return 0


def backward_plan(rows: int, hidden: int, dtype: torch.dtype, deterministic: bool, need_dw: bool,
                  gated: bool = False) -> BackwardPlan:
    """The backward's form: a function of (rows, H, dtype, mode, gate) only, never of the device."""
    cfg = configs.backward_config(hidden, dtype, gated)
    col_tiles = cfg.col_tiles(hidden)
    num_chunks, rpc = cfg.chunking(rows)
    if not need_dw or rows == 0:
        mode = DW_NONE
    elif col_tiles == 1 and num_chunks == 1:
        mode = DW_DIRECT
    elif rows <= cfg.cols_max_rows:
        mode = DW_COLS       # small T: dw by column slices in the same launch
    elif col_tiles > 1:
        mode = DW_PARTIAL    # wide rows accumulate each chunk's partial in place
    elif deterministic or rows < cfg.atomic_min_rows:
        mode = DW_PARTIAL    # deterministic=False too, where the atomic form is not faster
    else:
        mode = DW_ATOMIC
    return BackwardPlan(cfg, hidden, col_tiles, num_chunks, rpc, mode)


def backward(dy, h, weight, rstd, dh, deterministic, need_dw, workspace, gate=None, norm_before_gate=True):
    """(dx, dw, dgate); dw is float32 [H], or an empty tensor when it is not
    needed; dgate has the gate's dtype, or is empty without a gate."""
    hidden = h.shape[-1]
    rows = rstd.numel()
    need_dw = need_dw and weight is not None
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    dz = torch.empty(gate.shape, dtype=gate.dtype, device=h.device) if gate is not None else h.new_empty(0)
    if rows == 0 or not runs_kernels(h):
        if rows == 0:
            dw = torch.zeros(hidden if need_dw else 0, dtype=torch.float32, device=h.device)
            return dx, dw, dz
        out = reference.backward_fp64(dy, h, weight, rstd, dh, gate, norm_before_gate)
        dx.copy_(out[0])
        if gate is not None:
            dz.copy_(out[2])
        dw = out[1].float() if need_dw else h.new_empty(0, dtype=torch.float32)
        return dx, dw, dz

    plan = backward_plan(rows, hidden, h.dtype, deterministic, need_dw, gate is not None)
    dw = torch.empty(hidden if need_dw else 0, dtype=torch.float32, device=h.device)
    partial, counter = dx, dx
    nbytes = plan.workspace_bytes
    if nbytes:
        if workspace is None:
            # the atomic form needs its accumulator and counter zeroed (and leaves them so)
            alloc = torch.zeros if plan.dw_mode == DW_ATOMIC else torch.empty
            workspace = alloc(nbytes, dtype=torch.uint8, device=h.device)
        elif workspace.numel() < nbytes:
            raise ValueError(f"workspace: needs {nbytes} bytes for rows={rows}, H={hidden}, "
                             f"got {workspace.numel()} (size it with backward_workspace_bytes)")
        if plan.dw_mode == DW_PARTIAL:
            partial = workspace[:nbytes].view(torch.float64).view(plan.num_chunks, hidden)
        else:
            partial = workspace[:hidden * 8].view(torch.float64)
            counter = workspace[hidden * 8:hidden * 8 + 4].view(torch.int32)

    nh, views = row_views(*(t for t in (dy, h, dh, gate) if t is not None))
    (dyv, sdyt, sdyh), (hv, sht, shh), rest = views[0], views[1], iter(views[2:])
    dhv, sdht, sdhh = next(rest) if dh is not None else (dyv, 0, 0)
    zv, szt, szh = next(rest) if gate is not None else (dyv, 0, 0)
    rstd = rstd.reshape(-1)
    cfg = plan.cfg
    prefetch, stages = cfg.loads(plan.num_chunks)
    stages = _descriptor_stages(stages, plan.col_tiles, nh, (dyv, sdyt), (hv, sht))
    if stages:
        desc_dy, desc_h = (_row_descriptor(t, st, rows, hidden, cfg.block_m, cfg.block_n)
                           for t, st in ((dyv, sdyt), (hv, sht)))
    else:
        desc_dy, desc_h = dyv, hv
    cols = plan.dw_mode == DW_COLS
    programs = max(plan.num_chunks, cdiv(hidden, cfg.cols_block_n)) if cols else plan.num_chunks
    grid = min(programs, cfg.ctas_per_sm * sm_count(h.device))
    with _device_guard(h):
        rms_norm_bwd_kernel[(grid,)](
            dyv, hv, zv, weight if weight is not None else hv, rstd, dhv, dx, dz if gate is not None else dx,
            dw if need_dw else dx, partial, counter, desc_dy, desc_h,
            rows, hidden, nh, sdyt, sdyh, sht, shh, szt, szh, sdht, sdhh,
            plan.rows_per_chunk, plan.num_chunks,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, COL_TILES=plan.col_tiles,
            HAS_WEIGHT=weight is not None, HAS_DH=dh is not None, TWO_LEVEL=nh > 1,
            HAS_GATE=gate is not None, GATE_FIRST=not norm_before_gate,
            DW_MODE=DW_NONE if cols else plan.dw_mode, DW_COLS=cols,
            DW_BM=cfg.cols_block_m, DW_BN=cfg.cols_block_n, PREFETCH=prefetch and plan.col_tiles == 1 and not stages,
            TMA_STAGES=stages or None, DW_2D=cfg.dw_2d and plan.col_tiles == 1 and not cols,
            WIDE_TERMS=dy.element_size() > 2 or h.element_size() > 2,
            INTERPRETED=not h.is_cuda, num_warps=cfg.num_warps,
        )
        if plan.dw_mode == DW_PARTIAL:
            comb = configs.combine_config(hidden)
            dw_combine_kernel[(cdiv(hidden, comb.block_n),)](
                partial, dw, plan.num_chunks, hidden,
                BLOCK_P=comb.block_p, BLOCK_N=comb.block_n, num_warps=comb.num_warps,
            )
    return dx, dw, dz
