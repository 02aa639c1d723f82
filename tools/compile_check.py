"""Compile every kernel form the dispatcher launches, for sm_90, without a GPU.

Runs the public API on small CPU tensors with the launches recorded instead
of executed, then compiles each distinct (kernel, signature, constexprs,
num_warps) with Triton for an sm_90 target and runs Triton's bundled ptxas
with -v on the PTX: registers and spill bytes per form. A form that does not
compile, or that spills, is reported and the exit code is 1.

    python3 tools/compile_check.py [--arch 90]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import trainnorm  # noqa: E402
from trainnorm import configs, dispatch  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
         torch.int32: "i32", torch.uint8: "u8"}
records: dict = {}


class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kw):
            kw = dict(kw, INTERPRETED=False) if "INTERPRETED" in self.kernel.arg_names else dict(kw)
            num_warps = kw.pop("num_warps", 4)
            sig, aligned = {}, []
            for name, a in zip(self.kernel.arg_names, args):
                # the launch-time specialisation of Triton's JIT: 16-byte aligned pointers and
                # integers divisible by 16 are marked so (vector loads depend on it), 1 is a constant
                if isinstance(a, torch.Tensor):
                    sig[name] = "*" + TYPES[a.dtype]
                    if a.data_ptr() % 16 == 0:
                        aligned.append(name)
                elif type(a).__name__ == "TensorDescriptor":
                    sig[name] = f"tensordesc<{TYPES[a.base.dtype]}[{', '.join(map(str, a.block_shape))}]>"
                elif isinstance(a, bool):
                    sig[name] = "i1"
                elif isinstance(a, int) and a == 1:
                    kw[name] = 1
                elif isinstance(a, int):
                    sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
                    if a % 16 == 0:
                        aligned.append(name)
                else:
                    sig[name] = "fp32"
            consts = {k: v for k, v in kw.items()}
            for k in consts:
                sig[k] = "constexpr"
            key = (self.kernel.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())), num_warps,
                   tuple(aligned))
            records[key] = (self.kernel, sig, consts, num_warps, aligned)
        return launch


def _case(lead, hidden, dtype, wdt, query_view):
    """Uninitialised tensors of the right layouts: nothing is executed, and
    untouched CPU pages cost no memory."""
    e = lambda *shape, dt=dtype: torch.empty(shape, dtype=dt)
    if query_view:
        x = e(*lead[:-1], lead[-1], 2 * hidden)[..., :hidden]
    else:
        x = e(*lead, hidden)
    return x, e(*lead, hidden), e(*lead, hidden), e(*lead, hidden), e(hidden, dt=wdt)


def exercise():
    """The forms the package launches: every tuned H, odd and wide widths, dtypes,
    residual, gate in both orders, views, both dw modes at several row counts."""
    dispatch.runs_kernels = lambda t: True
    for name in ("rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "dw_combine_kernel"):
        setattr(dispatch, name, Recorder(getattr(dispatch, name)))
    widths = sorted({h for h, _ in configs.tuned.BWD} | {1, 1000, 8200, 65536})
    for hidden in widths:
        heads = 24 if hidden == 256 else 0
        for rows in (1, 300, 70000) if hidden <= 8192 else (1, 300):
            lead = (max(1, rows // 24), 24) if heads else (rows,)
            for dtype, wdt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                               (torch.float16, torch.float16), (torch.float32, torch.float32)):
                x, r, dy, dh, w = _case(lead, hidden, dtype, wdt, bool(heads))
                rstd = torch.empty(lead, dtype=torch.float32)
                for res in (None, r):
                    trainnorm.rms_norm_forward(x, w, residual=res)
                    for det in (True, False):
                        trainnorm.rms_norm_backward(dy, x, w, rstd, dh=None if res is None else dh,
                                                    deterministic=det)
                    trainnorm.rms_norm_forward(x, None, residual=res)
                    trainnorm.rms_norm_backward(dy, x, None, rstd)
                for nbg in (True, False):
                    trainnorm.rms_norm_gated_forward(x, r, w, norm_before_gate=nbg)
                    for det in (True, False):
                        trainnorm.rms_norm_gated_backward(dy, x, r, w, rstd, norm_before_gate=nbg, deterministic=det)


def exercise_cols():
    """The DW_COLS forms with the tiles tune.py --sweep-small times (no table entry
    takes them until that sweep has)."""
    from dataclasses import replace

    from tune import SMALL_COLS
    orig = configs.backward_config
    for bm, bn in SMALL_COLS:
        configs.backward_config = (lambda h, d, g=False, bm=bm, bn=bn:
                                   replace(orig(h, d, g), cols_max_rows=1 << 40, cols_block_m=bm, cols_block_n=bn))
        try:
            for hidden in (512, 1536, 2048, 4096, 5120, 6144, 8200):
                x, r, dy, dh, w = _case((64,), hidden, torch.bfloat16, torch.bfloat16, False)
                rstd = torch.empty((64,), dtype=torch.float32)
                for det in (True, False):
                    trainnorm.rms_norm_backward(dy, x, w, rstd, deterministic=det)
                trainnorm.rms_norm_backward(dy, x, w, rstd, dh=dh)
                trainnorm.rms_norm_gated_backward(dy, x, r, w, rstd)
        finally:
            configs.backward_config = orig


def exercise_fwd_tma():
    """The forward's descriptor forms at the stage counts tune.py --sweep-fwd times."""
    from dataclasses import replace

    from tune import FWD_TMA_STAGES
    orig = configs.forward_config
    for stages in FWD_TMA_STAGES:
        configs.forward_config = (lambda h, d, wd=None, st=stages: replace(orig(h, d, wd), tma_stages=st))
        try:
            for hidden in (512, 1536, 2048, 4096, 5120, 6144, 1000):
                for wdt in (torch.bfloat16, torch.float32):
                    x, r, dy, dh, w = _case((300,), hidden, torch.bfloat16, wdt, False)
                    for res in (None, r):
                        trainnorm.rms_norm_forward(x, w, residual=res)
                    trainnorm.rms_norm_gated_forward(x, r, w)
        finally:
            configs.forward_config = orig


def exercise_fwd_chunks():
    """The forward's two-pass forms (rows walked in 2-8 narrower tiles) that tune.py --sweep-fwd times."""
    from tune import FWD_WIDTHS, fwd_sweep_candidates
    orig = configs.forward_config
    try:
        for hidden in FWD_WIDTHS:
            for cfg in fwd_sweep_candidates(hidden):
                if cfg.col_tiles(hidden) == 1:
                    continue
                configs.forward_config = lambda h, d, wd=None, cfg=cfg: cfg
                for wdt in (torch.bfloat16, torch.float32):
                    x, r, dy, dh, w = _case((300,), hidden, torch.bfloat16, wdt, False)
                    for res in (None, r):
                        trainnorm.rms_norm_forward(x, w, residual=res)
                    trainnorm.rms_norm_gated_forward(x, r, w)
    finally:
        configs.forward_config = orig


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, str]:
    from triton.backends.nvidia.compiler import get_ptxas   # the ptxas Triton itself uses for this arch
    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        tgt = re.search(r"^\.target\s+(\w+)", ptx, re.M)
        res = subprocess.run([ptxas, f"-arch={tgt.group(1) if tgt else f'sm_{arch}'}", "-v", src,
                              "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)) if regs else -1, sum(int(s) for s in spill), text


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--cols-only", action="store_true", help="only the column-slice dw forms (DW_COLS)")
    p.add_argument("--fwd-tma-only", action="store_true", help="only the forward's descriptor forms")
    p.add_argument("--fwd-chunks-only", action="store_true", help="only the forward's two-pass forms")
    args = p.parse_args()
    exercise()
    only = args.cols_only or args.fwd_tma_only or args.fwd_chunks_only
    if only:
        records.clear()
    if args.cols_only or not only:
        exercise_cols()
    if args.fwd_tma_only or not only:
        exercise_fwd_tma()
    if args.fwd_chunks_only or not only:
        exercise_fwd_chunks()
    target = GPUTarget("cuda", args.arch, 32)
    bad = 0
    print(f"{len(records)} kernel forms; Triton {triton.__version__}, sm_{args.arch}")
    for (name, *_), (kernel, sig, c, num_warps, aligned) in sorted(records.items(), key=lambda kv: str(kv[0])):
        label = f"{name} w{num_warps} " + " ".join(f"{k}={v}" for k, v in sorted(c.items()) if k != "INTERPRETED")
        try:
            src = ASTSource(fn=kernel, signature=sig,
                            constexprs={(kernel.arg_names.index(k),): v for k, v in c.items()},
                            attrs={(kernel.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
            compiled = triton.compile(src, target=target, options=dict(num_warps=num_warps))
            regs, spill, text = ptxas_report(compiled.asm["ptx"], args.arch)
            if regs < 0:
                raise RuntimeError(f"ptxas gave no register count: {text.strip()[:200]}")
            flag = "  SPILLS" if spill else ""
            if c.get("TMA_STAGES"):
                flag += f"  bulk copies {compiled.asm['ptx'].count('cp.async.bulk.tensor')}"
            bad += bool(spill)
            print(f"  regs {regs:>3} spill {spill:>5}  {label}{flag}")
        except Exception as exc:  # noqa: BLE001 - report every form that fails
            bad += 1
            print(f"  FAILED  {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    print("compile check:", "OK" if not bad else f"{bad} forms failed or spill")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
