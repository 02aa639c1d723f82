"""Two-process runs of tools/multigpu.py: DDP / FSDP2 training against a single
process, bitwise repeats, and sequence-parallel dw.

The CPU test launches two gloo processes on 127.0.0.1 (the CPU path of
trainnorm, not Triton's interpreter); the gpu test needs two CUDA devices and
also checks device placement (part b).
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DW_BUDGET = 0.5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, *extra: str, timeout: int = 300) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)            # the CPU path of trainnorm, not the interpreter
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MASTER_ADDR"] = "127.0.0.1"
    if Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")   # loopback only
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for attempt in range(2):                     # a second try only if the free port was taken meanwhile
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               "-m", "trainnorm.dev.multigpu", "--out", str(out), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
        port_taken = any(s in log.lower() for s in ("address already in use", "eaddrinuse"))
        if proc.returncode == 0 or not port_taken or attempt:
            break
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{log[-6000:]}"
    assert "multigpu: OK" in proc.stdout, log[-6000:]
    return json.loads((out / "multigpu.json").read_text())


def _check_train(summary: dict, steps: int):
    a = summary["train"]
    tol = a["loss_tolerance"]
    runs = a["runs"]
    assert len(runs) == 2
    for run in runs:
        ref = run["single"]["losses"]
        assert len(ref) == steps
        for mode in ("ddp", "fsdp2"):
            if mode not in run:
                assert mode == "fsdp2" and "fsdp2_note" in summary
                continue
            curve = run[mode]["losses"]
            assert len(curve) == steps
            for i, (x, r) in enumerate(zip(curve, ref)):
                assert abs(x - r) <= tol["atol"] + tol["rtol"] * abs(r), f"{mode} step {i + 1}: {x} vs {r}"
            assert run[mode]["ranks_agree"], f"{mode}: the ranks disagree on the loss curve or the weights"
    for mode in runs[0]:
        assert runs[0][mode]["hash"] == runs[1][mode]["hash"], f"{mode}: weights differ between the two runs"
        assert runs[0][mode]["losses"] == runs[1][mode]["losses"], f"{mode}: losses differ between the two runs"


def _check_seqpar(summary: dict):
    per_rank = summary["sequence_parallel"]["per_rank"]
    assert len(per_rank) == 2
    for res in per_rank:
        assert res["dw_allreduce_err_over_tol"] <= DW_BUDGET, res
        assert res["dw_single_err_over_tol"] <= DW_BUDGET, res
        assert res["shard_y_rstd_dx_bitwise_as_single"], res


def test_two_gloo_processes(tmp_path):
    steps = 4
    summary = _launch(tmp_path / "out", "--device", "cpu", "--steps", str(steps), "--repeat", timeout=240)
    assert summary["backend"] == "gloo" and summary["world_size"] == 2
    assert summary["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert "skipped" in summary["placement"]
    _check_train(summary, steps)
    _check_seqpar(summary)
    assert summary["passed"] and all(summary["checks"].values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus(tmp_path):
    steps = 10
    summary = _launch(tmp_path / "out", "--device", "cuda", "--steps", str(steps), "--repeat", timeout=600)
    assert summary["backend"] == "nccl" and summary["world_size"] == 2
    _check_train(summary, steps)
    _check_seqpar(summary)
    placement = summary["placement"]["per_rank"]
    assert [r["device"] for r in placement] == ["cuda:0", "cuda:1"]
    for res in placement:
        assert res["ok"] and res["outputs_on_device"] and res["values_ok"], res
    assert placement[1]["cuda0_untouched"], placement[1]
    assert summary["passed"]
