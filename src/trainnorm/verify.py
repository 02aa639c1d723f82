"""`trainnorm verify`: accuracy and determinism report for this machine.

Accuracy: for each shape, token count, input family (SPEC section 2),
seed and weight dtype, dw err/tol of both modes against FP64 at the kernel's
own rstd, next to the FP32 eager reduction's; y and dx against FP64.
Determinism (bitwise): repeated calls, simulated SM counts, deterministic vs
fast mode for y/rstd/h/dx, batch invariance, the forward with a residual against
the forward of its h (SPEC), and on a GPU CUDA-graph replay and torch.compile
against eager.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch

from . import reference, rows
from .families import FAMILIES, make_case

EPS = 1e-6
BUDGET = 0.5


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int = 0            # per-head rows: [T, heads, hidden]
    query: bool = False       # the every-other-slice query view
    residual: bool = False
    weight32: bool = False


SHAPES = [Shape(f"H{h}", h) for h in (512, 1536, 2048, 4096, 5120, 6144)] + [
    Shape("H5120 w32", 5120, weight32=True), Shape("H6144 w32", 6144, weight32=True),
    Shape("H6144 res", 6144, residual=True), Shape("H6144 res w32", 6144, residual=True, weight32=True),
    Shape("[T,24,256]", 256, heads=24, query=True), Shape("[T,4,256]", 256, heads=4),
]
GPU_TOKENS = [1, 16, 256, 1024, 4096, 16384, 65536]
CPU_TOKENS = [1, 16, 64]


def _case(shape: Shape, tokens: int, family: str, seed: int, device):
    lead = (tokens, shape.heads) if shape.heads else (tokens,)
    return make_case(family, lead, shape.hidden, residual=shape.residual, seed=seed, device=device,
                     weight_dtype=torch.float32 if shape.weight32 else torch.bfloat16, query_view=shape.query)


def _run(case, deterministic):
    from . import rms_norm_backward, rms_norm_forward
    y, rstd, h = rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
    dx, dw = rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh, deterministic=deterministic)
    return y, rstd, h, dx, dw


def _bits_equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _max_rel(out, ref) -> float:
    """max |out - ref| / (1e-2 + 1e-2 |ref|): <= 1 is within atol = rtol = 1e-2."""
    return float(((out.double() - ref).abs() / (1e-2 + 1e-2 * ref.abs())).max()) if out.numel() else 0.0


def accuracy(shape: Shape, tokens: int, family: str, seed: int, device) -> dict:
    case = _case(shape, tokens, family, seed, device)
    det = _run(case, True)
    fast = _run(case, False)
    y, rstd, h, dx, dw = det
    y64, rstd64, _ = reference.forward_fp64(case.x, case.weight, EPS, case.residual)
    dx64, dw64 = reference.backward_fp64(case.dy, h, case.weight, rstd, case.dh)
    eager = reference.dw_fp32_eager(case.dy, h, rstd)
    return dict(
        shape=shape.name, tokens=tokens, family=family, seed=seed,
        det=reference.dw_err_over_tol(dw, dw64), fast=reference.dw_err_over_tol(fast[4], dw64),
        eager=reference.dw_err_over_tol(eager, dw64),
        y=_max_rel(y, y64), dx=_max_rel(dx, dx64),
        rstd=float((rstd.double() / rstd64 - 1).abs().max()) if rstd.numel() else 0.0,
        modes_equal=all(_bits_equal(a, b) for a, b in zip(det[:4], fast[:4])),
    )


def determinism(shape: Shape, tokens: int, device) -> dict:
    case = _case(shape, tokens, "outlier", 123, device)
    ref = _run(case, True)
    res = {"shape": shape.name, "tokens": tokens}
    res["repeat"] = all(all(_bits_equal(a, b) for a, b in zip(ref, _run(case, True))) for _ in range(3))
    sm_ok = True
    for sms in (1, 7, 66, 132, 264):
        with rows.simulate_sm_count(sms):
            sm_ok &= all(_bits_equal(a, b) for a, b in zip(ref, _run(case, True)))
    res["sm_counts"] = sm_ok
    res["modes_equal"] = all(_bits_equal(a, b) for a, b in zip(ref[:4], _run(case, False)[:4]))
    half = max(1, tokens // 2)
    sub = type(case)(case.x[1:half], case.weight, case.dy[1:half],
                     None if case.residual is None else case.residual[1:half],
                     None if case.dh is None else case.dh[1:half])
    out = _run(sub, True)
    res["batch_invariant"] = all(_bits_equal(a[1:half], b) for a, b in zip(ref[:4], out[:4]))
    res["residual_is_h"] = _residual_is_h(case)
    if torch.device(device).type == "cuda":
        res["cuda_graph"] = _graph_equal(case, ref)
        res["compile"] = _compile_equal(case, ref)
    return res


def _residual_is_h(case) -> bool:
    """SPEC: rms_norm(x, w, residual=r) is rms_norm(h, w) bit for bit (y and rstd); r is the
    case's residual, or its dy where the shape has none (any tensor of x's shape and dtype)."""
    from . import rms_norm_forward
    r = case.residual if case.residual is not None else case.dy
    y, rstd, h = rms_norm_forward(case.x, case.weight, EPS, residual=r)
    y_h, rstd_h, _ = rms_norm_forward(h, case.weight, EPS)
    return _bits_equal(y, y_h) and _bits_equal(rstd, rstd_h)


def _graph_equal(case, ref) -> bool:
    from . import backward_workspace, rms_norm_backward, rms_norm_forward
    rows = ref[1].numel()
    ws = backward_workspace(rows, case.x.shape[-1], dtype=case.x.dtype, device=case.x.device)

    def step():
        y, rstd, h = rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
        return (y, rstd, h) + rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh, workspace=ws)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    ok = True
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        ok &= all(_bits_equal(a, b) for a, b in zip(ref, outs))
    return ok


def _compile_equal(case, ref) -> bool:
    from . import rms_norm_backward, rms_norm_forward

    def step(x, w, r, dy, dh):
        y, rstd, h = rms_norm_forward(x, w, EPS, residual=r)
        return (y, rstd, h) + rms_norm_backward(dy, h, w, rstd, dh=dh)

    torch._dynamo.reset()
    outs = torch.compile(step, fullgraph=True)(case.x, case.weight, case.residual, case.dy, case.dh)
    return all(_bits_equal(a, b) for a, b in zip(ref, outs))


def not_checked(cuda: bool, interpreter: bool) -> list[str]:
    """What this run leaves out, as lines for the report (nothing on a GPU)."""
    if cuda:
        return []
    out = ["not checked here, since they need a GPU: CUDA-graph replay against eager, torch.compile (inductor) "
           "against eager, and the real sizes (token counts up to 65,536)"]
    if not interpreter:
        out.append("the Triton kernels do not run on this path: accuracy and bits are those of the float64 "
                   "reference path (set TRITON_INTERPRET=1 to check the kernels in Triton's interpreter, slowly)")
    return out


def _markdown(acc: list[dict], det: list[dict], header: str) -> str:
    lines = [header, "", "## dw accuracy: worst err/tol over seeds and token counts (budget B = 0.5)", "",
             "| shape | family | T max | det | fast | FP32 eager | det <= eager | worst y, dx (/1e-2) | rstd rel | modes equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in acc:
        groups.setdefault((r["shape"], r["family"]), []).append(r)
    for (shape, fam), rs in groups.items():
        worst = lambda k: max(r[k] for r in rs)
        beats = all(r["det"] <= r["eager"] + 1e-3 for r in rs)
        lines.append(f"| {shape} | {fam} | {max(r['tokens'] for r in rs)} | {worst('det'):.4f} | {worst('fast'):.4f} "
                     f"| {worst('eager'):.4f} | {'yes' if beats else 'NO'} | {worst('y'):.2f}, {worst('dx'):.2f} "
                     f"| {worst('rstd'):.1e} | {'yes' if all(r['modes_equal'] for r in rs) else 'NO'} |")
    keys = [k for k in ("repeat", "sm_counts", "modes_equal", "batch_invariant", "residual_is_h", "cuda_graph",
                        "compile") if det and k in det[0]]
    lines += ["", "## bitwise determinism", "", "| shape | T | " + " | ".join(keys) + " |",
              "|---|---|" + "---|" * len(keys)]
    for r in det:
        lines.append(f"| {r['shape']} | {r['tokens']} | " + " | ".join("yes" if r[k] else "NO" for k in keys) + " |")
    return "\n".join(lines) + "\n"


def passed(acc, det) -> bool:
    return (all(r["det"] <= BUDGET and r["fast"] <= BUDGET and r["y"] <= 1 and r["dx"] <= 1 and r["rstd"] <= 1e-4
                and r["modes_equal"] for r in acc)
            and all(v for r in det for k, v in r.items() if isinstance(v, bool)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="trainnorm verify", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, fewer token counts")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--tokens", type=str, default=None, help="comma-separated token counts")
    p.add_argument("--shapes", type=str, default=None, help="substring filter on shape names")
    p.add_argument("--out", type=str, default="verify-out")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the GPU where there is one and Triton is installed, else the CPU")
    args = p.parse_args(argv)

    try:
        device = rows.cli_device(args.device)
    except ValueError as e:
        p.error(str(e))
    cuda = device == "cuda"
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (GPU_TOKENS if cuda else CPU_TOKENS)
    if args.quick:
        tokens = tokens[:: max(1, len(tokens) // 3)] + [tokens[-1]] if len(tokens) > 3 else tokens
        tokens = sorted(set(tokens))
    seeds = 1 if args.quick else args.seeds
    shapes = [s for s in SHAPES if not args.shapes or args.shapes in s.name]
    interpreter = rows.interpreter_enabled()
    path = "kernels (GPU)" if cuda else ("kernels (Triton interpreter)" if interpreter else "CPU reference path")
    header = (f"# trainnorm verify\n\n{torch.cuda.get_device_name() if cuda else platform.processor() or 'CPU'}, "
              f"{path}; torch {torch.__version__}, python {platform.python_version()}; "
              f"seeds {seeds}, token counts {tokens}")
    left_out = not_checked(cuda, interpreter)
    if left_out:
        header += "\n\n" + "\n".join(f"- {line}" for line in left_out)
    print(header, flush=True)
    acc, det = [], []
    t0 = time.time()
    for shape in shapes:
        for t in tokens:
            for fam in FAMILIES:
                for seed in range(seeds):
                    acc.append(accuracy(shape, t, fam, seed, device))
        det.append(determinism(shape, tokens[-1], device))
        print(f"  {shape.name}: worst det {max(r['det'] for r in acc if r['shape'] == shape.name):.4f} "
              f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    md = _markdown(acc, det, header)
    print("\n" + md[len(header):].lstrip("\n"))   # the header was printed first
    os.makedirs(args.out, exist_ok=True)
    paths = [os.path.join(args.out, "verify.md"), os.path.join(args.out, "verify.json")]
    with open(paths[0], "w") as f:
        f.write(md)
    with open(paths[1], "w") as f:
        json.dump({"header": header, "not_checked": left_out, "accuracy": acc, "determinism": det}, f, indent=1)
    ok = passed(acc, det)
    print(f"wrote {paths[0]} and {paths[1]} (--out to choose the folder)")
    print("verify:", "PASS" if ok else "FAIL")
    return 0 if ok else 1
