"""Compile every kernel form the package launches, for sm_90, without a GPU.

Runs the public API on uninitialised CPU tensors with the launches recorded
instead of run (`recording()`: trainnorm.dispatch's kernels replaced by
recorders), each launch specialised as Triton's JIT specialises it on the
GPU (its own binder: pointer and integer alignment, integers equal to 1,
absent tensors passed as constexpr None, tensor descriptors), then compiles
each distinct form with Triton for an sm_90 target and runs Triton's bundled
ptxas with -v on the PTX: registers, spill bytes and shared memory per form. A
form that does not compile, that spills or that asks for more shared memory than
one block may have is reported and the exit status is 1.

    python -m trainnorm.dev.compile_check [--arch 90] [--quick] [--only fwd-tma|fwd-tiles|slices|pieces|weight]
    python -m trainnorm.dev.compile_check --load-forms
    python -m trainnorm.dev.compile_check --planned
    python -m trainnorm.dev.compile_check --only plans --ptx-digests new.json    # then under the other tree; diff
    python -m trainnorm.dev.compile_check --pdl

Besides the forms the table's plans launch (every measured width, odd and
wide widths, dtypes, residual, gate in both orders, per-head views, both dw
modes at row counts that reach every dw form), it compiles those the tuner
times: the column-slice tiles of --sweep-small, the forward's descriptor
depths and its two-pass tiles of --sweep-fwd, the two-piece rows of both (each config through
configs.override): about 2000 forms, ten minutes on two CPU cores (--jobs
processes compile in parallel). --quick compiles a few forms of every kernel
and dw form (seconds). Triton's interpreter must be off: the command restarts
itself without TRITON_INTERPRET when it is set.
"""
from __future__ import annotations

import argparse
import itertools
import json
import contextlib
import os
import re
import subprocess
import sys
import tempfile

import torch

INTERPRET = "TRITON_INTERPRET"


def _interpreted() -> bool:
    from trainnorm import kernels
    return not hasattr(kernels.fwd_one_tile_kernel, "params")    # an InterpretedFunction, not a JITFunction


# --- recording the launches ---------------------------------------------------------------

class Launches:
    """The distinct launches seen: {key: (kernel, signature, constexprs, attrs, options, named,
    widths)}, each specialised for `target` as Triton's JIT does at launch; widths: the
    row widths (n_cols) that launched the form."""

    def __init__(self, target):
        from triton.compiler import make_backend
        self.target = target
        self.backend = make_backend(target)
        self.forms: dict = {}
        self._binders: dict = {}

    def add(self, kernel, args, kw, grid=None) -> None:
        from triton.runtime.jit import create_function_from_signature
        binder = self._binders.get(kernel)
        if binder is None:
            binder = self._binders[kernel] = create_function_from_signature(kernel.signature, kernel.params,
                                                                            self.backend)
        bound, spec, opts = binder(*args, **kw)
        options, signature, constexprs, attrs = kernel._pack_args(self.backend, kw, bound, spec, opts)
        key = (kernel.fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), repr(options))
        if key not in self.forms:
            named = {k: v for k, v in kw.items() if k not in ("num_warps", "enable_fp_fusion")}
            self.forms[key] = (kernel, signature, constexprs, attrs, options, named, set())
        if "n_cols" in bound:
            self.forms[key][-1].add(bound["n_cols"])


class _Recorder:
    def __init__(self, kernel, launches: Launches):
        self.kernel = kernel
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.add(self.kernel, args, kw, grid)
        return launch


@contextlib.contextmanager
def recording(launches):
    """Within the block the package's launches are recorded into `launches` (a Launches, or
    any object with add(kernel, args, kwargs, grid)), not run: the dispatcher takes CPU
    tensors for device tensors, each of its kernels is a recorder, and its launch options
    (programmatic dependent launch: dispatch.launch_options) are those of the launches'
    target, else of the default table's architecture."""
    from trainnorm import configs, dispatch, kernels
    target = getattr(launches, "target", None)
    arch = f"sm_{target.arch}" if target is not None else configs.DEFAULT_ARCH
    saved = {"runs_kernels": dispatch.runs_kernels, "launch_options": dispatch.launch_options}
    saved.update({name: getattr(dispatch, name) for name in kernels.__all__})
    try:
        dispatch.runs_kernels = lambda t: True
        # launched as on a GPU of the target's (else the default table's) architecture
        dispatch.launch_options = lambda device, forward=False: dispatch.pdl_options(arch, forward)
        for name in kernels.__all__:
            setattr(dispatch, name, _Recorder(saved[name], launches))
        yield launches
    finally:
        for name, v in saved.items():
            setattr(dispatch, name, v)


# --- what the package launches --------------------------------------------------------------

def _case(lead, hidden, dtype, wdt, layout="contig"):
    """Uninitialised tensors of the right layouts: nothing is executed, and
    untouched CPU pages cost no memory. layout "query": x is every other
    H-slice of a twice wider row ([T, NH, H] with strides (2*NH*H, 2*H, 1): one
    row stride); "heads": x is NH of NH + 8 heads (two-level rows)."""
    e = lambda *shape, dt=dtype: torch.empty(shape, dtype=dt)
    if layout == "query":
        x = e(*lead[:-1], lead[-1], 2 * hidden)[..., :hidden]
    elif layout == "heads":
        x = e(*lead[:-1], lead[-1] + 8, hidden)[..., :lead[-1], :]
    else:
        x = e(*lead, hidden)
    return x, e(*lead, hidden), e(*lead, hidden), e(*lead, hidden), e(hidden, dt=wdt)


DTYPES = ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
          (torch.float32, torch.float32))
ODD_WIDTHS = (1, 1000, 8200, 65536)
# widths the table does not hold whose rule tiles (configs.default_forward / default_backward)
# no other width reaches: 4096 columns at 4 warps, 8192 at 8
UNSEEN_WIDTHS = (2304, 5376)
# row counts: one row (one chunk), 32 (column-slice dw), 300 (chunks and the combine),
# 70000 (the atomic form where the table takes it)
ROWS = (1, 32, 300, 70000)
WIDE_ROWS = (1, 300)             # rows wider than one tile (H > 8192)


def table_widths() -> list[int]:
    from trainnorm.configs import DEFAULT_ARCH, table
    t = table.load(DEFAULT_ARCH)
    return sorted({e["hidden"] for op in ("forward", "backward") for e in t[op]})


def exercise(widths, dtypes=DTYPES, gate_orders=(True, False), heads=None):
    """The forms the plans launch: dtypes, residual (also a float32 stream), no weight,
    gate in both orders, the (1 + w) weight, per-head views, both dw modes at several
    row counts."""
    import trainnorm
    from trainnorm.dev.tune import GATED_HEAD_LAYOUTS, HEAD_LAYOUTS
    heads = {**GATED_HEAD_LAYOUTS, **HEAD_LAYOUTS} if heads is None else heads
    for hidden, rows, layout in _shapes(widths, heads):
        nh = heads.get(hidden, 0)
        lead = (max(1, rows // nh), nh) if nh else (rows,)
        for dtype, wdt in dtypes:
            x, r, dy, dh, w = _case(lead, hidden, dtype, wdt, layout)
            rstd = torch.empty(lead, dtype=torch.float32)
            for res in (None, r):
                trainnorm.rms_norm_forward(x, w, residual=res)
                for det in (True, False):
                    trainnorm.rms_norm_backward(dy, x, w, rstd, dh=None if res is None else dh, deterministic=det)
                trainnorm.rms_norm_forward(x, None, residual=res)
                trainnorm.rms_norm_backward(dy, x, None, rstd)
            for nbg in gate_orders:
                trainnorm.rms_norm_gated_forward(x, r, w, norm_before_gate=nbg)
                for det in (True, False):
                    trainnorm.rms_norm_gated_backward(dy, x, r, w, rstd, norm_before_gate=nbg, deterministic=det)
            if dtype != torch.float32:
                _stream_forms(x, r, dy, dh, w, rstd, deterministic=(True, False))


def _stream_forms(x, r, dy, dh, w, rstd, deterministic=(True,)):
    """A float32 residual stream under 16-bit x, the (1 + w) weight and a float32 y
    (out_dtype, whose dy comes in float32), through the ops."""
    x_name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[x.dtype]
    h = torch.empty(x.shape, dtype=torch.float32)
    torch.ops.trainnorm.rms_norm_fwd(x, w, r.float(), None, 1e-6, f"x:{x_name}")
    for det in deterministic:
        torch.ops.trainnorm.rms_norm_bwd(dy, h, w, rstd, dh.float(), None, f"x:{x_name}", det, True, None)
        # the stream with y in float32: dy and h both float32 under x's 16-bit key
        torch.ops.trainnorm.rms_norm_bwd(dy.float(), h, w, rstd, dh.float(), None, f"x:{x_name},y:fp32", det,
                                         True, None)
        torch.ops.trainnorm.rms_norm_bwd(dy, x, w, rstd, None, None, "w+1.0", det, True, None)
        torch.ops.trainnorm.rms_norm_bwd(dy.float(), x, w, rstd, None, None, "", det, True, None)
    torch.ops.trainnorm.rms_norm_fwd(x, w, None, None, 1e-6, "w+1.0")
    torch.ops.trainnorm.rms_norm_fwd(x, w, None, None, 1e-6, "y:fp32")


def _shapes(widths, heads):
    """(H, rows, layout): the head layouts' widths as per-head rows, one-level and two-level."""
    for hidden in widths:
        for rows in ROWS if hidden <= 8192 else WIDE_ROWS:
            for layout in ("query", "heads") if hidden in heads else ("contig",):
                yield hidden, rows, layout


def exercise_quick():
    """A few launches that reach every kernel and dw form: H 4096 at one row (one chunk),
    32 (column slices), 300 (chunks and the combine) and 70000 rows (the atomic form), with
    a residual and with a gate; rows walked in column tiles (H 8200); two-level per-head rows."""
    import trainnorm
    for rows in ROWS:
        x, r, dy, dh, w = _case((rows,), 4096, torch.bfloat16, torch.bfloat16)
        rstd = torch.empty((rows,), dtype=torch.float32)
        trainnorm.rms_norm_forward(x, w)
        trainnorm.rms_norm_backward(dy, x, w, rstd, deterministic=rows < ROWS[-1])
    x, r, dy, dh, w = _case((300,), 4096, torch.bfloat16, torch.bfloat16)
    rstd = torch.empty((300,), dtype=torch.float32)
    trainnorm.rms_norm_forward(x, w, residual=r)
    trainnorm.rms_norm_backward(dy, x, w, rstd, dh=dh)
    trainnorm.rms_norm_gated_forward(x, r, w)
    trainnorm.rms_norm_gated_backward(dy, x, r, w, rstd)
    _stream_forms(x, r, dy, dh, w, rstd)
    for lead, hidden, layout in (((300,), 8200, "contig"), ((16, 24), 256, "heads")):
        x, r, dy, dh, w = _case(lead, hidden, torch.bfloat16, torch.bfloat16, layout)
        rstd = torch.empty(lead, dtype=torch.float32)
        trainnorm.rms_norm_forward(x, w)
        trainnorm.rms_norm_backward(dy, x, w, rstd)


def exercise_slices(widths=(512, 1536, 2048, 4096, 5120, 6144, 8200), tiles=None):
    """The column-slice dw form with the tiles trainnorm.dev.tune --sweep-small times."""
    import trainnorm
    from trainnorm import configs
    from trainnorm.dev.tune import ALWAYS, SMALL_SLICES
    for bm, bn, split, stages in SMALL_SLICES if tiles is None else tiles:
        with configs.override(backward=lambda key, cfg, bm=bm, bn=bn, split=split, stages=stages: cfg.replace(
                direct_max_rows=0, slices_max_rows=ALWAYS, slice_block_m=bm, slice_block_n=bn, split_roles=split,
                slice_stages=stages)):
            for hidden in widths:
                x, r, dy, dh, w = _case((64,), hidden, torch.bfloat16, torch.bfloat16)
                rstd = torch.empty((64,), dtype=torch.float32)
                for det in (True, False):
                    trainnorm.rms_norm_backward(dy, x, w, rstd, deterministic=det)
                trainnorm.rms_norm_backward(dy, x, w, rstd, dh=dh)
                trainnorm.rms_norm_gated_backward(dy, x, r, w, rstd)


def exercise_fwd_tma(widths=(512, 1536, 2048, 4096, 5120, 6144, 1000), stages=None):
    """The forward's descriptor forms at the depths trainnorm.dev.tune --sweep-fwd times (entries
    of one-piece tiles: a two-piece tile reads plainly, configs.FwdConfig refuses descriptors)."""
    import trainnorm
    from trainnorm import configs
    from trainnorm.dev.tune import FWD_TMA_STAGES
    for st in FWD_TMA_STAGES if stages is None else stages:
        with configs.override(forward=lambda key, cfg, st=st: None if cfg.block_n2 else cfg.replace(tma_stages=st)):
            for hidden in widths:
                for wdt in (torch.bfloat16, torch.float32):
                    x, r, dy, dh, w = _case((300,), hidden, torch.bfloat16, wdt)
                    for res in (None, r):
                        trainnorm.rms_norm_forward(x, w, residual=res)
                    trainnorm.rms_norm_gated_forward(x, r, w)


def exercise_fwd_tiles(widths=None, limit=None):
    """The forward's two-pass forms (rows walked in 2-8 narrower tiles) that trainnorm.dev.tune
    --sweep-fwd times (the first `limit` of each width's)."""
    import trainnorm
    from trainnorm import configs
    from trainnorm.dev.tune import FWD_WIDTHS, fwd_sweep_candidates
    for hidden in FWD_WIDTHS if widths is None else widths:
        cands = [c for c in fwd_sweep_candidates(hidden) if c.col_tiles(hidden) > 1][:limit]
        for cfg in cands:
            with configs.override(forward=cfg):
                for wdt in (torch.bfloat16, torch.float32):
                    x, r, dy, dh, w = _case((300,), hidden, torch.bfloat16, wdt)
                    for res in (None, r):
                        trainnorm.rms_norm_forward(x, w, residual=res)
                    trainnorm.rms_norm_gated_forward(x, r, w)


def exercise_weight(widths=None):
    """The forward entries with each weight read (and hold) trainnorm.dev.tune --sweep-weight times."""
    import trainnorm
    from trainnorm import configs
    from trainnorm.dev.tune import FWD_WIDTHS, weight_candidates
    for hidden in FWD_WIDTHS if widths is None else widths:
        for wdt in (torch.bfloat16, torch.float32):
            x, r, dy, dh, w = _case((300,), hidden, torch.bfloat16, wdt)
            base = configs.forward_config(configs.forward_key(hidden, 2, wdt.itemsize, None, False))
            for cfg in weight_candidates(base.replace(tma_stages=0), hidden).values():
                with configs.override(forward=cfg):
                    for res in (None, r):
                        trainnorm.rms_norm_forward(x, w, residual=res)


def exercise_pieces(widths=(1536, 5120, 6144, 1000), limit=None):
    """Rows held as two pieces: the backward's and the forward's candidates that
    trainnorm.dev.tune --sweep-bwd / --sweep-fwd time (the first `limit` of each width's),
    in every dw form, with a residual and a gate."""
    import trainnorm
    from trainnorm import configs
    from trainnorm.dev.tune import PIECE_LOOP_STAGES, SWEEP_TILES, bwd_candidate, fwd_sweep_candidates
    for hidden in widths:
        tiles = SWEEP_TILES.get(hidden, [(1, 8)])
        bwd = [bwd_candidate(hidden, (bm, nw, False, 0, False, 2, 132, True, ls))
               for (bm, nw), ls in itertools.product(tiles, PIECE_LOOP_STAGES)][:limit]
        fwd = [c for c in fwd_sweep_candidates(hidden) if c.block_n2][:limit]
        for bcfg, fcfg in itertools.zip_longest(bwd, fwd):
            with configs.override(forward=fcfg, backward=bcfg):
                x, r, dy, dh, w = _case((300,), hidden, torch.bfloat16, torch.bfloat16)
                rstd = torch.empty((300,), dtype=torch.float32)
                if fcfg is not None:
                    trainnorm.rms_norm_forward(x, w, residual=r)
                    trainnorm.rms_norm_gated_forward(x, r, w)
                if bcfg is not None:
                    for rows in (1, 32, 300):
                        with configs.override(backward=lambda key, cfg, rows=rows: cfg.replace(
                                direct_max_rows=1 if rows == 1 else 0, slices_max_rows=32)):
                            trainnorm.rms_norm_backward(dy[:rows], x[:rows], w, rstd[:rows])
                    trainnorm.rms_norm_backward(dy, x, w, rstd, dh=dh)
                    trainnorm.rms_norm_gated_backward(dy, x, r, w, rstd)


# --- the load forms compute the same arithmetic -----------------------------------------------

# the backward's ways of reading its row tiles (BwdSchedule fields); each must compute the
# same bits (kernels/backward.py), which the interpreter cannot check: it neither lays
# tensors out in registers nor lets the compiler fuse a product into an add
LOAD_FORMS = {"plain": dict(tma_stages=0, prefetch=False), "prefetch": dict(tma_stages=0, prefetch=True),
              "descriptors": dict(tma_stages=4, prefetch=False)}
# (name, x dtype, dy dtype, h dtype, dh dtype or None, gate: None / "after" / "first", op
# variant): the backward's stream sets
PLANNED_SETS = (("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16, None, None, ""),
                ("fp16", torch.float16, torch.float16, torch.float16, None, None, ""),
                ("bf16 residual", torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, None, ""),
                ("gated, norm first", torch.bfloat16, torch.bfloat16, torch.bfloat16, None, "after", ""),
                ("gated, gate first", torch.bfloat16, torch.bfloat16, torch.bfloat16, None, "first", ""),
                ("float32 stream, explicit", torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, None, ""),
                ("float32 stream, autograd", torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, None,
                 "x:bf16"),
                ("float32 y", torch.bfloat16, torch.float32, torch.bfloat16, None, None, ""))
# the sets the load forms are compared on: the residual stream in bf16 and in float32
# (both entry points), and y in float32
LOAD_FORM_STREAMS = tuple(c for c in PLANNED_SETS if c[0] in ("bf16 residual", "float32 stream, explicit",
                                                                "float32 stream, autograd", "float32 y"))


def fwd_load_form_keys(arch: str = "sm_90") -> tuple[list, list]:
    """(hidden, weight dtype) of the table's forward entries (plain and float32 weight) that read
    through tensor descriptors, and of those that walk rows in column tiles: the forms
    check_load_forms compares, whatever entries a re-tune leaves. H 1536 (bf16) is always among
    the first: the descriptor form stays compared where no entry takes it (the tuner times it)."""
    from trainnorm.configs import table as tables
    desc, tiles = [(1536, torch.bfloat16)], []
    for e in tables.load(arch)["forward"]:
        if e["kind"] not in ("plain", "weight_fp32") or e["elt"] != 2:
            continue
        cfg = tables.to_config("forward", e)
        key = (e["hidden"], torch.float32 if e["kind"] == "weight_fp32" else torch.bfloat16)
        if cfg.tma_stages and key not in desc:
            desc.append(key)
        elif cfg.col_tiles(e["hidden"]) > 1:
            tiles.append(key)
    return desc, tiles
# widths of the load-form comparison: narrow tiles of several rows (128, 512: a float32
# stream beside a 16-bit one took another layout there under descriptors), a width that
# is not a multiple of 16 values (1000: plain loads unvectorised), and wide one-row tiles
LOAD_FORM_WIDTHS = (128, 512, 1000, 1024, 4096)
# widths and row counts whose planned backward forms --load-forms compares (float32
# instructions: dw's float64 sums differ between dw forms by design)
PLANNED_WIDTHS = (512, 1000, 4096, 6144)
PLANNED_ROWS = (1, 300, 16384)
# the instructions whose count moves when a product is fused into an add in one form and
# rounded alone in another (plain products are left out: the compiler may compute one
# twice, which changes no bits)
FLOAT_OPS = re.compile(r"\b((?:fma|add|sub|div|rsqrt|sqrt)\.[a-z.]*f(?:32|64))\b")


REDUCE = re.compile(r'"tt\.reduce"\(.*?\) <\{axis = (\d+) : i32\}>.*?\}\) : \(tensor<([0-9x]+)x(\w+), (#[\w.]+(?:<.*?>)?)>\)',
                    re.S)
LAYOUT_ALIAS = re.compile(r"^(#\w+) = (.*)$", re.M)
BLOCKED = re.compile(r"#ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
                     r"warpsPerCTA = \[([\d, ]+)\]")


def reduction_trees(ttgir: str, last_axis_only: bool = False) -> dict:
    """{(element type, reduced extent, how the extent is split): count} of every reduction
    in a kernel's TTGIR. Triton reduces each thread's elements in register order, then
    across the lanes, then across the warps, so for a blocked layout the order of the
    additions follows the reduced axis's share of it alone: (elements a thread holds
    together, lanes, warps), the extent giving the repetitions. Two forms with the same
    trees and the same fused multiply-adds add in the same order; any other layout is
    kept whole. last_axis_only: only the sums along a 2-D tile's last axis (a row's columns)."""
    import collections
    aliases = dict(LAYOUT_ALIAS.findall(ttgir))

    def resolve(text: str) -> str:
        for _ in range(8):
            new = re.sub(r"#\w+(?![\w.<])", lambda m: aliases.get(m.group(0), m.group(0)), text)
            if new == text:
                break
            text = new
        return text

    trees = collections.Counter()
    for axis, shape, dtype, layout in REDUCE.findall(ttgir):
        axis, dims, layout = int(axis), [int(d) for d in shape.split("x")], resolve(layout)
        if last_axis_only and (len(dims) < 2 or axis != len(dims) - 1):
            continue
        m = BLOCKED.match(layout)
        if m:
            spt, tpw, wpc = ([int(v) for v in g.split(",")][axis] for g in m.groups())
            split = f"{spt} a thread, {tpw} lanes, {wpc} warps"
        else:
            split = layout
        trees[(dtype, dims[axis], split)] += 1
    return dict(trees)


def float_ops(form, target, last_axis_only: bool = False) -> dict:
    """{PTX floating-point instruction: count} of one recorded form, and under the key
    "reductions" its reduction trees (reduction_trees; last_axis_only: a row's sums only)."""
    import collections
    import triton
    from triton.compiler import ASTSource
    kernel, signature, constexprs, attrs, options, _, _ = form
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    ops = dict(collections.Counter(FLOAT_OPS.findall(_without_identities(compiled.asm["ptx"]))))
    ops["reductions"] = reduction_trees(compiled.asm["ttgir"], last_axis_only)
    return ops


NEG_ZERO = "0f80000000"


def _without_identities(ptx: str) -> str:
    """The PTX without the float32 multiply-adds that round nothing: a * b + (-0), which is
    a * b rounded once, bit for bit (x + -0 = x for every x, -0 and +0 included), and
    a * (-0) + c, which is c. Under Triton 3.9 LLVM's vectoriser pads vector lanes with
    such identities (the H 128 float32-stream backward: fma with a -0 register as the
    addend), where 3.6 writes plain multiplies; counted as they are, the two would read as
    a fused product."""
    zeros = set(re.findall(rf"mov\.b32\s+(%r\d+), {NEG_ZERO};", ptx)) | {NEG_ZERO}
    keep = []
    for line in ptx.splitlines():
        m = re.match(r"\s*fma\.rn\.f32\s+%r\d+, ([%\w]+), ([%\w]+), ([%\w]+);", line)
        if m and (m.group(3) in zeros or m.group(1) in zeros or m.group(2) in zeros):
            continue
        keep.append(line)
    return "\n".join(keep)


@contextlib.contextmanager
def _descriptors_forced(on: bool = True):
    """Within the block the dispatcher reads rows through tensor descriptors wherever
    rows.descriptor_depth allows them (recorded launches: no address to check)."""
    from trainnorm import dispatch, rows

    def aligned(stages, col_tiles, nh, *views, elt, block_n, hidden):
        if col_tiles != 1 or nh != 1:
            return 0
        return rows.descriptor_depth(stages, [t.element_size() for t, _ in views if t is not None], elt, block_n,
                                     hidden)

    real = dispatch.descriptor_stages
    if on:
        dispatch.descriptor_stages = aligned
    try:
        yield
    finally:
        dispatch.descriptor_stages = real


def _form_ops(target, call, kernels, last_axis_only=False, per_row=False, **override) -> dict:
    """float_ops of the one form of `kernels` that call() launches under configs.override;
    per_row: each instruction's count over the form's rows a tile (BLOCK_M), a fraction where
    it does not divide (one chunk of few rows runs a tile of fewer rows: the same code a row)."""
    from fractions import Fraction

    from trainnorm import configs
    launches = Launches(target)
    with recording(launches), configs.override(**override):
        call()
    (one,) = [f for key, f in launches.forms.items() if key[0] in kernels]
    ops = float_ops(_direct_twin(one), target, last_axis_only)
    kernel, constexprs = one[0], one[2]
    if per_row and "BLOCK_M" in kernel.arg_names:
        rows = constexprs[(kernel.arg_names.index("BLOCK_M"),)]
        ops = {k: v if k == "reductions" else Fraction(v, rows) for k, v in ops.items()}
    return ops


def _direct_twin(form):
    """The form with DW_FORM "direct" in place of "row" (DwForm.ROW, the backward over one row),
    the same launch otherwise. The row form forms dw's terms in float32 where the others take
    float64 (left out of these comparisons), the same bits (tests/test_kernels.py::
    test_one_row_dw_is_the_float64_terms_bits on the interpreter and the GPU); counted, those
    products and their additions into dw would read as dx's instructions. Its dx is compared
    through the twin: the kernel's code for dx does not look at DW_FORM."""
    kernel, signature, constexprs, attrs, options, named, widths = form
    key = (kernel.arg_names.index("DW_FORM"),) if "DW_FORM" in kernel.arg_names else None
    if key is None or constexprs.get(key) != "row":
        return form
    return kernel, signature, {**constexprs, key: "direct"}, attrs, options, named, widths


def _fwd_call(hidden, w_dt, extra="", rows=16384):
    """The forward on uninitialised bf16 rows with a weight of w_dt; extra: "residual",
    "gate after" or "gate first" (the gated forward), or "" (plain)."""
    import trainnorm
    e = lambda: torch.empty(rows, hidden, dtype=torch.bfloat16)
    w = torch.empty(hidden, dtype=w_dt)
    if extra.startswith("gate"):
        return lambda: trainnorm.rms_norm_gated_forward(e(), e(), w, norm_before_gate=extra == "gate after")
    return lambda: trainnorm.rms_norm_forward(e(), w, residual=e() if extra == "residual" else None)


def _bwd_call(rows, hidden, case, deterministic=True, pad=0):
    """The backward of a stream set (PLANNED_SETS) on uninitialised rows; pad: the rows'
    stride exceeds hidden by this."""
    import trainnorm
    _, x_dt, dy_dt, h_dt, dh_dt, gate, spec = case
    e = lambda dt: torch.empty(rows, hidden + pad, dtype=dt)[:, :hidden]
    w = torch.empty(hidden, dtype=x_dt)
    if gate:
        return lambda: trainnorm.rms_norm_gated_backward(e(dy_dt), e(h_dt), e(x_dt), w, torch.empty(rows),
                                                         norm_before_gate=gate == "after",
                                                         deterministic=deterministic)
    return lambda: torch.ops.trainnorm.rms_norm_bwd(e(dy_dt), e(h_dt), w, torch.empty(rows),
                                                    e(dh_dt) if dh_dt else None, None, spec, deterministic, True,
                                                    None)


def _differing(what: str, ops: dict, keep=lambda op: True) -> list[str]:
    """[a line naming every form's instructions] where the forms' ops (those `keep` takes) differ."""
    def kept(k, v):
        return {t: n for t, n in v.items() if keep(t[0])} if k == "reductions" else v

    ops = {form: {k: kept(k, v) for k, v in o.items() if keep(k) or k == "reductions"} for form, o in ops.items()}
    first = next(iter(ops.values()))
    if all(v == first for v in ops.values()):
        return []
    return [f"{what}: " + "; ".join(f"{form} {sorted(v.items())}" for form, v in ops.items())]


def dx_op(op: str) -> bool:
    """The instructions by which the backward's planned forms are compared for dx (counted a
    tile row, _form_ops per_row): float32 ones but the adds. Where a tile holds fewer rows a
    thread (one chunk of few rows, plan.one_chunk_block_m), the adds of the cross-warp step of
    a row's sum, one a thread whatever its rows, count differently a row (Triton 3.6, H 512 at 2
    and 8 rows a tile); the sum itself is compared as its tree ("reductions"), and a product
    fused in one form and rounded alone in another still shows as one fma.rn.f32 fewer."""
    return op.endswith("f32") and not op.startswith("add.")


def check_load_forms(target, widths=LOAD_FORM_WIDTHS, rows=16384) -> list[str]:
    """The backward's load forms at each width and stream dtypes (on the width's bf16 entry,
    descriptors forced), the backward forms the plans take at T 1, 300 and 16384, and the
    forward's load forms where the table reads through descriptors, compiled for `target`:
    a line for every set whose forms compile to different floating-point instructions or
    reduction trees (a product fused into an add in one form and rounded alone in
    another, or a row summed in another order, gives other bits). The planned forms are
    compared on rows of the width's stride and on rows whose stride (hidden + 4 values)
    rules descriptors out: where rows lie changes no bit."""
    from trainnorm import configs
    bad = []
    one_tile = ("bwd_one_tile_kernel",)
    for hidden in widths:
        base = configs.backward_config(configs.backward_key(hidden, 2))
        for streams in LOAD_FORM_STREAMS:
            ops = {}
            for form, kw in LOAD_FORMS.items():
                with _descriptors_forced(bool(kw["tma_stages"])):
                    ops[form] = _form_ops(target, _bwd_call(rows, hidden, streams), one_tile,
                                          backward=base.replace(direct_max_rows=0, slices_max_rows=0, **kw))
            bad += _differing(f"H {hidden}, {streams[0]}", ops)
    # the forms the plans take as T grows (one chunk, column slices, chunks): a row's dx
    # must not depend on T (before 2dedf9a the chunked form at H 1000 with a residual
    # rounded a product that the one-chunk form fused); float32 instructions only, counted
    # a tile row (a chunk of fewer rows than the tile runs a tile of fewer rows)
    planned = ("bwd_one_tile_kernel", "bwd_col_slices_kernel", "bwd_col_tiles_kernel")
    for hidden in PLANNED_WIDTHS:
        for streams in LOAD_FORM_STREAMS:
            ops = {f"T {t}": _form_ops(target, _bwd_call(t, hidden, streams), planned, per_row=True)
                   for t in PLANNED_ROWS}
            ops[f"T {PLANNED_ROWS[-1]}, stride {hidden + 4}"] = _form_ops(
                target, _bwd_call(PLANNED_ROWS[-1], hidden, streams, pad=4), planned, per_row=True)
            bad += _differing(f"H {hidden}, {streams[0]}, the planned forms", ops, keep=dx_op)
    # the forward's plain and descriptor forms, at H 1536 and where the table reads through
    # descriptors, with and without a (16-bit) residual
    desc_keys, tile_keys = fwd_load_form_keys()
    for hidden, w_dt in desc_keys:
        base = configs.forward_config(configs.forward_key(hidden, 2, w_dt.itemsize))
        for residual in (False, True):
            ops = {}
            for stages in (0, 3, 4):
                with _descriptors_forced():
                    ops[f"stages {stages}"] = _form_ops(target, _fwd_call(hidden, w_dt, "residual" * residual, rows),
                                                        ("fwd_one_tile_kernel",),
                                                        forward=base.replace(tma_stages=stages))
            bad += _differing(f"forward H {hidden}, weight {w_dt}, residual {residual}", ops)
    # the forward's column-tile walk, its tiles held in registers or read twice (H 5120 as three
    # tiles of 2048, and five of 1024 with a float32 weight, when this was written): the
    # multiply-adds, the roots and divisions of rstd and the row sums (with the gate first the
    # walk computes a(z) twice and the held form once: its adds and approximate divisions are
    # left out)
    for hidden, w_dt in tile_keys:
        base = configs.forward_config(configs.forward_key(hidden, 2, w_dt.itemsize))
        for extra in ("", "residual", "gate after", "gate first"):
            call = _fwd_call(hidden, w_dt, extra, rows)
            ops = {f"held {hold}": _form_ops(target, call, ("fwd_col_tiles_kernel",),
                                             forward=lambda key, c, hold=hold: c.replace(hold_tiles=hold, held_tile=())
                                             if key.hidden == hidden else None)
                   for hold in (False, True)}
            bad += _differing(f"forward H {hidden}, weight {w_dt}, {extra or 'plain'}: column tiles held or read "
                              f"twice", ops, keep=lambda op: op == "f32" or op.startswith(("fma", "sqrt", "div.rn")))
    return bad


# --- the forward's rows per tile: one order of a row's sum at every row count ---------------------

# the forms check_forward_rows compares by entry kind, in groups whose forms must all sum a row
# alike: without and with a residual together (SPEC: rms_norm(x, w, residual=r) is rms_norm(h, w)
# bit for bit); a float32 weight keeps its weight_fp32 entry under a gate (configs.forward_key),
# rows per tile and all, so its gated forms are checked too, each order on its own
ROWS_CHECK_GROUPS = {"gated": (("gate after",),),
                     "weight_fp32": (("", "residual"), ("gate after",), ("gate first",))}


def check_forward_rows(target, entries=None) -> list[str]:
    """For every forward entry of the sm_90 table, the forms its plan launches as the row count
    grows (rows per tile by row count, FwdSchedule.rows_block_m; with a residual the held walks
    of plan.RESIDUAL_HOLD, on or off, at FwdSchedule.held_tile's rows and warps), without and with a residual together (a float32-weight
    entry also under a gate, each order alone: ROWS_CHECK_GROUPS), compiled: a line for every
    group whose forms sum a row's columns in other orders (reduction_trees along the last axis;
    the sums over a tile's rows, which count the rows, are left out), i.e. where a row's y and
    rstd could follow T, or y with a residual differ from y of h.
    entries: [(hidden, kind, FwdConfig)] instead of the table's."""
    from trainnorm import configs, plan as plan_mod
    from trainnorm.configs import table as tables
    from trainnorm.variant import Variant
    if entries is None:
        entries = [(e["hidden"], e["kind"], tables.to_config("forward", e))
                   for e in tables.load(configs.DEFAULT_ARCH)["forward"] if e["elt"] == 2]
    bad = []
    kernels = ("fwd_one_tile_kernel", "fwd_col_tiles_kernel")
    edge = plan_mod.RESIDUAL_HOLD_MIN_ROWS
    saved = plan_mod.RESIDUAL_HOLD
    for hidden, kind, cfg in entries:
        w_dt = torch.float32 if kind == "weight_fp32" else torch.bfloat16
        counts = sorted({1, edge - 1, edge, 65536} | {n + d for n, _ in cfg.rows_block_m for d in (0, 1)})
        override = dict(forward=lambda key, c, hidden=hidden, kind=kind, cfg=cfg:
                        cfg if (key.hidden, key.kind) == (hidden, kind) else None)
        for group in ROWS_CHECK_GROUPS.get(kind, (("", "residual"),)):
            forms = {}      # (extra, rows a tile, held) -> (rule, the first row count that launches it)
            try:
                for rule in sorted({saved, True}):
                    plan_mod.RESIDUAL_HOLD = rule
                    for extra in group:
                        variant = Variant(gate="silu" if extra.startswith("gate") else None,
                                          norm_before_gate=extra != "gate first")
                        with configs.override(**override):
                            fp = plan_mod.forward_plan(hidden, torch.bfloat16, w_dt, variant, "sm_90",
                                                       residual=extra == "residual")
                        for n in counts:
                            forms.setdefault((extra, fp.block_m(n), fp.num_warps(n), fp.holds(n)), (rule, n))
                if len(forms) == 1:
                    continue
                trees = {}
                for (extra, bm, nw, held), (rule, n) in forms.items():
                    plan_mod.RESIDUAL_HOLD = rule
                    ops = _form_ops(target, _fwd_call(hidden, w_dt, extra, n), kernels, last_axis_only=True,
                                    **override)
                    warps = f" w{nw}" if nw != cfg.num_warps else ""
                    trees[f"{extra or 'plain'} bm{bm}{warps}{' held' if held else ''} (T {n})"] = \
                        {"reductions": ops["reductions"]}
            finally:
                plan_mod.RESIDUAL_HOLD = saved
            what = f"forward H {hidden} {kind} {'/'.join(e or 'plain' for e in group)}"
            found = _differing(f"{what}, rows per tile", trees)
            print(f"  {what} {sorted(trees)}: {'differ' if found else 'the same'}", flush=True)
            bad += found
    return bad


# --- every width's planned forms: batch invariance and the modes, statically -------------------

# token counts through every dw form of the windows (one chunk, column slices, chunks) and
# the fast mode's atomic form past atomic_min_rows
PLANNED_ALL_ROWS = (1, 16, 64, 300, 4096, 65536)
PLANNED_UNSEEN = (768, 1000, 2560, 3072, 8192)


def check_planned(target, widths=None) -> list[str]:
    """For every width (the table's and PLANNED_UNSEEN) and stream set, the backward form the
    plans launch at each of PLANNED_ALL_ROWS, in both modes from T 4096: a line for every set
    whose forms differ in float32 instructions a tile row (dx_op) or float32 reduction trees, i.e. where a row's
    dx could follow T (batch invariance) or the mode (SPEC: the modes give the same dx).
    dw's float64 sums differ between dw forms by design and are left out."""
    planned = ("bwd_one_tile_kernel", "bwd_col_slices_kernel", "bwd_col_tiles_kernel")
    bad = []
    for hidden in widths or sorted(set(table_widths()) | set(PLANNED_UNSEEN)):
        for case in PLANNED_SETS:
            ops = {}
            for rows in PLANNED_ALL_ROWS:
                for det in ((True, False) if rows >= 4096 else (True,)):
                    ops[f"T {rows}{'' if det else ' fast'}"] = _form_ops(target, _bwd_call(rows, hidden, case, det),
                                                                         planned, per_row=True)
            found = _differing(f"H {hidden}, {case[0]}", ops, keep=dx_op)
            print(f"  H {hidden}, {case[0]}: {'differ' if found else 'the same'}", flush=True)
            bad += found
    return bad


# --- compiling ------------------------------------------------------------------------------

def check_pdl(target) -> list[str]:
    """The PTX of the forward, the backward and its dw combine (H 512, 300 rows) recorded with
    and without dispatch.LAUNCH_PDL (and FORWARD_PDL): with them, each kernel waits for the grid ahead
    (griddepcontrol.wait) before its first global access, then lets the next launch
    (launch_dependents); without it no griddepcontrol at all. [] when that holds, else what
    does not."""
    import triton
    from triton.compiler import ASTSource
    import trainnorm
    from trainnorm import dispatch
    from trainnorm.kernels.common import HAS_PDL
    if not HAS_PDL:
        return [f"Triton {triton.__version__} has no grid dependency control"]

    def ptx_of(pdl: bool) -> dict:
        saved = dispatch.LAUNCH_PDL, dispatch.FORWARD_PDL
        dispatch.LAUNCH_PDL = dispatch.FORWARD_PDL = pdl
        launches = Launches(target)
        try:
            with recording(launches):
                x, _, dy, _, w = _case((300,), 512, torch.bfloat16, torch.bfloat16)
                trainnorm.rms_norm_forward(x, w)
                trainnorm.rms_norm_backward(dy, x, w, torch.empty(300), deterministic=True)
        finally:
            dispatch.LAUNCH_PDL, dispatch.FORWARD_PDL = saved
        out = {}
        for kernel, signature, constexprs, attrs, options, _, _ in launches.forms.values():
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            out[kernel.fn.__name__] = compiled.asm["ptx"]
        return out

    plain, pdl = ptx_of(False), ptx_of(True)
    bad = []
    if sorted(plain) != sorted(pdl) or len(plain) != 3:
        bad.append(f"kernels recorded: {sorted(plain)} plainly, {sorted(pdl)} with PDL (expected 3, the same)")
    for name, ptx in pdl.items():
        body = ptx[ptx.index(".entry"):]
        wait, go, first = (body.find(s) for s in ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                                   ".global."))
        if wait < 0 or go < wait or first < wait:
            bad.append(f"{name} with PDL: wait at {wait}, launch_dependents at {go}, first global access at {first}")
        if "griddepcontrol" in plain.get(name, ""):
            bad.append(f"{name} launched plainly holds griddepcontrol")
    return bad


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, str]:
    """(registers, spill store bytes, ptxas output) of ptxas -v on the PTX."""
    from triton.backends.nvidia.compiler import get_ptxas   # the ptxas Triton itself uses for this arch
    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        tgt = re.search(r"^\.target\s+(\w+)", ptx, re.M)
        res = subprocess.run([ptxas, f"-arch={tgt.group(1) if tgt else f'sm_{arch}'}", "-v", src,
                              "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)) if regs else -1, sum(int(s) for s in spill), text


def label(form) -> str:
    kernel, signature, constexprs, attrs, options, named, widths = form
    names = kernel.arg_names
    absent = [names[i] for (i,), v in sorted(constexprs.items()) if v is None and names[i] not in named]
    ones = [f"{names[i]}=1" for (i,), v in sorted(constexprs.items()) if v == 1 and names[i] not in named]
    ptrs = [(n, signature[n][1:]) for n in names if signature[n].startswith("*")]
    # the first stream's dtype, then every other stream whose dtype differs (a float32
    # weight, residual stream or y); rstd, dw and its workspace are float32 by design
    dtypes = ptrs[0][1] + "".join(f" {n}:{t}" for n, t in ptrs[1:]
                                  if t != ptrs[0][1] and n not in ("RSTD", "DW", "PARTIAL", "COUNTER"))
    text = (f"{kernel.fn.__name__} {dtypes} w{options.num_warps} "
            + " ".join(f"{k}={v}" for k, v in sorted(named.items())))
    if ones:
        text += " " + " ".join(ones)
    if absent:
        text += f" [no {','.join(absent)}]"
    unaligned = [names[i] for (i,), a in sorted(attrs.items()) if not a and signature[names[i]] in ("i32", "i64")]
    if unaligned:
        text += f" [not /16: {','.join(unaligned)}]"
    if widths:
        text += f" (H {','.join(map(str, sorted(widths)))})"
    return text


# shared memory one block may use (opt-in), bytes: a form asking for more fails at launch
# ("out of resource: shared memory"), which no CPU run of the package would see
SHARED_LIMIT = {90: 232448, 100: 232448, 80: 166912, 89: 101376, 86: 101376}


def ptx_digest(ptx: str) -> str:
    """sha1 of the PTX without its debug information (the .loc and .file lines, comments, the
    debug sections and the $L__tmp labels they point at, numbered by the inlined functions):
    two source trees whose kernels compile to the same instructions give the same digest,
    though their line numbers and helper functions differ."""
    import hashlib
    cut = re.search(r"^\s*\.section\s+\.debug", ptx, re.M)
    keep = [re.sub(r"\s*//.*$", "", line) for line in (ptx[:cut.start()] if cut else ptx).splitlines()
            if line.strip() and not line.strip().startswith((".loc", ".file", "//"))
            and not re.fullmatch(r"\$L__tmp\d+:", line.strip())]
    return hashlib.sha1("\n".join(keep).encode()).hexdigest()


def compile_form(form, arch: int, target) -> tuple[int, int, int, int, str]:
    """(registers, spill bytes, bulk tensor copies in the PTX, shared memory bytes,
    ptx_digest) of one recorded form."""
    import triton
    from triton.compiler import ASTSource
    kernel, signature, constexprs, attrs, options, _, _ = form
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    ptx = compiled.asm["ptx"]
    regs, spill, text = ptxas_report(ptx, arch)
    if regs < 0:
        raise RuntimeError(f"ptxas gave no register count: {text.strip()[:200]}")
    return regs, spill, ptx.count("cp.async.bulk.tensor"), compiled.metadata.shared, ptx_digest(ptx)


_FORMS: list = []        # the forms a forked worker compiles, by index


def _compile_one(job):
    i, arch, target = job
    try:
        return compile_form(_FORMS[i], arch, target), None
    except Exception as exc:  # noqa: BLE001 - report every form that fails
        return None, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def _compile_all(forms, arch, target, jobs):
    """(result, error) of every form, in order; `jobs` forked processes compile them."""
    _FORMS[:] = forms
    work = [(i, arch, target) for i in range(len(forms))]
    if jobs <= 1 or len(forms) < 2:
        yield from map(_compile_one, work)
        return
    import multiprocessing as mp
    with mp.get_context("fork").Pool(jobs) as pool:     # the children inherit the recorded forms
        yield from pool.imap(_compile_one, work)


def collect(args, target) -> Launches:
    """The launches of the plans (unless --only) and of the tuner's candidates."""
    launches = Launches(target)
    quick = args.quick
    with recording(launches):
        if args.only in (None, "plans"):
            if quick:
                exercise_quick()
            else:
                exercise(sorted(set(table_widths()) | set(ODD_WIDTHS) | set(UNSEEN_WIDTHS)))
        if args.only in (None, "slices"):
            exercise_slices(**(dict(widths=(4096,), tiles=((16, 64, False, 0), (64, 32, True, 0), (16, 64, True, 3))) if quick else {}))
        if args.only in (None, "fwd-tma"):
            exercise_fwd_tma(**(dict(widths=(4096,), stages=(3,)) if quick else {}))
        if args.only in (None, "fwd-tiles"):
            exercise_fwd_tiles(**(dict(widths=(5120,), limit=1) if quick else {}))
        if args.only in (None, "pieces"):
            exercise_pieces(**(dict(widths=(5120,), limit=1) if quick else {}))
        if args.only in (None, "weight"):
            exercise_weight(**(dict(widths=(5120,)) if quick else {}))
    return launches


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainnorm.dev.compile_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability of the target (default 90)")
    p.add_argument("--quick", action="store_true", help="a few forms of each kernel")
    p.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                   help="processes compiling in parallel (default: one per CPU)")
    p.add_argument("--only", choices=("plans", "slices", "fwd-tma", "fwd-tiles", "pieces", "weight"), default=None,
                   help="only the forms the plans launch (what users run), or only the tuner's column-slice "
                        "tiles, forward descriptor depths, two-pass tiles, two-piece rows or weight reads")
    p.add_argument("--load-forms", action="store_true",
                   help="only check that the load forms (plain, prefetch, tensor descriptors) and the backward "
                        "forms the plans take as T grows compile to the same floating-point instructions")
    p.add_argument("--rows", action="store_true",
                   help="only check that the forward entries' rows per tile (rows_block_m) sum a row's columns in "
                        "one order at every row count")
    p.add_argument("--planned", action="store_true",
                   help="only check that at every width the backward forms the plans take as T grows, and in both "
                        "modes, compile to the same float32 instructions and row-sum orders (minutes)")
    p.add_argument("--pdl", action="store_true",
                   help="only check the PTX of launches with and without programmatic dependent launch "
                        "(dispatch.LAUNCH_PDL): the grid dependency wait ahead of every global access")
    p.add_argument("--ptx-digests", default=None, metavar="PATH",
                   help="also write {form: ptx_digest} of every form compiled to PATH (JSON): run under two "
                        "trees' src and compare, to see whether a source change changed any instruction")
    p.add_argument("--hidden", default=None,
                   help="with --planned: these widths (comma-separated) instead of every table and unseen width")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if _interpreted():
        # the kernels were made for Triton's interpreter at import: start again without it
        env = {k: v for k, v in os.environ.items() if k != INTERPRET}
        return subprocess.call([sys.executable, "-m", "trainnorm.dev.compile_check", *argv], env=env)
    import triton
    from triton.backends.compiler import GPUTarget
    target = GPUTarget("cuda", args.arch, 32)
    widths = [int(h) for h in args.hidden.split(",")] if args.hidden else None
    for wanted, check, what, same in ((args.rows, check_forward_rows, "forward rows per tile",
                                       "one order of a row's sum at every row count"),
                                      (args.planned, check_planned, "planned forms",
                                       "the same at every T and in both modes"),
                                      (args.load_forms, check_load_forms, "load forms",
                                       "the same floating-point instructions"),
                                      (args.pdl, check_pdl, "programmatic dependent launch",
                                       "each kernel waits for the grid ahead before its first global access; "
                                       "plain launches hold no wait")):
        if wanted:
            bad = check(target, widths) if check is check_planned else check(target)
            for line in bad:
                print(f"  {what.upper()} DIFFER ", line)
            print(f"{what} (Triton {triton.__version__}, sm_{args.arch}):",
                  same if not bad else f"{len(bad)} stream sets differ")
            return 1 if bad else 0
    launches = collect(args, target)
    bad = 0
    forms = [form for _, form in sorted(launches.forms.items(), key=lambda kv: kv[0])]
    print(f"{len(forms)} kernel forms; Triton {triton.__version__}, sm_{args.arch}", flush=True)
    digests = {}
    for form, (res, err) in zip(forms, _compile_all(forms, args.arch, target, args.jobs)):
        text = label(form)
        if err is not None:
            bad += 1
            print(f"  FAILED  {text}: {err}", flush=True)
            continue
        regs, spill, bulk, shared, digests[text] = res
        over = shared > SHARED_LIMIT.get(args.arch, shared)
        flag = "  SPILLS" if spill else ""
        if over:
            flag += f"  SHARED MEMORY over {SHARED_LIMIT[args.arch]}"
        if bulk:
            flag += f"  bulk copies {bulk}"
        bad += bool(spill) or over
        print(f"  regs {regs:>3} spill {spill:>5} shared {shared:>6}  {text}{flag}", flush=True)
    if args.ptx_digests:
        with open(args.ptx_digests, "w") as f:
            json.dump(digests, f, indent=0, sort_keys=True)
        print(f"wrote the PTX digests of {len(digests)} forms to {args.ptx_digests}")
    print("compile check:", "OK" if not bad else f"{bad} forms failed, spill or ask for too much shared memory")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
