"""The tuner's probes run end to end under the interpreter (times stubbed: a GPU measures them)."""
import json

import pytest
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


def test_probe_flush_times_each_op_after_both_flushes(monkeypatch, tmp_path):
    ran = []

    def time_fns(fns, flush, **kw):
        flush()
        for fn in fns.values():       # each callable runs (the interpreter here)
            fn()
        ran.append((sorted(fns), type(flush).__name__))
        return {name: 2.0 if type(flush).__name__ == "_CleanFlush" else 3.0 for name in fns}

    monkeypatch.setattr(tune, "time_fns", time_fns)
    logs, flushes = [], []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    run = tune.Run(table={}, out=str(tmp_path), device=dev, log=logs.append, flush=lambda: flushes.append(1))
    tune.probe_flush(run, cases=((96, 3),), peers=(), nbytes=4096)
    names = ["trainnorm bwd", "trainnorm fwd"]
    assert [r[0] for r in ran] == [names, names], logs
    assert ran[0][1] == "function" and ran[1][1] == "_CleanFlush"
    assert len(flushes) == 2           # the clean flush runs the bench's first
    raw = json.loads((tmp_path / "probe-flush.json").read_text())
    assert sorted(raw) == ["H96 rows 3 clean", "H96 rows 3 dirty"]
    assert "trainnorm bwd 3.00 -> 2.00 (1.500x)" in logs[-1]


def test_probe_flush_command_line():
    args = tune.parse_args(["--probe-flush", "--cases", "2560x65536", "--out", "x"])
    assert args.probe_flush and tune._probing(args)


def test_copy_rows_floor_copies_the_rows():
    # on the CPU through the interpreter (tests/conftest.py turns it on)
    from trainnorm.kernels.floors import copy_rows_kernel
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(5, 100, device=dev).to(torch.bfloat16)
    y = torch.zeros_like(x)
    copy_rows_kernel[(5,)](x, y, 100, BLOCK=128)
    assert torch.equal(y, x)


def test_bwd_tile_edits_hold_the_row_as_two_pieces_without_spilling_counts():
    edits = tune.bwd_tile_edits(5120)
    entry = edits["entry"]
    assert entry == tune.configs.backward_config(tune.configs.backward_key(5120, 2))
    # the entry's rows dealt to its chunks: nothing else changes
    assert edits["entry dealt"] == entry.replace(deal_rows=True) and not entry.tile.deal_rows
    # H 5120's entry takes 132 chunks at most; the rule's 256 (H 2560) get 264 beside them
    assert "entry m264" not in edits and entry.tile.max_chunks == 132
    rule = tune.bwd_tile_edits(2560)
    assert rule["entry"].tile.max_chunks == 256 and rule["entry m264"] == rule["entry"].replace(max_chunks=264)
    pieces = {k: v for k, v in edits.items() if k.startswith("pieces")}
    # 8 or 16 warps (4 at 4096 + 1024 columns spill), loop 0 or 3 deep, 8 warps at 2 programs an SM only
    assert sorted(pieces) == sorted(["pieces bm1 w8 ls0 c2", "pieces bm1 w8 ls3 c2", "pieces bm1 w16 ls0 c2",
                                     "pieces bm1 w16 ls0 c4", "pieces bm1 w16 ls3 c2", "pieces bm1 w16 ls3 c4"])
    for name, cfg in pieces.items():
        t, s = cfg.tile, cfg.schedule
        assert (t.block_m, t.block_n, t.block_n2) == (1, 4096, 1024), name
        assert s.tma_stages == 0 and not s.prefetch and not s.direct_prefetch, name
        # the small-T windows and the chunking stay the entry's
        assert cfg.windows == entry.windows and t.max_chunks == entry.tile.max_chunks, name
    assert edits["pieces bm1 w16 ls3 c4"].schedule.loop_stages == 3
    assert edits["pieces bm1 w16 ls3 c4"].schedule.ctas_per_sm == 4
    # a power of two has no second piece; rows walked in column tiles none either
    assert not any(k.startswith("pieces") for k in tune.bwd_tile_edits(4096))
    assert not any(k.startswith("pieces") for k in tune.bwd_tile_edits(12288))


def test_bwd_tile_edits_walk_the_row_in_column_tiles_where_the_entry_holds_it_whole():
    from trainnorm.configs import cdiv
    from trainnorm.plan import DwForm
    from trainnorm.variant import Variant
    for hidden in (2560, 5120, 5376, 6144):
        edits = tune.bwd_tile_edits(hidden)
        entry = edits["entry"]
        walks = {k: v for k, v in edits.items() if k.startswith("walk")}
        assert walks, hidden
        for name, cfg in walks.items():
            t, s = cfg.tile, cfg.schedule
            n = cfg.col_tiles(hidden)
            # narrower than the row, few tiles, at most a quarter of the walk masked
            assert 1 < n <= tune.WALK_MAX_TILES and t.block_n2 == 0, name
            assert n * t.block_n - hidden <= tune.WALK_MAX_MASKED * n * t.block_n, name
            assert name == f"walk n{t.block_n} bm{t.block_m} w{t.num_warps}{' held' if t.hold_dw else ''}"
            assert walks[name.removesuffix(" held")].tile.hold_dw is False
            assert not t.hold_dw or t.block_m == 1, name
            assert 4 <= t.block_m * t.block_n // (32 * t.num_warps) <= 16, name
            assert s.tma_stages == 0 and not s.prefetch and cfg.windows == entry.windows, name
            # the plan walks it with a float64 partial a chunk past the column-slice window
            with tune.configs.override(backward=tune.only(hidden, "plain", cfg)):
                p = tune.plan_mod.backward_plan(16384, hidden, torch.bfloat16, Variant(), True, True)
            assert (p.col_tiles, p.dw, p.num_chunks) == (n, DwForm.PARTIAL, 256), name
    # H 2560: 2048 columns would leave 1536 of 4096 masked; a walked width has no walks to add
    assert "walk n2048 bm1 w8" not in tune.bwd_tile_edits(2560)
    assert not any(k.startswith("walk") for k in tune.bwd_tile_edits(12288))
    assert cdiv(5376, 512) == 11 and "walk n512 bm4 w4" in tune.bwd_tile_edits(5376)


def test_probe_bwd_tiles_times_every_edit_of_each_case(monkeypatch, tmp_path):
    timed = []
    monkeypatch.setattr(tune, "time_fns", lambda fns, flush, **kw: timed.append(sorted(fns)) or
                        {name: 2.0 if name == "entry" else 1.0 for name in fns})
    logs = []
    run = tune.Run(table={}, out=str(tmp_path), device="cpu", log=logs.append)
    tune.probe_bwd_tiles(run, cases=((2560, 40),))
    assert timed == [sorted(tune.bwd_tile_edits(2560))], logs
    raw = json.loads((tmp_path / "probe-bwd-tiles.json").read_text())
    assert raw["bwd H2560 rows 40"]["pieces bm1 w16 ls3 c2"] == 1.0
    assert "pieces bm1 w16 ls3 c2 1.00 (2.000x)" in logs[0]


def test_probe_bwd_tiles_command_line():
    args = tune.parse_args(["--probe-bwd-tiles", "--cases", "5120x16384"])
    assert args.probe_bwd_tiles and tune._probing(args) and not args.stack
    assert tune.parse_args(["--probe-bwd-tiles", "--stack"]).stack
    with pytest.raises(SystemExit):
        tune.parse_args(["--probe-defaults", "--stack"])


def test_probe_bwd_tiles_stack_times_the_residual_rows_backward(monkeypatch, tmp_path):
    # --stack: every candidate's backward gets dh and a float32 weight (the `res w32` rows)
    seen = []
    real = tune._bwd_with

    def spy(cfg, hidden, dy, x, w, rstd, ws, det, z=None, dh=None):
        seen.append((w.dtype, dh is not None and dh.shape == dy.shape))
        return real(cfg, hidden, dy, x, w, rstd, ws, det, z, dh)
    monkeypatch.setattr(tune, "_bwd_with", spy)
    monkeypatch.setattr(tune, "time_fns", lambda fns, flush, **kw: {n: fn() and 1.0 for n, fn in fns.items()})
    logs = []
    run = tune.Run(table={}, out=str(tmp_path), device="cpu", log=logs.append)
    tune.probe_bwd_tiles(run, cases=((96, 3),), stack=True)
    assert seen and set(seen) == {(torch.float32, True)}, seen
    assert "bwd H96 rows 3 res w32" in json.loads((tmp_path / "probe-bwd-tiles.json").read_text())


def test_pdl_options_by_architecture(monkeypatch):
    from trainnorm import dispatch
    monkeypatch.setattr(dispatch, "HAS_PDL", True)
    monkeypatch.setattr(dispatch, "LAUNCH_PDL", True)
    assert dispatch.pdl_options("sm_90") == dict(PDL=True, launch_pdl=True)
    assert dispatch.pdl_options("sm_100") == dict(PDL=True, launch_pdl=True)
    assert dispatch.pdl_options("sm_80") == {}
    assert dispatch.pdl_options(None) == {}
    assert dispatch.launch_options("cpu") == {}, "the interpreter launches plainly"
    monkeypatch.setattr(dispatch, "arch_of", lambda device: "sm_90")
    assert dispatch.launch_options("cuda") == dict(PDL=True, launch_pdl=True)
    monkeypatch.setattr(dispatch, "FORWARD_PDL", False)
    assert dispatch.launch_options("cuda", forward=True) == {}
    monkeypatch.setattr(dispatch, "FORWARD_PDL", True)
    assert dispatch.launch_options("cuda", forward=True) == dict(PDL=True, launch_pdl=True)
    monkeypatch.setattr(dispatch, "LAUNCH_PDL", False)
    assert dispatch.pdl_options("sm_90") == {}
    monkeypatch.setattr(dispatch, "LAUNCH_PDL", True)
    monkeypatch.setattr(dispatch, "HAS_PDL", False)
    assert dispatch.pdl_options("sm_90") == {}


def test_probe_pdl_times_both_launches_of_each_op(monkeypatch, tmp_path):
    from trainnorm import dispatch
    seen = []
    real = tune._launching
    before = dispatch.LAUNCH_PDL

    def launching(pdl, fn):
        call = real(pdl, fn)
        return lambda: seen.append((pdl, dispatch.LAUNCH_PDL)) or call()
    monkeypatch.setattr(tune, "_launching", launching)
    timed = []
    monkeypatch.setattr(tune, "time_fns", lambda fns, flush, **kw: timed.append(sorted(fns)) or
                        {"plain": 3.0, "pdl": 2.0})
    logs = []
    run = tune.Run(table={}, out=str(tmp_path), device="cpu", log=logs.append)
    tune.probe_pdl(run, row_ids=("H4096 T1",))
    assert timed == [["pdl", "plain"]] * 3, logs
    raw = json.loads((tmp_path / "probe-pdl.json").read_text())
    assert set(raw) == {"fwd H4096 T1", "bwd H4096 T1", "step H4096 T1"}
    assert "step H4096 T1: plain 3.00, pdl 2.00 (1.500x)" in logs
    assert dispatch.LAUNCH_PDL is before, "the switch is restored"
    # each side ran (for its bits) under its own setting: real(pdl) sets LAUNCH_PDL inside
    assert {pdl for pdl, _ in seen} == {False, True}


def test_probe_pdl_times_no_op_whose_bits_differ(monkeypatch, tmp_path):
    real = tune._launching

    def launching(pdl, fn):
        call = real(pdl, fn)
        return (lambda: [t + 1 for t in tune._flat_tensors(call())]) if pdl else call
    monkeypatch.setattr(tune, "_launching", launching)
    monkeypatch.setattr(tune, "time_fns", lambda *a, **kw: pytest.fail("timed a candidate with other bits"))
    logs = []
    run = tune.Run(table={}, out=str(tmp_path), device="cpu", log=logs.append)
    tune.probe_pdl(run, row_ids=("H4096 T1",), ops=("fwd",))
    assert logs == ["fwd H4096 T1: outputs differ with PDL; not timed"]


def test_probe_pdl_command_line():
    args = tune.parse_args(["--probe-pdl", "--rows", "H4096 T1;[T,4,256] T1024"])
    assert args.probe_pdl and tune._probing(args) and args.rows == ("H4096 T1", "[T,4,256] T1024")
    with pytest.raises(SystemExit):
        tune.parse_args(["--probe-pdl", "--rows", "H4096 T3"])
    with pytest.raises(SystemExit):
        tune.parse_args(["--probe-bwd-tiles", "--rows", "H4096 T1"])


def test_probe_placement_times_the_rule_and_its_rows_dealt_on_each_copy(monkeypatch, tmp_path):
    import trainnorm
    from trainnorm import plan
    from trainnorm.variant import Variant
    calls = []
    real = trainnorm.rms_norm_backward

    def spy(dy, h, w, rstd, **kw):
        p = plan.backward_plan(rstd.numel(), h.shape[-1], h.dtype, Variant(), True, True)
        calls.append((dy.data_ptr(), p.dealt, p.num_chunks))
        return real(dy, h, w, rstd, **kw)
    monkeypatch.setattr(trainnorm, "rms_norm_backward", spy)
    monkeypatch.setattr(tune, "time_fns", lambda fns, flush, **kw: {n: fn() and 1.0 for n, fn in fns.items()})
    logs = []
    run = tune.Run(table={}, out=str(tmp_path), device="cpu", log=logs.append)
    tune.probe_placement(run, cases=((256, 600),), copies=2, peers=())
    raw = json.loads((tmp_path / "probe-placement.json").read_text())
    assert sorted(raw) == ["bwd H256 rows 600 rep 0", "bwd H256 rows 600 rep 1"]
    assert sorted(raw["bwd H256 rows 600 rep 0"]) == ["copy0 dealt", "copy0 rule", "copy1 dealt", "copy1 rule"]
    # two copies at two places, each launched as the rule's chunks and with its rows dealt
    assert len({c[0] for c in calls}) == 2
    assert {c[1] for c in calls} == {False, True} and min(c[2] for c in calls) > 1
    assert tune.parse_args(["--probe-placement"]).probe_placement
