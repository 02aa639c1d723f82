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
