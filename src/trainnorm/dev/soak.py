"""Soak test: random cases of every input class against the FP64 reference.

Each case is drawn from its own seed (numpy and torch generators, no
hypothesis): H (1..65536, biased to the tuned widths and odd widths), leading
shape (T = 0 up to large T, capped in elements), layout (contiguous, a slice
of a wider buffer with an offset, a two-level per-head view such as
[T, 24, 256] with strides (12288, 512, 1), transposed leading dims, a strided
last dim, a broadcast row), dtype, weight dtype (activation, fp32, None),
residual (a float32 stream under 16-bit x), gate (both orders), a (1 + w)
weight, y's dtype, eps (incl. None) and input family.

Every case runs forward + backward three times (deterministic twice, then
deterministic=False) and checks:
  - y, h, dx, dgate within atol = rtol = 1e-2 of FP64; rstd relative error <= 1e-4;
  - dw err/tol <= 0.5 (tol = 1e-4 + 1e-4 |ref|) in both modes, and (plain and
    residual forms) in the deterministic mode never worse than the FP32 eager
    reduction (+1e-3);
  - deterministic=True: two calls give the same bits for every output;
  - modes: y, rstd, h, dx, dgate bitwise equal between the two modes.

    python -m trainnorm.dev.soak --cases 10000 --workers 8 --time-limit 540 --out soak-out
    python -m trainnorm.dev.soak --replay 4000000123           # one case, from its seed
    python -m trainnorm.dev.soak --device cpu --cases 30      # the kernels under Triton's interpreter

A case's seed is  seed * 10**9 + index ; worker k of K takes the indices
k, k + K, ...: workers draw disjoint cases. The JSON summary (--out) lists
every failure with its case description and seed for --replay (with the same
--device). The assertions are those of trainnorm.dev.checks. --device cpu
needs Triton's interpreter from the first import of triton: the command
restarts itself with TRITON_INTERPRET=1 when it is not set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections import Counter

from trainnorm.rows import interpreter_enabled

TUNED = [256, 512, 1536, 2048, 4096, 5120, 6144]
ODD = [1, 3, 7, 33, 127, 255, 257, 1000, 1023, 1025, 4095, 4097, 6143, 8191, 8193, 12289, 16385, 20000,
       32767, 65535]
DTYPE_NAMES = ["bf16", "fp16", "fp32"]
SEED_STRIDE = 10**9


def _interpreter_missing(device: str) -> bool:
    """--device cpu runs the kernels under Triton's interpreter, which must be on before
    triton is first imported (the package imports it)."""
    return device == "cpu" and not interpreter_enabled()


# --- case description ------------------------------------------------------------------------

def draw_case(case_seed: int, device: str) -> dict:
    """A JSON-able description of one case; a function of (case_seed, device) only."""
    import numpy as np
    rng = np.random.default_rng(case_seed)
    cpu = device == "cpu"
    max_elems = 1 << 14 if cpu else 1 << 24
    big = (not cpu) and rng.random() < 0.02
    if big:
        max_elems = 1 << 27
    max_h = 1024 if cpu else 65536

    u = rng.random()
    if u < 0.45:
        hidden = int(rng.choice(TUNED))
    elif u < 0.65:
        hidden = int(rng.choice([h for h in ODD if h <= max_h]))
    elif u < 0.8:
        base = int(rng.choice(TUNED))
        hidden = max(1, base + int(rng.choice([-1, 1, 2 * int(rng.integers(1, 8)) + 1])))
    else:
        hidden = int(round(math.exp(rng.uniform(0, math.log(max_h)))))
    if cpu and rng.random() < 0.05:
        hidden = int(rng.choice([8200, 16390]))      # one wide-row case now and then (column tiles)
    hidden = min(max(hidden, 1), 65536)

    layout = str(rng.choice(["contig", "slice", "per_head", "transposed", "strided_last", "broadcast", "one_d"],
                            p=[0.3, 0.2, 0.2, 0.12, 0.06, 0.04, 0.08]))
    budget_rows = max(1, max_elems // hidden)
    r = rng.random()
    if r < 0.04:
        rows = 0
    elif r < 0.25:
        rows = int(rng.integers(1, min(budget_rows, 64) + 1))
    else:
        rows = int(round(math.exp(rng.uniform(0, math.log(budget_rows + 1)))))
        rows = max(1, min(rows, budget_rows))
    if layout == "per_head":
        # q = proj.view(T, NH + extra_heads, H + pad)[:, :NH, :H]: one row stride when extra_heads == 0
        # (the query view [T, 24, 256] with strides (12288, 512, 1)), two levels otherwise
        heads = int(rng.choice([2, 3, 4, 8, 16, 24, 32]))
        lead = [max(1, rows // heads) if rows else 0, heads]
        pad = int(rng.choice([0, hidden, 2 * hidden, 8]))
        extra_heads = int(rng.choice([0, 0, 1, 8]))
    elif layout == "transposed":
        b = int(rng.integers(2, 6))
        lead = [max(1, rows // b) if rows else 0, b]
        pad = 0
    elif layout == "one_d":
        lead, pad = ([] if rows else [0]), 0
    else:
        ndim = int(rng.choice([1, 1, 1, 2, 3]))
        k = int(rng.integers(2, 6))
        t = max(1, rows // k) if rows else 0
        lead = [rows] if ndim == 1 else [t, k] if ndim == 2 else [t, 1, k]
        pad = int(rng.integers(1, 2 * hidden + 3)) if layout == "slice" else 0
    offset = int(rng.integers(0, 64)) if layout in ("slice", "per_head") else 0

    extra = str(rng.choice(["none", "residual", "gate", "gate_first"], p=[0.4, 0.25, 0.2, 0.15]))
    eps = [1e-6, 1e-5, 1e-12, 0.1, None][int(rng.integers(0, 5))]
    return dict(
        seed=int(case_seed), device=device, hidden=hidden, lead=[int(v) for v in lead], layout=layout,
        pad=pad, offset=offset, extra_heads=extra_heads if layout == "per_head" else 0, big=bool(big),
        dtype=DTYPE_NAMES[int(rng.choice(3, p=[0.6, 0.2, 0.2]))],
        weight=str(rng.choice(["same", "fp32", "none"], p=[0.5, 0.35, 0.15])),
        extra=extra, eps=eps,
        family=str(rng.choice(["normal", "outlier", "offset", "small", "large"], p=[0.4, 0.25, 0.2, 0.075, 0.075])),
        other_layouts=[str(rng.choice(["same", "contig", "slice"])) for _ in range(3)],   # dy, residual/gate, dh
        # drawn last, so that the fields above are those an older build drew for the seed
        stream32=bool(rng.random() < 0.4),          # a residual under 16-bit x: a float32 stream
        w_offset=float(rng.choice([0.0, 1.0], p=[0.7, 0.3])),
        out=[None, None, None, *DTYPE_NAMES][int(rng.integers(0, 6))],
    )


def _stream(c) -> str:
    """The residual stream's dtype name: float32 for a float32 stream under 16-bit x."""
    return "fp32" if c["extra"] == "residual" and c.get("stream32") else c["dtype"]


def _offset(c) -> float:
    return c.get("w_offset", 0.0) if c["weight"] != "none" else 0.0


def _dtype(name):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _place(values, c, layout, gen):
    """The same values in `layout` (see draw_case); the garbage around a view is random."""
    import torch
    shape, dev = values.shape, values.device
    hidden = shape[-1]
    if layout == "contig" or values.numel() == 0:
        return values
    if layout == "slice":
        pad, off = max(c["pad"], 1), c["offset"]
        n = values.numel() // hidden
        flat = torch.randn(off + n * (hidden + pad) + hidden, generator=gen, device=dev).to(values.dtype)
        view = flat[off:off + n * (hidden + pad)].view(*shape[:-1], hidden + pad)[..., :hidden]
        view.copy_(values)
        return view
    if layout == "per_head" and values.dim() >= 3:
        t, nh = shape[0], shape[1]
        wide = (nh + c["extra_heads"]) * (hidden + c["pad"])
        buf = torch.randn(c["offset"] + t * wide + 1, generator=gen, device=dev).to(values.dtype)
        view = buf[c["offset"]:c["offset"] + t * wide].view(t, nh + c["extra_heads"], hidden + c["pad"])
        view = view[:, :nh, :hidden]
        view.copy_(values)
        return view
    if layout == "transposed" and values.dim() >= 3:
        return values.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided_last":
        buf = torch.zeros(*shape[:-1], 2 * hidden, dtype=values.dtype, device=dev)
        view = buf[..., ::2]
        view.copy_(values)
        return view
    if layout == "broadcast" and values.dim() >= 2 and shape[0] > 0:
        # every row of dim 0 the same: a stride-0 leading dim, read in place
        return values[:1].expand(shape)
    return values


def make_tensors(c: dict):
    import torch
    dev = torch.device("cuda" if c["device"] == "cuda" else "cpu")
    gen = torch.Generator(device=dev).manual_seed(c["seed"] % (1 << 63))
    dtype = _dtype(c["dtype"])
    hidden = c["hidden"]
    shape = tuple(c["lead"]) + (hidden,)

    def draw(scale=1.0):
        return (torch.randn(shape, generator=gen, device=dev) * scale)

    fam = c["family"]
    x = draw({"small": 1e-3, "large": 100.0}.get(fam, 1.0))
    if fam == "outlier" and x.numel():
        k = max(1, hidden // 512)
        ch = torch.randperm(hidden, generator=gen, device=dev)[:k]
        x[..., ch] *= 30.0
    x = x.to(dtype)
    out = _dtype(c.get("out") or c["dtype"])
    stream = _dtype(_stream(c))
    dy = (0.05 + draw(1e-3)).to(out) if fam == "offset" else draw().to(out)
    other = draw().to(stream)
    dh = draw(0.5).to(stream)
    weight = None
    if c["weight"] != "none":
        # zero-centred weights with an offset: (offset + w) around 1 as the others
        weight = (1.0 - _offset(c) + 0.1 * torch.randn(hidden, generator=gen, device=dev)).to(
            dtype if c["weight"] == "same" else torch.float32)
    x = _place(x, c, c["layout"], gen)
    lay = [c["layout"] if l == "same" else l for l in c["other_layouts"]]
    dy = _place(dy, c, lay[0], gen)
    other = _place(other, c, lay[1], gen)
    dh = _place(dh, c, lay[2], gen)
    return x, dy, other, dh, weight


# --- running and checking ----------------------------------------------------------------------

def run_case(c, tensors, deterministic):
    """(y, rstd, h, dx, dw, dgate) through the explicit entry points."""
    from .checks import run_entry_points
    x, dy, other, dh, weight = tensors
    out = _dtype(c["out"]) if c.get("out") else None
    return run_entry_points(x, dy, other, dh, weight, c["eps"], c["extra"], deterministic, _offset(c), out)


OUT_NAMES = ("y", "rstd", "h", "dx", "dw", "dgate")


def _rel_err(out, ref):
    """max |out - ref| / (1e-2 + 1e-2 |ref|), counting an overflow the math makes as exact."""
    import torch

    from .checks import overflowed_with_ref
    if out.numel() == 0:
        return 0.0
    ref = ref.double()
    out = torch.where(overflowed_with_ref(out, ref), ref, out.double())
    return float(((out - ref).abs() / (1e-2 + 1e-2 * ref.abs())).max())


def check_case(c, tensors, det, det2, fast):
    """A list of failure messages (empty: the case passed) and the case's metrics."""
    import torch

    from trainnorm import reference

    from .checks import DW_BUDGET, assert_bits_equal, assert_close64

    x, dy, other, dh, weight = tensors
    dtype = _dtype(c["dtype"])
    eps = c["eps"] if c["eps"] is not None else float(torch.finfo(torch.float32).eps)   # torch's default
    extra = c["extra"]
    gate = other if extra.startswith("gate") else None
    nbg = extra != "gate_first"
    res = other if extra == "residual" else None
    dh_in = dh if res is not None else None
    offset = _offset(c)
    out = _dtype(c.get("out") or c["dtype"])
    fails, metrics = [], {}

    def attempt(what, fn):
        try:
            fn()
        except AssertionError as e:
            fails.append(f"{what}: {str(e).splitlines()[0][:300] if str(e) else 'assertion'}")

    y, rstd, h, dx, dw, dz = det
    rows = rstd.numel()

    def shapes():
        assert y.shape == x.shape and y.dtype == out, "y shape/dtype"
        assert rstd.shape == x.shape[:-1] and rstd.dtype == torch.float32, "rstd shape/dtype"
        assert h.dtype == _dtype(_stream(c)), "h dtype"
        assert dx.shape == x.shape and dx.dtype == h.dtype, "dx shape/dtype (h's: the explicit backward)"
        if weight is None:
            assert dw is None, "dw must be None without a weight"
        else:
            assert dw.shape == (c["hidden"],) and dw.dtype == torch.float32, "dw shape/dtype"
        if gate is not None:
            assert dz.shape == x.shape and dz.dtype == x.dtype, "dgate shape/dtype"
    attempt("shapes", shapes)
    if fails:
        return fails, metrics

    if rows == 0:
        def zero_dw():
            assert torch.equal(dw, torch.zeros_like(dw)), "dw must be all zeros for T = 0"
        if weight is not None:
            attempt("T=0 dw", zero_dw)
    else:
        y64, rstd64, h_ref = reference.forward_fp64(x, weight, eps, res, gate, nbg, weight_offset=offset)
        metrics["y"] = _rel_err(y, y64)
        metrics["rstd"] = float((rstd.double() / rstd64 - 1).abs().max())
        attempt("y", lambda: assert_close64(y, y64, "y"))

        def rstd_ok():
            assert torch.isfinite(rstd).all(), "rstd non-finite"
            assert metrics["rstd"] <= 1e-4, f"rstd rel err {metrics['rstd']:.3e} > 1e-4"
        attempt("rstd", rstd_ok)
        if res is not None:
            attempt("h", lambda: assert_bits_equal(h, h_ref, "h"))
        del y64, rstd64, h_ref
        back = reference.backward_fp64(dy, h, weight, rstd, dh_in, gate, nbg, weight_offset=offset)
        metrics["dx"] = _rel_err(dx, back[0])
        attempt("dx", lambda: assert_close64(dx, back[0], "dx"))
        if gate is not None:
            metrics["dgate"] = _rel_err(dz, back[2])
            attempt("dgate", lambda: assert_close64(dz, back[2], "dgate"))
        if weight is not None:
            dw64 = back[1]
            e_det = reference.dw_err_over_tol(dw, dw64)
            e_fast = reference.dw_err_over_tol(fast[4], dw64)
            # the FP32 eager reduction (dy.float() * xhat).sum(0): the contract's floor for the plain
            # form; the gated forms are held to the budget only (their terms carry silu's float32 rounding)
            e_eager = reference.dw_err_over_tol(reference.dw_fp32_eager(dy, h, rstd), dw64) if gate is None else None
            metrics.update(dw_det=e_det, dw_fast=e_fast)
            if e_eager is not None:
                metrics["dw_eager"] = e_eager

            def dw_ok():
                assert torch.isfinite(dw).all(), "dw non-finite"
                assert e_det <= DW_BUDGET, f"dw err/tol {e_det:.4f} > {DW_BUDGET}"
                assert e_fast <= DW_BUDGET, f"dw (deterministic=False) err/tol {e_fast:.4f} > {DW_BUDGET}"
                if e_eager is not None:
                    assert e_det <= e_eager + 1e-3, f"dw err/tol {e_det:.4f} worse than FP32 eager {e_eager:.4f}"
            attempt("dw", dw_ok)
        del back

    for i, name in enumerate(OUT_NAMES):
        if det[i] is not None:
            attempt(f"repeat {name}", lambda i=i, name=name: assert_bits_equal(det[i], det2[i], f"repeat {name}"))
    for i in (0, 1, 2, 3, 5):
        if det[i] is not None:
            attempt(f"modes {OUT_NAMES[i]}",
                    lambda i=i: assert_bits_equal(det[i], fast[i], f"mode equality {OUT_NAMES[i]}"))
    return fails, metrics


def features(c, tensors) -> list[str]:
    from trainnorm import plan
    from trainnorm.rows import row_views
    from trainnorm.variant import Variant
    x = tensors[0]
    rows = x.numel() // c["hidden"] if c["hidden"] else 0
    h = c["hidden"]
    hb = ("H=1" if h == 1 else f"H={h}" if h in TUNED else "H>16384" if h > 16384 else "H>8192" if h > 8192
          else "H odd" if h % 2 else "H other")
    feats = [hb, f"dtype={c['dtype']}", f"weight={c['weight']}", f"extra={c['extra']}", f"layout={c['layout']}",
             f"eps={'None' if c['eps'] is None else c['eps']}", f"family={c['family']}",
             f"stream={_stream(c)}", f"w_offset={_offset(c)}", f"y={c.get('out') or c['dtype']}"]
    if rows == 0:
        feats.append("T=0")
    if c["big"]:
        feats.append("big")
    if rows:
        extra = c["extra"]
        variant = Variant(has_weight=c["weight"] != "none", has_residual=extra == "residual",
                          gate="silu" if extra.startswith("gate") else None, norm_before_gate=extra != "gate_first")
        for det in (True, False):
            p = plan.backward_plan(rows, h, _dtype(_stream(c)), variant, det, c["weight"] != "none")
            feats.append(f"dw {'det' if det else 'fast'}={p.dw.value}")
        nh, _ = row_views(x)
        if nh > 1:
            feats.append("two-level rows")
    return feats


def one_case(case_seed: int, device: str):
    """(description, features, failures, metrics) of one case; never raises."""
    import torch
    c = draw_case(case_seed, device)
    feats = []
    try:
        tensors = make_tensors(c)
        feats = features(c, tensors)
        det = run_case(c, tensors, True)
        det2 = run_case(c, tensors, True)
        fast = run_case(c, tensors, False)
        if device == "cuda":
            torch.cuda.synchronize()
        fails, metrics = check_case(c, tensors, det, det2, fast)
    except torch.OutOfMemoryError:
        # several workers share the device: a large case may not fit next to the others'.
        # Not a failure of the kernels; counted under its own feature.
        if device == "cuda":
            torch.cuda.empty_cache()
        return c, feats + ["skipped: out of memory"], [], {}
    except Exception as e:  # a crash is a failure of the case, reported with its seed
        fails, metrics = [f"exception {type(e).__name__}: {str(e)[:500]}",
                          traceback.format_exc(limit=6)[-2000:]], {}
    return c, feats, fails, metrics


# --- workers ---------------------------------------------------------------------------------

def worker(wid: int, nworkers: int, args, deadline: float, queue=None, current=None) -> dict:
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True   # unwritten outputs read as NaN
    count, feats, fails = 0, Counter(), []
    worst = {}
    seeds = []
    fatal = False
    for i in range(wid, args.cases, nworkers):
        if time.time() >= deadline:
            break
        cs = args.seed * SEED_STRIDE + i
        if current is not None:
            current[wid] = cs        # the parent names this seed if the worker hangs
        c, f, fl, m = one_case(cs, args.device)
        count += 1
        seeds.append(cs)
        feats.update(f)
        for k, v in m.items():
            if v == v and v > worst.get(k, (-1.0, 0))[0]:
                worst[k] = (v, cs)
        if fl:
            fails.append(dict(seed=cs, case=c, features=f, failures=fl, metrics=m))
            print(f"[worker {wid}] FAIL seed {cs}: {fl[0]}", flush=True)
            if any("CUDA error" in s or "illegal memory" in s or "AcceleratorError" in s for s in fl):
                fatal = True     # the context is lost: stop this worker, report what it has
                break
        if count % 200 == 0:
            print(f"[worker {wid}] {count} cases, {len(fails)} failed", flush=True)
        if args.device == "cuda" and count % 50 == 0:
            torch.cuda.empty_cache()
    out = dict(worker=wid, count=count, first_seed=seeds[0] if seeds else None,
               last_seed=seeds[-1] if seeds else None, features=dict(feats), failures=fails,
               worst={k: list(v) for k, v in worst.items()}, fatal=fatal)
    print(f"[worker {wid}] done: {count} cases, {len(fails)} failed", flush=True)
    if queue is not None:
        queue.put(out)
    return out


def _worker_entry(wid, nworkers, args, deadline, queue, current):
    try:
        worker(wid, nworkers, args, deadline, queue, current)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(dict(worker=wid, count=0, features={}, failures=[dict(seed=None, case=None, features=[],
                  failures=[f"worker crashed: {type(e).__name__}: {e}"], metrics={})], worst={}, fatal=True))


def replay(args) -> int:
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    bad = 0
    for cs in args.replay:
        c, f, fl, m = one_case(cs, args.device)
        print(json.dumps(dict(seed=cs, case=c, features=f, metrics=m), indent=1))
        print("PASS" if not fl else "FAIL:\n  " + "\n  ".join(fl))
        bad += bool(fl)
    return 1 if bad else 0


def summarize(results, args, elapsed) -> dict:
    feats, fails, worst = Counter(), [], {}
    for r in results:
        feats.update(r["features"])
        fails.extend(r["failures"])
        for k, (v, s) in r.get("worst", {}).items():
            if v > worst.get(k, (-1.0, 0))[0]:
                worst[k] = (v, s)
    fail_feats = Counter(f for fl in fails for f in fl.get("features", []))
    return dict(count=sum(r["count"] for r in results), failed=len(fails), seed=args.seed, cases=args.cases,
                device=args.device, workers=[dict(worker=r["worker"], count=r["count"], first_seed=r.get("first_seed"),
                                                   last_seed=r.get("last_seed"), fatal=r.get("fatal", False))
                                              for r in sorted(results, key=lambda r: r["worker"])],
                seed_rule=f"case seed = {args.seed} * {SEED_STRIDE} + index; worker k takes index k, k + K, ...",
                elapsed_s=round(elapsed, 1), time_limited=sum(r["count"] for r in results) < args.cases,
                features=dict(sorted(feats.items())), failing_features=dict(sorted(fail_feats.items())),
                worst={k: dict(value=v, seed=s) for k, (v, s) in sorted(worst.items())},
                failures=fails)


def print_table(s):
    print()
    print(f"soak: {s['count']} cases ({s['cases']} asked{', time limit reached' if s['time_limited'] else ''}) "
          f"on {s['device']} in {s['elapsed_s']} s, seed {s['seed']}; workers: "
          + ", ".join(f"{w['worker']}:{w['count']}{' (stopped on a CUDA error)' if w['fatal'] else ''}"
                      for w in s["workers"]))
    print(f"{'feature':<28} {'cases':>7} {'failed':>7}")
    for k, v in s["features"].items():
        print(f"{k:<28} {v:>7} {s['failing_features'].get(k, 0):>7}")
    # y / dx / dgate: max |out - ref| / (1e-2 + 1e-2 |ref|); dw: err/tol; dw_eager: the FP32 eager reduction's
    limits = dict(y="1", dx="1", dgate="1", rstd="1e-4", dw_det="0.5", dw_fast="0.5", dw_eager="-")
    print(f"{'worst metric':<28} {'value':>10} {'limit':>8}  seed")
    for k, d in s["worst"].items():
        print(f"{k:<28} {d['value']:>10.4g} {limits.get(k, '-'):>8}  {d['seed']}")
    for fl in s["failures"][:20]:
        print(f"FAIL seed {fl['seed']}: {fl['failures'][0]}")
    if len(s["failures"]) > 20:
        print(f"... {len(s['failures']) - 20} more failures in the JSON summary")
    print(f"RESULT: {'PASS' if s['failed'] == 0 else 'FAIL'} ({s['count']} cases, {s['failed']} failed)")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m trainnorm.dev.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="worker processes on the same device")
    p.add_argument("--out", type=str, default=None, help="directory for soak.json")
    p.add_argument("--time-limit", type=float, default=None, help="seconds; stops cleanly and reports the count")
    p.add_argument("--grace", type=float, default=120.0,
                   help="with --time-limit: seconds a worker may overrun it (a case in flight) before it is stopped")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (default when present) or cpu (the kernels under TRITON_INTERPRET=1, tiny shapes)")
    p.add_argument("--replay", type=int, nargs="+", default=None, help="run these case seeds only, verbosely")
    args = p.parse_args(argv)
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if _interpreter_missing(args.device):
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call([sys.executable, "-m", "trainnorm.dev.soak", *argv, "--device", "cpu"], env=env)
    if args.replay:
        return replay(args)

    t0 = time.time()
    deadline = t0 + args.time_limit if args.time_limit else float("inf")
    if args.workers <= 1 and args.time_limit is None:
        results = [worker(0, 1, args, deadline)]
    else:
        # worker processes (also for one worker under a time limit: the parent is a watchdog
        # that stops a worker still busy `--grace` seconds after the limit, e.g. a hung kernel)
        import multiprocessing as mp
        import queue as queue_mod
        ctx = mp.get_context("spawn")   # CUDA cannot be forked
        q = ctx.Queue()
        nw = max(1, args.workers)
        current = ctx.Array("q", [-1] * nw)
        procs = [ctx.Process(target=_worker_entry, args=(k, nw, args, deadline, q, current)) for k in range(nw)]
        for pr in procs:
            pr.start()
        results = []

        def missing(why):
            got = {r["worker"] for r in results}
            for k, pr in enumerate(procs):
                if k not in got:
                    seed = current[k] if current[k] >= 0 else None
                    results.append(dict(worker=k, count=0, features={}, worst={}, fatal=True, failures=[
                        dict(seed=seed, case=None, features=[], metrics={},
                             failures=[f"worker {k} {why}{'' if pr.exitcode is None else f' (exit code {pr.exitcode})'}"
                                       f" during case seed {seed}; "
                                       f"its other results are lost"])]))
        while len(results) < len(procs):
            try:
                results.append(q.get(timeout=5))
                continue
            except queue_mod.Empty:
                pass
            if time.time() > deadline + args.grace:
                for pr in procs:
                    if pr.is_alive():
                        pr.terminate()
                missing(f"was still running {args.grace:.0f} s after the time limit (hung?) and was stopped")
            elif not any(pr.is_alive() for pr in procs):
                try:                      # a result may still be in flight
                    while True:
                        results.append(q.get(timeout=2))
                except queue_mod.Empty:
                    missing("died")
        for pr in procs:
            pr.join(timeout=30)
    s = summarize(results, args, time.time() - t0)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(s, f, indent=1, default=str)
    print_table(s)
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
