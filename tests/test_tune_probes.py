"""The tuner's probes run end to end under the interpreter (times stubbed: a GPU measures them)."""
import json

import torch

from trainnorm.dev import tune


def test_probe_stream_times_every_form_and_key(monkeypatch, tmp_path):
    timed = []
    monkeypatch.setattr(tune, "time_fns", lambda fns, flush, **kw: timed.append(sorted(fns)) or
                        {name: 2.0 if name != "bf16 pair" else 1.0 for name in fns})
    logs = []
    run = tune.Run(table={}, out=str(tmp_path), device="cpu", log=logs.append)
    tune.probe_stream(run, cases=((256, 40),))
    assert timed == [sorted(["bf16 pair", "explicit rule", "explicit plain loads", "explicit tma_stages 5",
                             "explicit tma_stages 6", "explicit float32 key", "autograd rule",
                             "autograd plain loads"])], logs
    raw = json.loads((tmp_path / "probe-stream.json").read_text())
    assert raw["stream bwd H256 rows 40"]["over the pair"]["explicit rule"] == 2.0


def test_stream_edits_raise_the_depth_only_where_descriptors_are_read():
    edits = tune.stream_edits(4096)
    assert edits["rule"] is None and edits["plain loads"].schedule.tma_stages == 0
    assert [edits[f"tma_stages {s}"].schedule.tma_stages for s in (5, 6)] == [5, 6]
    assert edits["float32 key"] == tune.configs.backward_config(tune.configs.backward_key(4096, 4))
    # rows walked in column tiles read no descriptors: no deeper edits
    assert not any(k.startswith("tma_stages") for k in tune.stream_edits(20000))


def test_probe_latency_times_trainnorm_and_the_floors_with_and_without_flush(monkeypatch, tmp_path):
    ran = []

    def time_fns(fns, flush, **kw):
        for name, fn in fns.items():       # each callable runs (the interpreter here)
            fn()
        ran.append((sorted(fns), type(flush).__name__))
        return {name: 1.0 for name in fns}

    monkeypatch.setattr(tune, "time_fns", time_fns)
    logs = []
    flushes = []
    # the kernels run on the GPU where there is one, else in the interpreter (tests/conftest.py)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    run = tune.Run(table={}, out=str(tmp_path), device=dev, log=logs.append, flush=lambda: flushes.append(1))
    tune.probe_latency(run, cases=((96, 3),), peers=())
    names = sorted(["trainnorm fwd", "trainnorm bwd", "empty kernel", "row copy"])
    assert [r[0] for r in ran] == [names, names], logs
    assert ran[1][1] == "_NoFlush" and ran[0][1] != "_NoFlush"
    raw = json.loads((tmp_path / "probe-latency.json").read_text())
    assert sorted(raw) == ["H96 rows 3 flush", "H96 rows 3 no flush"]


def test_copy_rows_floor_copies_the_rows():
    # on the CPU through the interpreter (tests/conftest.py turns it on)
    from trainnorm.kernels.floors import copy_rows_kernel
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(5, 100, device=dev).to(torch.bfloat16)
    y = torch.zeros_like(x)
    copy_rows_kernel[(5,)](x, y, 100, BLOCK=128)
    assert torch.equal(y, x)
