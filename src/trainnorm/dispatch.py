"""Allocate and launch: the last step before the kernels.

`forward` and `backward` allocate the outputs (and, without a caller's
workspace, the scratch), ask plan.py for the form, turn the tensors into rows
(rows.py) and launch the form's kernel. CPU tensors run the float64 reference
(reference.py) instead, unless Triton's interpreter is enabled.
"""
from __future__ import annotations

import os

import torch

from . import reference
from .configs import cdiv, combine_config
try:
    from .kernels import (bwd_col_slices_kernel, bwd_col_tiles_kernel, bwd_one_tile_kernel, dw_combine_kernel,
                          fwd_col_tiles_kernel, fwd_one_tile_kernel)
    from .kernels.common import HAS_PDL
except ImportError as _error:   # no Triton (it ships Linux wheels only): the CPU reference path needs none
    from .no_triton import is_missing_triton, missing_kernels
    if not is_missing_triton(_error):
        raise
    (bwd_col_slices_kernel, bwd_col_tiles_kernel, bwd_one_tile_kernel, dw_combine_kernel, fwd_col_tiles_kernel,
     fwd_one_tile_kernel) = missing_kernels(
        ("bwd_col_slices_kernel", "bwd_col_tiles_kernel", "bwd_one_tile_kernel", "dw_combine_kernel",
         "fwd_col_tiles_kernel", "fwd_one_tile_kernel"), _error)
    HAS_PDL = False
from .plan import DwForm, backward_key_dtype, backward_plan, forward_plan
from .rows import (arch_of, descriptor_stages, device_guard, loads_16_bytes, row_descriptor, row_views, runs_kernels,
                   sm_count)
from .variant import DTYPES, Variant


# Every launch says that the compiler may fuse a product into the add that follows it, as
# every measured form was compiled: Triton 3.9 warns that its default turns to no fusion in
# 3.10, which would change y's and dx's bits with the Triton version.
FP_FUSION = dict(enable_fp_fusion=True)

# Programmatic dependent launch (sm_90 and later): with LAUNCH_PDL the backward's kernels (the
# main one and the dw combine) are launched so that each may start while the grid ahead of it in
# the stream drains, and wait for that grid's writes before their first load or store
# (kernels/common.py grid_dependency). The bits do not change. On by default; TRAINNORM_PDL=0
# in the environment launches every kernel plainly.
# H100, trainnorm.dev.tune --probe-pdl at 50324cf (docs/benchmarks/tune/h100-pdl.txt), us, plain
# -> PDL, the forward launched plainly: bwd H512 T1024 10.62 -> 9.98, [T,4,256] T1024 12.51 ->
# 11.84, H5120 T64 6.91 -> 6.82; step (fwd + fwd + bwd) H512 T1024 15.12 -> 13.90, [T,4,256]
# T1024 18.53 -> 17.14, T4096 30.90 -> 29.74, H4096 T1 10.56 -> 10.11, H5120 T64 13.01 -> 12.43;
# bwd at H5120 T4096, H512 and H2048 T16384, H6144 T1024 res, H4096 T4096 gate within 1% either way.
LAUNCH_PDL = os.environ.get("TRAINNORM_PDL", "1") != "0"
# The forward under PDL as well (with LAUNCH_PDL). Not taken: in that file's runs 1 and 2 it
# took the step of H512 T1024 to 13.22-13.34 and of H4096 T1 to 8.64-8.72, but that of the per-head rows
# [T,4,256] T1024 from 18.22-18.43 to 21.42-21.50 (0.86x) and T4096 from 31.02 to 32.18, while
# the forward alone moved by at most 3% either way. Why the per-head forward ahead of its
# dependents costs that is not known.
FORWARD_PDL = False


def launch_options(device, forward: bool = False) -> dict:
    """The launch's PDL constexpr and Triton's launch_pdl option on `device`: pdl_options
    of its architecture (none on the CPU: the interpreter launches plainly)."""
    return pdl_options(arch_of(device), forward)


def pdl_options(arch: str | None, forward: bool = False) -> dict:
    """PDL=True and launch_pdl=True for "sm_90" and later while LAUNCH_PDL holds (and
    Triton has the instructions, 3.3 on), for the forward's kernels (`forward`) only with
    FORWARD_PDL; none for older GPUs and None (the kernels' PDL defaults to False)."""
    if not LAUNCH_PDL or not HAS_PDL or (forward and not FORWARD_PDL):
        return {}
    if arch is None or int(arch[3:]) < 90:
        return {}
    return dict(PDL=True, launch_pdl=True)


def _walk_hold(plan) -> dict:
    """HOLD_DW for a walked row (configs.BwdTile.hold_dw); nothing where the row is one tile
    or the config holds no dw (the launch as before the field)."""
    return {"HOLD_DW": True} if plan.col_tiles > 1 and plan.cfg.tile.hold_dw else {}


def _dealt(plan) -> dict:
    """DEAL_ROWS where the plan deals its rows to the chunks (BackwardPlan.dealt); nothing
    otherwise (the launch as before the field)."""
    return {"DEAL_ROWS": True} if plan.dealt else {}


def _weight_halves(plan, weight, hidden: int, nh: int, *views, **rows) -> int:
    """How many of the row's pieces read a float32 weight by halves (the plan's
    weight_halves, where the rows are read 16 bytes a thread: rows.loads_16_bytes); 0 for
    any other weight, and without looking at the rows where the plan's form takes none.
    rows: the forward's row count (its warps a program can follow it: FwdSchedule.held_tile)."""
    if weight is None or weight.element_size() != 4:
        return 0
    pieces = plan.weight_halves(True, **rows)
    return pieces if pieces and loads_16_bytes(hidden, nh, *views) else 0


def forward(x, weight, residual, gate, eps, variant: Variant):
    """(y, rstd, h); h is an empty tensor when there is no residual."""
    hidden = x.shape[-1]
    y_dtype = DTYPES[variant.y_dtype] if variant.y_dtype else x.dtype
    y = torch.empty(x.shape, dtype=y_dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    # the residual stream h in the residual's dtype: x's, or float32 under 16-bit x
    h = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else x.new_empty(0)
    rows = rstd.numel()
    if rows == 0:
        return y, rstd, h
    if not runs_kernels(x):
        y64, rstd64, h_ref = reference.forward_fp64(x, weight, eps, residual, gate, variant.norm_before_gate,
                                                    activation=variant.gate or "silu",
                                                    weight_offset=variant.weight_offset)
        y.copy_(y64)
        rstd.copy_(rstd64)
        if residual is not None:
            h.copy_(h_ref)
        return y, rstd, h

    plan = forward_plan(hidden, x.dtype, weight.dtype if weight is not None else None, variant, arch_of(x.device),
                        residual=residual is not None)
    cfg = plan.cfg
    nh, ((xv, sxt, sxh), (rv, srt, srh), (zv, szt, szh)) = row_views(x, residual, gate)
    views = (xv, sxt, sxh), (rv, srt, srh), (zv, szt, szh)
    # a held tile of its own splits a row as the tile does only where a thread reads 16 bytes of it
    block_m, num_warps, weight_at = plan.tile_at(rows, not plan.held_tile or loads_16_bytes(hidden, nh, *views))
    h_out = h if residual is not None else None
    w_halves = _weight_halves(plan, weight, hidden, nh, *views, rows=rows)
    common = dict(BLOCK_M=block_m, BLOCK_N=cfg.block_n, TWO_LEVEL=nh > 1, **variant.constexprs(),
                  num_warps=num_warps, **FP_FUSION, **launch_options(x.device, forward=True))
    with device_guard(x):
        if plan.one_tile:
            # a float32 residual stream beside 16-bit x: plain loads (the backward's
            # descriptor form of that stream was measured, not the forward's)
            mixed = rv is not None and rv.element_size() != x.element_size()
            tiles = cdiv(rows, block_m)
            # the persistent grid of a descriptor config. Where it has no fewer programs than
            # there are row tiles (one tile a program) the rows are read plainly: nothing for
            # the descriptor form's pipeline to overlap, and its copies through shared memory
            # cost more than plain loads. H100, bf16 (trainnorm.dev.tune --probe-schedule;
            # docs/benchmarks/tune/h100-schedule.txt), us, descriptors (the entry) -> plain
            # loads: H6144 float32 weight (tma4, 2 programs per SM), rows 1 5.89 -> 4.96, 16
            # 6.18 -> 5.31, 256 8.42 -> 7.81, with a residual 256 10.34 -> 9.26, while at 512
            # rows (two tiles a program) descriptors led, 10.48 against 11.36; H1536 (tma3, 4
            # per SM) rows 64 5.17 -> 5.02, 512 6.37 -> 6.08, 1024 7.57 -> 7.22
            # A residual on an entry with residual_plain: plain loads as well (configs.FwdSchedule)
            plain = mixed or (rv is not None and cfg.residual_plain)
            grid = cfg.ctas_per_sm * sm_count(x.device) if cfg.tma_stages else tiles
            stages = 0 if plain or tiles <= grid else descriptor_stages(
                cfg.tma_stages, 1, nh, (xv, sxt), (rv, srt), elt=x.element_size(), block_n=cfg.block_n, hidden=hidden)
            if stages:
                desc_x = row_descriptor(xv, sxt, rows, hidden, block_m, cfg.block_n)
                desc_r = row_descriptor(rv, srt, rows, hidden, block_m, cfg.block_n) if rv is not None else None
            else:
                desc_x, desc_r, grid = None, None, tiles
            fwd_one_tile_kernel[(grid,)](
                xv, rv, zv, weight, y, h_out, rstd, desc_x, desc_r, rows, hidden, nh, sxt, sxh, srt, srh, szt, szh,
                eps, BLOCK_N2=cfg.block_n2, TMA_STAGES=stages or None,
                WEIGHT="early" if stages else plan.weight, W_HALVES=0 if stages else w_halves, **common)
        else:
            fwd_col_tiles_kernel[(cdiv(rows, block_m),)](
                xv, rv, zv, weight, y, h_out, rstd, rows, hidden, nh, sxt, sxh, srt, srh, szt, szh,
                eps, COL_TILES=plan.col_tiles, COL_UNROLL=plan.col_unroll, HOLD=plan.holds(rows),
                WEIGHT=weight_at, W_HALVES=w_halves, **common)
    return y, rstd, h


def _workspace(plan, workspace, rows, device):
    """(partial, counter) views of the caller's workspace (or a new one) for the plan's dw form."""
    nbytes = plan.workspace_bytes
    if not nbytes:
        return None, None
    if workspace is None:
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
    elif workspace.numel() < nbytes:
        raise ValueError(f"workspace: needs {nbytes} bytes for rows={rows}, H={plan.hidden}, "
                         f"got {workspace.numel()} (size it with backward_workspace_bytes)")
    if plan.dw is DwForm.ATOMIC:
        # The atomic form adds into a zeroed float64 accumulator and counts its programs in
        # a zeroed ticket. Zeroed here on every call (one memset of H * 8 + 8 bytes, beside a
        # launch that reads at least 65536 rows: the form's window in sm_90.json), so a
        # workspace last used by the partials' form, or never zeroed, gives the same dw.
        workspace[:nbytes].zero_()
    hidden = plan.hidden
    if plan.dw is DwForm.PARTIAL:
        return workspace[:nbytes].view(torch.float64).view(plan.num_chunks, hidden), None
    return workspace[:hidden * 8].view(torch.float64), workspace[hidden * 8:hidden * 8 + 4].view(torch.int32)


def backward(dy, h, weight, rstd, dh, gate, variant: Variant, deterministic, need_dw, workspace):
    """(dx, dw, dgate, dres); dx in x's dtype (variant.x_dtype, else h's); dw is float32
    [H], or an empty tensor when it is not needed; dgate has the gate's dtype, or is
    empty without a gate; dres, the residual stream's gradient in h's dtype, is empty
    unless x's dtype differs from h's (dx is that gradient then too, rounded)."""
    hidden = h.shape[-1]
    rows = rstd.numel()
    need_dw = need_dw and weight is not None
    x_dtype = DTYPES[variant.x_dtype] if variant.x_dtype else h.dtype
    dx = torch.empty(h.shape, dtype=x_dtype, device=h.device)
    dres = torch.empty(h.shape, dtype=h.dtype, device=h.device) if x_dtype != h.dtype else h.new_empty(0)
    dz = torch.empty(gate.shape, dtype=gate.dtype, device=h.device) if gate is not None else h.new_empty(0)
    if rows == 0 or not runs_kernels(h):
        if rows == 0:
            dw = torch.zeros(hidden if need_dw else 0, dtype=torch.float32, device=h.device)
            return dx, dw, dz, dres
        out = reference.backward_fp64(dy, h, weight, rstd, dh, gate, variant.norm_before_gate,
                                      activation=variant.gate or "silu", weight_offset=variant.weight_offset)
        dx.copy_(out[0])
        if dres.numel():
            dres.copy_(out[0])
        if gate is not None:
            dz.copy_(out[2])
        dw = out[1].float() if need_dw else h.new_empty(0, dtype=torch.float32)
        return dx, dw, dz, dres

    key_dtype = backward_key_dtype(x_dtype, dy.dtype)
    plan = backward_plan(rows, hidden, key_dtype, variant, deterministic, need_dw, arch_of(h.device))
    dw = torch.empty(hidden if need_dw else 0, dtype=torch.float32, device=h.device)
    partial, counter = _workspace(plan, workspace, rows, h.device)
    nh, views = row_views(dy, h, dh, gate)
    (dyv, sdyt, sdyh), (hv, sht, shh), (dhv, sdht, sdhh), (zv, szt, szh) = views
    rstd = rstd.reshape(-1)
    cfg = plan.cfg
    prefetch, stages = plan.loads()
    stages = descriptor_stages(stages, plan.col_tiles, nh, (dyv, sdyt), (hv, sht), elt=key_dtype.itemsize,
                                block_n=cfg.block_n, hidden=hidden)
    if stages:
        desc_dy, desc_h = (row_descriptor(t, st, rows, hidden, plan.block_m, cfg.block_n)
                           for t, st in ((dyv, sdyt), (hv, sht)))
    else:
        desc_dy = desc_h = None
    slices = plan.dw is DwForm.COL_SLICES
    most = cfg.ctas_per_sm * sm_count(h.device)
    grid = (min(plan.num_chunks, most),)
    if slices:
        n_slices = cdiv(hidden, cfg.slice_block_n)
        if cfg.split_roles:     # programs [0, row_programs) take rows, the rest slices
            row_programs = slice_start = grid[0]
            grid = (row_programs + min(n_slices, most),)
        else:                   # every program takes rows, then slices
            grid = (min(max(plan.num_chunks, n_slices), most),)
            row_programs, slice_start = grid[0], 0
    tensors = (dyv, hv, zv, weight, rstd, dhv, dx, dres if dres.numel() else None, dz if gate is not None else None)
    w_halves = _weight_halves(plan, weight, hidden, nh, *views)
    sizes = (rows, hidden, nh, sdyt, sdyh, sht, shh, szt, szh, sdht, sdhh, plan.rows_per_chunk, plan.num_chunks)
    pdl = launch_options(h.device)
    common = dict(BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, TWO_LEVEL=nh > 1, **variant.constexprs(),
                  num_warps=cfg.num_warps, **FP_FUSION, **pdl)
    if stages:
        loads = dict(LOADS="tma", STAGES=stages)
    else:
        loads = dict(LOADS="prefetch" if prefetch else "plain", STAGES=cfg.loop_stages or None)
    with device_guard(h):
        if slices:
            bwd_col_slices_kernel[grid](*tensors, dw, desc_dy, desc_h, *sizes, row_programs, slice_start,
                                        BLOCK_N2=cfg.block_n2,
                                        COL_TILES=plan.col_tiles, DW_BM=cfg.slice_block_m, DW_BN=cfg.slice_block_n,
                                        DW_STAGES=cfg.slice_stages or None, **_walk_hold(plan), **_dealt(plan),
                                        **loads, **common)
        elif plan.col_tiles == 1:
            bwd_one_tile_kernel[grid](*tensors, dw if need_dw else None, partial, counter, desc_dy, desc_h, *sizes,
                                      BLOCK_N2=cfg.block_n2, DW_FORM=plan.dw.value, DW_2D=cfg.dw_2d,
                                      W_HALVES=w_halves, **_dealt(plan), **loads, **common)
        else:
            bwd_col_tiles_kernel[grid](*tensors, partial, *sizes, COL_TILES=plan.col_tiles, **_walk_hold(plan),
                                       **_dealt(plan), **common)
        if plan.dw is DwForm.PARTIAL:
            comb = combine_config(hidden)
            dw_combine_kernel[(cdiv(hidden, comb.block_n),)](
                partial, dw, plan.num_chunks, hidden,
                BLOCK_P=comb.block_p, BLOCK_N=comb.block_n, num_warps=comb.num_warps, **FP_FUSION, **pdl,
            )
    return dx, dw, dz, dres
