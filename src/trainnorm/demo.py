"""`trainnorm demo`: train a tiny transformer language model twice and compare.

The model (token embedding, pre-norm attention + MLP blocks whose residual
stream runs through trainnorm's fused residual add, a SiLU-gated norm in the
MLP, a final norm) is trained for a few dozen steps on a synthetic sequence
task, twice from the same seed in deterministic mode. The demo prints the loss
curve as it trains, whether the two runs agree bit for bit (every final weight
and every loss), and, on a GPU, the time of one norm's forward + backward at the
model's shape against torch.nn.functional.rms_norm. On a GPU the norms run the
Triton kernels. Without one they run trainnorm's CPU path, an exact float64
reference (or the kernels in Triton's interpreter when TRITON_INTERPRET=1):
there the demo checks results and says that it times nothing, since neither
path is the product whose speed matters.
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


def _marks(steps: int) -> list[int]:
    """The steps (0-based) whose loss is shown: the first, each quarter, the last."""
    return sorted({0, steps // 4, steps // 2, 3 * steps // 4, steps - 1})


def train(cfg, device, seed=0, progress=None):
    """(losses, final parameters); progress(step, loss) is called at the steps of _marks."""
    torch.manual_seed(seed)
    model = TinyLM(cfg["vocab"], cfg["dim"], cfg["heads"], cfg["layers"], device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    marks = set(_marks(cfg["steps"]))
    for step, tokens in enumerate(batches(cfg["vocab"], cfg["batch"], cfg["seq"], cfg["steps"], device)):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if progress is not None and step in marks:
            progress(step, float(losses[-1]))
    return [float(v) for v in losses], [p.detach().clone() for p in model.parameters()]


def _bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def norm_times(tokens: int, dim: int, reps: int = 100) -> tuple[float, float]:
    """GPU microseconds per forward + backward of one norm at [tokens, dim] float32,
    through autograd as the model calls it: trainnorm, torch. CUDA events around
    `reps` calls after a warm-up, so host overhead counts where it is not hidden."""
    x = torch.randn(tokens, dim, device="cuda", requires_grad=True)
    w = torch.ones(dim, device="cuda", requires_grad=True)
    dy = torch.randn(tokens, dim, device="cuda")

    def ours():
        torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), dy)

    def theirs():
        torch.autograd.grad(F.rms_norm(x, (dim,), w, 1e-6), (x, w), dy)

    out = []
    for fn in (ours, theirs):
        for _ in range(10):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / reps * 1e3)
    return out[0], out[1]


def _path(cuda: bool) -> str:
    if cuda:
        return f"the Triton kernels on {torch.cuda.get_device_name()}"
    if rows.interpreter_enabled():
        return "the CPU, the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1: slow, for testing)"
    why = rows.why_no_gpu_kernels() or "--device cpu"
    return f"the CPU, trainnorm's float64 reference path ({why}): exact results, not the kernels"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="trainnorm demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="the smallest model (for tests)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the GPU where there is one and Triton is installed, else the CPU")
    args = p.parse_args(argv)
    try:
        device = rows.cli_device(args.device)
    except ValueError as e:
        p.error(str(e))
    cuda = device == "cuda"
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
    print(f"trainnorm demo: a {cfg['layers']}-layer, d={cfg['dim']} language model, {cfg['steps']} AdamW steps "
          f"of {cfg['batch']}x{cfg['seq']} tokens, trained twice from one seed (deterministic=True)", flush=True)
    print(f"  norms run on {_path(cuda)}", flush=True)

    def run(n):
        print(f"  run {n}/2: loss at", end="", flush=True)
        t0 = time.perf_counter()

        def progress(step, loss):
            print(f"{',' if step else ''} step {step + 1} {loss:.3f}", end="", flush=True)
        out = train(cfg, device, progress=progress)
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
        return out

    losses1, params1 = run(1)
    losses2, params2 = run(2)
    same_w = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(params1, params2))
    same_l = losses1 == losses2
    print(f"  run 1 vs run 2: final weights bitwise identical: {same_w}; loss curves identical: {same_l}")
    tokens = cfg["batch"] * cfg["seq"]
    if cuda:
        ours, theirs = norm_times(tokens, cfg["dim"])
        print(f"  one norm's forward + backward at [{tokens}, {cfg['dim']}] float32, through autograd: "
              f"trainnorm {ours:.1f} us, torch.nn.functional.rms_norm {theirs:.1f} us (GPU time per call, CUDA "
              "events over 100 calls; at this size the launches dominate: `trainnorm bench` times the kernels)")
    else:
        what = ("Triton's interpreter runs the kernels on the CPU to test them" if rows.interpreter_enabled() else
                "the CPU path is a float64 reference kept for exactness")
        print(f"  speed: not timed here: {what}, not for speed. The kernels need a GPU "
              "(H200 timings: docs/benchmarks/h200.md; `trainnorm bench` on a GPU)")
    k = max(1, len(losses1) // 4)
    learned = sum(losses1[-k:]) < sum(losses1[:k])     # the last quarter's loss below the first's
    ok = same_w and same_l and learned
    print("demo:", "OK" if ok else "FAILED")
    return 0 if ok else 1
