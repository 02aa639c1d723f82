"""Measure kernel configurations on the GPU and write the measured table (configs/sm_90.json).

Timing as `trainnorm bench` does it (one CUDA-graph replay per sample after an
L2 flush, median of interleaved passes; trainnorm.bench.timing), trainnorm
alone, bf16 activations. Every candidate runs inside `configs.override(...)`
for its own key only: the package's lookups and tables are never patched.
Three sweeps, each writing the entries it chooses through `configs.table`
(`to_entry`, `put`, `save`) into a copy of the architecture's table: every
other entry keeps its fields and notes, and each entry written carries the
times that chose it.

    python -m trainnorm.dev.tune --sweep-bwd [--gated] [--hidden 512,4096] --out DIR
    python -m trainnorm.dev.tune --sweep-small --out DIR
    python -m trainnorm.dev.tune --sweep-fwd [--hidden 6144] [--kinds weight_fp32] [--tokens 256,4096] --out DIR
    python -m trainnorm.dev.tune --sweep-weight [--hidden 5120,6144] --out DIR
    python -m trainnorm.dev.tune --probe-defaults [--gated] [--cases 768x16384,128x131072] --out DIR
    python -m trainnorm.dev.tune --probe-schedule [--cases 6144x256] --out DIR
    python -m trainnorm.dev.tune --probe-chunks [--cases 256x4096] --out DIR
    python -m trainnorm.dev.tune --probe-stream [--cases 4096x16384] --out DIR
    python -m trainnorm.dev.tune --probe-latency [--cases 4096x4] --out DIR
    python -m trainnorm.dev.tune --probe-flush [--cases 2560x65536] --out DIR
    python -m trainnorm.dev.tune --probe-tiles --hidden 6144 --kinds weight_fp32 --tiles "bm2 w8 pieces,bm1 w16 n2048 held" --out DIR
    python -m trainnorm.dev.tune --probe-bwd-tiles [--cases 5120x16384,2560x65536] --out DIR
    python -m trainnorm.dev.tune --probe-pdl [--rows "H512 T1024;H5120 T4096"] --out DIR

--sweep-bwd times, for the backward, every candidate tile with the row-tile
loads (plain, prefetch, tensor descriptors), dw_2d, programs per SM and
chunking, interleaved at several token counts; the entry is the candidate
with the best geomean over those counts (relative to the best at each count),
then the fast form's edge (atomic_min_rows) for it. The small-T windows of
the entry it replaces (direct_max_rows, slices_max_rows, the one-chunk loads,
the slice tile) and their notes are kept: they were measured against the
previous tile, so run --sweep-small again after it. --gated does the same for
the SiLU-gated backward (gate after the norm) at the gated bench widths
(H 4096, and H 128 as [T, 32, 128]): the "gated" entries.

--sweep-small times, at T 1-512, the backward entry's chunked form against
one chunk (each load form) and against the column-slice dw form (each slice
tile): the one-chunk window, then the column-slice window past it, written
into the entry's windows, schedule and slice tile.

--sweep-fwd times every forward tile at T 1-65536 (plain loads, tensor
descriptors, rows walked in narrower tiles, rows held as two pieces) and writes
the "plain" entries and, at the bench's float32-weight widths, the
"weight_fp32" ones; --kinds picks the kinds, --tokens the row counts the entry
is chosen over (default FWD_T for the plain entries, FWD_W32_T, the float32-weight
bench rows' counts, for the others).

--sweep-weight times, at T 1-65536, each forward entry with plain loads with
each weight read its form takes (configs.FwdSchedule.weight_read: before the
tile loop, beside the rows' loads, after the sum of squares) and, for rows
walked in column tiles, the tiles held or walked twice: the same bits, a
load's latency apart at few rows. It writes each entry's weight_read and
hold_tiles.

--probe-defaults times, at widths the table does not hold, the analytical
defaults' configs (configs.default_backward / default_forward) against single
edits of them (half or twice the warps or the rows, the loads, dw_2d, programs
per SM and chunks, a row in two pieces; for the forward also the edits that
keep its bits: rows per tile at every count, the weight read, the descriptor
form): whether the rules are at a local best. Without --cases it also times the
gated forward's rule (configs.gated_forward_from_plain: the plain tile with half
the rows) against the plain tile and single edits (among them the weight reads other
than the rule's: FwdSchedule.gate_weight_read), at GATED_PROBE_CASES (widths
the table holds too: the rule serves every gated forward); --gated times that and
the gated backward's config (the table's gated entry, else configs.gated_from_plain)
against its edits (warps or rows halved, the loads), at --cases if given. It writes
only the raw times (probe-defaults.json) and the log: the rules are code, and their
comments cite the times that chose them.

--probe-schedule times, at SCHEDULE_PROBE_CASES, each forward entry the table
holds at the width (plain and float32 weight, without and with a residual)
against the edits that keep its bits: rows per tile, the descriptor form's depth
and programs per SM, and for a descriptor entry plain loads with each weight
read; and the backward's entry (deterministic, without and with the residual
stream's gradient) against its load forms: plain loads with and without the
prefetch, the other descriptor depths. Raw times to probe-schedule.json and the
log; no table is written.

--probe-chunks times, at CHUNK_PROBE_CASES, the backward's config at the width
(the table's entry, else the default) against the same config with at most 33, 66
or 132 dw chunks at the case's row count (a rows_max_chunks window): raw times to
probe-chunks.json and the log; no table is written.

--probe-stream times the backward of a float32 residual stream under bf16
activations (the explicit and the autograd entry points) at its 16-bit key's
config, with plain loads, deeper descriptor stages and the float32 key's config,
against the bf16 residual pair: raw times to probe-stream.json and the log
(docs/benchmarks/tune/h200-stream.txt holds the first such probe).

--probe-latency times, at few rows (LATENCY_PROBE_CASES), trainnorm's forward and
backward beside the peers' forwards that import (`trainnorm bench`'s adapters) and
two floors, an empty Triton kernel and a copy of the rows, each with the L2 flushed
before every replay and without: where a small-T forward's time goes (a gap to a peer
that closes without the flush is spent on cold fetches, one that stays is the kernel's
own path). Raw times to probe-latency.json and the log.

--probe-placement times the deterministic backward (PLACEMENT_PROBE_CASES by default) on
separately placed copies of the bench's data: the rule's config, the same with its rows dealt
to the chunks a tile at a time (configs.BwdTile.deal_rows), and torch.compile's backward of
the reference, interleaved, twice: whose time follows where its data lies (the same launch
read 4-6% apart on two copies of its data in one process). Raw times to probe-placement.json
and the log.

--probe-flush times, at FLUSH_PROBE_CASES, the forward and backward of trainnorm and of
torch.compile (and max-autotune) after the bench's flush, whose fill leaves L2 full of
dirty lines that DRAM takes back during the next replay, and after a flush that then reads
another buffer of the same size, leaving L2 clean (what ncu's cache control does before
each kernel it times): whether a kernel close to the DRAM limit pays more for those lines
than one with DRAM to spare. Raw times to probe-flush.json and the log.

--probe-tiles times, at --hidden, each forward entry of --kinds against the tiles
--tiles names (the --sweep-fwd candidates, named as its log names them) and
torch.compile of the reference forward, without and with a residual, all
interleaved per point at --tokens (default PROBE_TILES_T): how an entry stands
against the tiles a sweep would pick from and against the peer it must beat
(docs/benchmarks/tune/h100-fwd6144.txt). Raw times to probe-tiles.json and the log.

--probe-bwd-tiles times, at --cases (H x rows; default BWD_TILES_PROBE_CASES), the
deterministic backward's config against the row held as two pieces (4096 + 1024 at
H 5120: none of the 8192-column tile's 3072 masked columns, about half its
registers a thread), the row walked in column tiles of 512-2048 (walk_edits: the
walked widths' kernel, two passes, dw's partial added in place; 64-113 registers at
H 5120 where the 8192-column tile takes 255) and single edits of the config
(bwd_tile_edits), all interleaved per case. Raw times to probe-bwd-tiles.json and the log.

--probe-pdl times trainnorm's deterministic fwd, bwd and step on bench rows (--rows,
ids separated by ';'; default PDL_PROBE_ROWS: the bench's adapter and data) launched
plainly and with programmatic dependent launch (dispatch.LAUNCH_PDL), interleaved per
row and op, after a bit-for-bit comparison of the two sides' outputs. Raw times to
probe-pdl.json and the log.

The table is written to DIR/<arch>.json, or to --table PATH; a file already
there is the starting point, so sweeps run into one DIR add up. The package's
own table is written only when --table names it. DIR also gets the raw times
(sweep-bwd.json, sweep-small.json, sweep-fwd.json) and the log (tune.txt).
A new entry changes bits (configs/__init__.py): re-verify with
`trainnorm verify` and the GPU suite before committing a table.

The earlier two-stage search (a forward and a backward tile at one token
count, then the backward's chunking over token counts) is gone: the sweeps
time those choices at every count, and the table's method cites only them.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import trainnorm
from trainnorm import configs
from trainnorm.configs import BwdConfig, FwdConfig, Key, cdiv, next_pow2, row_pieces
from trainnorm.configs import table as tables
from trainnorm import plan as plan_mod
from trainnorm.families import make_case

ELT = 2                       # the sweeps time bf16 activations (fp16 shares the entries)
NEVER = 1 << 40               # atomic_min_rows of a width whose atomic form never paid

# Head layouts: widths the bench times as per-head rows ([T, heads, H]); their
# sweeps use those rows and fewer token counts (bench/shapes.py)
HEAD_LAYOUTS = {256: 24}
GATED_HEAD_LAYOUTS = {128: 32}
BWD_WIDTHS = (512, 1536, 2048, 4096, 5120, 6144, 256)
GATED_WIDTHS = (4096, 128)


def heads_of(hidden: int, gated: bool = False) -> int:
    return (GATED_HEAD_LAYOUTS if gated else HEAD_LAYOUTS).get(hidden, 1)


# --- the table being written --------------------------------------------------------------

@dataclass
class Run:
    """One tuning run: the table it writes (in memory, saved after every width),
    where its raw data goes, the device, the L2 flush and the log."""
    table: dict
    table_path: str | None = None
    out: str | None = None
    device: object = "cuda"
    flush: object = None
    log: Callable[[str], None] = print
    raw: dict = field(default_factory=dict)

    def save(self, raw_name: str | None = None) -> None:
        if self.table_path:
            tables.save(self.table, self.table_path)
        if self.out and raw_name:
            with open(os.path.join(self.out, raw_name), "w") as f:
                json.dump(self.raw, f, indent=1)


def new_table(arch: str) -> dict:
    return {"arch": arch, "measured_on": "", "method": [], "forward": [], "backward": []}


def start_table(table_path: str, arch: str) -> dict:
    """The table a run starts from: the file at table_path if there is one (earlier
    sweeps into the same place), else a copy of the package's table of arch, else an
    empty table."""
    if os.path.exists(table_path):
        with open(table_path) as f:
            return json.load(f)
    if arch in tables.archs():
        return copy.deepcopy(tables.load(arch))
    return new_table(arch)


def table_path_for(out: str, table: str | None, arch: str) -> str:
    """Where the table is written: --table, else OUT/<arch>.json; never one of the
    package's tables unless --table names it."""
    path = table or os.path.join(out, f"{arch}.json")
    package = {os.path.realpath(tables.path(a)) for a in tables.archs()}
    if table is None and os.path.realpath(path) in package:
        raise SystemExit(f"{path} is the package's table: name it with --table to overwrite it")
    return path


def find_entry(table: dict, op: str, hidden: int, kind: str, elt: int = ELT) -> dict | None:
    return next((e for e in table[op] if (e["hidden"], e["elt"], e["kind"]) == (hidden, elt, kind)), None)


def config_in(table: dict, op: str, hidden: int, kind: str):
    """The config a lookup would give for (hidden, bf16, kind) if `table` were the
    package's (the same fallbacks as configs.forward_config / backward_config)."""
    e = find_entry(table, op, hidden, kind)
    if e is not None:
        return tables.to_config(op, e)
    plain = find_entry(table, op, hidden, "plain")
    if op == "forward":
        return tables.to_config(op, plain) if plain else configs.default_forward(hidden, ELT)
    cfg = tables.to_config(op, plain) if plain else configs.default_backward(hidden, ELT)
    return configs.gated_from_plain(cfg) if kind == "gated" else cfg


def write_entry(table: dict, op: str, hidden: int, kind: str, cfg, notes) -> dict:
    """Put the entry of (hidden, bf16, kind) into `table` (in memory), replacing any
    entry of that key; every other entry stays as it is."""
    entry = tables.to_entry(op, hidden, ELT, kind, cfg, notes)
    tables.put(table, op, entry)
    return entry


def only(hidden: int, kind: str, cfg):
    """An override function: cfg for the key (hidden, bf16, kind), any architecture; the
    lookup's own config for every other key."""
    def pick(key: Key, current):
        return cfg if (key.hidden, key.elt, key.kind) == (hidden, ELT, kind) else None
    return pick


# --- timing -----------------------------------------------------------------------------

def time_fns(fns: dict, flush, passes=3, samples=8, captures=1) -> dict:
    """{name: median us} of zero-argument callables, each captured in `captures` CUDA graphs
    sampled in turn, in interleaved passes (trainnorm.bench.timing). The captures share one
    memory pool and keep no outputs (make_timer's pool): a sweep's memory is one
    candidate's outputs, whatever the number of candidates."""
    from trainnorm.bench.timing import make_timer, percentile, sample_interleaved
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    timers = []
    with torch.cuda.stream(stream):
        for name, fn in fns.items():
            timers.append(make_timer(name, fn, stream, captures=captures, pool=pool))
    torch.cuda.synchronize()
    res = sample_interleaved(timers, flush, passes, samples)
    out = {k: percentile([s for p in v for s in p], 50) for k, v in res.items()}
    for t in timers:
        t.release()
    return out


def captures(rows: int, hidden: int) -> int:
    """CUDA graphs per candidate, as `trainnorm bench` takes them (bench.run.captures_for_bytes:
    several where the rows move at most ROTATE_MAX_BYTES, one past it). The bytes are counted as 8 an
    element whatever the sweep (a 16-bit backward moves 6, a forward 4 and a gated one 6): one
    rule for every sweep, on the side of more captures. A candidate's replay of a few
    microseconds reads up to 8% off through one graph, against the 2% the windows' noise
    rules allow."""
    from trainnorm.bench.run import captures_for_bytes
    return captures_for_bytes(8 * rows * hidden)


def _geo(xs) -> float:
    return statistics.geometric_mean(list(xs))


def _inputs(hidden, tokens, dev, gated=False):
    """x, w, dy, rstd, and the gate z (None without one)."""
    heads = heads_of(hidden, gated)
    shape = (tokens, heads, hidden) if heads > 1 else (tokens, hidden)
    x = torch.randn(shape, device=dev).to(torch.bfloat16)
    w = torch.randn(hidden, device=dev).to(torch.bfloat16)
    dy = torch.randn(shape, device=dev).to(torch.bfloat16)
    if gated:
        z = torch.randn(shape, device=dev).to(torch.bfloat16)
        _, rstd = trainnorm.rms_norm_gated_forward(x, z, w)
        return x, w, dy, rstd, z
    _, rstd, _ = trainnorm.rms_norm_forward(x, w)
    return x, w, dy, rstd, None


def _bwd_with(cfg, hidden, dy, x, w, rstd, ws, det, z=None, dh=None):
    # inside the override at capture and, for an eager fallback, at every call
    kind = "gated" if z is not None else "plain"
    with configs.override(backward=only(hidden, kind, cfg)):
        if z is not None:
            return trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, deterministic=det, workspace=ws)
        return trainnorm.rms_norm_backward(dy, x, w, rstd, dh=dh, deterministic=det, workspace=ws)


def _workspace(cfg, hidden, rows, det, dev, gated):
    """The workspace the backward needs under cfg (its size follows the config's chunking)."""
    with configs.override(backward=only(hidden, "gated" if gated else "plain", cfg)):
        return trainnorm.backward_workspace(rows, hidden, deterministic=det, device=dev, gated=gated)


# --- the backward (--sweep-bwd) ---------------------------------------------------------------

SWEEP_TILES = {   # (block_m, num_warps) per width
    512: [(16, 4), (8, 4), (4, 4), (16, 8), (8, 8)],
    1536: [(2, 8), (1, 4), (2, 4), (4, 8)],
    2048: [(2, 8), (1, 4), (2, 4), (4, 8)],
    4096: [(1, 4), (1, 8), (2, 8)],
    5120: [(1, 8), (1, 16), (2, 16)],
    6144: [(1, 8), (1, 16), (2, 16)],
    # bm32 w4 spills ~850 bytes a thread with prefetch (trainnorm.dev.compile_check,
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
# the small-T fields of an entry, which --sweep-small measures and --sweep-bwd keeps
SMALL_FIELDS = ("direct_max_rows", "slices_max_rows", "direct_prefetch", "direct_tma_stages", "slice_block_m",
                "slice_block_n", "split_roles", "slice_stages")
SMALL_NOTE = "table/"     # the notes --sweep-small writes start so


# rows held as two pieces (configs.row_pieces, widths that are not powers of two): plain
# loads, the row loop pipelined by the compiler this deep (0: not)
PIECE_LOOP_STAGES = (0, 3)


def bwd_forms(hidden):
    """The row forms swept at a width: (pieces, prefetch, tma_stages, loop_stages, dw_2d)."""
    d2s = (False, True) if hidden <= DW_2D_MAX_H else (False,)
    forms = [(False, pf, st, 0, d2) for (pf, st), d2 in itertools.product(SWEEP_LOADS, d2s)]
    if row_pieces(hidden)[1]:
        forms += [(True, False, 0, ls, False) for ls in PIECE_LOOP_STAGES]
    return forms


def bwd_candidate(hidden, k) -> BwdConfig:
    bm, nw, pf, st, d2, ctas, mx, pieces, ls = k
    b1, b2 = row_pieces(hidden) if pieces else (next_pow2(hidden), 0)
    return BwdConfig.from_fields(block_m=bm, block_n=b1, block_n2=b2, num_warps=nw, min_rows_per_chunk=bm,
                                 max_chunks=mx, dw_2d=d2, ctas_per_sm=ctas, prefetch=pf, tma_stages=st,
                                 loop_stages=ls)


def bwd_name(k) -> str:
    bm, nw, pf, st, d2, ctas, mx, pieces, ls = k
    return (f"bm{bm} w{nw}{' pieces' if pieces else ''}{' pf' if pf else ''}{f' tma{st}' if st else ''}"
            f"{f' ls{ls}' if ls else ''}{' d2' if d2 else ''} c{ctas} max{mx}")


def _bwd_tokens(hidden, gated):
    return SWEEP_T_HEAD if heads_of(hidden, gated) > 1 else SWEEP_T


def sweep_bwd(run: Run, hidden: int, gated: bool = False) -> dict:
    """{T: {(bm, nw, prefetch, tma_stages, dw_2d, ctas, max_chunks): us}} of the deterministic backward."""
    dev = run.device
    tiles = (SWEEP_TILES_GATED if gated else SWEEP_TILES)[hidden]
    res = {}
    for tokens in _bwd_tokens(hidden, gated):
        x, w, dy, rstd, z = _inputs(hidden, tokens, dev, gated)
        rows = rstd.numel()
        res[tokens] = {}
        for (bm, nw), (pieces, pf, st, ls, d2) in itertools.product(tiles, bwd_forms(hidden)):
            fns = {}
            for ctas, mx in SWEEP_SCHED:
                k = (bm, nw, pf, st, d2, ctas, mx, pieces, ls)
                cfg = bwd_candidate(hidden, k)
                ws = _workspace(cfg, hidden, rows, True, dev, gated)
                fns[k] = (lambda cfg=cfg, ws=ws: _bwd_with(cfg, hidden, dy, x, w, rstd, ws, True, z))
            try:
                res[tokens].update(time_fns(fns, run.flush, passes=2, samples=6,
                                            captures=captures(rows, hidden)))
            except Exception as e:  # noqa: BLE001 - a tile that fails to compile or run is dropped
                run.log(f"  H{hidden} T{tokens} {bwd_name(k)}: {type(e).__name__}: {str(e)[:80]}")
        best = min(res[tokens].items(), key=lambda kv: kv[1])
        run.log(f"  H{hidden} T{tokens}: best {bwd_name(best[0])} {best[1]:.1f} us")
        del x, w, dy, rstd, z
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def fast_edge(run: Run, hidden: int, cfg: BwdConfig, gated: bool = False) -> dict:
    """{T: (deterministic us, atomic us, rows)} of cfg with the atomic form taken from the first row."""
    atomic = cfg.replace(atomic_min_rows=0)
    out = {}
    for tokens in _bwd_tokens(hidden, gated):
        x, w, dy, rstd, z = _inputs(hidden, tokens, run.device, gated)
        rows = rstd.numel()
        ws_d = _workspace(atomic, hidden, rows, True, run.device, gated)
        ws_f = _workspace(atomic, hidden, rows, False, run.device, gated)
        t = time_fns({"det": lambda: _bwd_with(atomic, hidden, dy, x, w, rstd, ws_d, True, z),
                      "fast": lambda: _bwd_with(atomic, hidden, dy, x, w, rstd, ws_f, False, z)},
                     run.flush, passes=3, samples=6)
        out[tokens] = (t["det"], t["fast"], rows)
    return out


def atomic_min_rows(edge: dict, rows_per_token: int) -> int:
    """The atomic form from the smallest measured count from which it is faster at every
    larger one (0: from the first; NEVER: at none)."""
    toks = sorted(edge)
    for i, t in enumerate(toks):
        if all(edge[u][1] <= edge[u][0] for u in toks[i:]):
            return 0 if i == 0 else t * rows_per_token
    return NEVER


def choose(res: dict):
    """(key, geomean score, worst ratio, candidates): the candidate present at every
    point with the lowest geomean of its time relative to the best at each point."""
    keys = set.intersection(*(set(v) for v in res.values()))
    best_t = {t: min(v.values()) for t, v in res.items()}
    score = {k: _geo(res[t][k] / best_t[t] for t in res) for k in keys}
    k = min(score, key=lambda c: (score[c], str(c)))
    return k, score, max(res[t][k] / best_t[t] for t in res)


def tune_bwd(run: Run, widths, gated: bool = False) -> None:
    kind = "gated" if gated else "plain"
    t0 = time.time()
    for hidden in widths:
        prev_entry = find_entry(run.table, "backward", hidden, kind)
        previous = config_in(run.table, "backward", hidden, kind)
        res = sweep_bwd(run, hidden, gated)
        k, score, worst = choose(res)
        cfg = bwd_candidate(hidden, k)
        edge = fast_edge(run, hidden, cfg, gated)
        amr = atomic_min_rows(edge, heads_of(hidden, gated))
        cfg = cfg.replace(atomic_min_rows=amr)
        times = ", ".join(f"T{t} {res[t][k]:.1f}" for t in sorted(res))
        notes = [f"{bwd_name(k)}: {times} us; x{score[k]:.3f} geomean, worst x{worst:.2f} of the best per T "
                 f"over {len(score)} candidates",
                 "det/atomic us: " + ", ".join(f"T{t} {edge[t][0]:.1f}/{edge[t][1]:.1f}" for t in sorted(edge))]
        if prev_entry is not None:
            # the small-T windows were measured against the previous tile: kept, with their notes
            small = {f: getattr(previous, f) for f in SMALL_FIELDS}
            if any(small[f] != getattr(cfg, f) for f in SMALL_FIELDS):
                cfg = cfg.replace(**small)
                notes.append("small-T windows, one-chunk loads and slice tile kept from the previous entry "
                             "(--sweep-small, measured against its tile)")
            notes += [n for n in prev_entry.get("notes", []) if n.startswith(SMALL_NOTE)]
        write_entry(run.table, "backward", hidden, kind, cfg, notes)
        run.raw[str(hidden)] = {"times": {str(t): {bwd_name(kk): v for kk, v in r.items()} for t, r in res.items()},
                                "chosen": bwd_name(k), "score": score[k],
                                "edge": {str(t): v for t, v in edge.items()}, "previous": previous.fields()}
        run.log(f"H{hidden} {kind}: {notes[0]} | {notes[1]} | atomic_min_rows {amr}  ({time.time() - t0:.0f}s)")
        # saved after every width, so a run cut short keeps what it chose
        run.save("sweep-bwd-gated.json" if gated else "sweep-bwd.json")


# --- the backward's small-T windows (--sweep-small) -------------------------------------------

SMALL_T = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SMALL_WIDTHS = (512, 1536, 2048, 4096, 5120, 6144)
# loads of the one-chunk form: (prefetch, tma_stages)
SMALL_LOADS = ((False, 0), (True, 0), (False, 2), (False, 3), (False, 4))
# column-slice dw tiles (slice_block_m, slice_block_n, split_roles, slice_stages);
# trainnorm.dev.compile_check compiles these. With split roles the row programs and the slice
# programs run side by side, so slices over more rows a step, narrower slices (more
# programs) and a slice's steps pipelined (loads in flight while the step before adds) can pay.
# A slice walks its rows one step after another, each step a load's latency: at T 256 the
# 64-row tiles take four (H 5120 and 6144 ran 0.84-0.85x torch.compile there on the H200,
# docs/benchmarks/h200-small), so tiles of 128 and 256 rows (two steps or one there) are
# timed too (compile_check --only slices, Triton 3.6: they spill only where every tile
# does, 8 bytes in the gated backward at H 8200)
SMALL_SLICES = ((16, 64, False, 0), (16, 128, False, 0), (32, 128, False, 0), (16, 64, True, 0),
                (32, 64, True, 0), (64, 64, True, 0), (32, 32, True, 0), (64, 32, True, 0), (16, 64, True, 3),
                (32, 32, True, 3), (128, 16, True, 0), (128, 32, True, 0), (256, 16, True, 0))
ALWAYS = 1 << 40          # a window that covers every count


def loads_name(pf, st) -> str:
    return "plain" if not pf and not st else ("prefetch" if pf else f"tma{st}")


def slices_name(bm, bn, split=False, stages=0) -> str:
    # the label of a column-slice tile in the table's notes ("table/cols16x64 us: ...";
    # "cols64x32s": split roles; "cols16x64s3": and a slice's steps pipelined 3 deep)
    return f"cols{bm}x{bn}{'s' if split else ''}{stages or ''}"


def small_base(table: dict, hidden: int) -> BwdConfig:
    """The entry's chunked form alone: its windows closed, its one-chunk loads unset."""
    return config_in(table, "backward", hidden, "plain").replace(
        direct_max_rows=0, slices_max_rows=0, direct_prefetch=None, direct_tma_stages=None)


def sweep_small(run: Run, hidden: int, base: BwdConfig) -> dict:
    """{T: {name: us}}: the chunked form ("table"), one chunk with each load form and the
    column-slice form with each tile, interleaved per T."""
    res = {}
    for tokens in SMALL_T:
        x, w, dy, rstd, _ = _inputs(hidden, tokens, run.device)
        ws = _workspace(base, hidden, rstd.numel(), True, run.device, False)
        fns = {"table": lambda ws=ws, x=x, w=w, dy=dy, rstd=rstd: _bwd_with(base, hidden, dy, x, w, rstd, ws, True)}
        for pf, st in SMALL_LOADS:
            cfg = base.replace(direct_max_rows=ALWAYS, direct_prefetch=pf, direct_tma_stages=st)
            fns[loads_name(pf, st)] = (lambda cfg=cfg, x=x, w=w, dy=dy, rstd=rstd:
                                       _bwd_with(cfg, hidden, dy, x, w, rstd, None, True))
        for bm, bn, split, stages in SMALL_SLICES:
            cfg = base.replace(slices_max_rows=ALWAYS, slice_block_m=bm, slice_block_n=bn, split_roles=split,
                               slice_stages=stages)
            fns[slices_name(bm, bn, split, stages)] = (lambda cfg=cfg, x=x, w=w, dy=dy, rstd=rstd:
                                        _bwd_with(cfg, hidden, dy, x, w, rstd, None, True))
        res[tokens] = time_fns(fns, run.flush, passes=3, samples=8, captures=captures(tokens, hidden))
        run.log(f"  H{hidden} T{tokens}: " + ", ".join(f"{k} {v:.2f}" for k, v in res[tokens].items()))
    return res


# Replays of a few microseconds differ by ~1-2% between interleaved groups: a one-chunk form within
# this of the table does not end the window (the H200 sweep of H 4096 read T2 5.70 against 5.65 us,
# then T4 6.78 against 9.36 and T8 9.07 against 9.34)
SMALL_NOISE = 0.02


def _baseline(res, toks, ref=None) -> dict:
    """{T: the table's time, or the faster of it and form ref's}."""
    return {t: min(res[t]["table"], res[t][ref]) if ref else res[t]["table"] for t in toks}


def _window(res, toks, names, win, ref=None):
    """(best, edge, note): of `names`, the form with the best geomean against ref (per count: the
    table's time, or the faster of the table and ref's form) over the counts `win`, and its
    window: up to the last count of `toks` where it is faster, with no count before it where
    it is slower by more than SMALL_NOISE (edge 0: none)."""
    base = _baseline(res, toks, ref)
    best = min(names, key=lambda k: _geo(res[t][k] / base[t] for t in win))
    edge = 0
    for t in toks:
        if res[t][best] > base[t] * (1 + SMALL_NOISE):
            break
        if res[t][best] < base[t]:
            edge = t
    return best, edge, ", ".join(f"T{t} {base[t]:.2f}/{res[t][best]:.2f}" for t in toks)


def choose_small(res, versus=None):
    """(loads name, direct_max_rows, note): the one-chunk load form and window (_window) over the
    counts where some one-chunk form beats the table and the column-slice tile `versus` (the
    one choose_slices takes over every count: at T 4-8 split-role slices ran 5.6-6.2 us where
    one chunk took 6.8-9.5 at H 4096-6144 on the H200); (None, 0, note) where none pays."""
    toks = sorted(res)
    names = [k for k in res[toks[0]] if k != "table" and not k.startswith("cols")]
    base = _baseline(res, toks, versus)
    win = [t for t in toks if min(res[t][k] for k in names) < base[t]] or toks[:1]
    best, edge, note = _window(res, toks, names, win, versus)
    if edge == 0:
        return None, 0, note     # no count where the one-chunk form pays: the table's forms stay
    return best, edge if edge > 1 else 0, note


def best_slices(res):
    """The column-slice tile with the best geomean against the table over the counts where
    some tile beats it (None: nowhere), whatever its window."""
    toks = sorted(res)
    names = [k for k in res[toks[0]] if k.startswith("cols")]
    win = [t for t in toks if names and min(res[t][k] for k in names) < res[t]["table"]]
    return _window(res, toks, names, win)[0] if win else None


def choose_slices(res, after):
    """(slice tile name, slices_max_rows, note): the column-slice tile and window (_window) past
    the one-chunk window (counts > after); (None, 0, note) where no tile pays."""
    toks = [t for t in sorted(res) if t > after]
    names = [k for k in res[toks[0]] if k.startswith("cols")] if toks else []
    win = [t for t in toks if names and min(res[t][k] for k in names) < res[t]["table"]]
    if not win:
        return None, 0, ""
    best, edge, note = _window(res, toks, names, win)
    return (best, edge, note) if edge else (None, 0, note)


def small_entry(base: BwdConfig, best, edge, sbest, sedge) -> BwdConfig:
    """The entry's config with the windows chosen (choose_small, choose_slices)."""
    cfg = base.replace(direct_max_rows=edge, slices_max_rows=sedge)
    if best is not None:
        pf, st = next((p, s) for p, s in SMALL_LOADS if loads_name(p, s) == best)
        cfg = cfg.replace(direct_prefetch=pf, direct_tma_stages=st)
    if sbest is not None:
        bm, bn, split, stages = next(t for t in SMALL_SLICES if slices_name(*t) == sbest)
        cfg = cfg.replace(slice_block_m=bm, slice_block_n=bn, split_roles=split, slice_stages=stages)
    return cfg


def tune_small(run: Run, widths) -> None:
    for hidden in widths:
        res = sweep_small(run, hidden, small_base(run.table, hidden))
        run.raw[str(hidden)] = {"times": {str(t): v for t, v in res.items()}}
        run.raw[str(hidden)].update(write_small_entry(run.table, hidden, res, run.log))
        run.save("sweep-small.json")


def write_small_entry(table: dict, hidden: int, res: dict, log=print) -> dict:
    """Put the backward entry of `hidden` with the small-T windows chosen from res ({T: {form:
    us}}, sweep_small) into table, its 'table/' notes replacing earlier ones; the choices."""
    prev_entry = find_entry(table, "backward", hidden, "plain")
    base = small_base(table, hidden)
    versus = best_slices(res)
    best, edge, note = choose_small(res, versus)
    # counts whose rows form one chunk in the chunked form too take the one-chunk form whatever
    # the windows (plan.py): the column-slice form never runs there, and its times at them are
    # the one-chunk form's noise (the H100 sweep of H 5120 read T1 6.11 against 6.53 us for
    # the same launch, and the window then ended before T2)
    one = [t for t in res if base.col_tiles(hidden) == 1 and plan_mod.chunking(base, t)[0] == 1]
    sbest, sedge, snote = choose_slices(res, max([edge] + one))
    chosen = {"loads": best, "direct_max_rows": edge, "slices": sbest, "slices_max_rows": sedge}
    log(f"H{hidden}: one chunk ({best}) up to {edge} rows | table/one-chunk us: {note}")
    log(f"H{hidden}: column-slice dw ({sbest}) up to {sedge} rows | table/slices us: {snote}")
    notes = [f"{SMALL_NOTE}one-chunk {best} us{f' (the table: the faster of it and {versus})' if versus else ''}: "
             f"{note}"]
    if snote:
        notes.append(f"{SMALL_NOTE}{sbest or 'column-slice dw'} us: {snote}")
    if prev_entry is None:
        if best is None and sbest is None:
            log(f"H{hidden}: no entry written, the default's forms stay")
            return chosen
        notes.append("tile: the analytical default (configs.default_backward); only the small-T windows "
                     "were measured")
    else:
        notes = [n for n in prev_entry.get("notes", []) if not n.startswith(SMALL_NOTE)] + notes
    write_entry(table, "backward", hidden, "plain", small_entry(base, best, edge, sbest, sedge), notes)
    return chosen


# --- the forward tile over token counts (--sweep-fwd) -----------------------------------------

# the plain entries are chosen over these row counts; 4096 is a count of every bench width, where
# the forward's misses include H1536 and [T,4,256] (docs/benchmarks/h200.md, goal 2)
FWD_T = (1, 16, 1024, 4096, 16384, 65536)
# the float32-weight entries over their bench rows' counts (H 5120 and 6144 at T 256-65536; none
# at T <= 16): the entry at T4096 ran 0.91x / 0.93x fla's forward (H100, b5f489a), where the
# sweep had not timed it; --tokens overrides both
FWD_W32_T = (256, 1024, 4096, 16384, 65536)
FWD_WIDTHS = (512, 1536, 2048, 4096, 5120, 6144)
FWD_W32_WIDTHS = (5120, 6144)     # the bench's float32-weight rows
FWD_TMA_STAGES = (3, 4)           # the descriptor forms' pipeline depths
FWD_TMA_CTAS = (1, 2, 4)          # and programs per SM
FWD_CHUNK_BN = (512, 1024, 2048)  # the two-pass forms' tile widths
FWD_CHUNK_MAX_TILES = 8
# bench rows that share a width's plain / weight_fp32 entry with the plain rows: the
# entry is scored on them too (H6144 res and res w32). The gated forward has its own
# key (configs.gated_forward_from_plain serves it): not swept here.
FWD_VARIANTS = {6144: ("", "res")}


def fwd_sweep_candidates(hidden):
    """Plain tiles (tma_stages 0), and the descriptor form of the tiles that hold
    at most 64 elements a thread, at each depth and programs per SM; then rows
    walked twice in 2-8 narrower tiles (the second pass re-reads x from L1 / L2),
    which hold no padding: H 5120 is five 1024-wide tiles where the one-tile
    form holds 8192 columns a row."""
    bn = next_pow2(hidden)
    for bm, nw in itertools.product((1, 2, 4, 8, 16), (2, 4, 8, 16)):
        per_thread = bm * bn // (32 * nw)
        if bm * bn <= 16384 and 4 <= per_thread <= 256 and (nw > 2 or bn <= 1024):
            yield FwdConfig.from_fields(block_m=bm, block_n=bn, num_warps=nw)
            if 8 <= per_thread <= 64 and nw in (4, 8):
                for st, ctas in itertools.product(FWD_TMA_STAGES, FWD_TMA_CTAS):
                    yield FwdConfig.from_fields(block_m=bm, block_n=bn, num_warps=nw, tma_stages=st,
                                                ctas_per_sm=ctas)
    b1, b2 = row_pieces(hidden)
    if b2:
        # the row as two pieces, none of the one-tile form's padding, read once
        for bm, nw in itertools.product((1, 2, 4), (4, 8, 16)):
            per_thread = bm * (b1 + b2) // (32 * nw)
            if bm * (b1 + b2) <= 16384 and 4 <= per_thread <= 64:
                yield FwdConfig.from_fields(block_m=bm, block_n=b1, block_n2=b2, num_warps=nw)
    for cbn in FWD_CHUNK_BN:
        if cbn < bn and cdiv(hidden, cbn) <= FWD_CHUNK_MAX_TILES:
            for bm, nw in itertools.product((1, 2, 4, 8), (4, 8, 16)):
                # unrolled, a thread holds all of its tiles at once: at most 64 elements
                # (H5120 bm4 n512 w4, 128, spills under ptxas: trainnorm.dev.compile_check)
                per_thread = bm * cbn // (32 * nw)
                if 4 <= per_thread and per_thread * cdiv(hidden, cbn) <= 64:
                    yield FwdConfig.from_fields(block_m=bm, block_n=cbn, num_warps=nw)
                    # the row's tiles held in registers between the walks: at H 5120 with a float32
                    # weight, bm1 w8 n1024 held ran 324.7 us at T 65536 against 364.5 read twice
                    # (docs/benchmarks/tune/h200-hold.txt)
                    yield FwdConfig.from_fields(block_m=bm, block_n=cbn, num_warps=nw, hold_tiles=True)


def fwd_key(c: FwdConfig, hidden: int):
    chunk = c.block_n if c.block_n < next_pow2(hidden) and not c.block_n2 else 0
    return (c.block_m, c.num_warps, c.tma_stages, c.ctas_per_sm if c.tma_stages else 0, chunk, bool(c.block_n2),
            c.hold_tiles)


def fwd_name(k) -> str:
    return (f"bm{k[0]} w{k[1]}" + (f" tma{k[2]} c{k[3]}" if k[2] else "") + (f" n{k[4]}" if k[4] else "")
            + (" pieces" if k[5] else "") + (" held" if k[6] else ""))


def _fwd_with(cfg, hidden, x, w, kind, r=None, z=None):
    with configs.override(forward=only(hidden, kind, cfg)):
        if z is not None:
            return trainnorm.rms_norm_gated_forward(x, z, w)
        return trainnorm.rms_norm_forward(x, w, residual=r)


def sweep_fwd(run: Run, hidden: int, cands, w32: bool = False, counts=None, variants=None, extra=None) -> dict:
    """{(variant, T): {key: us}} of the forward (float32 weight with w32), every
    candidate interleaved per point; variant '' plain, 'res' with a residual,
    'gate' gated (default FWD_VARIANTS); T over `counts` (default FWD_T). `cands`:
    configs, keyed by fwd_key, or {name: config}; `extra(x, w, r, z)`: more {name: fn}
    timed beside them (--probe-tiles: torch.compile of the reference)."""
    kind = "weight_fp32" if w32 else "plain"
    named = cands if isinstance(cands, dict) else {fwd_key(c, hidden): c for c in cands}
    res = {}
    for variant in variants or FWD_VARIANTS.get(hidden, ("",)):
        for tokens in counts or FWD_T:
            x = torch.randn(tokens, hidden, device=run.device).to(torch.bfloat16)
            w = torch.randn(hidden, device=run.device).to(torch.float32 if w32 else torch.bfloat16)
            r = torch.randn_like(x) if variant == "res" else None
            z = torch.randn_like(x) if variant == "gate" else None
            fns = {k: (lambda c=c, x=x, w=w, r=r, z=z: _fwd_with(c, hidden, x, w, kind, r, z))
                   for k, c in named.items()}
            if extra is not None:
                fns.update(extra(x, w, r, z))
            res[(variant, tokens)] = pt = time_fns(fns, run.flush, passes=2, samples=8,
                                                   captures=captures(tokens, hidden))
            b = min(pt, key=pt.get)
            run.log(f"  H{hidden}{' w32' if w32 else ''}{' ' + variant if variant else ''} T{tokens}: "
                    f"best {fwd_name(b) if isinstance(b, tuple) else b} {pt[b]:.2f} us")
            del x, w, r, z, fns
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return res


def _point(p) -> str:
    return f"{p[0]} T{p[1]}" if p[0] else f"T{p[1]}"


FWD_KINDS = ("plain", "weight_fp32")


def tune_fwd(run: Run, widths, kinds=FWD_KINDS, counts=None) -> None:
    """The forward entries of `kinds` at `widths` (weight_fp32 at FWD_W32_WIDTHS only), each
    chosen over the row counts `counts` (default FWD_T, and FWD_W32_T for weight_fp32):
    --kinds weight_fp32 re-tunes the float32-weight entries alone."""
    for w32 in (False, True):
        kind = "weight_fp32" if w32 else "plain"
        if kind not in kinds:
            continue
        for hidden in [h for h in widths if not w32 or h in FWD_W32_WIDTHS]:
            prev_entry = find_entry(run.table, "forward", hidden, kind)
            previous = config_in(run.table, "forward", hidden, kind)
            cands = {fwd_key(c, hidden): c for c in fwd_sweep_candidates(hidden)}
            res = sweep_fwd(run, hidden, cands, w32, counts or (FWD_W32_T if w32 else FWD_T))
            k, score, worst = choose(res)
            pk = fwd_key(previous, hidden)
            times = ", ".join(f"{_point(t)} {res[t][k]:.2f}" for t in res)
            prev_note = (f"; previous {fwd_name(pk)} x{score[pk]:.3f}: "
                         + ", ".join(f"{_point(t)} {res[t][pk]:.2f}" for t in res)) if pk in score else ""
            note = (f"{fwd_name(k)}: {times} us; x{score[k]:.3f} geomean, worst x{worst:.2f} of the best per "
                    f"point over {len(score)}{prev_note}")
            if prev_entry is not None and any(n.startswith("kept:") for n in prev_entry.get("notes", [])):
                run.log(f"note: the {kind} H{hidden} entry it replaces had been kept against its sweep "
                        f"(its 'kept:' notes are gone with it): {prev_entry['notes']}")
            write_entry(run.table, "forward", hidden, kind, cands[k], [note])
            run.raw[f"{kind} {hidden}"] = {"times": {_point(t): {fwd_name(kk): v for kk, v in r.items()}
                                                     for t, r in res.items()}, "chosen": fwd_name(k)}
            run.log(f"{kind} H{hidden}: {note}")
            run.save("sweep-fwd.json")


# --- the forward entry against named tiles and torch.compile (--probe-tiles) -------------------

PROBE_TILES_T = (256, 1024, 4096, 16384, 65536)
REFERENCE = "torch.compile"


def named_tiles(hidden: int, names) -> dict:
    """{name: config} of the forward sweep's candidates at `hidden` named as fwd_name names
    them ('bm2 w8 pieces', 'bm1 w16 n2048 held', 'bm1 w4 tma4 c2'); ValueError naming the
    names that are none of them."""
    known = {fwd_name(fwd_key(c, hidden)): c for c in fwd_sweep_candidates(hidden)}
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"not a forward tile at H {hidden}: {', '.join(missing)} (fwd_sweep_candidates names "
                         f"{len(known)}, e.g. {', '.join(sorted(known)[:4])})")
    return {n: known[n] for n in names}


def compiled_reference(backend: str = "inductor"):
    """extra() for sweep_fwd: torch.compile of the bench's reference forward, each point
    compiled afresh as `trainnorm bench` compiles it (bench.impls.compile_reference), with
    a residual or a gate where the point has one."""
    from trainnorm.bench.impls import compile_reference, ref_forward, ref_forward_gated, ref_forward_residual

    def extra(x, w, r, z):
        if z is not None:
            fn = compile_reference(ref_forward_gated, backend=backend)
            return {REFERENCE: lambda: fn(x, w, z)}
        if r is not None:
            fn = compile_reference(ref_forward_residual, backend=backend)
            return {REFERENCE: lambda: fn(x, w, r)}
        fn = compile_reference(ref_forward, backend=backend)
        return {REFERENCE: lambda: fn(x, w)}
    return extra


def probe_tiles(run: Run, widths, kinds, names, counts=None, backend: str = "inductor") -> None:
    """The forward entry of each kind at each width against the named tiles (named_tiles)
    and torch.compile of the reference, without and with a residual, interleaved per
    point at `counts` (default PROBE_TILES_T): raw times to probe-tiles.json and the log,
    each time with torch.compile's over it (> 1: the tile is faster). No table is written."""
    for kind in kinds:
        for hidden in widths:
            entry = config_in(run.table, "forward", hidden, kind)
            tiles = {f"entry {fwd_name(fwd_key(entry, hidden))}": entry, **named_tiles(hidden, names)}
            res = sweep_fwd(run, hidden, tiles, kind == "weight_fp32", counts or PROBE_TILES_T, ("", "res"),
                            compiled_reference(backend))
            for point, times in res.items():
                ref = times[REFERENCE]
                run.log(f"{kind} H{hidden} {_point(point)}: " + ", ".join(
                    f"{k} {v:.2f} ({ref / v:.3f}x)" for k, v in sorted(times.items(), key=lambda kv: kv[1])))
            run.raw[f"{kind} {hidden}"] = {_point(p): t for p, t in res.items()}
            run.save("probe-tiles.json")


# --- the forward's rows per tile by row count (--sweep-rows) ------------------------------------

ROWS_T = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
ROWS_BITS_T = 8192        # the rows the variants' bits are compared on
# a variant within this of the entry's own tile does not replace it: replays of 4-6 us differ
# by 1-2% between interleaved groups (SMALL_NOISE); at 1% the H200 sweep of H 512 switched
# rows per tile five times over T 1-1024 on differences of 0.02-0.2 us
ROWS_NOISE = 0.02
ROWS_NOTE = "rows: "


def rows_candidates(cfg: FwdConfig, hidden: int, elt: int = ELT) -> list[int]:
    """Rows per tile that keep the entry's column layout (the tile's own among them):
    block_n and num_warps stay, and each thread holds the tile's vector of a row (16
    bytes, or the tile's elements over its threads where fewer: the compiler narrows the
    vector there, and a row's sum changes order), at most 64 elements a thread (the
    table's tiles hold 8-64) and 16384 a tile."""
    def vector(bm):
        return min(16 // elt, bm * cfg.block_n // (32 * cfg.num_warps))
    out = []
    for bm in (1, 2, 4, 8, 16, 32, 64):
        per_thread = bm * cfg.block_n // (32 * cfg.num_warps)
        if bm == cfg.tile.block_m or (vector(bm) == vector(cfg.tile.block_m) and per_thread * cfg.col_tiles(hidden) <= 64
                                       and bm * (cfg.block_n + cfg.block_n2) <= 16384):
            out.append(bm)
    return out


def time_forward_variants(run: Run, hidden: int, kind: str, ref: FwdConfig, cands: dict, label=str):
    """({T: {key: us}}, keys with other bits): each candidate config of cands ({key: config})
    whose y, rstd and h are ref's to the bit on outlier rows (ROWS_BITS_T, with and without a
    residual), timed interleaved per T (ROWS_T); the others are logged and not timed."""
    w_dt = torch.float32 if kind == "weight_fp32" else torch.bfloat16
    case = make_case("outlier", (ROWS_BITS_T,), hidden, weight_dtype=w_dt, residual=True, seed=1234,
                     device=run.device)
    base = [_fwd_with(ref, hidden, case.x, case.weight, kind, rr) for rr in (None, case.residual)]
    kept, differ = {}, []
    for key, c in cands.items():
        outs = [_fwd_with(c, hidden, case.x, case.weight, kind, rr) for rr in (None, case.residual)]
        if all(torch.equal(a, b) for o, q in zip(outs, base) for a, b in zip(o, q) if a is not None):
            kept[key] = c
        else:
            differ.append(key)
            run.log(f"  {kind} H{hidden} {label(key)}: y / rstd / h differ from the entry's bits; not timed")
    res = {}
    for tokens in ROWS_T:
        x = torch.randn(tokens, hidden, device=run.device).to(torch.bfloat16)
        w = torch.randn(hidden, device=run.device).to(w_dt)
        fns = {key: (lambda c=c, x=x, w=w: _fwd_with(c, hidden, x, w, kind)) for key, c in kept.items()}
        res[tokens] = time_fns(fns, run.flush, passes=3, samples=10, captures=captures(tokens, hidden))
        run.log(f"  {kind} H{hidden} T{tokens}: " + ", ".join(f"{label(k)} {v:.2f}" for k, v in res[tokens].items()))
    return res, differ


def sweep_rows(run: Run, hidden: int, kind: str) -> tuple[dict, list[int]]:
    """({T: {block_m: us}}, variants with other bits): the entry's tile with each row count
    of rows_candidates (time_forward_variants against the tile's own count)."""
    cfg = config_in(run.table, "forward", hidden, kind).replace(rows_block_m=())
    return time_forward_variants(run, hidden, kind, cfg, {bm: cfg.replace(block_m=bm)
                                                           for bm in rows_candidates(cfg, hidden)},
                                 label=lambda bm: f"bm{bm}")


def choose_rows(res: dict, own: int) -> tuple:
    """rows_block_m: per T the fastest row count, the entry's own wherever none is faster by
    more than ROWS_NOISE; each run of one count a window up to its last T (counts between
    two measured T take the later one's), the last run's up to any count (ALWAYS) unless it
    is the entry's own. The tile keeps its own count: the one the forms derived from it
    (configs.gated_forward_from_plain) were measured against."""
    toks = sorted(res)
    pick = {}
    for t in toks:
        best = min(res[t], key=res[t].get)
        pick[t] = own if own in res[t] and res[t][best] >= res[t][own] * (1 - ROWS_NOISE) else best
    windows = [(a, pick[a]) for a, b in zip(toks, toks[1:]) if pick[a] != pick[b]]
    if pick[toks[-1]] != own:
        windows.append((ALWAYS, pick[toks[-1]]))
    return tuple(windows)


def forward_entries(table: dict, widths):
    """(hidden, kind, entry) of the table's plain and float32-weight forward entries at widths."""
    for hidden in widths:
        for kind in ("plain", "weight_fp32"):
            entry = find_entry(table, "forward", hidden, kind)
            if entry is not None:
                yield hidden, kind, entry


def tune_rows(run: Run, widths) -> None:
    for hidden, kind, entry in forward_entries(run.table, widths):
        res, differ = sweep_rows(run, hidden, kind)
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else str(run.device)
        note = write_rows_entry(run.table, entry, res, differ, gpu)
        run.raw[f"{kind} {hidden}"] = {"times": {str(t): {str(k): v for k, v in r.items()} for t, r in res.items()},
                                       "differ": differ, "gpu": gpu}
        run.log(f"{kind} H{hidden}: {note}")
        run.save("sweep-rows.json")


def write_rows_entry(table: dict, entry: dict, res: dict, differ, gpu: str) -> str:
    """Put the forward entry with the rows per tile chosen from res ({T: {block_m: us}},
    choose_rows) and its 'rows:' note (which replaces any earlier one) into table; the note."""
    cfg = tables.to_config("forward", entry)
    windows = choose_rows(res, cfg.tile.block_m)
    times = "; ".join(f"T{t} " + ", ".join(f"bm{k} {v:.2f}" for k, v in r.items()) for t, r in sorted(res.items()))
    note = (f"{ROWS_NOTE}windows {[list(w) for w in windows] or 'none'} past which the tile's bm{cfg.tile.block_m} "
            f"({gpu}, python -m trainnorm.dev.tune --sweep-rows; the tile's block_n and warps, y / rstd / h "
            f"bit-equal on outlier rows at T {ROWS_BITS_T}"
            f"{'; other bits: ' + ', '.join(f'bm{b}' for b in differ) if differ else ''}): {times} us")
    notes = [n for n in entry.get("notes", []) if not n.startswith(ROWS_NOTE)] + [note]
    write_entry(table, "forward", entry["hidden"], entry["kind"], cfg.replace(rows_block_m=windows), notes)
    return note


# --- when the forward reads the weight (--sweep-weight) -------------------------------------------

WEIGHT_NOTE = "weight: "
# a variant replaces the entry's own read only where its geomean over ROWS_T is lower by more
# than this: at few rows the variants differ by a load's latency, at many by nothing or registers
WEIGHT_NOISE = 0.01


def weight_candidates(cfg: FwdConfig, hidden: int) -> dict:
    """{name: config}: the entry's tile with each weight read (configs.FwdSchedule.weight_read)
    its form takes, and for rows walked in column tiles (unrolled) each with the tiles held
    or walked twice. The entry's own config is among them, under its own name."""
    tiles = cfg.col_tiles(hidden)
    if tiles == 1:
        reads, holds = ("early", "rows", "late"), (False,)
    elif tiles <= plan_mod.FWD_COL_UNROLL_MAX:
        reads, holds = ("rows", "late"), (False, True)
    else:
        reads, holds = ("late",), (False,)
    return {f"{r}{' held' if h else ''}": cfg.replace(weight_read=r, hold_tiles=h) for r in reads for h in holds}


def _weight_name(cfg: FwdConfig, hidden: int) -> str:
    """The weight_candidates name of the read (and hold) the plan gives the config."""
    tiles = cfg.col_tiles(hidden)
    read = plan_mod.weight_read(cfg, tiles)
    return f"{read}{' held' if cfg.hold_tiles and 1 < tiles <= plan_mod.FWD_COL_UNROLL_MAX else ''}"


def sweep_weight(run: Run, hidden: int, kind: str) -> tuple[dict, list[str]]:
    """({T: {name: us}}, variants with other bits): the entry's config with each weight read
    (weight_candidates; time_forward_variants against the entry: the read moves no addition,
    so other bits would be a broken form)."""
    cfg = config_in(run.table, "forward", hidden, kind)
    return time_forward_variants(run, hidden, kind, cfg, weight_candidates(cfg, hidden))


def choose_weight(res: dict, own: str) -> tuple[str, dict]:
    """(name, {name: geomean of its time over the best per T}): the variant with the lowest
    geomean, the entry's own unless that is lower by more than WEIGHT_NOISE."""
    names = list(next(iter(res.values())))
    score = {n: _geo(res[t][n] / min(res[t].values()) for t in res) for n in names}
    best = min(score, key=score.get)
    if own in score and score[best] >= score[own] * (1 - WEIGHT_NOISE):
        best = own
    return best, score


def tune_weight(run: Run, widths) -> None:
    for hidden, kind, entry in forward_entries(run.table, widths):
        cfg = tables.to_config("forward", entry)
        if cfg.tma_stages:
            run.log(f"{kind} H{hidden}: descriptor loads read the weight once per program; not swept")
            continue
        res, differ = sweep_weight(run, hidden, kind)
        own = _weight_name(cfg, hidden)
        best, score = choose_weight(res, own)
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else str(run.device)
        times = "; ".join(f"T{t} " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) for t, r in sorted(res.items()))
        note = (f"{WEIGHT_NOTE}{best} (was {own}; geomean over the best per T: "
                + ", ".join(f"{k} x{v:.3f}" for k, v in score.items())
                + f"; {gpu}, python -m trainnorm.dev.tune --sweep-weight, y / rstd / h bit-equal"
                + (f"; other bits: {', '.join(differ)}" if differ else "") + f"): {times} us")
        chosen = weight_candidates(cfg, hidden)[best]
        notes = [n for n in entry.get("notes", []) if not n.startswith(WEIGHT_NOTE)] + [note]
        write_entry(run.table, "forward", hidden, kind, chosen, notes)
        run.raw[f"{kind} {hidden}"] = {"times": {str(t): r for t, r in res.items()}, "differ": differ,
                                       "chosen": best, "own": own, "gpu": gpu}
        run.log(f"{kind} H{hidden}: {note}")
        run.save("sweep-weight.json")


# --- the analytical defaults (--probe-defaults) -------------------------------------------------

# Widths the table does not hold, as (H, rows): configs.default_backward / default_forward
# serve them. Per-head rows are timed as plain rows of the head width (rows = T x heads).
PROBE_CASES = ((768, 16384), (1024, 16384), (2560, 16384), (3584, 16384), (5376, 16384), (128, 131072),
               (64, 393216), (1024, 65536))


def default_edits(hidden: int) -> tuple[dict, dict]:
    """({name: BwdConfig}, {name: FwdConfig}) at a width the table does not hold: the
    rules' configs ("rule") and single edits of them (warps, rows per tile, loads, dw_2d,
    programs per SM and chunks, a row held as two pieces)."""
    d = configs.default_backward(hidden, ELT)
    t, sch = d.tile, d.schedule
    bwd = {"rule": d}

    def edit(name, ok, **kw):
        if ok:
            bwd[name] = d.replace(**kw)
    edit("w/2", t.num_warps >= 2, num_warps=t.num_warps // 2)
    edit("w*2", t.num_warps <= 8, num_warps=2 * t.num_warps)
    edit("bm/2", t.block_m >= 2, block_m=t.block_m // 2)
    edit("bm*2", t.block_m * t.block_n <= 8192, block_m=2 * t.block_m,
         min_rows_per_chunk=max(t.min_rows_per_chunk, 2 * t.block_m))
    edit("plain loads", sch.tma_stages > 0, tma_stages=0)
    edit("tma4", sch.tma_stages > 0, tma_stages=4)
    edit("dw_2d" if not t.dw_2d else "no dw_2d", t.block_n <= 1024, dw_2d=not t.dw_2d)
    # programs per SM and chunks at every row count (no rows_max_chunks window), and the rule
    # without its window
    if (sch.ctas_per_sm, t.max_chunks) == (2, 256):
        edit("c4 m132", True, ctas_per_sm=4, max_chunks=132, min_rows_per_chunk=t.block_m, rows_max_chunks=())
    else:
        edit("c2 m256", True, ctas_per_sm=2, max_chunks=256, min_rows_per_chunk=max(16, t.block_m),
             rows_max_chunks=())
    edit("no chunk window", bool(t.rows_max_chunks), rows_max_chunks=())
    b1, b2 = row_pieces(hidden)
    edit("two pieces", b2 > 0 and hidden <= configs.BWD_MAX_TILE, block_n=b1, block_n2=b2, dw_2d=False,
         tma_stages=0, loop_stages=3)
    f = configs.default_forward(hidden, ELT)
    ft = f.tile
    fwd = {"rule": f}
    for name, ok, kw in (("w/2", ft.num_warps >= 2, dict(num_warps=ft.num_warps // 2)),
                         ("w*2", ft.num_warps <= 8, dict(num_warps=2 * ft.num_warps)),
                         ("bm/2", ft.block_m >= 2, dict(block_m=ft.block_m // 2)),
                         ("bm*2", ft.block_m * ft.block_n <= 16384, dict(block_m=2 * ft.block_m)),
                         ("tma3", ft.block_n >= hidden, dict(tma_stages=3)),
                         ("two pieces", b2 > 0 and ft.block_n >= hidden, dict(block_n=b1, block_n2=b2))):
        if ok:
            fwd[name] = f.replace(**kw)
    # programs of one warp, 1-4 rows each (no row's sum across warps; torch.compile's choice
    # at H 768-1024: a warp a row)
    for bm in (1, 2, 4):
        if ft.num_warps > 1 and bm * ft.block_n <= 4096 and bm * ft.block_n >= 32 * 4:
            fwd[f"bm{bm} w1"] = f.replace(block_m=bm, num_warps=1, rows_block_m=())
    fwd.update(schedule_edits(f, hidden))
    tiles = f.col_tiles(hidden)
    own = plan_mod.weight_read(f, tiles)
    for read in ("early", "rows", "late"):
        if read != own and (read != "early" or tiles == 1) and plan_mod.weight_read(f.replace(weight_read=read),
                                                                                  tiles) == read:
            fwd[f"weight {read}"] = f.replace(weight_read=read)
    return bwd, fwd


def schedule_edits(cfg: FwdConfig, hidden: int, weight_reads: bool = True) -> dict:
    """{name: FwdConfig}: edits of a forward config that keep its tile, so its bits (the rows
    per tile at every count, the weight read, the descriptor form's depth and programs per SM).
    weight_reads False: the descriptor form's plain loads without the weight_read edits (the
    gated forward does not read weight_read: gated_forward_edits)."""
    t = cfg.tile
    out = {}
    for bm in (t.block_m // 2, t.block_m // 4, 2 * t.block_m):
        if 1 <= bm != t.block_m and bm * t.block_n <= 16384:
            out[f"rows {bm}"] = cfg.replace(rows_block_m=((ALWAYS, bm),))
    if cfg.col_tiles(hidden) == 1 and not t.block_n2:
        for st, ctas in ((3, 2), (3, 4), (4, 2)):
            if (st, ctas) != (cfg.schedule.tma_stages, cfg.schedule.ctas_per_sm):
                out[f"tma{st} c{ctas}"] = cfg.replace(tma_stages=st, ctas_per_sm=ctas)
        if cfg.schedule.residual_plain:
            # with a residual, the descriptor form the entry leaves (no change without one)
            out["residual descriptors"] = cfg.replace(residual_plain=False)
        if cfg.schedule.tma_stages:
            # the descriptor form's plain-load counterpart, with each weight read it can take
            for read in ("", "rows", "late") if weight_reads else ("",):
                out["plain loads" + (f" weight {read}" if read else "")] = cfg.replace(tma_stages=0, weight_read=read)
    return out


def bwd_schedule_edits(cfg: BwdConfig) -> dict:
    """{name: BwdConfig}: the backward's load forms, which keep its bits (compile_check
    --load-forms): plain loads with and without the next tile's prefetch, and the other
    descriptor depths (plan.CHUNK_STAGES still caps them at a chunk's row tiles)."""
    s = cfg.schedule
    out = {}
    if cfg.tile.block_n2:
        return out
    if s.tma_stages:
        out["plain loads"] = cfg.replace(tma_stages=0, prefetch=False)
        out["plain loads prefetch"] = cfg.replace(tma_stages=0, prefetch=True)
    for st in (2, 3, 4):
        if st != s.tma_stages:
            out[f"tma{st}"] = cfg.replace(tma_stages=st, prefetch=False)
    return out


# rows of the bench's float32-weight rows and their small-T neighbours
SCHEDULE_PROBE_CASES = tuple((h, t) for h in (5120, 6144) for t in (1, 16, 256, 1024, 4096, 16384))


def probe_schedule(run: Run, cases=SCHEDULE_PROBE_CASES) -> None:
    """Time each forward entry the table holds at a case's width (plain and float32 weight;
    without and with a residual) against the edits that keep its bits (schedule_edits), and
    the backward's entry (deterministic; without and with the residual stream's gradient)
    against its load forms (bwd_schedule_edits); candidates interleaved, a candidate whose
    outputs are not the entry's bits left out. Raw times to probe-schedule.json; no table."""
    for hidden, rows in cases:
        _probe_bwd_schedule(run, hidden, rows)
        for kind in ("plain", "weight_fp32"):
            key = configs.forward_key(hidden, ELT, 4 if kind == "weight_fp32" else 2)
            if kind == "weight_fp32" and tables.lookup("forward", key) is None:
                continue
            own = configs.forward_config(key)
            cands = {"entry": own, **schedule_edits(own, hidden)}
            for res in (False, True):
                x = torch.randn(rows, hidden, device=run.device).to(torch.bfloat16)
                r = torch.randn_like(x) if res else None
                w = (1 + 0.1 * torch.randn(hidden, device=run.device)).to(
                    torch.float32 if kind == "weight_fp32" else torch.bfloat16)
                fns = {name: (lambda cfg=cfg: _fwd_with(cfg, hidden, x, w, kind, r)) for name, cfg in cands.items()}
                outs = {name: fn()[:1] for name, fn in fns.items()}
                _time_bit_equal(run, f"{kind} fwd H{hidden}{' res' if res else ''} rows {rows}", fns, outs, cands,
                                captures(rows, hidden))
                del x, r, w, fns, outs


def _time_bit_equal(run: Run, what: str, fns: dict, outs: dict, cands: dict, n_captures: int) -> None:
    """Time the candidates whose outputs are the entry's bits (the others logged, not timed),
    recorded as _record_probe does, in probe-schedule.json."""
    for name, out in outs.items():
        if not all(torch.equal(a, b) for a, b in zip(out, outs["entry"]) if a is not None):
            run.log(f"  {what} {name}: outputs differ from the entry's; not timed")
            fns.pop(name)
    _record_probe(run, what, time_fns(fns, run.flush, captures=n_captures), cands, "probe-schedule.json")


def _probe_bwd_schedule(run: Run, hidden: int, rows: int) -> None:
    own = configs.backward_config(configs.backward_key(hidden, ELT))
    cands = {"entry": own, **bwd_schedule_edits(own)}
    x, w, dy, rstd = _bwd_inputs(run, hidden, rows)
    ws = _workspace(own, hidden, rows, True, run.device, False)
    for res in (False, True):
        dh = torch.randn_like(x) if res else None

        def call(cfg):
            with configs.override(backward=only(hidden, "plain", cfg)):
                return trainnorm.rms_norm_backward(dy, x, w, rstd, dh=dh, deterministic=True, workspace=ws)
        fns = {name: (lambda cfg=cfg: call(cfg)) for name, cfg in cands.items()}
        outs = {name: fn() for name, fn in fns.items()}
        _time_bit_equal(run, f"plain bwd H{hidden}{' res' if res else ''} rows {rows}", fns, outs, cands,
                        captures(rows, hidden))
        del fns, outs, dh


# the gated forward's rule, at the gated rows of the bench: H 4096 and [T,32,128] (rows = T x 32)
GATED_PROBE_CASES = ((4096, 16384), (4096, 65536), (128, 131072), (128, 524288))


def gated_forward_edits(hidden: int) -> dict:
    """{name: FwdConfig} of the gated forward (16-bit weight): the rule's config ("rule"),
    the plain tile it is derived from, and single edits of the rule (warps, rows per tile,
    the weight read)."""
    plain = configs.forward_config(configs.forward_key(hidden, ELT))
    rule = configs.gated_forward_from_plain(plain)
    t = rule.tile
    out = {"rule": rule}
    if plain != rule:
        out["plain tile"] = plain
    for name, ok, kw in (("w/2", t.num_warps >= 2, dict(num_warps=t.num_warps // 2)),
                         ("w*2", t.num_warps <= 8, dict(num_warps=2 * t.num_warps)),
                         ("bm/2", t.block_m >= 2, dict(block_m=t.block_m // 2)),
                         ("bm*2", t.block_m * t.block_n <= 16384, dict(block_m=2 * t.block_m)),
                         ("bm*2 w*2", t.block_m * t.block_n <= 8192 and t.num_warps <= 8,
                          dict(block_m=2 * t.block_m, num_warps=2 * t.num_warps))):
        if ok and rule.replace(**kw) != plain:
            out[name] = rule.replace(**kw)
    out.update(schedule_edits(rule, hidden, weight_reads=False))
    if rule.col_tiles(hidden) == 1:
        # the weight reads other than the rule's (plan.weight_read: beside the rows' loads in
        # 16-bit gated tiles of up to 4096 columns, else after the sum of squares)
        own = plan_mod.weight_read(rule, 1, gated=True, gate_after_16bit=True)
        for read in ("early", "rows", "late"):
            if read != own:
                out[f"weight {read}"] = rule.replace(gate_weight_read=read)
    return out


def probe_gated_forward(run: Run, cases=GATED_PROBE_CASES) -> None:
    """Time the gated forward's rule against the plain tile and its edits (bf16), each
    case's candidates interleaved; raw times to probe-defaults.json."""
    for hidden, rows in cases:
        x, z = (torch.randn(rows, hidden, device=run.device).to(torch.bfloat16) for _ in range(2))
        w = (1 + 0.1 * torch.randn(hidden, device=run.device)).to(torch.bfloat16)
        cands = gated_forward_edits(hidden)
        fns = {name: (lambda cfg=cfg: _fwd_with(cfg, hidden, x, w, "gated", z=z)) for name, cfg in cands.items()}
        outs = {name: fn()[:1] for name, fn in fns.items()}
        _drop_disagreeing(run, fns, outs, f"gated fwd H{hidden} rows {rows}")
        _record_probe(run, f"gated fwd H{hidden} rows {rows}",
                      time_fns(fns, run.flush, captures=captures(rows, hidden)), cands)
        del x, z, w, fns, outs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def gated_backward_edits(hidden: int) -> dict:
    """{name: BwdConfig} of the gated backward: the config its key gets ("rule": the table's
    gated entry, else configs.gated_from_plain of the plain one), the plain tile it comes
    from (its rows and warps), single edits of the rule (warps, rows per tile, both
    halved, the loads); where the rule holds one masked row (H 5120's 8192 columns) the row
    as two pieces (8 warps pipelined 3 deep or not, 16 warps 3 deep), and where that one
    tile is wider than 4096 columns the row walked in 2048-column tiles, one row a tile
    (walk_edits): the rule's tile there spills 220-296 bytes a thread on sm_90, these forms
    little or none (docs/benchmarks/tune/sm90-regs-gated-wide-bwd.txt)."""
    rule = configs.backward_config(configs.backward_key(hidden, ELT, gated=True))
    plain = configs.backward_config(configs.backward_key(hidden, ELT))
    t, sch = rule.tile, rule.schedule
    out = {"rule": rule}
    if plain.tile != t:
        out["plain tile"] = configs.gated_from_plain(plain).replace(block_m=plain.tile.block_m,
                                                                    num_warps=plain.tile.num_warps)
    for name, ok, kw in (("w/2", t.num_warps >= 2, dict(num_warps=t.num_warps // 2)),
                         ("bm/2", t.block_m >= 2, dict(block_m=t.block_m // 2)),
                         ("bm/2 w/2", t.block_m >= 2 and t.num_warps >= 2,
                          dict(block_m=t.block_m // 2, num_warps=t.num_warps // 2)),
                         ("plain loads", sch.tma_stages > 0, dict(tma_stages=0)),
                         ("tma4", 0 < sch.tma_stages < 4, dict(tma_stages=4))):
        if ok:
            out[name] = rule.replace(**kw)
    b1, b2 = row_pieces(hidden)
    if b2 and t.block_m == 1 and t.block_n > b1 + b2:
        for nw, ls in ((8, 3), (8, 0), (16, 3)):
            out[f"pieces w{nw} ls{ls}"] = pieces_edit(rule, hidden, nw, ls)
    if t.block_m == 1 and t.block_n > 4096 and rule.col_tiles(hidden) == 1:
        out.update({k: v for k, v in walk_edits(hidden, rule).items() if (v.block_n, v.block_m) == (2048, 1)})
    return out


def probe_gated_backward(run: Run, cases=GATED_PROBE_CASES) -> None:
    """Time the gated backward's config (deterministic, gate after the norm, bf16) against its
    edits (gated_backward_edits), each case's candidates interleaved; raw times to
    probe-defaults.json."""
    for hidden, rows in cases:
        x, z, dy = (torch.randn(rows, hidden, device=run.device).to(torch.bfloat16) for _ in range(3))
        w = (1 + 0.1 * torch.randn(hidden, device=run.device)).to(torch.bfloat16)
        _, rstd = trainnorm.rms_norm_gated_forward(x, z, w)
        cands = gated_backward_edits(hidden)
        what = f"gated bwd H{hidden} rows {rows}"
        _record_probe(run, what, _time_bwd_candidates(run, cands, what, dy, x, w, rstd, z), cands)
        del x, z, dy, w, rstd
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _bwd_inputs(run: Run, hidden: int, rows: int):
    """(x, w, dy, rstd) of a plain bf16 backward probe: standard-normal rows and gradient,
    weight 1 + 0.1 N(0, 1), rstd from trainnorm's forward."""
    x = torch.randn(rows, hidden, device=run.device).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device=run.device)).to(torch.bfloat16)
    dy = torch.randn(rows, hidden, device=run.device).to(torch.bfloat16)
    _, rstd, _ = trainnorm.rms_norm_forward(x, w)
    return x, w, dy, rstd


def _time_bwd_candidates(run: Run, cands: dict, what: str, dy, x, w, rstd, z=None) -> dict:
    """{name: us} of the deterministic backward under each config of cands (gated with z),
    each with the workspace its chunking needs, interleaved; a candidate whose outputs are not
    the rule's is left out (_drop_disagreeing)."""
    rows, hidden = x.shape
    fns, outs = {}, {}
    for name, cfg in cands.items():
        ws = _workspace(cfg, hidden, rows, True, run.device, z is not None)
        fns[name] = lambda cfg=cfg, ws=ws: _bwd_with(cfg, hidden, dy, x, w, rstd, ws, True, z=z)
        outs[name] = fns[name]()
    _drop_disagreeing(run, fns, outs, what)
    return time_fns(fns, run.flush, captures=captures(rows, hidden))


def _record_probe(run: Run, what: str, times: dict, cands: dict, file: str = "probe-defaults.json") -> None:
    """Log a probe's times (fastest first) and keep them, with each timed config's fields,
    in `file` under the run's folder."""
    run.log(f"{what}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(times.items(), key=lambda kv: kv[1])))
    run.raw[what] = {"times": times, "configs": {k: cands[k].fields() for k in times}}
    run.save(file)


def probe_defaults(run: Run, cases=PROBE_CASES) -> None:
    """Time the rules' configs against their edits (bf16, deterministic backward), each
    case's candidates interleaved; raw times to probe-defaults.json. Writes no table: the
    rules are code (configs/__init__.py), whose comments cite these times."""
    for hidden, rows in cases:
        x, w, dy, rstd = _bwd_inputs(run, hidden, rows)
        bwd, fwd = default_edits(hidden)
        times = {"bwd": _time_bwd_candidates(run, bwd, f"bwd H{hidden} rows {rows}", dy, x, w, rstd)}
        fns, outs = {}, {}
        for name, cfg in fwd.items():
            fns[name] = lambda cfg=cfg: _fwd_with(cfg, hidden, x, w, "plain")
            outs[name] = fns[name]()[:1]
        _drop_disagreeing(run, fns, outs, f"fwd H{hidden} rows {rows}")
        times["fwd"] = time_fns(fns, run.flush, captures=captures(rows, hidden))
        for op, t in times.items():
            _record_probe(run, f"{op} H{hidden} rows {rows}", t, bwd if op == "bwd" else fwd)
        del x, w, dy, rstd, fns, outs
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --- the backward's chunk count by row count (--probe-chunks) ----------------------------------

# the backward rows behind at few thousand rows (H100, docs/benchmarks/h100-default-cb872d0):
# [T,4,256] T1024 (4096 rows of 256) 0.85x max-autotune, H512 T1024 / T4096 0.95x / 0.92x
CHUNK_PROBE_CASES = ((256, 4096), (256, 16384), (512, 1024), (512, 4096), (512, 16384), (1536, 4096),
                     (2048, 4096))
CHUNK_CAPS = (33, 66, 132)


def chunk_edits(hidden: int, rows: int) -> dict:
    """{name: BwdConfig}: the backward's config at a width ("rule": the table's entry, else
    the analytical default) and the same config with at most m chunks at this row count
    (a rows_max_chunks window ending at `rows`), for each m in CHUNK_CAPS below the chunks
    the config takes there. Each chunk's float64 partial of dw is H x 8 bytes written and
    read back by the combine; fewer chunks, fewer partials and more row tiles a program."""
    cfg = configs.backward_config(configs.backward_key(hidden, ELT))
    own, _ = plan_mod.chunking(cfg, rows)
    out = {"rule": cfg}
    for m in CHUNK_CAPS:
        if m < own:
            out[f"m{m}"] = cfg.replace(rows_max_chunks=((rows, m),))
    return out


def probe_chunks(run: Run, cases=CHUNK_PROBE_CASES) -> None:
    """Time the backward (deterministic, bf16) at each case's row count under its config and
    under fewer chunks (chunk_edits), interleaved; a candidate whose outputs are not the
    rule's up to the reduction order is left out. Raw times to probe-chunks.json; no table."""
    for hidden, rows in cases:
        x, w, dy, rstd = _bwd_inputs(run, hidden, rows)
        cands = chunk_edits(hidden, rows)
        what = f"chunks bwd H{hidden} rows {rows}"
        _record_probe(run, what, _time_bwd_candidates(run, cands, what, dy, x, w, rstd), cands, "probe-chunks.json")
        del x, w, dy, rstd
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --- the float32 residual stream (--probe-stream) --------------------------------------------

STREAM_PROBE_CASES = tuple((h, t) for h in (1024, 2048, 4096, 5120, 6144, 8192) for t in (4096, 16384, 65536))


def stream_edits(hidden: int) -> dict:
    """{name: BwdConfig or None} for the backward of a float32 residual stream under bf16
    activations at its 16-bit key: the key's own config ("rule", None: no override), plain
    loads, the descriptor depth raised (rows.descriptor_stages scales the config's stages
    to the footprint: tma_stages 5 and 6 read 3 and 4 tiles deep with h in float32, the
    latter over the shared memory at 8192 columns and left out where it does not launch),
    and the float32 key's config (what the explicit backward took before 289d9b8)."""
    cfg = configs.backward_config(configs.backward_key(hidden, ELT))
    out = {"rule": None, "plain loads": cfg.replace(tma_stages=0, direct_tma_stages=0)}
    for stages in (5, 6):
        if cfg.schedule.tma_stages and cfg.col_tiles(hidden) == 1:
            out[f"tma_stages {stages}"] = cfg.replace(tma_stages=stages, direct_tma_stages=stages)
    out["float32 key"] = configs.backward_config(configs.backward_key(hidden, 4))
    return out


def probe_stream(run: Run, cases=STREAM_PROBE_CASES) -> None:
    """Time the float32 residual stream's backward (r, h, dh float32; x, y, dy bf16) through
    the explicit rms_norm_backward and through the autograd path's op (x's gradient in bf16
    beside the stream's), each at stream_edits' configs, against the bf16 residual pair (the
    same call with h and dh in bf16); every case's candidates interleaved. Raw times, with
    each time over the pair's, to probe-stream.json."""
    for hidden, rows in cases:
        dev = run.device
        x = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
        r = torch.randn(rows, hidden, device=dev)
        w = (1 + 0.1 * torch.randn(hidden, device=dev)).to(torch.bfloat16)
        dy = torch.randn(rows, hidden, device=dev).to(torch.bfloat16)
        dh = torch.randn(rows, hidden, device=dev)
        _, rstd, h = trainnorm.rms_norm_forward(x, w, residual=r)
        _, rstd16, h16 = trainnorm.rms_norm_forward(x, w, residual=r.to(torch.bfloat16))
        dh16 = dh.to(torch.bfloat16)
        entry = {"explicit": lambda: trainnorm.rms_norm_backward(dy, h, w, rstd, dh=dh),
                 "autograd": lambda: torch.ops.trainnorm.rms_norm_bwd(dy, h, w, rstd, dh, None, "x:bf16", True,
                                                                      True, None)[:2]}
        fns = {"bf16 pair": lambda: trainnorm.rms_norm_backward(dy, h16, w, rstd16, dh=dh16)}
        cands = stream_edits(hidden)
        for path, call in entry.items():
            path_fns, outs = {}, {}
            for name, cfg in cands.items():
                if path == "autograd" and name not in ("rule", "plain loads"):
                    continue

                def fn(cfg=cfg, call=call):
                    with configs.override(backward=only(hidden, "plain", cfg) if cfg is not None else None):
                        return call()
                try:
                    outs[name] = fn()
                except Exception as exc:  # noqa: BLE001 - a depth that does not launch is left out
                    run.log(f"  stream H{hidden} rows {rows} {path} {name}: {type(exc).__name__}; not timed")
                    continue
                path_fns[name] = fn
            _drop_disagreeing(run, path_fns, outs, f"stream {path} H{hidden} rows {rows}")
            fns.update({f"{path} {name}": fn for name, fn in path_fns.items()})
        times = time_fns(fns, run.flush)
        pair = times["bf16 pair"]
        what = f"stream bwd H{hidden} rows {rows}"
        run.log(f"{what}: " + ", ".join(f"{k} {v:.1f} ({v / pair:.2f})" for k, v in times.items()))
        run.raw[what] = {"times": times, "over the pair": {k: v / pair for k, v in times.items()}}
        run.save("probe-stream.json")
        del x, r, w, dy, dh, h, h16, dh16, rstd, rstd16, fns
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --- the backward's wide rows held as two pieces (--probe-bwd-tiles) ------------------------------

BWD_TILES_PROBE_CASES = ((5120, 4096), (5120, 16384), (5120, 65536), (6144, 16384), (6144, 65536), (5376, 65536),
                         (2560, 65536))


# a backward config's fields for rows read with plain loads (no tensor descriptors, no
# prefetch, in the one-chunk form too) and no per-position dw sums: the pieces and the walks
PLAIN_ROWS = dict(direct_prefetch=False, direct_tma_stages=0, prefetch=False, tma_stages=0, dw_2d=False)


def pieces_edit(cfg: BwdConfig, hidden: int, num_warps: int, loop_stages: int, **fields) -> BwdConfig:
    """cfg with one row a tile held as configs.row_pieces(hidden), read plainly (the row
    loop pipelined loop_stages deep), one row the least a chunk."""
    b1, b2 = row_pieces(hidden)
    return cfg.replace(block_m=1, block_n=b1, block_n2=b2, num_warps=num_warps, loop_stages=loop_stages,
                       min_rows_per_chunk=1, **PLAIN_ROWS, **fields)


def bwd_tile_edits(hidden: int) -> dict:
    """{name: BwdConfig}: the backward's config at `hidden` ("entry": the table's, else the
    rule's), the row held as two pieces (configs.row_pieces; one row a tile, 8 or 16 warps,
    the row loop pipelined 3 deep or not, 2 programs an SM or, at 16 warps, 4; at most 24 values of a row a
    thread: 4 warps at 4096 + 1024 columns and wider spill under ptxas, sm_90), and the entry
    with twice or half its warps (where a thread keeps at most 32 values) and its other
    number of programs per SM; where the entry holds the row in one tile, the row walked in
    column tiles (walk_edits); the entry with its rows dealt to the chunks a tile at a time
    (deal_rows); and where the entry takes up to 256 chunks (the rule's), up to 264 (two
    of the H100's and H200's 132 SMs each). Windows, chunking and small-T fields stay the
    entry's otherwise (the walks' chunking is the walked widths')."""
    cur = configs.backward_config(configs.backward_key(hidden, ELT))
    t, s = cur.tile, cur.schedule
    out = {"entry": cur}
    b1, b2 = row_pieces(hidden)
    if b2 and b1 + b2 <= configs.BWD_MAX_TILE:
        for nw, ls, ctas in itertools.product((8, 16), (0, 3), (2, 4)):
            if (b1 + b2) // (32 * nw) <= 24 and (nw, ctas) != (8, 4):
                out[f"pieces bm1 w{nw} ls{ls} c{ctas}"] = pieces_edit(cur, hidden, nw, ls, ctas_per_sm=ctas)
    if cur.col_tiles(hidden) == 1:
        out.update(walk_edits(hidden, cur))
    per_thread = t.block_m * t.block_n // (32 * t.num_warps)
    if t.num_warps < 16:
        out["entry w*2"] = cur.replace(num_warps=2 * t.num_warps)
    if t.num_warps > 4 and 2 * per_thread <= 32:
        out["entry w/2"] = cur.replace(num_warps=t.num_warps // 2)
    other = 2 if s.ctas_per_sm == 4 else 4
    out[f"entry c{other}"] = cur.replace(ctas_per_sm=other)
    out["entry dealt"] = cur.replace(deal_rows=True)
    # 256 chunks of one program an SM (the rule's rows of 2049-4096 columns at T 65536, 117-124
    # registers at 16 warps: docs/benchmarks/tune/h100-ncu-wide-bwd.md) run as a wave of 132
    # and one of 124 on 132 SMs
    if t.max_chunks == 256:
        out["entry m264"] = cur.replace(max_chunks=264)
    return out


# the row walked in column tiles (bwd_col_tiles_kernel: c from a first walk, dx and the
# chunk's float64 dw partial, added in place, from a second that finds the row in L1 / L2):
# (block_n, block_m, num_warps), 4-16 values of a tile a thread; held (hold_dw) at one row a
# tile: 76 / 142 registers at n2048 w16 / w8, H 5120 (sm_90, Triton 3.6)
WALK_TILES = ((2048, 1, 8), (2048, 1, 16), (1024, 1, 8), (1024, 2, 8), (1024, 4, 8), (512, 4, 4))
WALK_MAX_TILES = 12
WALK_MAX_MASKED = 0.25


def walk_edits(hidden: int, cur: BwdConfig) -> dict:
    """{name: BwdConfig}: cur's row walked in column tiles narrower than H (WALK_TILES; at
    most WALK_MAX_TILES tiles, at most WALK_MAX_MASKED of the walk's columns masked), as the
    table's walked widths run (plain loads, 16 rows a chunk at least, up to 256 chunks, 2
    programs an SM), each also with its dw partial held in registers ("held": hold_dw).
    cur's small-T windows stay; a walk sums a row's c in another order than cur's tile, so
    dx's bits differ from the entry's (the same at every T within a walk)."""
    out = {}
    for bn, bm, nw in WALK_TILES:
        n = cdiv(hidden, bn)
        if bn >= hidden or n > WALK_MAX_TILES or n * bn - hidden > WALK_MAX_MASKED * n * bn:
            continue
        # held only at one row a tile: a tile of more rows holds its dw sums once a warp of
        # its rows (the sum's layout), 206-255 registers at H 5120 (sm_90, Triton 3.6)
        for held in ((False, True) if bm == 1 else (False,)):
            out[f"walk n{bn} bm{bm} w{nw}{' held' if held else ''}"] = cur.replace(
                block_m=bm, block_n=bn, block_n2=0, num_warps=nw, min_rows_per_chunk=max(16, bm), max_chunks=256,
                rows_max_chunks=(), ctas_per_sm=2, loop_stages=0, hold_dw=held, **PLAIN_ROWS)
    return out


def probe_bwd_tiles(run: Run, cases=BWD_TILES_PROBE_CASES, stack: bool = False) -> None:
    """The deterministic backward's config against bwd_tile_edits at each (H, rows), every
    candidate interleaved per case (bf16 rows, 16-bit weight; with `stack`, as the bench's
    `res w32` rows: a float32 weight and the residual stream's gradient dh): raw times to
    probe-bwd-tiles.json and the log, each with the entry's time over it (> 1: faster)."""
    for hidden, rows in cases:
        x, w, dy, rstd, _ = _inputs(hidden, rows, run.device)
        dh = None
        if stack:
            w = w.float()
            dh = torch.randn_like(dy)
        fns = {}
        for name, cfg in bwd_tile_edits(hidden).items():
            ws = _workspace(cfg, hidden, rows, True, run.device, False)
            fns[name] = (lambda cfg=cfg, ws=ws: _bwd_with(cfg, hidden, dy, x, w, rstd, ws, True, dh=dh))
        times = time_fns(fns, run.flush, passes=3, samples=10, captures=captures(rows, hidden))
        entry = times["entry"]
        what = f"bwd H{hidden} rows {rows}{' res w32' if stack else ''}"
        run.log(f"{what}: " + ", ".join(f"{k} {v:.2f} ({entry / v:.3f}x)"
                                        for k, v in sorted(times.items(), key=lambda kv: kv[1])))
        run.raw[what] = times
        run.save("probe-bwd-tiles.json")
        del x, w, dy, dh, rstd, fns
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --- programmatic dependent launch (--probe-pdl) -----------------------------------------------

# bench rows: few rows, the one-launch backward, the partials and their combine, wide rows,
# a float32 weight, a residual, a gate, per-head views
PDL_PROBE_ROWS = ("H4096 T1", "H5120 T64", "H512 T1024", "H4096 T1024", "[T,4,256] T1024", "H2048 T4096",
                  "H5120 T4096", "H512 T16384", "H2048 T16384", "H5120 T16384", "H6144 T4096 w32",
                  "H6144 T1024 res", "H4096 T4096 gate", "H5120 T65536")


def _launching(pdl: bool, fn):
    """fn run (and so captured) with dispatch.LAUNCH_PDL set to `pdl`."""
    from trainnorm import dispatch

    def call():
        saved = dispatch.LAUNCH_PDL
        dispatch.LAUNCH_PDL = pdl
        try:
            return fn()
        finally:
            dispatch.LAUNCH_PDL = saved
    return call


def _flat_tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat_tensors(o)]
    return []


def probe_pdl(run: Run, row_ids=PDL_PROBE_ROWS, ops=("fwd", "bwd", "step")) -> None:
    """trainnorm's deterministic fwd, bwd and step (the bench's adapter and data, so the
    bench's launches) launched plainly and with programmatic dependent launch
    (dispatch.LAUNCH_PDL), interleaved per row and op. Each side's outputs are compared
    bit for bit first; a difference is logged and the op not timed. Raw times to
    probe-pdl.json and the log, with plain's time over PDL's (> 1: PDL faster)."""
    from trainnorm.bench import impls as bench_impls
    from trainnorm.bench import shapes
    from trainnorm.bench.run import captures as bench_captures
    by_id = {r.id: r for r in shapes.all_rows()}
    for rid in row_ids:
        row = by_id[rid]
        d = bench_impls.make_row_data(row, run.device)
        impl = bench_impls.Trainnorm(True)
        impl.begin_row(d)
        for op in ops:
            fns = {name: _launching(pdl, impl.prepare(d, op)) for name, pdl in (("plain", False), ("pdl", True))}
            outs = {name: [t.clone() for t in _flat_tensors(fn())] for name, fn in fns.items()}
            what = f"{op} {rid}"
            if len(outs["plain"]) != len(outs["pdl"]) or not all(
                    torch.equal(a, b) for a, b in zip(outs["plain"], outs["pdl"])):
                run.log(f"{what}: outputs differ with PDL; not timed")
                continue
            times = time_fns(fns, run.flush, passes=3, samples=10, captures=bench_captures(row, op))
            run.log(f"{what}: plain {times['plain']:.2f}, pdl {times['pdl']:.2f} "
                    f"({times['plain'] / times['pdl']:.3f}x)")
            run.raw[what] = times
            run.save("probe-pdl.json")
            del outs, fns
        impl.end_row()
        del d
        torch.cuda.empty_cache()


LATENCY_PROBE_CASES = tuple((h, t) for h in (2048, 4096, 5120, 6144) for t in (1, 4, 64))
LATENCY_PEERS = ("liger", "torch-compile", "quack", "fla")


class _NoFlush:
    """In place of the flush: the GPU kept busy for ~50 us without touching memory, so that
    the host has queued the replay before its start event runs. With nothing before it, the
    start event ran at once and the replay's launch followed from the host: every H100
    replay then read 11-18 us, the empty kernel's too (docs/benchmarks/tune/h100-latency.txt)."""

    def __call__(self) -> None:
        torch.cuda._sleep(100_000)


def bench_row_fns(hidden: int, rows: int, device, peers, peer_ops=("fwd", "bwd")) -> tuple[object, dict, list]:
    """(the bench's data for the row, {"impl op": zero-argument callable}, [adapters to
    end_row]): trainnorm's forward and backward and each importable peer's `peer_ops`,
    through `trainnorm bench`'s adapters."""
    from trainnorm.bench import impls as bench_impls
    from trainnorm.bench import shapes
    row = shapes.Row(hidden, rows)
    d = bench_impls.make_row_data(row, device)
    adapters = [i for i in bench_impls.make_impls() if i.name in ("trainnorm",) + tuple(peers) and i.available()]
    fns, begun = {}, []
    for impl in adapters:
        if impl.skip_reason(row):
            continue
        impl.begin_row(d)
        begun.append(impl)
        for op in ("fwd", "bwd") if impl.name == "trainnorm" else peer_ops:
            fns[f"{impl.name} {op}"] = impl.prepare(d, op)
    return d, fns, begun


def latency_fns(hidden: int, rows: int, device, peers=LATENCY_PEERS) -> tuple[dict, list]:
    """({name: zero-argument callable}, [adapters to end_row]) for probe_latency: trainnorm's
    forward and backward, each importable peer's forward (bench adapters, bench data), an
    empty Triton kernel over the rows' programs and a copy of the rows (a load and a store
    of each element, one program a row)."""
    from trainnorm.kernels.floors import copy_rows_kernel, empty_kernel
    d, fns, begun = bench_row_fns(hidden, rows, device, peers, peer_ops=("fwd",))
    x = d.x.reshape(-1, hidden)
    y = torch.empty_like(x)
    sink = torch.empty(x.shape[0], device=device)
    block = next_pow2(hidden)
    warps = 4 if block < 2048 else 8 if block < 8192 else 16
    fns["empty kernel"] = lambda: empty_kernel[(x.shape[0],)](sink)
    fns["row copy"] = lambda: copy_rows_kernel[(x.shape[0],)](x, y, hidden, BLOCK=block, num_warps=warps)
    return fns, begun


def probe_latency(run: Run, cases=LATENCY_PROBE_CASES, peers=LATENCY_PEERS) -> None:
    """Time latency_fns at each (H, rows), interleaved, with run.flush before every replay
    and without; raw times to probe-latency.json (the module docstring says what for)."""
    for hidden, rows in cases:
        fns, begun = latency_fns(hidden, rows, run.device, peers)
        for flushed, flush in (("flush", run.flush), ("no flush", _NoFlush())):
            times = time_fns(fns, flush, captures=captures(rows, hidden))
            what = f"H{hidden} rows {rows} {flushed}"
            run.log(f"{what}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
            run.raw[what] = times
        run.save("probe-latency.json")
        for impl in begun:
            impl.end_row()


FLUSH_PROBE_CASES = ((2560, 65536), (5376, 65536), (5120, 16384), (4096, 65536))
FLUSH_PEERS = ("torch-compile", "torch-compile-maxat")


class _CleanFlush:
    """The bench's flush, then a read of as many bytes of another buffer: the fill leaves L2
    full of dirty lines (50 MB on an H100), which DRAM takes back while the next replay runs;
    after the read L2 holds clean lines only, as after ncu's cache control, which flushes and
    invalidates before each kernel it times."""

    def __init__(self, flush, device, nbytes: int):
        self.flush = flush
        self.src = torch.zeros(nbytes // 4, dtype=torch.int32, device=device)
        self.out = torch.empty((), dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.flush()
        torch.amax(self.src, dim=0, out=self.out)


def probe_flush(run: Run, cases=FLUSH_PROBE_CASES, peers=FLUSH_PEERS, nbytes: int | None = None) -> None:
    """Time the forward and backward of trainnorm and of each importable peer of `peers`
    (bench_row_fns: bench adapters, bench data) at each (H, rows), interleaved, after the
    bench's flush (L2 left dirty) and after _CleanFlush (L2 left clean); raw times to
    probe-flush.json. Where trainnorm's
    time over ncu's kernel time is larger than a peer's (docs/benchmarks/tune/h100-ncu-wide-bwd.md),
    this says whether the dirty lines are why."""
    from trainnorm.bench.timing import FLUSH_BYTES
    clean = _CleanFlush(run.flush, run.device, nbytes or FLUSH_BYTES)
    for hidden, rows in cases:
        _, fns, begun = bench_row_fns(hidden, rows, run.device, peers)
        got = {}
        for name, flush in (("dirty", run.flush), ("clean", clean)):
            got[name] = time_fns(fns, flush, captures=captures(rows, hidden))
            run.raw[f"H{hidden} rows {rows} {name}"] = got[name]
        run.log(f"H{hidden} rows {rows}: " + ", ".join(
            f"{k} {got['dirty'][k]:.2f} -> {got['clean'][k]:.2f} ({got['dirty'][k] / got['clean'][k]:.3f}x)"
            for k in fns))
        run.save("probe-flush.json")
        for impl in begun:
            impl.end_row()
        del fns
        torch.cuda.empty_cache()


# --- the same launch on other data and addresses (--probe-placement) -------------------------

# the bench at 88c3c5a (H100, docs/benchmarks/h100-stack-h5120-88c3c5a): H5120 T16384's backward
# read 201.79 us on the plain row and 189.25 on the 1+w row, the same launch but W_OFFSET, each
# row's samples tight; torch-compile-maxat moved the other way (199.10 -> 205). At dea9d71 on
# the H100 (docs/benchmarks/tune/h100-placement.txt) the time followed the copy of the data
# (188.7-189.3 us on the first, 197.0-201.0 on the three others), not W_OFFSET (within 0.6%)
# (the weight's storage is no longer probed). The chunks read contiguous runs of rows unless the
# config deals them (configs.BwdTile.deal_rows): at these rows the programs read 1.3-5.3 MB
# apart. H2560 and H5376 T65536 ran 0.93x max-autotune in two benches and level with it in
# one process (docs/benchmarks/tune/h100-flush-probe.txt)
PLACEMENT_PROBE_CASES = ((5120, 16384), (2560, 65536), (5376, 65536))
PLACEMENT_COPIES = 3
PLACEMENT_PEERS = ("torch-compile",)


def probe_placement(run: Run, cases=PLACEMENT_PROBE_CASES, copies: int = PLACEMENT_COPIES,
                    peers=PLACEMENT_PEERS) -> None:
    """The deterministic backward at each (H, rows) on `copies` copies of the bench's data
    (copy i the bench's seed i, each allocated after a spacer of its own size: other
    addresses): the rule's config, the same with its rows dealt to the chunks (deal_rows),
    and each importable peer's backward (`trainnorm bench`'s adapters), all interleaved in
    one process, twice: whether a form's time follows its data's place. Raw times to
    probe-placement.json and the log."""
    from trainnorm.bench import impls as bench_impls
    from trainnorm.bench import shapes
    for hidden, rows in cases:
        row = shapes.Row(hidden, rows)
        rule = configs.backward_config(configs.backward_key(hidden, ELT))
        forms = {"rule": rule, "dealt": rule.replace(deal_rows=True)}
        adapters = [i for i in bench_impls.make_impls() if i.name in peers and i.available() and not i.skip_reason(row)]
        fns, keep = {}, []
        for i in range(copies):
            keep.append(torch.empty((i + 1) * 37 * 2**20, dtype=torch.uint8, device=run.device))
            d = bench_impls.make_row_data(row, run.device, seed=i)
            _, rstd, _ = trainnorm.rms_norm_forward(d.x, d.w)
            keep.append((d, rstd))
            for name, cfg in forms.items():
                ws = _workspace(cfg, hidden, rows, True, run.device, False)
                fns[f"copy{i} {name}"] = (lambda cfg=cfg, d=d, rstd=rstd, ws=ws:
                                          _bwd_with(cfg, hidden, d.dy, d.x, d.w, rstd, ws, True))
            for impl in adapters:
                if i == 0:
                    impl.begin_row(d)
                fns[f"copy{i} {impl.name}"] = impl.prepare(d, "bwd")
        for rep in range(2):
            t = time_fns(fns, run.flush, passes=3, samples=15, captures=1)
            what = f"bwd H{hidden} rows {rows} rep {rep}"
            run.log(f"{what}: " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
            run.raw[what] = t
        run.save("probe-placement.json")
        for impl in adapters:
            impl.end_row()
        del fns, keep
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _drop_disagreeing(run: Run, fns: dict, outs: dict, what: str) -> None:
    """Leave out (and log) a candidate whose outputs are not those of the rule's config up
    to the reduction order: a broken config is not timed."""
    for name, out in outs.items():
        for a, b in zip(out, outs["rule"]):
            if a is not None and not torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-2 * b.abs().max().item()):
                run.log(f"  {what} {name}: outputs differ from the rule's; not timed")
                fns.pop(name, None)
                break


# --- command line ---------------------------------------------------------------------------

PROBES = ("probe_defaults", "probe_schedule", "probe_chunks", "probe_stream", "probe_latency", "probe_tiles",
          "probe_bwd_tiles", "probe_pdl", "probe_flush", "probe_placement")


def _probing(args) -> bool:
    """Whether the command line asks for a probe (raw times, no table) rather than a sweep."""
    return any(getattr(args, name) for name in PROBES)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainnorm.dev.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep = p.add_mutually_exclusive_group(required=True)
    sweep.add_argument("--sweep-bwd", action="store_true", help="the backward's tile, loads, schedule and chunking")
    sweep.add_argument("--sweep-small", action="store_true", help="the backward's one-chunk and column-slice windows")
    sweep.add_argument("--sweep-fwd", action="store_true", help="the forward tile over token counts 1-65536")
    sweep.add_argument("--sweep-rows", action="store_true",
                       help="the forward entries' rows per tile by row count (the tile's column layout kept)")
    sweep.add_argument("--sweep-weight", action="store_true",
                       help="when the forward entries read the weight (and whether column tiles are held)")
    sweep.add_argument("--probe-defaults", action="store_true",
                       help="the analytical defaults against single edits of them at widths the table does not hold")
    sweep.add_argument("--probe-schedule", action="store_true",
                       help="the forward entries against the edits that keep their bits (rows per tile, loads)")
    sweep.add_argument("--probe-chunks", action="store_true",
                       help="the backward's config against fewer dw chunks at the case's row count")
    sweep.add_argument("--probe-stream", action="store_true",
                       help="the float32 residual stream's backward: load forms and keys against the bf16 pair")
    sweep.add_argument("--probe-latency", action="store_true",
                       help="few rows: trainnorm, the peers' forwards and launch floors, with and without the L2 flush")
    sweep.add_argument("--probe-flush", action="store_true",
                       help="trainnorm's and torch.compile's fwd and bwd after the bench's flush (L2 left dirty) "
                            "and after a flush that leaves it clean, at --cases")
    sweep.add_argument("--probe-placement", action="store_true",
                       help="the backward (the rule's, its rows dealt, torch.compile's) on separately placed "
                            "copies of its data, at --cases")
    sweep.add_argument("--probe-bwd-tiles", action="store_true",
                       help="the backward's config against its row held as two pieces and other edits, at --cases")
    sweep.add_argument("--probe-pdl", action="store_true",
                       help="trainnorm's fwd, bwd and step on bench rows (--rows) launched plainly and with "
                            "programmatic dependent launch")
    sweep.add_argument("--probe-tiles", action="store_true",
                       help="the forward entries at --hidden against the --tiles and torch.compile of the reference")
    p.add_argument("--cases", default=None,
                   help="with a --probe-*: comma-separated HxROWS (default: PROBE_CASES, SCHEDULE_PROBE_CASES, "
                        "CHUNK_PROBE_CASES, STREAM_PROBE_CASES, LATENCY_PROBE_CASES, BWD_TILES_PROBE_CASES, "
                        "FLUSH_PROBE_CASES, PLACEMENT_PROBE_CASES)")
    p.add_argument("--rows", default=None,
                   help="with --probe-pdl: bench row ids separated by ';' (default: PDL_PROBE_ROWS)")
    p.add_argument("--gated", action="store_true",
                   help="with --sweep-bwd: the gated backward (the 'gated' entries); with --probe-defaults: "
                        "the gated forward's rule and the gated backward's config against their edits "
                        "(default cases GATED_PROBE_CASES)")
    p.add_argument("--stack", action="store_true",
                   help="with --probe-bwd-tiles: a float32 weight and the residual stream's gradient dh "
                        "(the bench's 'res w32' rows)")
    p.add_argument("--out", default="tune-out", help="directory for the table, raw times and log (default tune-out)")
    p.add_argument("--table", default=None,
                   help="write the table here instead of OUT/<arch>.json (the only way to write the package's)")
    p.add_argument("--hidden", default=None, help="comma-separated widths (default: the sweep's bench widths)")
    p.add_argument("--kinds", default=None,
                   help="with --sweep-fwd or --probe-tiles: comma-separated entry kinds, of " + ", ".join(FWD_KINDS)
                        + " (default: both)")
    p.add_argument("--tokens", default=None,
                   help="with --sweep-fwd: comma-separated row counts to choose over (default: FWD_T, FWD_W32_T "
                        "for weight_fp32); with "
                        "--probe-tiles: to time at (default: PROBE_TILES_T)")
    p.add_argument("--tiles", default=None,
                   help="with --probe-tiles: comma-separated forward tiles as the sweep names them, e.g. "
                        "'bm2 w8 pieces,bm1 w16 n2048 held,bm1 w4 tma4 c2'")
    args = p.parse_args(argv)
    if args.stack and not args.probe_bwd_tiles:
        p.error("--stack needs --probe-bwd-tiles")
    if (args.kinds or args.tokens) and not (args.sweep_fwd or args.probe_tiles):
        p.error("--kinds and --tokens need --sweep-fwd or --probe-tiles")
    if args.probe_tiles:
        if not args.hidden or not args.tiles:
            p.error("--probe-tiles needs --hidden and --tiles")
        args.tiles = tuple(t.strip() for t in args.tiles.split(","))
        for h in args.hidden.split(","):
            try:
                named_tiles(int(h), args.tiles)
            except ValueError as exc:
                p.error(f"--tiles: {exc}")
    elif args.tiles:
        p.error("--tiles needs --probe-tiles")
    # parsed here once: args.kinds a tuple of kinds (default FWD_KINDS), args.tokens a tuple
    # of row counts or None (each command's default: FWD_T / FWD_W32_T, PROBE_TILES_T)
    if args.kinds:
        bad = [k for k in args.kinds.split(",") if k not in FWD_KINDS]
        if bad:
            p.error(f"--kinds: {', '.join(bad)} is not one of {', '.join(FWD_KINDS)}")
    args.kinds = tuple(args.kinds.split(",")) if args.kinds else FWD_KINDS
    if args.tokens:
        try:
            counts = tuple(int(t) for t in args.tokens.split(","))
        except ValueError:
            counts = ()
        if not counts or min(counts) < 1:
            p.error(f"--tokens: expected comma-separated positive row counts, got {args.tokens!r}")
        args.tokens = counts
    if args.rows:
        if not args.probe_pdl:
            p.error("--rows needs --probe-pdl")
        from trainnorm.bench import shapes
        known = {r.id for r in shapes.all_rows()}
        args.rows = tuple(r.strip() for r in args.rows.split(";"))
        bad = [r for r in args.rows if r not in known]
        if bad:
            p.error(f"--rows: no bench row {', '.join(map(repr, bad))}")
    if args.gated and not (args.sweep_bwd or args.probe_defaults):
        p.error("--gated needs --sweep-bwd or --probe-defaults")
    if args.cases and (not _probing(args) or args.probe_tiles or args.probe_pdl):
        p.error("--cases needs --probe-defaults, --probe-schedule, --probe-chunks, --probe-stream, --probe-latency, "
                "--probe-flush or --probe-bwd-tiles")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hidden:
        widths = [int(h) for h in args.hidden.split(",")]
    else:
        widths = list(SMALL_WIDTHS if args.sweep_small else FWD_WIDTHS if args.sweep_fwd or args.sweep_rows or args.sweep_weight else
                      GATED_WIDTHS if args.gated else BWD_WIDTHS)
    if args.sweep_bwd:
        known = SWEEP_TILES_GATED if args.gated else SWEEP_TILES
        if any(h not in known for h in widths):
            raise SystemExit(f"--sweep-bwd has candidate tiles for H in {sorted(known)} only")
    if not torch.cuda.is_available():
        raise SystemExit("tune: needs a CUDA GPU")
    from trainnorm.bench.timing import L2Flush
    from trainnorm.rows import arch_of
    dev = torch.device("cuda")
    arch = arch_of(dev)
    os.makedirs(args.out, exist_ok=True)
    path = table_path_for(args.out, args.table, arch)
    log_lines = []

    def log(s):
        print(s, flush=True)
        log_lines.append(s)

    probe = _probing(args)
    run = Run(table=start_table(path, arch), table_path=None if probe else path, out=args.out,
              device=dev, flush=L2Flush(dev), log=log)
    log(f"tune: {torch.cuda.get_device_name(dev)} ({arch}), torch {torch.__version__}; table {path}")
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")] if args.cases else None
    try:
        if args.probe_defaults and args.gated:
            probe_gated_forward(run, cases or GATED_PROBE_CASES)
            probe_gated_backward(run, cases or GATED_PROBE_CASES)
        elif args.probe_defaults:
            probe_defaults(run, cases or PROBE_CASES)
            if not cases:
                probe_gated_forward(run, GATED_PROBE_CASES)
        elif args.probe_schedule:
            probe_schedule(run, cases or SCHEDULE_PROBE_CASES)
        elif args.probe_chunks:
            probe_chunks(run, cases or CHUNK_PROBE_CASES)
        elif args.probe_stream:
            probe_stream(run, cases or STREAM_PROBE_CASES)
        elif args.probe_latency:
            probe_latency(run, cases or LATENCY_PROBE_CASES)
        elif args.probe_flush:
            probe_flush(run, cases or FLUSH_PROBE_CASES)
        elif args.probe_tiles:
            probe_tiles(run, widths, args.kinds, args.tiles, args.tokens)
        elif args.probe_placement:
            probe_placement(run, cases or PLACEMENT_PROBE_CASES)
        elif args.probe_bwd_tiles:
            probe_bwd_tiles(run, cases or BWD_TILES_PROBE_CASES, args.stack)
        elif args.probe_pdl:
            probe_pdl(run, args.rows or PDL_PROBE_ROWS)
        elif args.sweep_small:
            tune_small(run, widths)
        elif args.sweep_fwd:
            tune_fwd(run, widths, args.kinds, args.tokens)
        elif args.sweep_rows:
            tune_rows(run, widths)
        elif args.sweep_weight:
            tune_weight(run, widths)
        else:
            tune_bwd(run, widths, args.gated)
        if not probe:
            log(f"wrote {path}")
    finally:
        with open(os.path.join(args.out, "tune.txt"), "w") as f:
            f.write("\n".join(log_lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
