"""Measure kernel configurations on the GPU: the data behind configs/tuned.py.

Timing as `trainnorm bench` does it (one CUDA-graph replay per sample after an
L2 flush, median of interleaved passes), trainnorm alone. Stage 1 picks the
forward tile (block_m, num_warps) and the backward tile per H at a mid-size T;
stage 2 sweeps the backward's chunking (min_rows_per_chunk, max_chunks) for
the best backward tiles over token counts. Prints tables and writes JSON.

    python3 tools/tune.py --out DIR [--hidden 512,2048] [--quick]

--sweep-bwd replaces both stages for the backward: every candidate tile,
the row-tile loads (plain, prefetch, tensor descriptors), dw_2d, programs per SM and chunking, timed interleaved at several token
counts, the best by geomean over those counts (relative to the best at each
count), then the fast form's edge (atomic_min_rows) for the winner; it writes
tuned.py (configs/tuned.py with the BWD table replaced, each entry carrying its
numbers) and sweep.json to --out.

--sweep-small times, at T 1-512, the BWD entry's chunked backward against one
chunk (each load form) and against the column-slice dw form (each tile) and
writes the BWD_DIRECT table: the one-chunk window, then the column-slice
window past it. --sweep-fwd times every forward tile at T 1-65536 and writes
FWD and FWD_W32.

--sweep-bwd --gated does the same for the SiLU-gated backward
(rms_norm_gated, gate after the norm) at the gated bench widths (H 4096, and
H 128 as [T, 32, 128]) and writes the BWD_GATED table instead.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import trainnorm  # noqa: E402
from trainnorm import configs  # noqa: E402
from trainnorm.bench.timing import L2Flush, make_timer, percentile, sample_interleaved  # noqa: E402
from trainnorm.configs import BwdConfig, FwdConfig, tuned  # noqa: E402

FAMILIES = {512: 1, 1536: 1, 2048: 1, 4096: 1, 5120: 1, 6144: 1, 256: 24}   # H -> heads per token
GATED_FAMILIES = {4096: 1, 128: 32}    # the gated bench rows: H4096 and [T, 32, 128]


def _heads(hidden, gated=False):
    return (GATED_FAMILIES if gated else FAMILIES).get(hidden, 1)


def _set(fwd: FwdConfig | None = None, bwd: BwdConfig | None = None, hidden: int = 0, gated: bool = False,
         w32: bool = False):
    """Put a config into the live table (FWD_W32 with w32, BWD_GATED with gated) and drop the caches."""
    if fwd is not None:
        (tuned.FWD_W32 if w32 else tuned.FWD)[(hidden, 2)] = fwd.__dict__
    if bwd is not None:
        (tuned.BWD_GATED if gated else tuned.BWD)[(hidden, 2)] = bwd.__dict__
    configs.forward_config.cache_clear()
    configs.backward_config.cache_clear()


def _inputs(hidden, tokens, dev, gated=False):
    """x, w, dy, rstd (and the gate z with gated=True)."""
    heads = _heads(hidden, gated)
    shape = (tokens, heads, hidden) if heads > 1 else (tokens, hidden)
    x = torch.randn(shape, device=dev).to(torch.bfloat16)
    w = torch.randn(hidden, device=dev).to(torch.bfloat16)
    dy = torch.randn(shape, device=dev).to(torch.bfloat16)
    if gated:
        z = torch.randn(shape, device=dev).to(torch.bfloat16)
        _, rstd = trainnorm.rms_norm_gated_forward(x, z, w)
        return x, w, dy, rstd, z
    y, rstd, h = trainnorm.rms_norm_forward(x, w)
    return x, w, dy, rstd


def time_fns(fns: dict, flush, passes=3, samples=8) -> dict:
    stream = torch.cuda.Stream()
    timers = []
    with torch.cuda.stream(stream):
        for name, fn in fns.items():
            timers.append(make_timer(name, fn, stream))
    torch.cuda.synchronize()
    res = sample_interleaved(timers, flush, passes, samples)
    out = {k: percentile([s for p in v for s in p], 50) for k, v in res.items()}
    for t in timers:
        t.release()
    return out


def fwd_candidates(hidden):
    bn = configs.next_pow2(hidden)
    for bm, nw in itertools.product((1, 2, 4, 8, 16, 32), (2, 4, 8, 16)):
        if bm * bn <= 16384 and bm * bn >= 32 * nw:
            yield FwdConfig(bm, bn, nw)


def bwd_tiles(hidden):
    bn = configs.next_pow2(hidden)
    for bm, nw in itertools.product((1, 2, 4, 8, 16, 32), (4, 8, 16)):
        if bm * bn <= 8192 and bm * bn >= 32 * nw:
            yield bm, bn, nw


def stage1(hidden, dev, flush, tokens, log):
    x, w, dy, rstd = _inputs(hidden, tokens, dev)
    rows = rstd.numel()
    fwd = {}
    for cfg in fwd_candidates(hidden):
        _set(fwd=cfg, hidden=hidden)
        name = f"fwd bm{cfg.block_m} w{cfg.num_warps}"
        try:
            fwd[cfg] = time_fns({name: lambda: trainnorm.rms_norm_forward(x, w)}, flush)[name]
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            log(f"  {name}: {type(e).__name__}")
    bwd = {}
    for bm, bn, nw in bwd_tiles(hidden):
        cfg = BwdConfig(bm, bn, nw, min_rows_per_chunk=max(bm, 16), max_chunks=528)
        _set(bwd=cfg, hidden=hidden)
        ws = trainnorm.backward_workspace(rows, hidden, device=dev)
        name = f"bwd bm{bm} w{nw}"
        try:
            bwd[(bm, bn, nw)] = time_fns(
                {name: lambda: trainnorm.rms_norm_backward(dy, x, w, rstd, workspace=ws)}, flush)[name]
        except Exception as e:  # noqa: BLE001
            log(f"  {name}: {type(e).__name__}")
    return fwd, bwd


def stage2(hidden, tile, dev, flush, token_list):
    bm, bn, nw = tile
    res = {}
    for tokens in token_list:
        x, w, dy, rstd = _inputs(hidden, tokens, dev)
        rows = rstd.numel()
        for min_rows, max_chunks in itertools.product((bm, 4 * bm, 16 * bm, 64 * bm), (132, 264, 528, 1056, 2112)):
            cfg = BwdConfig(bm, bn, nw, min_rows_per_chunk=min_rows, max_chunks=max_chunks)
            if cfg.chunking(rows)[0] * hidden * 8 > (256 << 20):
                continue
            _set(bwd=cfg, hidden=hidden)
            fns = {}
            for det in (True, False):
                ws = trainnorm.backward_workspace(rows, hidden, deterministic=det, device=dev)
                fns[f"{det}"] = (lambda ws=ws, det=det: trainnorm.rms_norm_backward(
                    dy, x, w, rstd, deterministic=det, workspace=ws))
            t = time_fns(fns, flush, passes=2, samples=6)
            res[(tokens, min_rows, max_chunks)] = (t["True"], t["False"], cfg.chunking(rows)[0])
    return res


SWEEP_TILES = {   # (block_m, num_warps) around the tiles stage 1 picked
    512: [(16, 4), (8, 4), (4, 4), (16, 8), (8, 8)],
    1536: [(2, 8), (1, 4), (2, 4), (4, 8)],
    2048: [(2, 8), (1, 4), (2, 4), (4, 8)],
    4096: [(1, 4), (1, 8), (2, 8)],
    5120: [(1, 8), (1, 16), (2, 16)],
    6144: [(1, 8), (1, 16), (2, 16)],
    # bm32 w4 (the stage-2 entry) spills ~850 bytes a thread with prefetch (tools/compile_check.py,
    # Triton 3.9): tiles of at most 32 elements a thread
    256: [(16, 4), (8, 4), (16, 8)],
}
SWEEP_TILES_GATED = {
    4096: [(1, 8), (2, 8), (2, 16)],
    128: [(32, 4), (32, 8), (64, 8)],
}
SWEEP_T = (256, 1024, 4096, 16384, 65536)
SWEEP_T_HEAD = (1024, 4096, 16384)      # x the heads per token (24 for H 256, 32 for gated H 128)
# row-tile loads: (prefetch, tma_stages): plain, register prefetch, tensor descriptors 3 or 4 deep
SWEEP_LOADS = ((False, 0), (True, 0), (False, 3), (False, 4))
DW_2D_MAX_H = 2048      # dw_2d is swept up to this H (wider tiles hold too many float64 sums)
SWEEP_SCHED = [(c, m) for c in (2, 4) for m in (132, 264, 528)]   # (ctas_per_sm, max_chunks)


def _geo(xs):
    import math
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def sweep_bwd(hidden, dev, flush, log, gated=False):
    """{T: {(bm, nw, prefetch, ctas, max_chunks): us}} for the deterministic backward."""
    toks = SWEEP_T_HEAD if _heads(hidden, gated) > 1 else SWEEP_T
    bn = configs.next_pow2(hidden)
    res = {}
    for tokens in toks:
        x, w, dy, rstd, *z = _inputs(hidden, tokens, dev, gated)
        z = z[0] if z else None
        rows = rstd.numel()
        res[tokens] = {}
        d2s = (False, True) if hidden <= DW_2D_MAX_H else (False,)
        tiles = (SWEEP_TILES_GATED if gated else SWEEP_TILES)[hidden]
        for (bm, nw), (pf, st), d2 in itertools.product(tiles, SWEEP_LOADS, d2s):
            fns = {}
            for ctas, mx in SWEEP_SCHED:
                cfg = BwdConfig(bm, bn, nw, min_rows_per_chunk=bm, max_chunks=mx, ctas_per_sm=ctas, prefetch=pf,
                                tma_stages=st, dw_2d=d2)
                _set(bwd=cfg, hidden=hidden, gated=gated)
                ws = trainnorm.backward_workspace(rows, hidden, device=dev, gated=gated)
                fns[(bm, nw, pf, st, d2, ctas, mx)] = (lambda cfg=cfg, ws=ws, dy=dy, x=x, w=w, rstd=rstd, z=z:
                                                       _bwd_with(cfg, hidden, dy, x, w, rstd, ws, True, z))
            try:
                t = time_fns(fns, flush, passes=2, samples=6)
                res[tokens].update(t)
            except Exception as e:  # noqa: BLE001 - a tile that fails to compile or spills badly is dropped
                log(f"  H{hidden} T{tokens} bm{bm} w{nw} pf{int(pf)} tma{st} d2{int(d2)}: "
                    f"{type(e).__name__}: {str(e)[:80]}")
        best = min(res[tokens].items(), key=lambda kv: kv[1])
        log(f"  H{hidden} T{tokens}: best {_key(best[0])} {best[1]:.1f} us")
        del x, w, dy, rstd, z
        torch.cuda.empty_cache()
    return res


def _key(k):
    bm, nw, pf, st, d2, ctas, mx = k
    return f"bm{bm} w{nw}{' pf' if pf else ''}{f' tma{st}' if st else ''}{' d2' if d2 else ''} c{ctas} max{mx}"


def _bwd_with(cfg, hidden, dy, x, w, rstd, ws, det, z=None):
    # the graph captures the launch made with cfg; the table is set before capture and replay alike
    _set(bwd=cfg, hidden=hidden, gated=z is not None)
    if z is not None:
        return trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, deterministic=det, workspace=ws)
    return trainnorm.rms_norm_backward(dy, x, w, rstd, deterministic=det, workspace=ws)


def fast_edge(hidden, cfg, dev, flush, gated=False):
    """{T: (det us, atomic us)} of cfg with the atomic form forced on."""
    toks = SWEEP_T_HEAD if _heads(hidden, gated) > 1 else SWEEP_T
    out = {}
    atomic = replace(cfg, atomic_min_rows=0)
    for tokens in toks:
        x, w, dy, rstd, *z = _inputs(hidden, tokens, dev, gated)
        z = z[0] if z else None
        rows = rstd.numel()
        _set(bwd=atomic, hidden=hidden, gated=gated)   # the workspaces are sized by the table
        ws_d = trainnorm.backward_workspace(rows, hidden, deterministic=True, device=dev, gated=gated)
        ws_f = trainnorm.backward_workspace(rows, hidden, deterministic=False, device=dev, gated=gated)
        t = time_fns({"det": lambda: _bwd_with(atomic, hidden, dy, x, w, rstd, ws_d, True, z),
                      "fast": lambda: _bwd_with(atomic, hidden, dy, x, w, rstd, ws_f, False, z)},
                     flush, passes=3, samples=6)
        out[tokens] = (t["det"], t["fast"], rows)
    return out


def render_bwd_table(chosen, name="BWD") -> str:
    lines = [f"{name}: dict = {{"]
    for hidden, c in chosen.items():
        cfg, note, edge_note = c["cfg"], c["note"], c["edge_note"]
        lines.append(f"    # {note}")
        lines.append(f"    ({hidden}, 2): dict(block_m={cfg.block_m}, block_n={cfg.block_n}, num_warps={cfg.num_warps}, "
                     f"min_rows_per_chunk={cfg.min_rows_per_chunk}, max_chunks={cfg.max_chunks},")
        lines.append(f"                   ctas_per_sm={cfg.ctas_per_sm}, prefetch={cfg.prefetch}, "
                     f"tma_stages={cfg.tma_stages}, dw_2d={cfg.dw_2d},")
        lines.append(f"                   # {edge_note}")
        amr = "NEVER" if cfg.atomic_min_rows >= tuned.NEVER else cfg.atomic_min_rows
        lines.append(f"                   atomic_min_rows={amr}),")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_table(path, name, table):
    """`path` with the table `name` replaced by the text `table`; a path that does not exist yet
    starts as configs/tuned.py, so sweeps writing to one --out add up."""
    import re
    src = open(path if os.path.exists(path) else tuned.__file__).read()
    out, n = re.subn(rf"^{name}: dict = \{{.*?\n\}}\n", lambda m: table, src, count=1, flags=re.S | re.M)
    if n != 1:
        raise ValueError(f"{path if os.path.exists(path) else tuned.__file__} has no table {name}")
    with open(path, "w") as f:
        f.write(out)


def _entry_texts(name) -> dict:
    """{(H, elt): text} of table `name` in configs/tuned.py as it was when this run
    started: each entry with the comment lines above it."""
    import ast
    import re
    src = ORIGINAL_SOURCE
    m = re.search(rf"^{name}: dict = \{{\n(.*?)^\}}\n", src, flags=re.S | re.M)
    texts, block, key = {}, [], None
    for line in (m.group(1).splitlines(keepends=True) if m else []):
        head = re.match(r"    \((\d+), (\d+)\):", line)
        if line.startswith("    #") and key is not None:
            texts[key], block, key = "".join(block), [], None
        if head:
            if key is not None:
                texts[key], block = "".join(block), []
            key = ast.literal_eval(f"({head.group(1)}, {head.group(2)})")
        block.append(line)
    if key is not None:
        texts[key] = "".join(block)
    return texts


def _kept(original, chosen, name):
    """The entries of `original` (table `name`) that were not swept, as they were written."""
    texts = _entry_texts(name)
    return "".join(texts.get(key, f"    {key!r}: {entry!r},\n")
                   for key, entry in original.items() if key[0] not in chosen)


def write_tuned(chosen, path, gated=False):
    """tuned.py with the BWD (or BWD_GATED) table replaced by `chosen` plus the entries not swept."""
    name = "BWD_GATED" if gated else "BWD"
    table = render_bwd_table(chosen, name)
    table = table[:-2] + _kept(ORIGINAL_BWD_GATED if gated else ORIGINAL_BWD, chosen, name) + "}\n"
    write_table(path, name, table)


ORIGINAL_SOURCE = open(tuned.__file__).read()
ORIGINAL_BWD = dict(tuned.BWD)
ORIGINAL_BWD_GATED = dict(tuned.BWD_GATED)
ORIGINAL_BWD_DIRECT = dict(tuned.BWD_DIRECT)
ORIGINAL_FWD = dict(tuned.FWD)
ORIGINAL_FWD_W32 = dict(tuned.FWD_W32)


# --- the backward's one-chunk window (--sweep-small) ----------------------------------------

SMALL_T = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SMALL_WIDTHS = (512, 1536, 2048, 4096, 5120, 6144)
# loads of the one-chunk form: (prefetch, tma_stages)
SMALL_LOADS = ((False, 0), (True, 0), (False, 2), (False, 3), (False, 4))
# column-slice dw tiles (cols_block_m, cols_block_n); tools/compile_check.py compiles these
SMALL_COLS = ((16, 64), (16, 128), (32, 128), (16, 256))


def _loads_key(pf, st):
    return "plain" if not pf and not st else ("prefetch" if pf else f"tma{st}")


def _cols_key(bm, bn):
    return f"cols{bm}x{bn}"


def sweep_small(hidden, dev, flush, log):
    """{T: {name: us}}: the table's form ("table") and one chunk with each load form, interleaved per T."""
    base = replace(configs.backward_config(hidden, torch.bfloat16), direct_max_rows=0,
                   direct_prefetch=None, direct_tma_stages=None)
    res = {}
    for tokens in SMALL_T:
        x, w, dy, rstd = _inputs(hidden, tokens, dev)
        _set(bwd=base, hidden=hidden)
        ws = trainnorm.backward_workspace(rstd.numel(), hidden, device=dev)
        fns = {"table": lambda ws=ws, x=x, w=w, dy=dy, rstd=rstd: _bwd_with(base, hidden, dy, x, w, rstd, ws, True)}
        for pf, st in SMALL_LOADS:
            cfg = replace(base, direct_max_rows=1 << 40, direct_prefetch=pf, direct_tma_stages=st)
            fns[_loads_key(pf, st)] = (lambda cfg=cfg, x=x, w=w, dy=dy, rstd=rstd:
                                       _bwd_with(cfg, hidden, dy, x, w, rstd, None, True))
        for bm, bn in SMALL_COLS:
            cfg = replace(base, cols_max_rows=1 << 40, cols_block_m=bm, cols_block_n=bn)
            fns[_cols_key(bm, bn)] = (lambda cfg=cfg, x=x, w=w, dy=dy, rstd=rstd:
                                      _bwd_with(cfg, hidden, dy, x, w, rstd, None, True))
        res[tokens] = time_fns(fns, flush, passes=3, samples=8)
        log(f"  H{hidden} T{tokens}: " + ", ".join(f"{k} {v:.2f}" for k, v in res[tokens].items()))
    tuned.BWD.clear()
    tuned.BWD.update(ORIGINAL_BWD)
    configs.backward_config.cache_clear()
    return base, res


# Replays of a few microseconds differ by ~1-2% between interleaved groups: a one-chunk form within
# this of the table does not end the window (the H200 sweep of H 4096 read T2 5.70 against 5.65 us,
# then T4 6.78 against 9.36 and T8 9.07 against 9.34)
SMALL_NOISE = 0.02


def _window(res, toks, names, win):
    """(best, edge, note): of `names`, the form with the best geomean against the table over the
    counts `win`, and its window: up to the last count of `toks` where it is faster, with no count
    before it where it is slower by more than SMALL_NOISE (edge 0: none)."""
    best = min(names, key=lambda k: _geo([res[t][k] / res[t]["table"] for t in win]))
    edge = 0
    for t in toks:
        if res[t][best] > res[t]["table"] * (1 + SMALL_NOISE):
            break
        if res[t][best] < res[t]["table"]:
            edge = t
    return best, edge, ", ".join(f"T{t} {res[t]['table']:.2f}/{res[t][best]:.2f}" for t in toks)


def choose_small(res):
    """(loads name, direct_max_rows, note): the one-chunk load form and window (_window) over the
    counts where some one-chunk form beats the table; (None, 0, note) where none pays."""
    toks = sorted(res)
    names = [k for k in res[toks[0]] if k != "table" and not k.startswith("cols")]
    win = [t for t in toks if min(res[t][k] for k in names) < res[t]["table"]] or toks[:1]
    best, edge, note = _window(res, toks, names, win)
    if edge == 0:
        return None, 0, note     # no count where the one-chunk form pays: the table's forms stay
    return best, edge if edge > 1 else 0, note


def choose_cols(res, after):
    """(cols name, cols_max_rows, note): the column-slice tile and window (_window) past the one-chunk
    window (counts > after); (None, 0, note) where no tile pays."""
    toks = [t for t in sorted(res) if t > after]
    names = [k for k in res[toks[0]] if k.startswith("cols")] if toks else []
    win = [t for t in toks if names and min(res[t][k] for k in names) < res[t]["table"]]
    if not win:
        return None, 0, ""
    best, edge, note = _window(res, toks, names, win)
    return (best, edge, note) if edge else (None, 0, note)


def main_small(args, dev, flush, log):
    lines, raw = [], {}
    tuned.BWD_DIRECT.clear()     # "table" is the BWD entry alone
    configs.backward_config.cache_clear()
    for hidden in [int(h) for h in args.hidden.split(",")]:
        base, res = sweep_small(hidden, dev, flush, log)
        best, edge, note = choose_small(res)
        cbest, cedge, cnote = choose_cols(res, edge)
        raw[hidden] = {"times": {str(t): v for t, v in res.items()}, "loads": best, "direct_max_rows": edge,
                       "cols": cbest, "cols_max_rows": cedge}
        log(f"H{hidden}: one chunk ({best}) up to {edge} rows | table/one-chunk us: {note}")
        log(f"H{hidden}: column-slice dw ({cbest}) up to {cedge} rows | table/cols us: {cnote}")
        lines.append(f"    # table/one-chunk {best} us: {note}")
        if cnote:
            lines.append(f"    # table/{cbest or 'column-slice dw'} us: {cnote}")
        fields = []
        if best is not None:
            pf, st = next((p, s) for p, s in SMALL_LOADS if _loads_key(p, s) == best)
            fields.append(f"direct_max_rows={edge}, direct_prefetch={pf}, direct_tma_stages={st}")
        if cbest is not None:
            bm, bn = next((m, n) for m, n in SMALL_COLS if _cols_key(m, n) == cbest)
            fields.append(f"cols_max_rows={cedge}, cols_block_m={bm}, cols_block_n={bn}")
        if fields:
            lines.append(f"    ({hidden}, 2): dict({', '.join(fields)}),")
        else:
            lines[-1] += f" (H{hidden}: no entry, the table's forms stay)"
        table = "BWD_DIRECT: dict = {\n" + "\n".join(lines) + "\n" + _kept(ORIGINAL_BWD_DIRECT, raw, "BWD_DIRECT") + "}\n"
        write_table(os.path.join(args.out, "tuned.py"), "BWD_DIRECT", table)
        with open(os.path.join(args.out, "sweep-small.json"), "w") as f:
            json.dump(raw, f, indent=1)


# --- the forward tile over token counts (--sweep-fwd) ---------------------------------------

FWD_T = (1, 16, 1024, 16384, 65536)
FWD_WIDTHS = (512, 1536, 2048, 4096, 5120, 6144)
FWD_W32_WIDTHS = (5120, 6144)     # the bench's float32-weight rows
FWD_TMA_STAGES = (3, 4)           # the descriptor forms' pipeline depths


FWD_TMA_CTAS = (1, 2, 4)          # and programs per SM


FWD_CHUNK_BN = (512, 1024, 2048)   # the two-pass forms' tile widths
FWD_CHUNK_MAX_TILES = 8
# bench rows that share a width's FWD / FWD_W32 entry with the plain rows: the
# entry is scored on them too (H6144 res and res w32, H4096 gate)
FWD_VARIANTS = {6144: ("", "res"), 4096: ("", "gate")}


def fwd_sweep_candidates(hidden):
    """Plain tiles (tma_stages 0), and the descriptor form of the tiles that hold
    at most 64 elements a thread, at each depth and programs per SM; then rows
    walked twice in 2-8 narrower tiles (the second pass re-reads x from L1 / L2),
    which hold no padding: H 5120 is five 1024-wide tiles where the one-tile
    form holds 8192 columns a row."""
    bn = configs.next_pow2(hidden)
    for bm, nw in itertools.product((1, 2, 4, 8, 16), (2, 4, 8, 16)):
        per_thread = bm * bn // (32 * nw)
        if bm * bn <= 16384 and 4 <= per_thread <= 256 and (nw > 2 or bn <= 1024):
            yield FwdConfig(bm, bn, nw)
            if 8 <= per_thread <= 64 and nw in (4, 8):
                for st, ctas in itertools.product(FWD_TMA_STAGES, FWD_TMA_CTAS):
                    yield FwdConfig(bm, bn, nw, tma_stages=st, ctas_per_sm=ctas)
    for cbn in FWD_CHUNK_BN:
        if cbn < bn and configs.cdiv(hidden, cbn) <= FWD_CHUNK_MAX_TILES:
            for bm, nw in itertools.product((1, 2, 4, 8), (4, 8, 16)):
                # unrolled, a thread holds all of its tiles at once: at most 64 elements
                # (H5120 bm4 n512 w4, 128, spills under ptxas: tools/compile_check.py)
                per_thread = bm * cbn // (32 * nw)
                if 4 <= per_thread and per_thread * configs.cdiv(hidden, cbn) <= 64:
                    yield FwdConfig(bm, cbn, nw)


def _fwd_key(c: FwdConfig, hidden: int):
    chunk = c.block_n if c.block_n < configs.next_pow2(hidden) else 0
    return (c.block_m, c.num_warps, c.tma_stages, c.ctas_per_sm if c.tma_stages else 0, chunk)


def _fwd_name(k) -> str:
    return f"bm{k[0]} w{k[1]}" + (f" tma{k[2]} c{k[3]}" if k[2] else "") + (f" n{k[4]}" if k[4] else "")


def _fwd_entry(hidden, k) -> str:
    extra = f", tma_stages={k[2]}, ctas_per_sm={k[3]}" if k[2] else ""
    return f"dict(block_m={k[0]}, block_n={k[4] or configs.next_pow2(hidden)}, num_warps={k[1]}{extra})"


def _fwd_with(cfg, hidden, x, w, w32, r=None, z=None):
    _set(fwd=cfg, hidden=hidden, w32=w32)
    if z is not None:
        return trainnorm.rms_norm_gated_forward(x, z, w)
    return trainnorm.rms_norm_forward(x, w, residual=r)


def sweep_fwd(hidden, dev, flush, log, w32=False):
    """{(variant, T): {key: us}} of the forward (float32 weight with w32), every
    candidate interleaved per point; variant '' plain, 'res' with a residual,
    'gate' gated (FWD_VARIANTS)."""
    cands = list(fwd_sweep_candidates(hidden))
    res = {}
    for variant in FWD_VARIANTS.get(hidden, ("",)):
        for tokens in FWD_T:
            x = torch.randn(tokens, hidden, device=dev).to(torch.bfloat16)
            w = torch.randn(hidden, device=dev).to(torch.float32 if w32 else torch.bfloat16)
            r = torch.randn_like(x) if variant == "res" else None
            z = torch.randn_like(x) if variant == "gate" else None
            fns = {_fwd_key(c, hidden): (lambda c=c, x=x, w=w, r=r, z=z: _fwd_with(c, hidden, x, w, w32, r, z))
                   for c in cands}
            res[(variant, tokens)] = pt = time_fns(fns, flush, passes=2, samples=8)
            b = min(pt, key=pt.get)
            log(f"  H{hidden}{' w32' if w32 else ''}{' ' + variant if variant else ''} T{tokens}: "
                f"best {_fwd_name(b)} {pt[b]:.2f} us")
            del x, w, r, z
            torch.cuda.empty_cache()
    return res


def _point(p) -> str:
    return f"{p[0]} T{p[1]}" if p[0] else f"T{p[1]}"


def main_fwd(args, dev, flush, log):
    raw = {}
    for w32 in (False, True):
        name = "FWD_W32" if w32 else "FWD"
        original = ORIGINAL_FWD_W32 if w32 else ORIGINAL_FWD
        widths = [int(h) for h in args.hidden.split(",") if not w32 or int(h) in FWD_W32_WIDTHS]
        lines, chosen = [], {}
        for hidden in widths:
            res = sweep_fwd(hidden, dev, flush, log, w32)
            best_t = {t: min(v.values()) for t, v in res.items()}
            keys = set.intersection(*(set(v) for v in res.values()))
            score = {k: _geo([res[t][k] / best_t[t] for t in res]) for k in keys}
            k = min(score, key=score.get)
            prev = original.get((hidden, 2)) or (ORIGINAL_FWD.get((hidden, 2)) if w32 else None)
            pk = _fwd_key(FwdConfig(**prev), hidden) if prev else None
            times = ", ".join(f"{_point(t)} {res[t][k]:.2f}" for t in res)
            prev_note = (f"; previous {_fwd_name(pk)} x{score[pk]:.3f}: "
                         + ", ".join(f"{_point(t)} {res[t][pk]:.2f}" for t in res)) if pk in score else ""
            lines.append(f"    # {_fwd_name(k)}: {times} us; x{score[k]:.3f} geomean, worst "
                         f"x{max(res[t][k] / best_t[t] for t in res):.2f} of the best per point over {len(score)}{prev_note}")
            lines.append(f"    ({hidden}, 2): {_fwd_entry(hidden, k)},")
            chosen[hidden] = k
            raw[f"{name} {hidden}"] = {"times": {_point(t): {_fwd_name(kk): v for kk, v in r.items()}
                                                 for t, r in res.items()}, "chosen": _fwd_name(k)}
            log(f"{name} H{hidden}: {lines[-2][6:]}")
            table = f"{name}: dict = {{\n" + "\n".join(lines) + "\n" + _kept(original, chosen, name) + "}\n"
            write_table(os.path.join(args.out, "tuned.py"), name, table)
            with open(os.path.join(args.out, "sweep-fwd.json"), "w") as f:
                json.dump(raw, f, indent=1)
    for table, original in ((tuned.FWD, ORIGINAL_FWD), (tuned.FWD_W32, ORIGINAL_FWD_W32)):
        table.clear()
        table.update(original)
    configs.forward_config.cache_clear()


def main_sweep(args, dev, flush, log):
    chosen, raw = {}, {}
    t0 = time.time()
    for hidden in [int(h) for h in args.hidden.split(",")]:
        gated = args.gated
        previous = dict((tuned.BWD_GATED if gated else tuned.BWD).get((hidden, 2), {}))
        res = sweep_bwd(hidden, dev, flush, log, gated)
        keys = set.intersection(*(set(v) for v in res.values()))
        best_t = {t: min(v.values()) for t, v in res.items()}
        score = {k: _geo([res[t][k] / best_t[t] for t in res]) for k in keys}
        k = min(score, key=score.get)
        worst = max(res[t][k] / best_t[t] for t in res)
        bm, nw, pf, st, d2, ctas, mx = k
        cfg = BwdConfig(bm, configs.next_pow2(hidden), nw, min_rows_per_chunk=bm, max_chunks=mx,
                        ctas_per_sm=ctas, prefetch=pf, tma_stages=st, dw_2d=d2)
        edge = fast_edge(hidden, cfg, dev, flush, gated)
        # the atomic form from the smallest measured count from which it is faster at every larger one
        toks = sorted(edge)
        start = None
        for i, t in enumerate(toks):
            if all(edge[u][1] <= edge[u][0] for u in toks[i:]):
                start = t
                break
        rows_per_token = _heads(hidden, gated)
        amr = tuned.NEVER if start is None else (0 if start == toks[0] else start * rows_per_token)
        cfg = replace(cfg, atomic_min_rows=amr)
        times = ", ".join(f"T{t} {res[t][k]:.1f}" for t in sorted(res))
        note = (f"{_key(k)}: {times} us; x{score[k]:.3f} geomean, worst x{worst:.2f} of the best per T "
                f"over {len(keys)} candidates")
        edge_note = "det/atomic us: " + ", ".join(f"T{t} {edge[t][0]:.1f}/{edge[t][1]:.1f}" for t in toks)
        chosen[hidden] = dict(cfg=cfg, note=note, edge_note=edge_note)
        raw[hidden] = {"times": {str(t): {_key(kk): v for kk, v in r.items()} for t, r in res.items()},
                       "chosen": _key(k), "score": score[k], "edge": {str(t): v for t, v in edge.items()},
                       "previous": previous}
        log(f"H{hidden}: {note} | {edge_note} | atomic_min_rows {amr}  ({time.time() - t0:.0f}s)")
        with open(os.path.join(args.out, "sweep.json"), "w") as f:
            json.dump(raw, f, indent=1)
        # rewritten after every width, so a run cut short keeps what it chose
        write_tuned(chosen, os.path.join(args.out, "tuned.py"), gated)
    log(f"wrote {os.path.join(args.out, 'tuned.py')}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="tune-out")
    p.add_argument("--hidden", default=None,
                   help="comma-separated widths (default: the bench families; with --gated, 4096,128)")
    p.add_argument("--tokens1", type=int, default=16384)
    p.add_argument("--tokens2", default="16,256,1024,4096,16384,65536")
    p.add_argument("--sweep-bwd", action="store_true", help="sweep the backward and write tuned.py (see above)")
    p.add_argument("--gated", action="store_true", help="with --sweep-bwd: the gated backward (BWD_GATED)")
    p.add_argument("--sweep-small", action="store_true",
                   help="the backward's one-chunk window at small T; writes the BWD_DIRECT table")
    p.add_argument("--sweep-fwd", action="store_true",
                   help="the forward tile over token counts 1-65536; writes the FWD and FWD_W32 tables")
    args = p.parse_args()
    if args.hidden is None:
        widths = SMALL_WIDTHS if args.sweep_small else FWD_WIDTHS if args.sweep_fwd else (
            GATED_FAMILIES if args.gated else FAMILIES)
        args.hidden = ",".join(str(h) for h in widths)
    if args.gated and not args.sweep_bwd:
        p.error("--gated needs --sweep-bwd")
    dev = "cuda"
    flush = L2Flush(dev)
    os.makedirs(args.out, exist_ok=True)
    log_lines = []

    def log(s):
        print(s, flush=True)
        log_lines.append(s)

    for flag, fn in ((args.sweep_small, main_small), (args.sweep_fwd, main_fwd)):
        if flag:
            fn(args, dev, flush, log)
            with open(os.path.join(args.out, "tune.txt"), "w") as f:
                f.write("\n".join(log_lines) + "\n")
            return
    if args.sweep_bwd:
        main_sweep(args, dev, flush, log)
        with open(os.path.join(args.out, "tune.txt"), "w") as f:
            f.write("\n".join(log_lines) + "\n")
        return

    results = {}
    t0 = time.time()
    for hidden in [int(h) for h in args.hidden.split(",")]:
        tok1 = args.tokens1
        fwd, bwd = stage1(hidden, dev, flush, tok1, log)
        fbest = sorted(fwd.items(), key=lambda kv: kv[1])[:3]
        bbest = sorted(bwd.items(), key=lambda kv: kv[1])[:3]
        log(f"H{hidden} T{tok1} fwd best: " + ", ".join(f"bm{c.block_m} w{c.num_warps} {t:.1f}us" for c, t in fbest)
            + " | bwd best: " + ", ".join(f"bm{k[0]} w{k[2]} {t:.1f}us" for k, t in bbest)
            + f"  ({time.time() - t0:.0f}s)")
        toks = [int(t) for t in args.tokens2.split(",")]
        if hidden == 256:
            toks = [t for t in toks if 1024 <= t <= 16384]
        s2 = stage2(hidden, bbest[0][0], dev, flush, toks)
        for tokens in toks:
            rows_best = sorted(((k, v) for k, v in s2.items() if k[0] == tokens), key=lambda kv: kv[1][0])[:4]
            log(f"  T{tokens}: " + "; ".join(f"min{k[1]} max{k[2]} P{v[2]}: det {v[0]:.1f} fast {v[1]:.1f}"
                                           for k, v in rows_best) + f"  ({time.time() - t0:.0f}s)")
        results[hidden] = {
            "fwd": {f"{c.block_m},{c.num_warps}": t for c, t in fwd.items()},
            "bwd_tile": {f"{k[0]},{k[2]}": t for k, t in bwd.items()},
            "bwd_chunking": {f"{k[0]},{k[1]},{k[2]}": v for k, v in s2.items()},
            "bwd_tile_used": bbest[0][0],
        }
        with open(os.path.join(args.out, "tune.json"), "w") as f:
            json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "tune.txt"), "w") as f:
        f.write("\n".join(log_lines) + "\n")


if __name__ == "__main__":
    main()
