"""What the kernels of a bench row spend their time on: Nsight Compute counters
of every kernel one call of an implementation launches, for bench rows and
implementations named on the command line, plus the graph-replay latency of
a kernel that stores one element (the fixed cost in every small-T row).

    ncu --profile-from-start off --clock-control none --cache-control all \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --csv --page details --log-file ncu.csv \\
        python -m trainnorm.dev.ncu_rows --case 'H5120 T65536|fwd|trainnorm,torch-compile-maxat' ...
    python -m trainnorm.dev.ncu_rows --summarize ncu.csv cases.json > ncu.md
    python -m trainnorm.dev.ncu_rows --launch-floor

Each case is run three times unprofiled (compiles, caches), then once between
cudaProfilerStart and cudaProfilerStop, after a marker kernel
(torch.cuda._sleep) that splits ncu's kernel list into the cases in order.
ncu flushes the caches before each kernel (--cache-control all), as the bench
flushes L2 before each replay. Without ncu (--launch-floor) it times, by the
bench's method, a CUDA graph of one Triton kernel that stores one element.

A peer that picks its config by timing at its first call (torch.compile's
reductions, QuACK's autotune) picks it here under ncu, and may pick another
than the bench did: at [T,24,64] T4096 (H100) ncu_rows's torch.compile forward
was one 61.9 us kernel of 98,304 programs where the bench's replay of it reads
13.6 us. Counters of a peer are those of the kernel named in the table, which
need not be the one the bench timed; trainnorm's configs come from its table.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys

MARKER = "spin"       # torch.cuda._sleep's kernel name contains it
METRICS = {            # (section metric name, short name, scale)
    "Duration": ("us", 1e-3),
    "DRAM Throughput": ("dram %", 1),
    "Memory Throughput": ("mem %", 1),
    "Registers Per Thread": ("regs", 1),
    "Grid Size": ("grid", 1),
    "Block Size": ("block", 1),
    "Achieved Occupancy": ("occ %", 1),
    "Theoretical Occupancy": ("theo occ %", 1),
    "Block Limit Registers": ("blocks/SM (regs)", 1),
    "Warp Cycles Per Issued Instruction": ("cycles/issue", 1),
}


def run_cases(cases: list[tuple[str, str, list[str]]], out_json: str | None) -> None:
    import torch

    from trainnorm.bench import impls as bench_impls
    from trainnorm.bench import shapes

    dev = torch.device("cuda")
    rows = {r.id: r for r in shapes.all_rows()}
    adapters = {i.name: i for i in bench_impls.make_impls()}
    order = []
    for row_id, op, names in cases:
        row = rows[row_id]
        d = bench_impls.make_row_data(row, dev)
        for name in names:
            impl = adapters[name]
            if not impl.available() or impl.skip_reason(row):
                print(f"skip {row_id} {op} {name}: {impl.reason or impl.skip_reason(row)}", flush=True)
                continue
            impl.begin_row(d)
            try:
                fn = impl.prepare(d, op)
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                torch.cuda._sleep(1000)
                fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                order.append({"row": row_id, "op": op, "impl": name})
                print(f"ran {row_id} {op} {name}", flush=True)
            finally:
                impl.end_row()
        del d
        torch.cuda.empty_cache()
    if out_json:
        with open(out_json, "w") as f:
            json.dump(order, f, indent=1)


def launch_floor() -> None:
    """Graph replay of a one-store Triton kernel after an L2 flush (the bench's method)."""
    import torch
    import triton
    import triton.language as tl

    from trainnorm.bench import timing

    @triton.jit
    def _one_store(X):
        # one store: a kernel with no side effect is not captured into the graph at all
        tl.store(X, 0.0)

    dev = torch.device("cuda")
    x = torch.empty(1, device=dev)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        timers = [timing.make_timer("one-store triton kernel", lambda: _one_store[(1,)](x), stream),
                  timing.make_timer("one-element copy", lambda: x.copy_(x), stream)]
    torch.cuda.synchronize()
    res = timing.sample_interleaved(timers, timing.L2Flush(dev), 3, 25)
    for name, passes in res.items():
        print(f"{name}: {timing.percentile([s for p in passes for s in p], 50):.2f} us per graph replay")


def summarize(csv_path: str, cases_json: str) -> str:
    with open(cases_json) as f:
        order = json.load(f)
    with open(csv_path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    kernels: dict[str, dict] = {}
    for rec in csv.DictReader(lines):
        k = kernels.setdefault(rec["ID"], {"name": rec["Kernel Name"], "m": {}})
        if rec["Metric Name"] in METRICS:
            try:
                k["m"][rec["Metric Name"]] = float(rec["Metric Value"].replace(",", ""))
            except ValueError:
                pass
            if rec["Metric Name"] == "Duration" and rec.get("Metric Unit") == "usecond":
                k["m"]["Duration"] *= 1e3
            elif rec["Metric Name"] == "Duration" and rec.get("Metric Unit") == "msecond":
                k["m"]["Duration"] *= 1e6
    groups, cur = [], None
    for kid in sorted(kernels, key=int):
        k = kernels[kid]
        if MARKER in k["name"]:
            cur = []
            groups.append(cur)
        elif cur is not None:
            cur.append(k)
    head = ["row", "op", "impl", "kernel"] + [v[0] for v in METRICS.values()]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, ks in zip(order, groups):
        for k in ks:
            vals = [f"{k['m'][m] * METRICS[m][1]:.4g}" if m in k["m"] else "-" for m in METRICS]
            out.append(f"| {case['row']} | {case['op']} | {case['impl']} | {k['name'][:40]} | " + " | ".join(vals) + " |")
    if len(groups) != len(order):
        out.append(f"\n{len(order)} cases ran, {len(groups)} marker kernels in the ncu log")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainnorm.dev.ncu_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", default=[], help="'ROW ID|OP|impl,impl,...' (repeatable)")
    p.add_argument("--cases-out", default="cases.json", help="the order the cases ran in (for --summarize)")
    p.add_argument("--launch-floor", action="store_true", help="time a graph of a one-store kernel")
    p.add_argument("--summarize", nargs=2, metavar=("NCU_CSV", "CASES_JSON"))
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize(*args.summarize))
        return 0
    if args.launch_floor:
        launch_floor()
    cases = []
    for c in args.case:
        row, op, names = c.split("|")
        cases.append((row, op, names.split(",")))
    if cases:
        run_cases(cases, args.cases_out)
    elif not args.launch_floor:
        p.error("nothing to do: give --case, --launch-floor or --summarize")
    return 0


if __name__ == "__main__":
    sys.exit(main())
