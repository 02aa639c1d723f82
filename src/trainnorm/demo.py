"""`trainnorm demo`: one forward and backward on this machine, checked and timed.

On a GPU: [T, H] = [16384, 4096] in bfloat16 through the kernels; without one,
[256, 1024] through the CPU path (the Triton interpreter when TRITON_INTERPRET=1).
Prints the accuracy against FP64, whether two runs agree bit for bit, and the
time of a forward + backward against torch's own rms_norm with autograd.
"""
from __future__ import annotations

import argparse
import time

import torch

from . import dispatch, reference, rms_norm, rms_norm_backward, rms_norm_forward
from .families import make_case


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _time(fn, cuda: bool, reps: int) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="trainnorm demo", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    tokens = args.tokens or (16384 if cuda else 256)
    hidden = args.hidden or (4096 if cuda else 1024)
    path = (torch.cuda.get_device_name() if cuda else
            "CPU, Triton interpreter" if dispatch.interpreter_enabled() else "CPU reference path")
    print(f"trainnorm demo: [T, H] = [{tokens}, {hidden}] bf16 on {path}")
    case = make_case("outlier", (tokens,), hidden, seed=0, device=device)

    def step(deterministic=True):
        x = case.x.clone().requires_grad_()
        w = case.weight.clone().requires_grad_()
        y = rms_norm(x, w, 1e-6, deterministic=deterministic)
        y.backward(case.dy)
        return y.detach(), x.grad, w.grad

    y, dx, dw = step()
    y2, dx2, dw2 = step()
    _, rstd, _ = rms_norm_forward(case.x, case.weight, 1e-6)
    y64, _, _ = reference.forward_fp64(case.x, case.weight, 1e-6)
    dx64, dw64 = reference.backward_fp64(case.dy, case.x, case.weight, rstd)
    # w.grad arrives in the weight's dtype (bf16); check the float32 dw the kernel returns
    dw32 = rms_norm_backward(case.dy, case.x, case.weight, rstd)[1]
    err = reference.dw_err_over_tol(dw32, dw64)
    eager = reference.dw_err_over_tol(reference.dw_fp32_eager(case.dy, case.x, rstd), dw64)
    same = all(torch.equal(_bits(a), _bits(b)) for a, b in ((y, y2), (dx, dx2), (dw, dw2)))
    y_ok = torch.allclose(y.double(), y64, atol=1e-2, rtol=1e-2)
    dx_ok = torch.allclose(dx.double(), dx64, atol=1e-2, rtol=1e-2)
    print(f"  y  within 1e-2 of FP64: {y_ok}")
    print(f"  dx within 1e-2 of FP64: {dx_ok}")
    print(f"  dw err/tol vs FP64: {err:.4f} (budget 0.5; FP32 eager reduction: {eager:.4f})")
    print(f"  two runs bitwise identical (y, dx, dw): {same}")

    def torch_step():
        x = case.x.clone().requires_grad_()
        w = case.weight.clone().requires_grad_()
        torch.nn.functional.rms_norm(x, (hidden,), w, 1e-6).backward(case.dy)

    reps = 20 if cuda else 2
    ours = _time(step, cuda, reps)
    theirs = _time(torch_step, cuda, reps)
    print(f"  forward + backward: trainnorm {ours:.0f} us, torch.nn.functional.rms_norm {theirs:.0f} us "
          f"(wall clock per step, eager)")
    ok = y_ok and dx_ok and err <= 0.5 and same
    print("demo:", "OK" if ok else "FAILED")
    return 0 if ok else 1
