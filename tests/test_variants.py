"""trainnorm.dev.variants: kernel-source variants routed through dispatch, one process."""
import json
import os
import shutil

import pytest
import torch

import trainnorm
from trainnorm import dispatch
from trainnorm.dev import variants

KERNELS = os.path.join(os.path.dirname(trainnorm.__file__), "kernels")


def _variant(tmp_path, name, edit=None):
    d = tmp_path / name
    shutil.copytree(KERNELS, d)
    if edit:
        f, old, new = edit
        p = d / f
        s = p.read_text()
        assert old in s
        p.write_text(s.replace(old, new))
    return str(d)


def test_probe_routes_each_variant_and_compares_bits(tmp_path, device):
    # a variant whose forward doubles y: its fwd bits differ from base's, its bwd (from
    # base's rstd) do not; an unedited copy matches base everywhere
    doubled = _variant(tmp_path, "doubled", ("forward.py", "    b_y = b_h * b_rstd[:, None]\n",
                                             "    b_y = b_h * b_rstd[:, None] * 2.0\n"))
    same = _variant(tmp_path, "same")
    sets = {"doubled": variants.load_kernels("doubled", doubled), "same": variants.load_kernels("same", same)}
    assert sets["same"]["fwd_one_tile_kernel"] is not dispatch.fwd_one_tile_kernel
    timed = []

    def time_fns(fns, flush, **kw):
        for fn in fns.values():
            fn()
        timed.append(sorted(fns))
        return {n: 2.0 if n.startswith("base") else 1.0 for n in fns}

    logs = []
    res = variants.probe(sets, [(96, 5)], device, flush=lambda: None, log=logs.append, time_fns=time_fns)
    bits = res["H96 T5"]["bits"]
    assert bits == {"base fwd": True, "base bwd": True, "doubled fwd": False, "doubled bwd": True,
                    "same fwd": True, "same bwd": True}
    assert timed == [sorted(bits)]
    assert any("doubled 1.00 (2.000x, BITS DIFFER)" in line for line in logs), logs
    assert dispatch.fwd_one_tile_kernel is not sets["same"]["fwd_one_tile_kernel"]     # restored
    assert not isinstance(dispatch.fwd_one_tile_kernel, variants._Routed)


def test_load_kernels_refuses_a_directory_without_the_package(tmp_path):
    with pytest.raises(SystemExit, match="no __init__.py"):
        variants.load_kernels("empty", str(tmp_path))


def test_command_line():
    args = variants.parse_args(["--variant", "a=/x", "--variant", "b=/y", "--cases", "4096x16384,512x3",
                                "--ops", "bwd", "--out", "o"])
    assert args.variant == {"a": "/x", "b": "/y"} and args.cases == [(4096, 16384), (512, 3)] and args.ops == ("bwd",)
    for bad in (["--variant", "base=/x"], ["--variant", "nodir"], ["--variant", "a=/x", "--cases", "4096"],
                ["--variant", "a=/x", "--ops", "step"]):
        argv = bad + (["--cases", "1x1"] if "--cases" not in bad else []) + ["--out", "o"]
        with pytest.raises(SystemExit):
            variants.parse_args(argv)


def test_residual_cases_add_the_stream_and_take_its_gradient(device):
    # --residual: the forward's h is x + r (not x), and the backward's dx carries dh
    plain = variants.case_fns(96, 5, device)
    res = variants.case_fns(96, 5, device, residual=True)
    _, rstd0, h0 = plain["fwd"]()
    _, rstd, h = res["fwd"]()
    assert not torch.equal(h, h0) and not torch.equal(rstd, rstd0)
    dx0, _ = plain["bwd"]()
    dx, _ = res["bwd"]()
    assert not torch.equal(dx, dx0)
    same = {"same": variants.load_kernels("same", KERNELS)}
    out = variants.probe(same, [(96, 5)], device, flush=lambda: None, log=lambda line: None,
                         time_fns=lambda fns, flush, **kw: {n: 1.0 for n in fns}, residual=True)
    assert list(out) == ["H96 T5 res"] and all(out["H96 T5 res"]["bits"].values())
    assert variants.parse_args(["--variant", "a=/x", "--cases", "1x1", "--residual", "--out", "o"]).residual
