"""Kernel-source variants timed side by side in one process.

A variant is a directory holding a copy of `trainnorm/kernels/` with edits (a load's
cache hint, a store written another way, a float64 step done in float32). Each is
imported as a package of its own; while a variant's turn runs, trainnorm.dispatch
launches that package's kernels, so the package's plans, configs and launches are the
ones the variant is measured under, and nothing but the kernel source differs. Every
op is timed as `trainnorm bench` times (a CUDA-graph replay after an L2 flush, medians
of interleaved passes), all variants of a case in one process, and the outputs of each
variant are compared bit for bit with the package's own kernels ("base").

    cp -r src/trainnorm/kernels /tmp/k_hint     # then edit /tmp/k_hint/*.py
    python -m trainnorm.dev.variants --variant hint=/tmp/k_hint --cases 4096x16384,5120x65536 --out DIR

Raw times and the bit comparisons go to DIR/variants.json, one line a case and op to the
log; the exit status is 1 where a variant's outputs differ from base's.
A variant is a measurement, not a form: what it shows is brought into kernels/ (and
the GPU suite) before anything ships.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys

import torch

KERNEL_NAMES = ("fwd_one_tile_kernel", "fwd_col_tiles_kernel", "bwd_one_tile_kernel", "bwd_col_tiles_kernel",
                "bwd_col_slices_kernel", "dw_combine_kernel")
OPS = ("fwd", "bwd")


def load_kernels(name: str, path: str) -> dict:
    """{kernel name: kernel} of the kernels package at `path`, imported as its own package
    (trainnorm_variant_<name>), so that its Triton functions are distinct from the package's."""
    init = os.path.join(path, "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"--variant {name}: {path} holds no __init__.py (a copy of trainnorm/kernels/)")
    pkg = f"trainnorm_variant_{name}"
    spec = importlib.util.spec_from_file_location(pkg, init, submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = module
    spec.loader.exec_module(module)
    missing = [k for k in KERNEL_NAMES if not hasattr(module, k)]
    if missing:
        raise SystemExit(f"--variant {name}: {path} lacks {', '.join(missing)}")
    return {k: getattr(module, k) for k in KERNEL_NAMES}


class _Routed:
    """In dispatch's place for one kernel name: launches the kernel of the set named by
    `current[0]`."""

    def __init__(self, name: str, sets: dict, current: list):
        self.name, self.sets, self.current = name, sets, current

    def __getitem__(self, grid):
        return self.sets[self.current[0]][self.name][grid]


@contextlib.contextmanager
def routed(sets: dict):
    """Within the block dispatch's kernels are those of sets[current[0]] (yields `current`, a
    one-element list holding "base" until the caller names another set)."""
    from trainnorm import dispatch
    saved = {k: getattr(dispatch, k) for k in KERNEL_NAMES}
    sets = {"base": saved, **sets}
    current = ["base"]
    for k in KERNEL_NAMES:
        setattr(dispatch, k, _Routed(k, sets, current))
    try:
        yield current
    finally:
        for k, v in saved.items():
            setattr(dispatch, k, v)


def case_fns(hidden: int, rows: int, device, weight_dtype=torch.bfloat16, ops=OPS, residual=False) -> dict:
    """{op: zero-argument callable} of trainnorm's explicit forward and backward on seeded bf16
    rows (the backward from the forward's rstd). With `residual`, the forward adds a bf16
    residual stream (the plans' residual forms, held walks among them) and the backward takes
    the stream's gradient dh, as a decoder block's norm does."""
    import trainnorm
    g = torch.Generator(device=device).manual_seed(hidden * 7919 + rows)
    x = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(weight_dtype)
    dy = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16)
    r = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16) if residual else None
    dh = torch.randn(rows, hidden, device=device, generator=g).to(torch.bfloat16) if residual else None
    _, rstd, h = trainnorm.rms_norm_forward(x, w, residual=r)
    fns = {"fwd": lambda: trainnorm.rms_norm_forward(x, w, residual=r),
           "bwd": lambda: trainnorm.rms_norm_backward(dy, h, w, rstd, dh=dh)}
    return {op: fns[op] for op in ops}


def _bits(out) -> list:
    return [t.detach().reshape(-1).view(torch.uint8).clone() for t in out if t is not None and t.numel()]


def probe(sets: dict, cases, device, flush, log=print, weight_dtype=torch.bfloat16, ops=OPS,
          time_fns=None, residual=False) -> dict:
    """Time every op of every case under the package's kernels ("base") and each set of
    `sets` ({name: kernels}), interleaved; {case: {"times": {variant op: us}, "bits": {variant
    op: equal to base}}}. time_fns(fns, flush, captures=...) -> {name: us} (tune.time_fns)."""
    from trainnorm.dev import tune
    time_fns = time_fns or tune.time_fns
    out = {}
    with routed(sets) as current:
        for hidden, rows in cases:
            base_fns = case_fns(hidden, rows, device, weight_dtype, ops, residual)
            fns, bits, ref = {}, {}, {}
            for name in ("base", *sets):
                for op, fn in base_fns.items():
                    def run(name=name, fn=fn):
                        current[0] = name
                        try:
                            return fn()
                        finally:
                            current[0] = "base"
                    got = _bits(run())
                    if name == "base":
                        ref[op] = got
                    bits[f"{name} {op}"] = len(got) == len(ref[op]) and all(
                        torch.equal(a, b) for a, b in zip(got, ref[op]))
                    fns[f"{name} {op}"] = run
            times = time_fns(fns, flush, captures=tune.captures(rows, hidden))
            what = f"H{hidden} T{rows}{' res' if residual else ''}"
            out[what] = {"times": times, "bits": bits}
            for op in base_fns:
                base = times[f"base {op}"]
                log(f"{what} {op}: base {base:.2f}" + "".join(
                    f", {n} {times[f'{n} {op}']:.2f} ({base / times[f'{n} {op}']:.3f}x"
                    f"{'' if bits[f'{n} {op}'] else ', BITS DIFFER'})" for n in sets))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainnorm.dev.variants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=True,
                   help="NAME=DIR: a copy of trainnorm/kernels/ with edits (repeatable)")
    p.add_argument("--cases", required=True, help="comma-separated HxROWS")
    p.add_argument("--ops", default="fwd,bwd", help="comma-separated subset of fwd,bwd")
    p.add_argument("--weight", default="bf16", choices=("bf16", "fp32"), help="the weight's dtype")
    p.add_argument("--residual", action="store_true",
                   help="add a bf16 residual stream (forward) and its gradient dh (backward)")
    p.add_argument("--out", required=True, help="directory for variants.json")
    args = p.parse_args(argv)
    variants = {}
    for v in args.variant:
        name, sep, path = v.partition("=")
        if not sep or not name.isidentifier() or name == "base":
            p.error(f"--variant: NAME=DIR with NAME an identifier other than 'base', got {v!r}")
        variants[name] = path
    args.variant = variants
    try:
        cases = [tuple(int(n) for n in c.split("x")) for c in args.cases.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        p.error(f"--cases: HxROWS,HxROWS... of positive integers, got {args.cases!r}")
    args.cases = cases
    args.ops = tuple(args.ops.split(","))
    if not set(args.ops) <= set(OPS):
        p.error(f"--ops: a subset of {','.join(OPS)}, got {','.join(args.ops)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("variants: needs a CUDA GPU")
    from trainnorm.bench.timing import L2Flush
    device = torch.device("cuda")
    sets = {name: load_kernels(name, path) for name, path in args.variant.items()}
    os.makedirs(args.out, exist_ok=True)
    print(f"variants: {torch.cuda.get_device_name(device)}, torch {torch.__version__}; {', '.join(sets)}", flush=True)
    res = probe(sets, args.cases, device, L2Flush(device), ops=args.ops,
                weight_dtype=torch.float32 if args.weight == "fp32" else torch.bfloat16, residual=args.residual)
    with open(os.path.join(args.out, "variants.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 1 if any(not ok for case in res.values() for ok in case["bits"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
