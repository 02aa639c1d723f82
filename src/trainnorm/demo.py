"""`trainnorm demo`: train a tiny transformer language model twice and compare.

The model (token embedding, pre-norm attention + MLP blocks whose residual
stream runs through trainnorm's fused residual add, a SiLU-gated norm in the
MLP, a final norm) is trained for a few dozen steps on a synthetic sequence
task, twice from the same seed in deterministic mode. The demo prints the loss
curve, whether the two runs agree bit for bit (every final weight and every
loss), and the time of the norms' forward + backward at the model's shape
against torch.nn.functional.rms_norm. On a GPU the norms run the Triton
kernels; without one, the CPU path (or the kernels in Triton's interpreter
when TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from . import RMSNorm, RMSNormGated, rms_norm, rows


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, device):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, device=device)
        self.proj = nn.Linear(dim, dim, bias=False, device=device)
        self.mlp_norm = RMSNorm(dim, device=device)
        self.up = nn.Linear(dim, 4 * dim, bias=False, device=device)
        self.gate = nn.Linear(dim, 4 * dim, bias=False, device=device)
        self.gnorm = RMSNormGated(4 * dim, device=device)
        self.down = nn.Linear(4 * dim, dim, bias=False, device=device)

    def forward(self, x, residual):
        b, t, d = x.shape
        y, residual = self.attn_norm(x, residual)
        q, k, v = self.qkv(y).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = self.proj(att.transpose(1, 2).reshape(b, t, d))
        y, residual = self.mlp_norm(x, residual)
        return self.down(self.gnorm(self.up(y), self.gate(y))), residual


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, device):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, device=device)
        self.blocks = nn.ModuleList(Block(dim, heads, device) for _ in range(layers))
        self.norm = RMSNorm(dim, device=device)
        self.head = nn.Linear(dim, vocab, bias=False, device=device)

    def forward(self, tokens):
        x = self.embed(tokens)
        residual = torch.zeros_like(x)
        for blk in self.blocks:
            x, residual = blk(x, residual)
        y, _ = self.norm(x, residual)
        return self.head(y)


def batches(vocab, batch, seq, steps, device, seed=1):
    """Sequences that follow t[i+1] = (a * t[i] + c) mod vocab per sequence: learnable."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        a = torch.randint(1, 8, (batch, 1), generator=g) * 2 + 1
        c = torch.randint(0, vocab, (batch, 1), generator=g)
        t = torch.empty(batch, seq + 1, dtype=torch.long)
        t[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for i in range(seq):
            t[:, i + 1] = (a[:, 0] * t[:, i] + c[:, 0]) % vocab
        yield t.to(device)


def train(cfg, device, seed=0):
    torch.manual_seed(seed)
    model = TinyLM(cfg["vocab"], cfg["dim"], cfg["heads"], cfg["layers"], device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens in batches(cfg["vocab"], cfg["batch"], cfg["seq"], cfg["steps"], device):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses], [p.detach().clone() for p in model.parameters()]


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def norm_times(tokens: int, dim: int, device, reps: int) -> tuple[float, float]:
    """us per forward + backward of one norm at the model's shape: trainnorm, torch."""
    cuda = device == "cuda"
    x = torch.randn(tokens, dim, device=device, requires_grad=True)
    w = torch.ones(dim, device=device, requires_grad=True)
    dy = torch.randn(tokens, dim, device=device)

    def ours():
        torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy)

    def theirs():
        torch.autograd.grad(F.rms_norm(x, (dim,), w, 1e-6), (x, w), dy)

    out = []
    for fn in (ours, theirs):
        fn()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / reps * 1e6)
    return out[0], out[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="trainnorm demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="the smallest model (for tests)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        # PyTorch's own ops deterministic too (cuBLAS needs a fixed workspace for that)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if cuda and not args.tiny:
        cfg = dict(vocab=256, dim=512, heads=8, layers=2, batch=8, seq=256, steps=40)
    elif args.tiny:
        cfg = dict(vocab=32, dim=32, heads=2, layers=1, batch=4, seq=8, steps=16)
    else:
        cfg = dict(vocab=64, dim=128, heads=4, layers=2, batch=4, seq=32, steps=30)
    if args.steps:
        cfg["steps"] = args.steps
    path = (torch.cuda.get_device_name() if cuda else
            "CPU, Triton interpreter" if rows.interpreter_enabled() else "CPU reference path")
    print(f"trainnorm demo on {path}: a {cfg['layers']}-layer, d={cfg['dim']} language model, "
          f"{cfg['steps']} AdamW steps of {cfg['batch']}x{cfg['seq']} tokens, trained twice (deterministic=True)")
    t0 = time.perf_counter()
    losses1, params1 = train(cfg, device)
    losses2, params2 = train(cfg, device)
    took = time.perf_counter() - t0
    same_w = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(params1, params2))
    same_l = losses1 == losses2
    marks = sorted({0, len(losses1) // 4, len(losses1) // 2, 3 * len(losses1) // 4, len(losses1) - 1})
    print("  loss: " + ", ".join(f"step {i + 1} {losses1[i]:.3f}" for i in marks))
    print(f"  run 1 vs run 2: final weights bitwise identical: {same_w}; loss curves identical: {same_l} "
          f"({took:.1f} s for both)")
    tokens = cfg["batch"] * cfg["seq"]
    ours, theirs = norm_times(tokens, cfg["dim"], device, 50 if cuda else 3)
    print(f"  one norm's forward + backward at [{tokens}, {cfg['dim']}]: trainnorm {ours:.0f} us, "
          f"torch.nn.functional.rms_norm {theirs:.0f} us (wall clock, eager)")
    k = max(1, len(losses1) // 4)
    learned = sum(losses1[-k:]) < sum(losses1[:k])     # the last quarter's loss below the first's
    ok = same_w and same_l and learned
    print("demo:", "OK" if ok else "FAILED")
    return 0 if ok else 1
