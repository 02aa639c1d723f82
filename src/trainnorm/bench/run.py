"""`trainnorm bench`: time trainnorm against its peers, row by row, and write the report.

For every row: allocate the inputs once; check each implementation's dw
against FP64 (bwd and step rows); then per op capture every implementation's
op in its own CUDA graph, sample them in interleaved passes, and release the
graphs before the next op. The row's tensors are freed before the next row.
bench.md and bench.json are rewritten after every row, so an interrupted run
keeps what it measured; the plots are drawn at the end.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time

import torch

from . import report, shapes, timing
from .block import QWEN3_8B, make_block_data, make_block_impls
from .impls import EPS, IMPL_NAMES, Impl, dw_check, make_impls, make_row_data
from .timing import first_line
from .report import DW_BUDGET, TRAINNORM_NAMES, BenchResult, Measurement

DEFAULT_SAMPLES = 25
# ops that move at most this many bytes are captured ROTATE_CAPTURES times and sampled in
# turn (timing.py: a replay of a few microseconds follows its graph by up to 8% on an H100);
# at 64 MiB a row's floor is about 22 us on an H100 and 16 on an H200, past which one graph's
# offset of ~0.3 us weighs little. Longer ops keep one capture (and their outputs' memory)
ROTATE_MAX_BYTES = 64 << 20
ROTATE_CAPTURES = 3
QUICK_SAMPLES = 10
DEFAULT_PASSES = 3
SEED = 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainnorm bench",
        description="Latency of trainnorm's forward, backward and 2 x fwd + bwd against its peers "
                    "(CUDA-graph replays after an L2 flush, median of interleaved passes), with the "
                    "copy-bandwidth floor of every row and the dw accuracy of every implementation.")
    p.add_argument("--set", default="default", metavar="NAMES",
                   help="comma-separated row sets: " + "; ".join(f"{s.name} ({len(s.rows())} rows: {s.description})"
                                                                for s in shapes.ROW_SETS.values())
                        + f"; or {shapes.ALL_SETS} (default: default)")
    p.add_argument("--quick", action="store_true",
                   help=f"a representative subset of each set ({len(shapes.QUICK_IDS)} rows of the default set) "
                        f"with {QUICK_SAMPLES} samples per pass")
    p.add_argument("--shapes", action="append", metavar="PATTERN",
                   help="keep rows of the sets whose id contains PATTERN or matches it as a regex, e.g. "
                        "'H6144', 'res', '^H4096 T(1|4)$', '[T,8,128]', 'block' (repeatable)")
    p.add_argument("--ops", default=",".join(shapes.OPS), help="comma-separated subset of fwd,bwd,step")
    p.add_argument("--impls", default=None,
                   help="comma-separated subset of: " + ", ".join(IMPL_NAMES) + " (default: all but quack-autotune)")
    p.add_argument("--passes", type=int, default=DEFAULT_PASSES, help="interleaved passes (default 3)")
    p.add_argument("--samples", type=int, default=None,
                   help=f"samples per pass and implementation (default {DEFAULT_SAMPLES}, {QUICK_SAMPLES} with --quick)")
    p.add_argument("--out", default="bench-out", help="output folder for bench.md, bench.json, *.png")
    p.add_argument("--quack-autotune", action="store_true",
                   help="also time QuACK with its exhaustive per-shape autotune (slow: minutes per shape)")
    p.add_argument("--jobs", type=int, default=0, metavar="N",
                   help="before timing, run every selected row's implementations once in N worker "
                        "processes, so that their compiles (torch.compile, QuACK's CuTe DSL, Triton) land in "
                        "the on-disk caches in parallel; the timing process then loads them. 0: no warm-up")
    p.add_argument("--warm-only", action="store_true",
                   help="with --jobs: fill the compile caches and stop, timing nothing (the timing "
                        "run follows in another process, on the same machine)")
    p.add_argument("--skip-done", nargs="+", metavar="BENCH_JSON",
                   help="leave out the rows that these earlier bench.json files measured (finish a run "
                        "cut short; join the parts with --merge)")
    p.add_argument("--reuse", nargs="+", metavar="BENCH_JSON",
                   help="take from these earlier bench.json files every selected row whose launches' "
                        "fingerprint (the kernels' source and every launch of the row: trainnorm launches) "
                        "equals this tree's, measured for every op on the same GPU, torch, Triton and "
                        "peers' versions; time only the others, and write one report of all of them")
    p.add_argument("--list", action="store_true", help="print the selected rows and implementations, run nothing")
    p.add_argument("--merge", nargs="+", metavar="BENCH_JSON",
                   help="run nothing: merge the bench.json files of runs over different rows into one "
                        "report (tables, JSON, plots) in --out")
    return p


def merge_files(paths: list[str], out: str) -> int:
    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(report.from_json(json.load(f)))
    result = report.merge(parts)
    written, note = report.write_outputs(result, out)
    print("\n".join(report.summary_lines(result)))
    if note:
        print(f"trainnorm bench: {note}", file=sys.stderr)
    print(f"trainnorm bench: merged {len(parts)} runs, {len(result.rows)} rows; wrote " + ", ".join(written))
    return 0


def done_rows(data: dict, ops: list[str]) -> set[str]:
    """Ids of the rows that a bench.json measured for every op in `ops`.

    A cut run's "rows" lists every row it selected; only its "measurements"
    say which were reached (a row's cells are written when the whole row is)."""
    return _rows_with_ops(((m["row"], m["op"]) for m in data["measurements"]), ops)


def _rows_with_ops(cells, ops: list[str]) -> set[str]:
    """The rows among (row, op) pairs that have every op in `ops`."""
    seen: dict[str, set[str]] = {}
    for row, op in cells:
        seen.setdefault(row, set()).add(op)
    return {rid for rid, got in seen.items() if set(ops) <= got}


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _err(msg: str) -> int:
    print(f"trainnorm bench: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        return merge_files(args.merge, args.out)
    ops = _split(args.ops)
    bad = [o for o in ops if o not in shapes.OPS]
    if not ops or bad:
        return _err(f"--ops must be a comma-separated subset of {','.join(shapes.OPS)}, got {args.ops!r}")
    try:
        sets = shapes.parse_sets(args.set)
    except ValueError as exc:
        return _err(str(exc))
    rows = shapes.select_rows(shapes.set_rows(sets, quick=args.quick), args.shapes)
    if args.skip_done:
        done: set[str] = set()
        for path in args.skip_done:
            with open(path) as f:
                done |= done_rows(json.load(f), ops)
        rows = [r for r in rows if r.id not in done]
        if not rows:
            print(f"trainnorm bench: every selected row is in {', '.join(args.skip_done)}", file=sys.stderr)
            return 0
    if not rows:
        return _err(f"no row id of --set {args.set} matches --shapes {args.shapes}; "
                    "`trainnorm bench --list --set all` prints the ids")
    if args.impls is None:
        names = [n for n in IMPL_NAMES if n != "quack-autotune"]
    else:
        names = _split(args.impls)
        unknown = [n for n in names if n not in IMPL_NAMES]
        if not names or unknown:
            return _err(f"unknown implementation(s) {unknown}; choose from {', '.join(IMPL_NAMES)}")
    if args.quack_autotune and "quack-autotune" not in names:
        names.append("quack-autotune")
    samples = args.samples if args.samples is not None else (QUICK_SAMPLES if args.quick else DEFAULT_SAMPLES)
    if args.passes < 1 or samples < 1:
        return _err("--passes and --samples must be at least 1")
    if args.list:
        print(f"{len(rows)} rows x {len(ops)} ops ({', '.join(ops)}); implementations: {', '.join(names)}")
        marks = {"small_t": "  (small T)", "gated": "  (gated)", "beyond": "  (beyond the table)",
                 "block": "  (decoder block)", "stack": "  (training stack)"}
        for r in rows:
            print(f"  {r.id}{marks.get(r.group, '')}")
        return 0
    if args.warm_only and args.jobs < 1:
        return _err("--warm-only needs --jobs N (N >= 1)")
    if not torch.cuda.is_available():
        return _err("no CUDA GPU is visible (torch.cuda.is_available() is False). The benchmark times "
                    "CUDA-graph replays on a GPU; nothing was run.")
    return _run(args, rows, ops, names, samples)


# --- environment header ---------------------------------------------------------------------

def _smi_id(index: int) -> str:
    """nvidia-smi's id of torch's device `index` (CUDA_VISIBLE_DEVICES renumbers devices)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def nvidia_smi(index: int) -> dict:
    """Driver and clocks from nvidia-smi, best effort."""
    keys = ("driver", "clock_sm", "clock_mem", "clock_max_sm")
    query = "driver_version,clocks.sm,clocks.mem,clocks.max.sm"
    try:
        res = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-i", _smi_id(index)],
                             capture_output=True, text=True, timeout=20)
        if res.returncode != 0:
            return {"nvidia-smi": f"failed ({res.stderr.strip()[:120] or res.returncode})"}
        vals = [v.strip() for v in res.stdout.strip().splitlines()[0].split(",")]
        return dict(zip(keys, vals))
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return {"nvidia-smi": f"unavailable ({type(exc).__name__})"}


def environment(device: torch.device, impls: list[Impl], unavailable: dict[str, str]) -> dict:
    import triton

    import trainnorm
    props = torch.cuda.get_device_properties(device)
    env = {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "gpu_memory": f"{props.total_memory / 2**30:.0f} GiB",
    }
    env.update(nvidia_smi(device.index or 0))
    env.update({
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "trainnorm": trainnorm.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    })
    peers = {}
    for impl in impls:
        if impl.name in TRAINNORM_NAMES:
            continue
        peers[impl.name] = "not available" if impl.name in unavailable else (impl.version() or "version unknown")
    env["peers"] = peers
    return env


# --- progress -------------------------------------------------------------------------------

class Progress:
    """tqdm when it is installed, else one status line on stderr."""

    def __init__(self, total: int):
        self.total, self.done, self.t0, self.text = total, 0, time.time(), ""
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="op", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.tty = sys.stderr.isatty()

    def status(self, text: str) -> None:
        self.text = text
        if self.bar is not None:
            self.bar.set_description_str(text[:48])
        elif self.tty:
            self._line()

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            self._line(end="" if self.tty else "\n")

    def _line(self, end: str = "") -> None:
        el = int(time.time() - self.t0)
        line = f"[{self.done:>4}/{self.total}] {el // 60:>3}m{el % 60:02d}s  {self.text}"
        sys.stderr.write(("\r" + line.ljust(78)) if self.tty else line)
        sys.stderr.write(end)
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")


# --- adapters and data per row ----------------------------------------------------------------

def make_adapters(rows: list[shapes.Row], names: list[str]) -> tuple[list[Impl], list[Impl]]:
    """(norm adapters, block adapters) named in `names`, each list empty when no selected row needs it."""
    norm = [i for i in make_impls(quack_autotune="quack-autotune" in names) if i.name in names] \
        if any(not r.block for r in rows) else []
    block = [i for i in make_block_impls() if i.name in names] if any(r.block for r in rows) else []
    return norm, block


def fingerprints(rows: list[shapes.Row], sms: int, arch: str | None = None) -> dict[str, str]:
    """Each norm row's launch fingerprint (trainnorm.dev.launches.fingerprint, taken on the
    CPU with the dispatcher seeing `sms` multiprocessors and the default architecture's
    table). Where they cannot be taken (`arch`, the GPU's, has a table of its own; an error)
    the run goes on without them, said on stderr: its rows then cannot be reused."""
    from trainnorm import configs
    from trainnorm.configs import table
    if arch and arch != configs.DEFAULT_ARCH and arch in table.archs():
        print(f"trainnorm bench: no launch fingerprints: {arch} has its own table, the CPU's launches "
              f"follow {configs.DEFAULT_ARCH}'s; this run's rows cannot be reused", file=sys.stderr)
        return {}
    try:
        from trainnorm.dev import launches
        digest = launches.kernels_digest()
        return {r.id: launches.fingerprint(r, sms, digest) for r in rows if not r.block}
    except Exception as exc:    # noqa: BLE001 (the timing does not depend on them)
        print(f"trainnorm bench: no launch fingerprints ({type(exc).__name__}: {first_line(exc)}); "
              "this run's rows cannot be reused", file=sys.stderr)
        return {}


# what a reused part must share with this run, besides each row's fingerprint
REUSE_ENV = ("gpu", "sm_count", "torch", "triton")


def reusable(parts: list[tuple[str, BenchResult]], prints: dict[str, str], env: dict,
             ops: list[str]) -> list[BenchResult]:
    """Each (path, part) restricted to the rows it can give this run: measured for every op in
    `ops`, with the fingerprint `prints` holds for the row (rows without one, and block rows,
    are never reused). A part run on another GPU, torch, Triton or peer version (every peer
    this run times) is an error: its rows would not compare with this run's."""
    out = []
    for path, part in parts:
        for k in REUSE_ENV:
            if part.env.get(k) != env.get(k):
                raise ValueError(f"--reuse: {path} ran with {k} {part.env.get(k)!r}, this run has {env.get(k)!r}")
        theirs = part.env.get("peers", {})
        for name, version in env.get("peers", {}).items():
            if theirs.get(name) != version:
                raise ValueError(f"--reuse: {path} ran {name} {theirs.get(name)!r}, this run has {version!r}")
        done = _rows_with_ops(((m.row, m.op) for m in part.measurements), ops)
        ids = [r.id for r in part.rows if r.id in done
               and prints.get(r.id) is not None and part.launches.get(r.id) == prints[r.id]]
        out.append(report.subset(part, ids))
    return out


def row_data(row: shapes.Row, device):
    return make_block_data(row, device, SEED) if row.block else make_row_data(row, device, SEED)


def impl_names(impls: list[Impl]) -> list[str]:
    """The adapters' names once each, in IMPL_NAMES order (the report's columns)."""
    got = {i.name for i in impls}
    return [n for n in IMPL_NAMES if n in got]


# --- one row --------------------------------------------------------------------------------

def captures_for_bytes(nbytes: int) -> int:
    """CUDA graphs to capture of an op that moves nbytes (ROTATE_MAX_BYTES)."""
    return ROTATE_CAPTURES if nbytes <= ROTATE_MAX_BYTES else 1


def captures(row: shapes.Row, op: str) -> int:
    """CUDA graphs to capture of each implementation of a row's op (captures_for_bytes; one
    for the block rows, which have no byte count)."""
    return 1 if row.block else captures_for_bytes(shapes.op_bytes(row, op))


def _recover() -> None:
    """After an implementation failed: finish what is queued and give its memory back."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()
    torch.cuda.empty_cache()


def bench_row(row: shapes.Row, impls: list[Impl], ops: list[str], flush: timing.L2Flush,
              stream: torch.cuda.Stream, passes: int, samples: int, progress: Progress) -> list[Measurement]:
    out: list[Measurement] = []
    device = flush.buf.device
    progress.status(f"{row.id} inputs")
    d = row_data(row, device)

    ready: list[Impl] = []
    for impl in impls:
        why = impl.skip_reason(row)
        if why:
            out += [Measurement(row.id, op, impl.name, mode="skipped", note=f"skipped: {why}") for op in ops]
            continue
        try:
            impl.begin_row(d)
            ready.append(impl)
        except Exception as exc:  # noqa: BLE001
            _recover()
            out += [Measurement(row.id, op, impl.name, mode="failed", note=f"failed: {first_line(exc)}")
                    for op in ops]

    dw: dict[str, tuple[float | None, str | None]] = {}
    dw_note: dict[str, str] = {}
    for impl in ready:
        if impl.checks_dw and any(op != "fwd" and not impl.op_skip_reason(op) for op in ops):
            progress.status(f"{row.id} dw {impl.name}")
            try:
                dw[impl.name] = dw_check(impl, d)
            except Exception as exc:  # noqa: BLE001
                _recover()
                dw_note[impl.name] = f"dw check failed ({first_line(exc)})"
            gc.collect()
            torch.cuda.empty_cache()

    for op in ops:
        progress.status(f"{row.id} {op}")
        timers: list[timing.Timer] = []
        for impl in ready:
            why = impl.op_skip_reason(op)
            if why:
                out.append(Measurement(row.id, op, impl.name, mode="skipped", note=f"{op} skipped: {why}"))
                continue
            try:
                timers.append(timing.make_timer(impl.name, impl.prepare(d, op), stream,
                                                captures=captures(row, op)))
            except Exception as exc:  # noqa: BLE001
                _recover()
                out.append(Measurement(row.id, op, impl.name, mode="failed", note=f"{op} failed: {first_line(exc)}"))
        try:
            got = timing.sample_interleaved(timers, flush, passes, samples)
        except Exception as exc:  # noqa: BLE001
            _recover()
            got = None
            out += [Measurement(row.id, op, t.name, mode="failed", note=f"{op} sampling failed: {first_line(exc)}")
                    for t in timers]
        by_name = {i.name: i for i in ready}
        for t in timers:
            if got is not None:
                impl = by_name[t.name]
                flat = [s for p in got[t.name] for s in p]
                st = timing.Stats.of(flat)
                err, dtype = dw.get(t.name, (None, None)) if op != "fwd" else (None, None)
                note = "; ".join(n for n in (t.note, impl.row_note(row),
                                             dw_note.get(t.name, "") if op != "fwd" else "") if n)
                out.append(Measurement(
                    row.id, op, t.name, st.median, st.p20, st.p80,
                    [round(timing.percentile(p, 50), 3) for p in got[t.name]],
                    [round(s, 3) for s in flat], t.mode, note, err, dtype))
            t.release()
        del timers, got
        gc.collect()
        torch.cuda.empty_cache()
        progress.advance()

    for impl in ready:
        impl.end_row()
    del d
    gc.collect()
    torch.cuda.empty_cache()
    torch.compiler.reset()
    return out


# --- parallel compile warm-up -----------------------------------------------------------------

def _warm_worker(row_ids: list[str], ops: list[str], names: list[str]) -> tuple[int, float, list[str]]:
    """Run each row's implementations once per op (no timing): fills the compile caches."""
    t0 = time.time()
    by_id = {r.id: r for r in shapes.all_rows()}
    norm, block = make_adapters([by_id[i] for i in row_ids], names)
    norm, block = [i for i in norm if i.available()], [i for i in block if i.available()]
    device = torch.device("cuda", torch.cuda.current_device())
    errors = []
    for rid in row_ids:
        row = by_id[rid]
        d = row_data(row, device)
        for impl in block if row.block else norm:
            if impl.skip_reason(row):
                continue
            try:
                impl.begin_row(d)
                for op in ops:
                    if not impl.op_skip_reason(op):
                        impl.prepare(d, op)()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - the timing process reports failures itself
                errors.append(f"{rid} {impl.name}: {first_line(exc)}")
                _recover()
            finally:
                impl.end_row()
        del d
        gc.collect()
        torch.cuda.empty_cache()
        torch.compiler.reset()
    return len(row_ids), time.time() - t0, errors


def warm_caches(rows: list[shapes.Row], ops: list[str], names: list[str], jobs: int) -> None:
    """Compile every row's implementations in `jobs` processes, rows dealt round-robin.

    What runs there is the implementations' first calls: compiles (CPU), and
    the benchmarking inside torch.compile's max-autotune, which then shares the
    GPU with the other workers' first calls. The timing afterwards is done by
    this process alone."""
    import concurrent.futures as cf
    import multiprocessing as mp
    t0 = time.time()
    shares = [[r.id for r in rows[i::jobs]] for i in range(jobs)]
    shares = [s for s in shares if s]
    print(f"trainnorm bench: compiling {len(rows)} rows in {len(shares)} processes", file=sys.stderr)
    with cf.ProcessPoolExecutor(max_workers=len(shares), mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_warm_worker, s, ops, names) for s in shares]
        for f in cf.as_completed(futs):
            try:
                n, dt, errors = f.result()
                print(f"trainnorm bench: warm-up worker done: {n} rows in {dt:.0f} s"
                      + (f"; {len(errors)} failures, first: {errors[0]}" if errors else ""), file=sys.stderr)
            except Exception as exc:  # noqa: BLE001
                print(f"trainnorm bench: warm-up worker failed ({first_line(exc)})", file=sys.stderr)
    print(f"trainnorm bench: warm-up took {time.time() - t0:.0f} s", file=sys.stderr)


# --- the run --------------------------------------------------------------------------------

def _run(args, rows: list[shapes.Row], ops: list[str], names: list[str], samples: int) -> int:
    device = torch.device("cuda", torch.cuda.current_device())
    norm, block = make_adapters(rows, names)
    wanted = norm + block
    unavailable: dict[str, str] = {}
    for impl in wanted:
        if not impl.available():
            unavailable[impl.name] = impl.reason
            print(f"trainnorm bench: skipping {impl.name}: {impl.reason}", file=sys.stderr)
    norm = [i for i in norm if i.name not in unavailable]
    block = [i for i in block if i.name not in unavailable]
    active = norm + block
    if not active:
        return _err("none of the selected implementations is available")

    env = environment(device, wanted, unavailable)
    prints = fingerprints(rows, env["sm_count"], "sm_" + env["compute_capability"].replace(".", ""))
    reused: list[BenchResult] = []
    if args.reuse:
        try:
            parts = []
            for path in args.reuse:
                with open(path) as f:
                    parts.append((path, report.from_json(json.load(f))))
            reused = [p for p in reusable(parts, prints, env, ops) if p.rows]
        except (OSError, ValueError, KeyError) as exc:
            return _err(str(exc))
        taken = {r.id for p in reused for r in p.rows}
        print(f"trainnorm bench: {len(taken)} of {len(rows)} rows taken from {', '.join(args.reuse)} "
              "(the same launches and kernels' source)", file=sys.stderr)
        rows = [r for r in rows if r.id not in taken]
        if not rows:
            return _report(report.merge(reused), args.out, interrupted=False)
    if args.jobs > 0:
        warm_caches(rows, ops, impl_names(active), args.jobs)
    if args.warm_only:
        return 0
    stream = torch.cuda.Stream(device)
    interrupted = False
    with torch.cuda.device(device), torch.cuda.stream(stream):
        config = {
            "rows": shapes.describe(rows),
            "ops": ",".join(ops),
            "passes x samples": f"{args.passes} x {samples} per implementation",
            "captures": f"{ROTATE_CAPTURES} CUDA graphs per implementation sampled in turn where the op moves at "
                        f"most {ROTATE_MAX_BYTES >> 20} MiB, else 1",
            "inputs": f"bfloat16 activations, weight bfloat16 (float32 on w32 rows), eps {EPS:g}; "
                      "on res r32 rows r, h, dh and dx float32; on 1+w rows y = x_hat * (1 + w)",
            "L2 flush": f"{timing.FLUSH_BYTES >> 20} MB written before every sample",
            "dw budget": f"err/tol <= {DW_BUDGET:g} and float32 dw for a matched bwd/step peer",
            "torch.compile": "dynamic=False, fullgraph=True, emulate_precision_casts=True",
            "compile warm-up": (f"{args.jobs} processes filled the compile caches before timing" if args.jobs > 0
                                else "none: each implementation compiled in the timing process"),
        }
        if block:
            c = QWEN3_8B
            config["block"] = (f"Qwen3-style decoder block, hidden {c.hidden}, {c.heads} query and {c.kv_heads} "
                               f"key/value heads of {c.head_dim} with q/k norms, rotary, causal SDPA, SwiGLU MLP "
                               f"{c.intermediate}, bfloat16, batch 1; fwd (training forward) and step = fwd + "
                               "autograd.grad of the input and every parameter; compiled whole: "
                               "torch.compile(fullgraph=True, dynamic=False), Inductor defaults")
        print(f"trainnorm bench: {env['gpu']} ({env['sm_count']} SMs); measuring copy bandwidth", file=sys.stderr)
        bw = timing.copy_bandwidth(device)
        flush = timing.L2Flush(device)
        result = BenchResult(env, config, rows, ops, impl_names(active), bw, [], unavailable,
                             {r.id: prints[r.id] for r in rows if r.id in prints})
        with_reused = lambda: report.merge(reused + [result]) if reused else result
        progress = Progress(len(rows) * len(ops))
        try:
            for row in rows:
                result.measurements += bench_row(row, block if row.block else norm, ops, flush, stream,
                                                 args.passes, samples, progress)
                report.write_outputs(with_reused(), args.out, plots=False)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            progress.close()
        after = nvidia_smi(device.index or 0)
        env["clocks_after_run"] = ", ".join(f"{k} {v}" for k, v in after.items() if k != "driver")
    return _report(with_reused(), args.out, interrupted)


def _report(result: BenchResult, out: str, interrupted: bool) -> int:
    paths, note = report.write_outputs(result, out)
    print("\n".join(report.summary_lines(result)))
    if note:
        print(f"trainnorm bench: {note}", file=sys.stderr)
    print("trainnorm bench: wrote " + ", ".join(paths))
    if interrupted:
        print("trainnorm bench: interrupted; the files hold the rows measured so far", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
