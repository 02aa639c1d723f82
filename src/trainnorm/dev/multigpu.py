"""Multi-GPU evidence for trainnorm: data parallel, device placement, sequence parallel.

Launch (two GPUs, NCCL):
    torchrun --nproc_per_node 2 -m trainnorm.dev.multigpu --out multigpu-out --repeat
CPU (two processes, gloo):
    torchrun --nproc_per_node 2 -m trainnorm.dev.multigpu --device cpu --out multigpu-out --repeat

Parts (see docs/multigpu.md):
  a. train the demo's tiny transformer LM (trainnorm.demo.TinyLM, whose norms are
     trainnorm.RMSNorm / RMSNormGated) under DistributedDataParallel and under
     FSDP2 (torch.distributed.fsdp.fully_shard), each rank taking its half of
     the global batch, deterministic mode, fixed seeds; compare the global loss
     curve with a single-process run over the same global batch (computed by
     every rank on its own device); sha256 of the final weights per run;
     --repeat runs the whole job twice in one launch for a bitwise comparison.
  b. device placement (CUDA only): each rank runs the kernels on its own
     device (cuda:1 for rank 1) on a side stream, checks the results against
     the FP64 reference on the CPU, that the outputs live on that device, that
     the kernels were ordered on that device's current stream, and that rank 1
     allocated nothing on cuda:0.
  c. sequence parallel: each rank normalises its shard of tokens
     (rms_norm_forward / rms_norm_backward); the dw partials are summed with
     all_reduce and compared with the single-process dw over all tokens and the
     FP64 reference (err/tol <= 0.5, tol = 1e-4 + 1e-4 |ref|).

Rank 0 writes DIR/multigpu.json and prints a table; the exit status is 0 when
every check passed.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import trainnorm
from trainnorm import reference
from trainnorm.demo import TinyLM, batches

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch without FSDP2
    fully_shard = None
try:
    from torch.distributed.tensor import DTensor
except ImportError:
    DTensor = None

# NVLink multicast stays off (NCCL NVLS, symmetric-memory multicast, NVSHMEM NVLS): forced, not
# defaulted, before the process group starts (NCCL, symmetric memory and NVSHMEM read them then).
# cuBLAS is deterministic only with a fixed workspace (read when its first handle is made).
FORCED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def set_env() -> None:
    os.environ.update(FORCED_ENV)
    for k, v in DEFAULT_ENV.items():
        os.environ.setdefault(k, v)


DW_BUDGET = 0.5
MODEL_CFG = {
    # the demo's GPU model; 8 sequences per global batch, 4 per rank
    "cuda": dict(vocab=256, dim=512, heads=8, layers=2, batch=8, seq=256),
    # small enough for the float64 CPU path on two cores
    "cpu": dict(vocab=32, dim=32, heads=2, layers=2, batch=4, seq=16),
}
SEQPAR_CFG = {"cuda": dict(tokens=16384, hidden=4096), "cpu": dict(tokens=1024, hidden=256)}
PLACEMENT_CFG = dict(tokens=4096, hidden=2048)


# --- set-up ---------------------------------------------------------------------------------

class Ctx:
    def __init__(self, args):
        self.args = args
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.cuda = args.device == "cuda"
        if self.cuda:
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda: no CUDA device here (use --device cpu for the gloo run)")
            if self.local_rank >= torch.cuda.device_count():
                raise SystemExit(f"local rank {self.local_rank} has no GPU ({torch.cuda.device_count()} visible)")
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            self.backend = "nccl"
        else:
            self.device = torch.device("cpu")
            self.backend = "gloo"
        kw = dict(backend=self.backend, timeout=datetime.timedelta(seconds=args.timeout))
        if self.cuda:
            kw["device_id"] = self.device
        dist.init_process_group(**kw)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = None

    def log(self, msg):
        if self.rank == 0:
            print(msg, flush=True)

    def gather(self, obj):
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def weights_hash(params) -> str:
    """sha256 of the bytes of every parameter, in order (full tensors; a collective for FSDP2)."""
    h = hashlib.sha256()
    for p in params:
        if DTensor is not None and isinstance(p, DTensor):
            p = p.full_tensor()
        h.update(_bits(p).cpu().numpy().tobytes())
    return h.hexdigest()


# --- a. data-parallel training --------------------------------------------------------------

def train(ctx: Ctx, mode: str, cfg: dict, steps: int):
    """One training run; mode is 'single' (this rank alone, the whole global batch),
    'ddp' or 'fsdp2' (this rank's half of every global batch). Returns the global
    loss per step and the final weights' hash."""
    torch.manual_seed(ctx.args.seed)
    model = TinyLM(cfg["vocab"], cfg["dim"], cfg["heads"], cfg["layers"], ctx.device)
    if mode == "ddp":
        net = DDP(model, device_ids=[ctx.local_rank] if ctx.cuda else None)
    elif mode == "fsdp2":
        if ctx.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            ctx.mesh = init_device_mesh(ctx.device.type, (ctx.world,))
        for blk in model.blocks:
            fully_shard(blk, mesh=ctx.mesh)
        fully_shard(model, mesh=ctx.mesh)
        net = model
    else:
        net = model
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    per_rank = cfg["batch"] // ctx.world
    losses = []
    for tokens in batches(cfg["vocab"], cfg["batch"], cfg["seq"], steps, "cpu", seed=ctx.args.seed + 1):
        if mode != "single":
            tokens = tokens[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        tokens = tokens.to(ctx.device)
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    if mode != "single":
        # every rank's loss is the mean over the same number of tokens: their mean is the global loss
        dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        losses = losses / ctx.world
    return [float(v) for v in losses.cpu()], weights_hash(model.parameters())


def loss_err_over_tol(curve, ref, atol, rtol) -> float:
    def one(a, b):
        tol = atol + rtol * abs(b)
        return abs(a - b) / tol if tol > 0 else (0.0 if a == b else float("inf"))
    return max(one(a, b) for a, b in zip(curve, ref))


def part_a(ctx: Ctx, cfg: dict, steps: int, modes: list[str]) -> dict:
    args = ctx.args
    runs = []
    for r in range(2 if args.repeat else 1):
        run = {}
        for mode in modes:
            dist.barrier()
            t0 = time.perf_counter()
            losses, digest = train(ctx, mode, cfg, steps)
            took = time.perf_counter() - t0
            per_rank = ctx.gather((losses, digest))
            run[mode] = {
                "losses": losses,            # rank 0's (the global curve for ddp / fsdp2)
                "hash": digest,
                "ranks_agree": all(p == per_rank[0] for p in per_rank),
                "seconds": round(took, 3),
            }
            ctx.log(f"  run {r + 1} {mode:6s} {took:6.2f} s  final loss {losses[-1]:.5f}  sha256 {digest[:16]}")
        for mode in modes:
            if mode != "single":
                run[mode]["loss_err_over_tol"] = loss_err_over_tol(run[mode]["losses"], run["single"]["losses"],
                                                                   args.loss_atol, args.loss_rtol)
        runs.append(run)
    out = {"config": dict(cfg, steps=steps, lr=3e-3, seed=args.seed, per_rank_batch=cfg["batch"] // ctx.world),
           "loss_tolerance": {"atol": args.loss_atol, "rtol": args.loss_rtol}, "runs": runs}
    if len(runs) == 2:
        out["repeat"] = {m: {"hash_equal": runs[0][m]["hash"] == runs[1][m]["hash"],
                             "losses_equal": runs[0][m]["losses"] == runs[1][m]["losses"]} for m in modes}
    return out


# --- b. device placement --------------------------------------------------------------------

def part_b(ctx: Ctx) -> dict:
    """Kernels on this rank's device and its current stream; nothing allocated on cuda:0 by rank > 0."""
    if not ctx.cuda:
        return {"skipped": "CPU run: device placement is checked on CUDA only (each rank on cuda:<local rank>)"}
    dev = ctx.device
    torch.cuda.synchronize(dev)
    watch0 = dev.index != 0
    before0 = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)) if watch0 else None
    t, hdim, eps = PLACEMENT_CFG["tokens"], PLACEMENT_CFG["hidden"], 1e-6
    g = torch.Generator().manual_seed(4321 + ctx.rank)
    x_cpu = (torch.randn(t, hdim, generator=g) * 1.5 + 0.25).to(torch.bfloat16)
    w_cpu = 1 + 0.5 * torch.randn(hdim, generator=g)
    dy_cpu = torch.randn(t, hdim, generator=g).to(torch.bfloat16)
    x_src, w, dy = x_cpu.to(dev), w_cpu.to(dev), dy_cpu.to(dev)
    # compile the kernels first, so that the launches below take microseconds, not the sleep's time
    _, rstd_w, _ = trainnorm.rms_norm_forward(x_src, w, eps)
    trainnorm.rms_norm_backward(dy, x_src, w, rstd_w)
    torch.cuda.synchronize(dev)
    x = torch.zeros_like(x_src)                  # holds zeros until the side stream's copy runs
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        # the copy waits behind ~tens of ms of sleep: a kernel launched on any other
        # stream would read the zeros and fail the comparison below
        torch.cuda._sleep(int(5e7))
        x.copy_(x_src)
        y, rstd, _ = trainnorm.rms_norm_forward(x, w, eps)
        dx, dw = trainnorm.rms_norm_backward(dy, x, w, rstd)
    queued = not stream.query()                  # the work is still behind the sleep on that stream
    stream.synchronize()                         # before any of these tensors is freed
    y64, rstd64, _ = reference.forward_fp64(x_cpu, w_cpu, eps)
    dx64, dw64 = reference.backward_fp64(dy_cpu, x_cpu, w_cpu, rstd.cpu())
    res = {
        "device": str(dev),
        "outputs_on_device": all(o.device == dev for o in (y, rstd, dx, dw)),
        "queued_on_side_stream": queued,
        "y_max_abs_err": float((y.cpu().double() - y64).abs().max()),
        "rstd_max_rel_err": float(((rstd.cpu().double() - rstd64) / rstd64).abs().max()),
        "dx_max_abs_err": float((dx.cpu().double() - dx64).abs().max()),
        "dw_err_over_tol": reference.dw_err_over_tol(dw.cpu(), dw64),
    }
    res["values_ok"] = bool(torch.allclose(y.cpu().double(), y64, atol=1e-2, rtol=1e-2)
                            and res["rstd_max_rel_err"] < 1e-5
                            and torch.allclose(dx.cpu().double(), dx64, atol=1e-2, rtol=1e-2)
                            and res["dw_err_over_tol"] <= DW_BUDGET)
    if watch0:
        torch.cuda.synchronize(dev)
        after0 = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))
        res["cuda0_allocated_before_after"] = [before0[0], after0[0]]
        res["cuda0_reserved_before_after"] = [before0[1], after0[1]]
        res["cuda0_untouched"] = before0 == after0
    res["ok"] = bool(res["outputs_on_device"] and res["values_ok"] and res.get("cuda0_untouched", True))
    return res


# --- c. sequence parallel -------------------------------------------------------------------

def part_c(ctx: Ctx, tokens: int, hidden: int) -> dict:
    if tokens % ctx.world:
        raise SystemExit(f"--seq-tokens {tokens} is not divisible by the world size {ctx.world}")
    dev, eps = ctx.device, 1e-6
    g = torch.Generator().manual_seed(2024)
    x_cpu = (torch.randn(tokens, hidden, generator=g) * 2 + 0.5).to(torch.bfloat16)
    dy_cpu = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w_cpu = 1 + 0.5 * torch.randn(hidden, generator=g)
    n = tokens // ctx.world
    lo, hi = ctx.rank * n, (ctx.rank + 1) * n
    x, dy, w = x_cpu.to(dev), dy_cpu.to(dev), w_cpu.to(dev)
    # this rank's shard of the tokens
    y_s, rstd_s, _ = trainnorm.rms_norm_forward(x[lo:hi], w, eps)
    dx_s, dw_part = trainnorm.rms_norm_backward(dy[lo:hi], x[lo:hi], w, rstd_s)
    dw_sum = dw_part.clone()
    dist.all_reduce(dw_sum, op=dist.ReduceOp.SUM)
    # single process over all tokens, on this rank's device
    y_f, rstd_f, _ = trainnorm.rms_norm_forward(x, w, eps)
    dx_f, dw_f = trainnorm.rms_norm_backward(dy, x, w, rstd_f)
    # FP64 reference at the kernels' float32 rstd
    _, dw64 = reference.backward_fp64(dy_cpu, x_cpu, w_cpu, rstd_f.cpu())
    shard_bitwise = all(torch.equal(_bits(a), _bits(b[lo:hi]))
                        for a, b in ((y_s, y_f), (rstd_s, rstd_f), (dx_s, dx_f)))
    return {
        "tokens": tokens, "hidden": hidden, "dtype": "bfloat16", "shard_tokens": n,
        "dw_allreduce_err_over_tol": reference.dw_err_over_tol(dw_sum.cpu(), dw64),
        "dw_single_err_over_tol": reference.dw_err_over_tol(dw_f.cpu(), dw64),
        "dw_fp32_eager_err_over_tol": reference.dw_err_over_tol(
            reference.dw_fp32_eager(dy_cpu, x_cpu, rstd_f.cpu()), dw64),
        "dw_allreduce_vs_single_max_abs": float((dw_sum - dw_f).abs().max()),
        "shard_y_rstd_dx_bitwise_as_single": shard_bitwise,
    }


# --- report ---------------------------------------------------------------------------------

def checks_of(summary: dict, args) -> dict:
    c = {}
    a = summary.get("train")
    if a:
        for r, run in enumerate(a["runs"]):
            for mode, res in run.items():
                if mode != "single":
                    c[f"run{r + 1}_{mode}_loss_within_tol"] = res["loss_err_over_tol"] <= 1.0
                    c[f"run{r + 1}_{mode}_ranks_agree"] = res["ranks_agree"]
        for mode, rep in a.get("repeat", {}).items():
            c[f"repeat_{mode}_hash_equal"] = rep["hash_equal"]
    b = summary.get("placement")
    if b and not b.get("skipped"):
        for rank_res in b["per_rank"]:
            c[f"placement_rank{rank_res['rank']}_ok"] = rank_res["ok"]
    s = summary.get("sequence_parallel")
    if s:
        for rank_res in s["per_rank"]:
            r = rank_res["rank"]
            c[f"seqpar_rank{r}_dw_allreduce_within_budget"] = rank_res["dw_allreduce_err_over_tol"] <= DW_BUDGET
            c[f"seqpar_rank{r}_dw_single_within_budget"] = rank_res["dw_single_err_over_tol"] <= DW_BUDGET
            c[f"seqpar_rank{r}_shards_bitwise"] = rank_res["shard_y_rstd_dx_bitwise_as_single"]
    if args.compare and a:
        prev = json.loads(Path(args.compare).read_text())
        for mode, res in a["runs"][0].items():
            old = prev.get("train", {}).get("runs", [{}])[0].get(mode)
            if old is not None:
                c[f"compare_{mode}_hash_equal"] = old["hash"] == res["hash"]
    return c


def print_table(summary: dict):
    rows = []
    a = summary.get("train")
    if a:
        for r, run in enumerate(a["runs"]):
            for mode, res in run.items():
                e = res.get("loss_err_over_tol")
                rows.append((f"a run {r + 1}", mode, f"{res['losses'][-1]:.5f}",
                             "-" if e is None else f"{e:.3g}", res["hash"][:16],
                             "yes" if res["ranks_agree"] else "NO"))
    if rows:
        print(f"{'part':9s} {'mode':7s} {'final loss':>10s} {'loss err/tol':>12s} {'sha256':16s} ranks agree")
        for row in rows:
            print(f"{row[0]:9s} {row[1]:7s} {row[2]:>10s} {row[3]:>12s} {row[4]:16s} {row[5]}")
        for mode, rep in a.get("repeat", {}).items():
            print(f"a repeat  {mode:7s} weights bitwise equal: {rep['hash_equal']}, "
                  f"loss curves equal: {rep['losses_equal']}")
    b = summary.get("placement")
    if b:
        if b.get("skipped"):
            print(f"b placement: skipped ({b['skipped']})")
        else:
            for res in b["per_rank"]:
                print(f"b rank {res['rank']} on {res['device']}: outputs on device {res['outputs_on_device']}, "
                      f"ordered on its stream {res['queued_on_side_stream']}, values vs FP64 {res['values_ok']} "
                      f"(dw err/tol {res['dw_err_over_tol']:.3g}), cuda:0 untouched "
                      f"{res.get('cuda0_untouched', 'n/a (own device)')}")
    s = summary.get("sequence_parallel")
    if s:
        for res in s["per_rank"]:
            print(f"c rank {res['rank']}: [{res['tokens']}, {res['hidden']}] bf16 in shards of {res['shard_tokens']}: "
                  f"dw err/tol all_reduce {res['dw_allreduce_err_over_tol']:.3g}, single "
                  f"{res['dw_single_err_over_tol']:.3g}, fp32 eager {res['dw_fp32_eager_err_over_tol']:.3g} "
                  f"(budget {DW_BUDGET}); shards bitwise as single: {res['shard_y_rstd_dx_bitwise_as_single']}")
    for name, ok in summary["checks"].items():
        if not ok:
            print(f"FAILED: {name}")
    print("multigpu:", "OK" if summary["passed"] else "FAILED")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainnorm.dev.multigpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for multigpu.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: NCCL, one GPU per rank; cpu: gloo, the CPU path of trainnorm")
    p.add_argument("--parts", default="a,b,c", help="comma-separated subset of a,b,c")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (part a)")
    p.add_argument("--repeat", action="store_true", help="run part a twice in this launch and compare bits")
    p.add_argument("--compare", default=None, help="a previous multigpu.json: compare the weight hashes")
    p.add_argument("--no-fsdp", action="store_true", help="part a without the FSDP2 run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-atol", type=float, default=1e-4)
    p.add_argument("--loss-rtol", type=float, default=1e-3)
    p.add_argument("--seq-tokens", type=int, default=None)
    p.add_argument("--seq-hidden", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = {s.strip() for s in args.parts.split(",") if s.strip()}
    set_env()
    ctx = Ctx(args)
    torch.use_deterministic_algorithms(True)
    if ctx.world != 2:
        ctx.log(f"note: world size {ctx.world}; the checks are written for 2 ranks but hold for any even split")
    cfg = MODEL_CFG[ctx.device.type]
    if cfg["batch"] % ctx.world:
        raise SystemExit(f"global batch {cfg['batch']} is not divisible by the world size {ctx.world}")
    summary = {
        "torch": torch.__version__, "backend": ctx.backend, "device": ctx.device.type, "world_size": ctx.world,
        "gpu": torch.cuda.get_device_name(ctx.device) if ctx.cuda else None,
        "cpu_path": "float64 reference" if ctx.device.type == "cpu" else None,
        "deterministic": True,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "NVSHMEM_DISABLE_NVLS", "CUBLAS_WORKSPACE_CONFIG")},
    }
    ctx.log(f"multigpu: {ctx.world} ranks, backend {ctx.backend}, device {ctx.device.type}"
            + (f" ({summary['gpu']})" if ctx.cuda else ""))
    t0 = time.perf_counter()
    if "a" in parts:
        modes = ["single", "ddp"]
        if args.no_fsdp:
            summary["fsdp2_note"] = "FSDP2 run left out (--no-fsdp)"
        elif fully_shard is None:
            summary["fsdp2_note"] = "FSDP2 skipped: this torch has no torch.distributed.fsdp.fully_shard"
            ctx.log(summary["fsdp2_note"])
        else:
            modes.append("fsdp2")
        summary["train"] = part_a(ctx, cfg, args.steps, modes)
    if "b" in parts:
        res = part_b(ctx)
        if "skipped" in res:
            summary["placement"] = res
        else:
            summary["placement"] = {"per_rank": [dict(r, rank=i) for i, r in enumerate(ctx.gather(res))]}
    if "c" in parts:
        sc = SEQPAR_CFG[ctx.device.type]
        res = part_c(ctx, args.seq_tokens or sc["tokens"], args.seq_hidden or sc["hidden"])
        summary["sequence_parallel"] = {"per_rank": [dict(r, rank=i) for i, r in enumerate(ctx.gather(res))]}
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["checks"] = checks_of(summary, args)
    summary["passed"] = all(summary["checks"].values())
    if ctx.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "multigpu.json").write_text(json.dumps(summary, indent=2) + "\n")
        print_table(summary)
        print(f"wrote {out / 'multigpu.json'}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    rc = main()
    # Leave without the interpreter's teardown: gloo's worker threads can still be
    # joinable when C++ statics are destroyed at finalization, and the rank then
    # aborts ("terminate called without an active exception") after the run has
    # passed and written its summary. The process group is already destroyed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
