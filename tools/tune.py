"""Measure kernel configurations on the GPU: the data behind configs/tuned.py.

Timing as `trainnorm bench` does it (one CUDA-graph replay per sample after an
L2 flush, median of interleaved passes), trainnorm alone. Stage 1 picks the
forward tile (block_m, num_warps) and the backward tile per H at a mid-size T;
stage 2 sweeps the backward's chunking (min_rows_per_chunk, max_chunks) for
the best backward tiles over token counts. Prints tables and writes JSON.

    python3 tools/tune.py --out DIR [--hidden 512,2048] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import trainnorm  # noqa: E402
from trainnorm import configs  # noqa: E402
from trainnorm.bench.timing import L2Flush, make_timer, percentile, sample_interleaved  # noqa: E402
from trainnorm.configs import BwdConfig, FwdConfig, tuned  # noqa: E402

FAMILIES = {512: 1, 1536: 1, 2048: 1, 4096: 1, 5120: 1, 6144: 1, 256: 24}   # H -> heads per token


def _set(fwd: FwdConfig | None = None, bwd: BwdConfig | None = None, hidden: int = 0):
    if fwd is not None:
        tuned.FWD[(hidden, 2)] = fwd.__dict__
    if bwd is not None:
        tuned.BWD[(hidden, 2)] = bwd.__dict__
    configs.forward_config.cache_clear()
    configs.backward_config.cache_clear()


def _inputs(hidden, tokens, dev):
    heads = FAMILIES.get(hidden, 1)
    shape = (tokens, heads, hidden) if heads > 1 else (tokens, hidden)
    x = torch.randn(shape, device=dev).to(torch.bfloat16)
    w = torch.randn(hidden, device=dev).to(torch.bfloat16)
    dy = torch.randn(shape, device=dev).to(torch.bfloat16)
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="tune-out")
    p.add_argument("--hidden", default=",".join(str(h) for h in FAMILIES))
    p.add_argument("--tokens1", type=int, default=16384)
    p.add_argument("--tokens2", default="16,256,1024,4096,16384,65536")
    args = p.parse_args()
    dev = "cuda"
    flush = L2Flush(dev)
    os.makedirs(args.out, exist_ok=True)
    log_lines = []

    def log(s):
        print(s, flush=True)
        log_lines.append(s)

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
