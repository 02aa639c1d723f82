"""What the interpreter cannot see: how the kernels are compiled for the GPU (CPU-only checks)."""
import os
import subprocess
import sys

import pytest
import torch

import trainnorm
from trainnorm import dispatch, kernels


def compiled(*argv) -> str:
    """stdout of `python ARGV` outside the interpreter (the kernels compiled for sm_90),
    asserted to exit 0."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def compile_check(*args) -> str:
    """stdout of `python -m trainnorm.dev.compile_check ARGS` run for sm_90."""
    return compiled("-m", "trainnorm.dev.compile_check", *args)


def test_every_launch_fixes_fp_fusion(monkeypatch):
    # the compiler's freedom to fuse a product into the next add is part of the bits:
    # every launch states it (Triton 3.10 turns its default off)
    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((self.name, kw.get("enable_fp_fusion")))

    for name in kernels.__all__:
        monkeypatch.setattr(dispatch, name, Recorder(name))
    monkeypatch.setattr(dispatch, "runs_kernels", lambda t: True)
    x = torch.empty(300, 40000, dtype=torch.bfloat16)
    w = torch.empty(40000, dtype=torch.bfloat16)
    rstd = torch.empty(300)
    for rows, hidden in ((300, 4096), (300, 8200), (300, 40000), (1, 4096), (32, 4096)):
        trainnorm.rms_norm_forward(x[:rows, :hidden], w[:hidden])
        trainnorm.rms_norm_backward(x[:rows, :hidden], x[:rows, :hidden], w[:hidden], rstd[:rows])
        trainnorm.rms_norm_gated_backward(x[:rows, :hidden], x[:rows, :hidden], x[:rows, :hidden], w[:hidden],
                                          rstd[:rows])
    names = {n for n, _ in seen}
    assert {"fwd_one_tile_kernel", "fwd_col_tiles_kernel", "bwd_one_tile_kernel", "bwd_col_tiles_kernel",
            "bwd_col_slices_kernel", "dw_combine_kernel"} <= names, names
    assert all(f is True for _, f in seen), [s for s in seen if s[1] is not True]


def test_load_forms_compile_to_the_same_arithmetic():
    # the backward's plain loads, prefetch and tensor descriptors, for 16-bit streams and
    # float32 ones (residual stream, y) beside them, its forms as T grows, and the
    # forward's descriptor forms: compiled for sm_90, the same fused multiply-adds and adds
    # (a product fused in one form and rounded alone in another gave dx other bits: with
    # descriptor loads of a float32 stream, and past one chunk at H 1000 with a residual)
    # and the same split of every row sum (values a thread, lanes, warps: at H 512 the
    # descriptor form of a float32 stream summed rows in another order, and an H100 saw
    # a row's dx differ alone and in a batch), on contiguous rows and rows of stride H + 4
    assert "the same floating-point instructions" in compile_check("--load-forms")


def test_narrow_planned_forms_sum_rows_alike():
    # the backward forms the plans take as T grows, at the widths where Triton 3.9 had a
    # row's products fused into its sum in one form and rounded alone in another (a float32
    # residual stream at H 128 and 256: 80 against 79 and 40 against 38 multiply-adds, so
    # dx followed T) and a width of 1000 (one value a thread): every stream set the same
    assert "the same at every T and in both modes" in compile_check("--planned", "--hidden", "128,256,1000")


def test_forward_rows_per_tile_sum_rows_alike():
    # the forms each forward entry's plan launches as T grows (rows per tile by row count,
    # FwdSchedule.rows_block_m; held walks) compiled for sm_90: one split of a row's sum, so y
    # and rstd take the same bits at every T; for a float32-weight entry under a gate too (the
    # gated forward keeps that entry, windows and all: H 6144's pieces); without and with a
    # residual together (SPEC: rms_norm(x, w, residual=r) is rms_norm(h, w)
    # bit for bit), the residual's held walks (plan.RESIDUAL_HOLD) among them, on or off
    out = compile_check("--rows")
    assert "forward H 6144 weight_fp32 gate first ['gate first bm1 (T 1)', 'gate first bm2 (T 1025)']: the same" in out
    # H 5120's float32-weight entry holds from 1024 rows one row over 4 warps (FwdSchedule.held_tile)
    assert ("forward H 5120 weight_fp32 plain/residual ['plain bm1 w4 held (T 1024)', 'plain bm2 (T 1)', "
            "'residual bm1 w4 held (T 1024)', 'residual bm2 (T 1)']: the same") in out
    assert "one order of a row's sum at every row count" in out


def test_forward_rows_check_finds_a_window_that_splits_rows_otherwise():
    # H 5120's float32-weight tile holds two rows of 1024-column tiles over 8 warps (4 warps,
    # 8 values a thread a row); one row a tile spreads a row over 8 warps at 4 values: another
    # sum, so a window of one row would give a row other bits below 1024 rows than above.
    # The check must say so (the interpreter's tests cannot: its reductions have no warps)
    code = ("from triton.backends.compiler import GPUTarget\n"
            "from trainnorm.configs import FwdConfig\n"
            "from trainnorm.dev import compile_check as cc\n"
            "cfg = FwdConfig.from_fields(block_m=2, block_n=1024, num_warps=8, rows_block_m=((1024, 1),))\n"
            "bad = cc.check_forward_rows(GPUTarget('cuda', 90, 32), [(5120, 'weight_fp32', cfg)])\n"
            "print('lines', len(bad))\n")
    out = compiled("-c", code)
    lines = [line for line in out.splitlines() if line.startswith("  forward H 5120 weight_fp32")]
    assert [line.split(" [")[0] for line in lines] == ["  forward H 5120 weight_fp32 plain/residual",
                                                       "  forward H 5120 weight_fp32 gate after",
                                                       "  forward H 5120 weight_fp32 gate first"]
    assert all(line.endswith(": differ") for line in lines)
    assert "'plain bm1 (T 1)'" in lines[0] and "'residual bm2 held (T 1025)'" in lines[0]
    assert "lines 3" in out


def test_held_dw_walk_compiles_a_row_alike_at_every_T():
    # configs.BwdTile.hold_dw unrolls the walked row's second walk in the chunked form (dw
    # held) and in the column-slice form (no dw) alike, so a row's dx compiles to the same
    # float32 instructions and sums at T 1, 300 and 4096; mixing a held walk with one that
    # adds its partial in place (a rolled second walk) must read as different
    code = ("from triton.backends.compiler import GPUTarget\n"
            "from trainnorm.dev import compile_check as cc, tune\n"
            "t = GPUTarget('cuda', 90, 32)\n"
            "k = ('bwd_one_tile_kernel', 'bwd_col_slices_kernel', 'bwd_col_tiles_kernel')\n"
            "e = tune.bwd_tile_edits(5120)\n"
            "held, rolled = e['walk n2048 bm1 w16 held'], e['walk n2048 bm1 w16']\n"
            "for case in (cc.PLANNED_SETS[0], cc.PLANNED_SETS[2]):\n"
            "    ops = {r: cc._form_ops(t, cc._bwd_call(r, 5120, case), k, per_row=True,\n"
            "                           backward=tune.only(5120, 'plain', held)) for r in (1, 300, 4096)}\n"
            "    print(case[0], 'held', len(cc._differing('', ops, keep=cc.dx_op)))\n"
            "    ops[4096] = cc._form_ops(t, cc._bwd_call(4096, 5120, case), k, per_row=True,\n"
            "                             backward=tune.only(5120, 'plain', rolled))\n"
            "    print(case[0], 'mixed', len(cc._differing('', ops, keep=cc.dx_op)))\n")
    out = compiled("-c", code).splitlines()
    assert out == ["bf16 held 0", "bf16 mixed 1", "bf16 residual held 0", "bf16 residual mixed 1"], out


def test_dealt_rows_compile_a_row_alike():
    # configs.BwdTile.deal_rows moves where a chunk's row tiles start and how far apart they
    # are, nothing a row computes: at H 5120 (one 8192-column tile, descriptor loads) and
    # walked in 2048-column tiles, bf16 and with a residual, the dealt form's float32
    # instructions a row and its sums are the chunked form's at T 4096
    code = ("from triton.backends.compiler import GPUTarget\n"
            "from trainnorm.dev import compile_check as cc, tune\n"
            "t = GPUTarget('cuda', 90, 32)\n"
            "k = ('bwd_one_tile_kernel', 'bwd_col_tiles_kernel')\n"
            "e = tune.bwd_tile_edits(5120)\n"
            "for name in ('entry', 'walk n2048 bm1 w16'):\n"
            "    for case in (cc.PLANNED_SETS[0], cc.PLANNED_SETS[2]):\n"
            "        ops = {d: cc._form_ops(t, cc._bwd_call(4096, 5120, case), k, per_row=True,\n"
            "                               backward=tune.only(5120, 'plain', e[name].replace(deal_rows=d)))\n"
            "               for d in (False, True)}\n"
            "        print(name, case[0], len(cc._differing('', ops, keep=cc.dx_op)))\n")
    out = compiled("-c", code).splitlines()
    assert out == ["entry bf16 0", "entry bf16 residual 0", "walk n2048 bm1 w16 bf16 0",
                   "walk n2048 bm1 w16 bf16 residual 0"], out


def test_ptx_digest_ignores_debug_information_only():
    from trainnorm.dev.compile_check import ptx_digest
    body = ".visible .entry k(\n)\n{\n\tld.global.b32 %r1, [%rd1];\n\tst.global.b32 [%rd2], %r1;\n}\n"
    a = "//\n.version 8.7\n" + body.replace("\tld", "\t.loc\t1 14 0\n\tld") + "\t.file\t1 \"a.py\"\n"
    b = "//\n.version 8.7\n" + body.replace("\tld", "\t.loc\t1 19 3 // a.py:19:3\n\tld")
    b += "\t.section\t.debug_abbrev\n\t{\n.b8 1\n\t}\n"
    assert ptx_digest(a) == ptx_digest(b)
    assert ptx_digest(a) != ptx_digest(a.replace("st.global.b32", "st.global.cs.b32"))
    # the labels the debug sections point at, numbered by inlined helper functions
    c = b.replace("\tst.global", "$L__tmp7:\n\tst.global")
    assert ptx_digest(c) == ptx_digest(a)
    assert ptx_digest(a.replace("\tst.global", "$L__BB0_2:\n\tst.global")) != ptx_digest(a)


def test_pdl_launches_compile_to_a_grid_dependency_wait_and_plain_ones_to_none():
    """sm_90 PTX of the forward, the backward and its dw combine recorded with and without
    dispatch.LAUNCH_PDL: griddepcontrol.wait, then launch_dependents, ahead of every global
    access in the PDL forms; no griddepcontrol in the plain ones."""
    from trainnorm.kernels.common import HAS_PDL
    if not HAS_PDL:
        pytest.skip("this Triton has no grid dependency control")
    out = compile_check("--pdl")
    assert "each kernel waits for the grid ahead before its first global access" in out, out
