"""Bit fingerprints of every output the tuned table's plans produce, to compare two builds.

Runs the public API only (forward and backward, plain, residual, gated in both
orders, per-head views, both modes) over the tuned widths and an unseen one,
at token counts that reach every form the table chooses (one chunk, column
slices, chunked with the combine, the atomic form, rows walked in column
tiles, tensor-descriptor loads), and writes a fingerprint of each output's bytes
(_digest: formed on the output's device, so the outputs of 65536 rows are not
copied to the host and hashed there, which took most of a run's 300-500 s).
Inputs are drawn from a seeded generator on the device, so two builds see the
same bits. A change meant to keep the arithmetic (a refactor, a schedule
change) must give identical files; `--compare` lists what differs.

    python -m trainnorm.dev.bits --out A.json              # on the GPU: real sizes
    python -m trainnorm.dev.bits --compare A.json B.json

Because it uses nothing but the public API, the same file runs against another
checkout's package: `PYTHONPATH=OTHER/src python path/to/bits.py --out B.json`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import zlib

import torch

import trainnorm

WIDTHS = (512, 1536, 2048, 4096, 5120, 6144, 1000, 8200)
GPU_T = (1, 4, 16, 64, 300, 4096, 16384, 65536)
CPU_T = (1, 16)                 # the interpreter: one row, and one small chunked launch
HEADS = ((24, 256, True), (4, 256, False), (32, 128, False))     # (heads, H, every other slice of a wider row)


DIGEST_BLOCK = 1 << 16          # bytes a block
DIGEST_CHUNK = 1 << 26          # bytes widened to int64 at a time (512 MB of int64)


def _digest(t) -> str | None:
    """SHA-1 (16 hex digits) of the byte count and, per block of DIGEST_BLOCK bytes, the
    exact sum of byte * (its position in the block + 1), the sums formed on t's device.
    Each sum is below 255 * 2**16 * 2**16 < 2**40 (no overflow, no rounding), so two byte
    strings that differ in one byte, or by two bytes trading places, give other sums."""
    if t is None:
        return None
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    weights = torch.arange(1, DIGEST_BLOCK + 1, dtype=torch.int64, device=b.device)
    sums = []
    for i in range(0, b.numel(), DIGEST_CHUNK):
        c = b[i:i + DIGEST_CHUNK].to(torch.int64)
        c = torch.nn.functional.pad(c, (0, -c.numel() % DIGEST_BLOCK))
        sums.append((c.view(-1, DIGEST_BLOCK) * weights).sum(dim=1))
    h = hashlib.sha1(str(b.numel()).encode())
    if sums:
        h.update(torch.cat(sums).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _draw(shape, gen, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).to(dtype)


def cases(device, tokens):
    for hidden in WIDTHS:
        for t in tokens:
            yield f"H{hidden} T{t}", (t,), hidden, False
    for heads, hidden, strided in HEADS:
        for t in tokens:
            yield f"[T,{heads},{hidden}]{' strided' if strided else ''} T{t}", (t, heads), hidden, strided


def run(device, tokens) -> dict:
    out = {}
    for name, lead, hidden, strided in cases(device, tokens):
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        shape = lead + (hidden,)
        x = _draw(lead + (2 * hidden,), gen, torch.bfloat16)[..., :hidden] if strided else _draw(shape, gen,
                                                                                                 torch.bfloat16)
        r, z, dy = (_draw(shape, gen, torch.bfloat16) for _ in range(3))
        dh = _draw(shape, gen, torch.bfloat16, 0.5)
        for wdt in (torch.bfloat16, torch.float32):
            w = (1 + _draw((hidden,), gen, torch.float32, 0.1)).to(wdt)
            for det in (True, False):
                key = f"{name} w={str(wdt)[6:]} det={det}"
                y, rstd, h = trainnorm.rms_norm_forward(x, w, 1e-6)
                dx, dw = trainnorm.rms_norm_backward(dy, x, w, rstd, deterministic=det)
                out[key] = [_digest(v) for v in (y, rstd, dx, dw if det else None)]
                y, rstd, h = trainnorm.rms_norm_forward(x, w, 1e-6, residual=r)
                dx, dw = trainnorm.rms_norm_backward(dy, h, w, rstd, dh=dh, deterministic=det)
                out[key + " res"] = [_digest(v) for v in (y, rstd, h, dx, dw if det else None)]
                for nbg in (True, False):
                    y, rstd = trainnorm.rms_norm_gated_forward(x, z, w, 1e-6, norm_before_gate=nbg)
                    dx, dz, dw = trainnorm.rms_norm_gated_backward(dy, x, z, w, rstd, norm_before_gate=nbg,
                                                                   deterministic=det)
                    out[key + f" gate nbg={nbg}"] = [_digest(v) for v in (y, rstd, dx, dz, dw if det else None)]
        if device.type == "cuda":
            torch.cuda.synchronize()
    return out


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    if a.get("tokens") != b.get("tokens"):
        print(f"different token lists: {a.get('tokens')} vs {b.get('tokens')}")
    keys = sorted(set(a["bits"]) | set(b["bits"]))
    diff = [k for k in keys if a["bits"].get(k) != b["bits"].get(k)]
    for k in diff:
        print(f"differs: {k}: {a['bits'].get(k)} vs {b['bits'].get(k)}")
    print(f"{len(keys) - len(diff)} of {len(keys)} cases bit-identical ({a.get('device')} / {b.get('device')})")
    return 1 if diff else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainnorm.dev.bits", description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the fingerprints here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    p.add_argument("--tokens", help="comma-separated token counts (default: by device)")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("--out or --compare is required")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (
        GPU_T if device.type == "cuda" else CPU_T)
    bits = run(device, tokens)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", tokens=list(tokens),
                torch=torch.__version__, trainnorm=getattr(trainnorm, "__file__", ""), bits=bits)
    with open(args.out, "w") as f:
        json.dump(meta, f, indent=0, sort_keys=True)
    print(f"{len(bits)} cases -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
