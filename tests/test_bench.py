"""The benchmark harness's pure-Python parts: rows, bytes, matching, summary, rendering, CLI.

Timing itself needs a GPU; here the results are built by hand, so every
expected number below is worked out from the definitions.
"""
import json
import math

import pytest
import torch

from trainnorm import reference
from trainnorm.bench import block, impls, report, run, shapes, timing
from trainnorm.bench.report import BenchResult, Measurement
from trainnorm.bench.shapes import Row


def by_id():
    return {r.id: r for r in shapes.all_rows()}


# --- rows -----------------------------------------------------------------------------------

def test_row_counts_and_unique_ids():
    seed, small, gated = shapes.seed_rows(), shapes.small_t_rows(), shapes.gated_rows()
    assert len(seed) == 78 and len(small) == 20 and len(gated) == 7
    ids = [r.id for r in seed + small + gated]
    assert len(set(ids)) == 105
    assert [r.group for r in seed + small + gated] == ["seed"] * 78 + ["small_t"] * 20 + ["gated"] * 7
    assert sorted(r.id for r in shapes.default_rows()) == sorted(ids)
    # every set's rows: ids unique across the sets, the default set first; the stack set
    # shares its 5 plain pairs with the seed rows, which all_rows holds once
    beyond, block, stack = shapes.beyond_rows(), shapes.block_rows(), shapes.stack_rows()
    assert len(beyond) == 42 and len(block) == 2 and len(stack) == 20
    every = [r.id for r in shapes.all_rows()]
    assert len(every) == len(set(every)) == 105 + 42 + 2 + 15
    assert set(every[:105]) == set(ids)


def test_gated_rows_bytes_and_data():
    row = next(r for r in shapes.gated_rows() if r.id == "H4096 T1024 gate")
    n = 1024 * 4096
    # the gate is read in the forward; read and its gradient written in the backward
    assert shapes.op_bytes(row, "fwd") == 3 * 2 * n + 4096 * 2 + 1024 * 4
    assert shapes.op_bytes(row, "bwd") == 5 * 2 * n + 4096 * 2 + 1024 * 4 + 4096 * 4
    d = impls.make_row_data(shapes.Row(64, 5, gated=True), "cpu")
    assert d.z is not None and d.z.shape == d.x.shape
    # trainnorm's and the explicit FP32 reference's dw of the gated norm, both against FP64
    for impl in (impls.Eager(), impls.Trainnorm(True)):
        impl.begin_row(d)
        err, dtype = impls.dw_check(impl, d)
        impl.end_row()
        assert dtype == "float32" and err < 0.05, (impl.name, err)
    assert impls.Quack().skip_reason(d.row) and impls.Liger().skip_reason(d.row)


def test_series():
    seed = shapes.seed_rows()
    count = {}
    for r in seed:
        count[r.series] = count.get(r.series, 0) + 1
    assert count == {
        "H512": 7, "H1536": 7, "H2048": 7, "H4096": 7, "H5120": 7, "H6144": 7,
        "H5120 w32": 7, "H6144 w32": 7, "H6144 res": 7, "H6144 res w32": 7,
        "[T,24,256]": 4, "[T,4,256]": 4,
    }
    assert {r.tokens for r in seed if r.series == "H512"} == {256, 1024, 4096, 14928, 16384, 32768, 65536}
    assert {r.tokens for r in seed if r.per_head} == {1024, 4096, 16384, 65536}
    small = {(r.series, r.tokens) for r in shapes.small_t_rows()}
    assert small == {(f, t) for f in ("H2048", "H4096", "H5120", "H6144", "H6144 res") for t in (1, 4, 16, 64)}


def test_row_ids_and_layouts():
    rows = by_id()
    for i in ("H4096 T1024", "H6144 T1024 w32", "H6144 T1024 res", "H6144 T1024 res w32",
              "[T,24,256] T1024", "[T,4,256] T1024", "H6144 T1 res", "H2048 T64"):
        assert i in rows, i
    q = rows["[T,24,256] T1024"]
    assert q.strided and q.shape == (1024, 24, 256) and q.rows == 1024 * 24 and q.hidden == 256
    k = rows["[T,4,256] T1024"]
    assert not k.strided and k.shape == (1024, 4, 256) and k.rows == 4096
    r = rows["H6144 T1024 res w32"]
    assert r.residual and r.w32 and r.weight_bytes == 4 and r.shape == (1024, 6144)


def test_quick_rows_are_a_representative_subset():
    q = shapes.quick_rows()
    assert 8 <= len(q) <= 12
    assert {r.id for r in q} <= set(by_id())
    assert any(r.residual for r in q) and any(r.w32 for r in q) and any(r.small_t for r in q)
    assert any(r.strided for r in q) and any(r.per_head and not r.strided for r in q)


def test_select_rows_substring_and_regex():
    rows = shapes.all_rows()
    assert [r.id for r in shapes.select_rows(rows, ["[T,24,256]"])] == [
        "[T,24,256] T1024", "[T,24,256] T4096", "[T,24,256] T16384", "[T,24,256] T65536"]
    assert [r.id for r in shapes.select_rows(rows, [r"^H4096 T(1|4)$"])] == ["H4096 T1", "H4096 T4"]
    assert len(shapes.select_rows(rows, ["res w32"])) == 7
    assert len(shapes.select_rows(rows, ["res w32", "res w32"])) == 7
    assert shapes.select_rows(rows, ["H9999"]) == []
    assert len(shapes.select_rows(shapes.default_rows(), None)) == 105
    assert len(shapes.select_rows(rows, ["gate"])) == 7


# --- bytes and floor ------------------------------------------------------------------------

def test_op_bytes_by_hand():
    rows = by_id()
    # x read + y written (2 B each), weight 4096 x 2 B, rstd 1024 x 4 B
    assert shapes.op_bytes(rows["H4096 T1024"], "fwd") == 1024 * 4096 * 2 * 2 + 4096 * 2 + 1024 * 4 == 16789504
    # h, dy, dh read and dx written, FP32 weight and dw, rstd
    assert shapes.op_bytes(rows["H6144 T1024 res w32"], "bwd") == 1024 * 6144 * 4 * 2 + 6144 * 4 + 1024 * 4 + 6144 * 4
    assert shapes.op_bytes(rows["H6144 T1024 res w32"], "bwd") == 50384896
    # residual forward: x, r read, y, h written
    assert shapes.op_bytes(rows["H6144 T1024 res"], "fwd") == 1024 * 6144 * 4 * 2 + 6144 * 2 + 1024 * 4
    # per head: 24576 rows of 256, shared w[256]
    fwd = 24576 * 256 * 2 * 2 + 256 * 2 + 24576 * 4
    bwd = 24576 * 256 * 3 * 2 + 256 * 2 + 24576 * 4 + 256 * 4
    assert (fwd, bwd) == (25264640, 37848576)
    assert shapes.op_bytes(rows["[T,24,256] T1024"], "step") == 2 * fwd + bwd == 88377856
    with pytest.raises(ValueError):
        shapes.op_bytes(rows["H4096 T1024"], "both")


def test_floor_us():
    row = by_id()["H4096 T1024"]
    assert shapes.floor_us(row, "fwd", 4e12) == pytest.approx(16789504 / 4e12 * 1e6)
    assert shapes.floor_us(row, "fwd", 4e12) == pytest.approx(4.197376)


# --- statistics and pass order --------------------------------------------------------------

def test_percentile_and_stats():
    assert timing.percentile([5, 1, 3, 2, 4], 50) == 3
    assert timing.percentile([1, 2, 3, 4, 5], 20) == pytest.approx(1.8)
    assert timing.percentile([1, 2], 50) == pytest.approx(1.5)
    assert math.isnan(timing.percentile([], 50))
    s = timing.Stats.of([10.0, 12.0, 11.0, 30.0, 9.0])
    assert (s.median, s.n) == (11.0, 5) and s.p20 < s.median < s.p80


def test_passes_alternate_order():
    calls = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def sample(self, flush, n):
            calls.append(self.name)
            return [float(len(calls))] * n

    got = timing.sample_interleaved([Fake("a"), Fake("b"), Fake("c")], None, passes=3, samples=2)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert got["a"] == [[1.0, 1.0], [6.0, 6.0], [7.0, 7.0]]



def test_timer_replays_its_captures_in_turn():
    # a short row's samples go to each capture in turn (timing.py): no one graph stands for all
    replays = []

    class Graph:
        def __init__(self, i):
            self.i = i

        def replay(self):
            replays.append(self.i)

    t = timing.Timer("a", fn=lambda: replays.append("eager"), graphs=[Graph(0), Graph(1), Graph(2)])
    for _ in range(7):
        t.run()
    assert replays == [0, 1, 2, 0, 1, 2, 0]
    t.release()
    assert t.graphs == [] and t.keep == []
    eager = timing.Timer("b", fn=lambda: replays.append("eager"))
    eager.run()
    assert replays[-1] == "eager"


def test_short_ops_are_captured_several_times():
    rows = {r.id: r for r in shapes.set_rows(shapes.parse_sets("default,block"), quick=False)}
    assert run.captures(rows["H6144 T4"], "step") == run.ROTATE_CAPTURES > 1
    assert run.captures(rows["H512 T16384"], "fwd") == run.ROTATE_CAPTURES      # 32 MiB
    assert shapes.op_bytes(rows["H512 T16384"], "fwd") <= run.ROTATE_MAX_BYTES
    assert run.captures(rows["H4096 T65536"], "fwd") == 1
    assert shapes.op_bytes(rows["H4096 T65536"], "fwd") > run.ROTATE_MAX_BYTES
    assert run.captures(next(r for r in rows.values() if r.block), "fwd") == 1


@pytest.mark.gpu
def test_make_timer_captures_with_their_own_outputs():
    # each capture replays into its own outputs: three graphs, three result tensors, each
    # written by its own replay
    stream = torch.cuda.Stream()
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    with torch.cuda.stream(stream):
        t = timing.make_timer("double", lambda: x * 2, stream, warmup=1, captures=3)
        assert t.mode == "graph" and len(t.graphs) == 3 and len(t.keep) == 3
        assert len({o.data_ptr() for o in t.keep}) == 3
        for o in t.keep:
            o.zero_()
        x.add_(1)
        for _ in range(2):
            t.run()
        torch.cuda.synchronize()
    assert [bool(torch.equal(o, x * 2)) for o in t.keep] == [True, True, False]


@pytest.mark.gpu
def test_make_timer_with_a_shared_pool_keeps_no_outputs():
    # the tuner's timers share one graph pool and keep no outputs: ten candidates of 64 MiB
    # outputs each take about one output's memory in all, where kept outputs take ten
    stream = torch.cuda.Stream()
    x = torch.ones(16 << 20, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    before = torch.cuda.memory_reserved()
    with torch.cuda.stream(stream):
        timers = [timing.make_timer(f"c{i}", lambda i=i: x * (i + 1), stream, warmup=1, pool=pool)
                  for i in range(10)]
        assert all(t.mode == "graph" and len(t.graphs) == 1 and not t.keep for t in timers)
        for t in timers:
            t.run()
        torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - before < 4 * x.nbytes


# --- matching -------------------------------------------------------------------------------

def M(impl, us, err=None, dtype=None, op="bwd", row="H4096 T1024", mode="graph", note=""):
    return Measurement(row, op, impl, us, us * 0.98, us * 1.03, [us], [us], mode, note, err, dtype)


def test_best_peer_bwd_needs_fp32_dw_within_budget():
    cells = {m.impl: m for m in [
        M("trainnorm", 10.0, 0.1, "float32"),
        M("trainnorm-fast", 4.0, 0.2, "float32"),           # never a peer
        M("liger", 5.0, 30.0, "bfloat16"),                  # fastest, BF16 dw
        M("quack", 6.0, 0.3, "bfloat16"),                   # in budget but BF16 dw
        M("torch-compile", 8.0, 1.5, "float32"),            # FP32 but outside the budget
        M("torch-compile-maxat", 9.0, 1.0, "float32"),      # err/tol = B exactly: matched
        M("eager", 20.0, 0.01, "float32"),
        Measurement("H4096 T1024", "bwd", "transformer-engine", mode="skipped", note="skipped"),
    ]}
    best, outside = report.best_peer(cells, "bwd")
    assert best.impl == "torch-compile-maxat"
    assert [m.impl for m in outside] == ["liger", "quack", "torch-compile"]
    # a tighter budget moves the match to the slower, more accurate peer
    best, outside = report.best_peer(cells, "bwd", budget=0.5)
    assert best.impl == "eager" and [m.impl for m in outside][-1] == "torch-compile-maxat"


def test_best_peer_fwd_is_fastest_and_none_when_nothing_matches():
    cells = {m.impl: m for m in [M("trainnorm", 3.0, op="fwd"), M("liger", 3.3, op="fwd"),
                                 M("quack", 3.1, op="fwd"), M("eager", 9.0, op="fwd")]}
    best, outside = report.best_peer(cells, "fwd")
    assert best.impl == "quack" and outside == []
    cells = {m.impl: m for m in [M("trainnorm", 10.0, 0.1, "float32"), M("liger", 5.0, 30.0, "bfloat16")]}
    best, outside = report.best_peer(cells, "bwd")
    assert best is None and [m.impl for m in outside] == ["liger"]


# --- comparisons and summary ----------------------------------------------------------------

def fake_result(ratios):
    """Rows with det 10 us, fast 8 us, liger at 7 us with a BF16 dw, and a matched
    peer at ratio * 10 us (None: no matched peer on bwd and step)."""
    rows = by_id()
    ms = []
    for rid, op, ratio in ratios:
        ms.append(M("trainnorm", 10.0, 0.25, "float32", op=op, row=rid))
        ms.append(M("trainnorm-fast", 8.0, 0.4, "float32", op=op, row=rid))
        ms.append(M("liger", 7.0, 40.0, "bfloat16", op=op, row=rid))   # fast, but BF16 dw
        if ratio is not None:
            ms.append(M("torch-compile", 10.0 * ratio, 0.5, "float32", op=op, row=rid))
    ms.append(M("eager", 50.0, 0.1, "float32", op="bwd", row="H4096 T1024", mode="eager",
                note="eager timing, graph capture failed (RuntimeError: x)"))
    used = [rows[i] for i in dict.fromkeys(r for r, _, _ in ratios)]
    env = {"gpu": "NVIDIA H200", "sm_count": 132, "torch": "2.11", "peers": {"liger": "0.8.5", "quack": "not available"}}
    return BenchResult(env, {"passes x samples": "3 x 25"}, used, ["fwd", "bwd", "step"],
                       ["trainnorm", "trainnorm-fast", "torch-compile", "liger", "eager"], 4.0e12, ms,
                       {"quack": "not importable (ModuleNotFoundError: No module named 'quack')"})


def test_compare_ratios():
    res = fake_result([("H4096 T1024", "bwd", 1.2), ("H4096 T1024", "fwd", None)])
    cs = {(c.row.id, c.op): c for c in report.compare(res)}
    bwd = cs[("H4096 T1024", "bwd")]
    assert bwd.peer.impl == "torch-compile"
    assert bwd.ratio_det == pytest.approx(1.2) and bwd.ratio_fast == pytest.approx(12.0 / 8.0)
    assert bwd.floor_us == pytest.approx(shapes.op_bytes(by_id()["H4096 T1024"], "bwd") / 4e12 * 1e6)
    fwd = cs[("H4096 T1024", "fwd")]
    # on fwd rows the dw does not matter: liger is the peer
    assert fwd.peer.impl == "liger" and fwd.ratio_det == pytest.approx(0.7)


def test_summary_geomean_and_minimum_per_group():
    res = fake_result([
        ("H4096 T1024", "bwd", 2.0), ("H6144 T65536", "bwd", 0.5), ("H512 T256", "bwd", 1.0),
        ("H2048 T16", "bwd", 1.5), ("H6144 T1 res", "bwd", None),
    ])
    summ = {(s["group"], s["op"]): s for s in report.summarize(report.compare(res))}
    seed = summ[("seed", "bwd")]
    assert seed["rows"] == 3 and seed["unmatched"] == 0
    assert seed["det_geomean"] == pytest.approx(1.0) and seed["det_min"] == pytest.approx(0.5)
    assert seed["det_below_1"] == 1
    assert seed["fast_geomean"] == pytest.approx(1.25) and seed["fast_min"] == pytest.approx(0.625)
    assert seed["fast_vs_det_geomean"] == pytest.approx(1.25)
    small = summ[("small_t", "bwd")]
    assert small["rows"] == 2 and small["unmatched"] == 1
    assert small["det_geomean"] == pytest.approx(1.5) and small["det_min"] == pytest.approx(1.5)
    assert ("seed", "fwd") not in summ
    assert report.geomean([]) is None and report.geomean([4.0, 1.0]) == pytest.approx(2.0)


# --- rendering ------------------------------------------------------------------------------

def test_markdown():
    res = fake_result([("H4096 T1024", "bwd", 1.2), ("H4096 T1024", "fwd", None), ("H6144 T4 res", "step", 0.8)])
    md = report.render_markdown(res)
    assert ("| row | op | floor us | trainnorm det us (% floor) | trainnorm fast us (% floor) | best peer "
            "| peer us (% floor) | det vs peer | fast vs peer | det dw err/tol |") in md
    floor = shapes.op_bytes(by_id()["H4096 T1024"], "bwd") / 4e12 * 1e6
    pct = round(100 * floor / 10.0)
    assert (f"| H4096 T1024 | bwd | {floor:.2f} | 10.00 ({pct}%) | 8.00 ({round(100 * floor / 8.0)}%) "
            f"| torch-compile * | 12.00 ({round(100 * floor / 12.0)}%) | 1.20x | 1.50x | 0.250 |") in md
    assert "| H6144 T4 res | step |" in md and "| 0.80x |" in md
    assert "NVIDIA H200" in md and "sm_count: 132" in md and "4000.0 GB/s" in md
    assert "quack: not run, not importable" in md
    assert "eager timing, graph capture failed" in md and "50.00 (49.00–51.50) †" in md
    assert "- H4096 T1024 bwd: liger 7.00 (40.000, bfloat16)" in md   # the faster unmatched peer
    assert "## Summary" in md and "| 78-shape list | bwd | 1 | 0 | 1.20x |" in md


def test_json_is_strict_and_complete():
    res = fake_result([("H4096 T1024", "bwd", 1.2)])
    res.measurements.append(Measurement("H4096 T1024", "bwd", "quack", float("nan")))
    data = json.loads(json.dumps(report.to_json(res), allow_nan=False))
    assert data["env"]["gpu"] == "NVIDIA H200"
    assert data["rows"][0]["id"] == "H4096 T1024" and data["rows"][0]["bytes"]["fwd"] == 16789504
    ms = {(m["impl"], m["op"]): m for m in data["measurements"]}
    assert ms[("trainnorm", "bwd")]["median_us"] == 10.0 and ms[("trainnorm", "bwd")]["p20_us"] == 9.8
    assert ms[("quack", "bwd")]["median_us"] is None
    assert data["comparisons"][0]["peer"] == "torch-compile"
    assert data["comparisons"][0]["det_vs_peer"] == pytest.approx(1.2)


def test_write_outputs(tmp_path):
    res = fake_result([("H4096 T1024", "bwd", 1.2), ("H4096 T4096", "bwd", 1.1)])
    paths, note = report.write_outputs(res, str(tmp_path))
    assert (tmp_path / "bench.md").read_text().startswith("# trainnorm bench")
    assert json.loads((tmp_path / "bench.json").read_text())["impls"][0] == "trainnorm"
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    if note:
        assert "matplotlib" in note and pngs == []
    else:
        assert pngs == ["latency_bwd.png", "latency_fwd.png", "latency_step.png", "ratio_vs_peer.png"]


# --- inputs and the reference the peers are held to (CPU, small) ---------------------------

def test_strided_per_head_input_layout():
    d = impls.make_row_data(Row(256, 3, heads=24, strided=True), "cpu")
    assert d.x.shape == (3, 24, 256) and d.x.stride() == (12288, 512, 1)
    assert d.dy.is_contiguous() and d.r is None and d.w.dtype == torch.bfloat16
    assert d.flat(d.x).shape == (72, 256)
    d2 = impls.make_row_data(Row(64, 5, residual=True, w32=True), "cpu")
    assert d2.w.dtype == torch.float32 and d2.r.shape == d2.dh.shape == (5, 64)
    assert torch.equal(impls.make_row_data(Row(64, 5), "cpu").x, impls.make_row_data(Row(64, 5), "cpu").x)


def test_reference_dw_chunked_equals_whole():
    d = impls.make_row_data(Row(64, 37, residual=True), "cpu")
    y, rstd, h = impls.ref_forward_residual(d.x, d.w, d.r)
    whole = reference.backward_fp64(d.dy, h, d.w, rstd, d.dh)[1]
    chunked = impls.reference_dw(d.dy, h, d.w, rstd, d.dh, chunk_elems=64 * 5)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


def test_eager_adapter_dw_check_and_ops():
    eager = impls.Eager()
    d = impls.make_row_data(Row(128, 16, residual=True), "cpu")
    err, dtype = impls.dw_check(eager, d)
    assert dtype == "float32" and 0 <= err < 0.5
    for op in shapes.OPS:
        assert impls.Eager().prepare(d, op)() is not None
    dx, dw = eager.prepare(d, "bwd")()
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32 and dw.shape == (128,)


def test_adapters_have_the_documented_names():
    names = [i.name for i in impls.make_impls(quack_autotune=True)]
    assert names == ["trainnorm", "trainnorm-fast", "torch-compile", "torch-compile-maxat", "quack", "quack-f32dw",
                     "quack-autotune", "liger", "fla", "transformer-engine", "eager"]
    block_names = [i.name for i in block.make_block_impls()]
    assert block_names == ["trainnorm", "trainnorm-fast", "torch-compile", "trainnorm-eager", "eager"]
    assert set(names) | set(block_names) == set(impls.IMPL_NAMES)
    assert "quack-autotune" not in [i.name for i in impls.make_impls()]
    liger = impls.Liger()
    assert liger.skip_reason(by_id()["H6144 T1024 res"]) and liger.skip_reason(by_id()["H6144 T1024"]) is None
    fla = impls.Fla()    # fuses the residual and has a gated norm; no weight offset
    stack = {r.id: r for r in shapes.stack_rows()}
    assert fla.skip_reason(by_id()["H6144 T1024 res"]) is None and fla.skip_reason(stack["H4096 T4096 1+w"])


# --- command line ---------------------------------------------------------------------------

def test_main_without_cuda_returns_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and "nothing was run" in err


def test_main_rejects_bad_arguments(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main(["--ops", "fwd,sideways"]) == 2
    assert "--ops" in capsys.readouterr().err
    assert run.main(["--impls", "trainnorm,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert run.main(["--shapes", "H9999"]) == 2
    assert run.main(["--passes", "0"]) == 2
    assert run.main(["--warm-only"]) == 2
    assert "--warm-only" in capsys.readouterr().err


def test_main_list(capsys):
    assert run.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("105 rows x 3 ops") and "[T,24,256] T65536" in out and "quack-autotune" not in out
    assert run.main(["--list", "--quick", "--ops", "bwd", "--quack-autotune"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(shapes.QUICK_IDS)} rows x 1 ops") and "quack-autotune" in out


def test_merge_runs_over_different_rows(tmp_path):
    a = fake_result([("H4096 T1024", "bwd", 1.2), ("H4096 T1024", "fwd", None)])
    b = fake_result([("H4096 T4096", "bwd", 0.9)])
    b.copy_bytes_per_s = 4.2e12
    b.env = dict(b.env, date="later")
    b.rows = b.rows + [r for r in shapes.all_rows() if r.id == "H4096 T16384"]   # selected, never reached
    for name, res in (("a", a), ("b", b)):
        report.write_outputs(res, str(tmp_path / name), plots=False)
    back = report.from_json(json.loads((tmp_path / "a" / "bench.json").read_text()))
    assert [r.id for r in back.rows] == ["H4096 T1024"] and len(back.measurements) == len(a.measurements)
    assert run.main(["--merge", str(tmp_path / "b" / "bench.json"), str(tmp_path / "a" / "bench.json"),
                     "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "bench.json").read_text())
    assert [r["id"] for r in merged["rows"]] == ["H4096 T1024", "H4096 T4096"]   # the shape list's order
    ratios = {(c["row"], c["op"]): c["det_vs_peer"] for c in merged["comparisons"]}
    assert ratios[("H4096 T1024", "bwd")] == pytest.approx(1.2)
    assert ratios[("H4096 T4096", "bwd")] == pytest.approx(0.9)
    assert merged["copy_bandwidth_bytes_per_s"] == pytest.approx(4.2e12)   # median of 4.0 and 4.2 (upper)
    assert "later" in merged["env"]["merged from"]
    assert "(1 of 2 selected rows measured" in merged["env"]["merged from"]
    assert merged["config"]["rows"] == "2 (2 seed, 0 small-T)"


def test_skip_done_leaves_out_only_rows_measured_for_every_op(tmp_path, capsys):
    # a run cut short: it selected three rows but measured one whole and one for fwd only
    res = fake_result([("H4096 T1024", "fwd", None), ("H4096 T1024", "bwd", 1.0), ("H4096 T1024", "step", 1.0),
                       ("H4096 T4096", "fwd", None)])
    res.rows = [by_id()[i] for i in ("H4096 T1024", "H4096 T4096", "H4096 T16384")]
    report.write_outputs(res, str(tmp_path), plots=False)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == 3
    assert run.done_rows(data, ["fwd", "bwd", "step"]) == {"H4096 T1024"}
    assert run.done_rows(data, ["fwd"]) == {"H4096 T1024", "H4096 T4096"}
    assert run.main(["--shapes", "^H4096 T(1024|4096|16384)$", "--skip-done", str(tmp_path / "bench.json"),
                     "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 rows x 3 ops") and "H4096 T4096" in out and "H4096 T1024\n" not in out
    # several parts: the rows any of them measured
    other = fake_result([(r, op, 1.0 if op != "fwd" else None) for r in ("H4096 T16384",) for op in ("fwd", "bwd", "step")])
    report.write_outputs(other, str(tmp_path / "other"), plots=False)
    assert run.main(["--shapes", "^H4096 T(1024|4096|16384)$", "--skip-done", str(tmp_path / "bench.json"),
                     str(tmp_path / "other" / "bench.json"), "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 rows x 3 ops") and "H4096 T4096" in out


def _three_ops(rid, ratio=1.0):
    return [(rid, op, ratio if op != "fwd" else None) for op in ("fwd", "bwd", "step")]


def test_reuse_takes_rows_whose_launches_and_versions_match(tmp_path):
    # an earlier run of three rows, one cut after fwd; this run's fingerprints match two of them
    old = fake_result(_three_ops("H4096 T1024") + _three_ops("H4096 T4096", 1.1) + [("H4096 T16384", "fwd", None)])
    old.env = dict(old.env, triton="3.6.0")
    old.launches = {"H4096 T1024": "a", "H4096 T4096": "b", "H4096 T16384": "c"}
    report.write_outputs(old, str(tmp_path), plots=False)
    back = report.from_json(json.loads((tmp_path / "bench.json").read_text()))
    assert back.launches == old.launches, "bench.json keeps each row's fingerprint"
    env = dict(old.env)
    ops = ["fwd", "bwd", "step"]
    prints = {"H4096 T1024": "a", "H4096 T4096": "B", "H4096 T16384": "c"}
    (part,) = run.reusable([("old.json", back)], prints, env, ops)
    # T4096's launches changed (another fingerprint); T16384 lacks bwd and step
    assert [r.id for r in part.rows] == ["H4096 T1024"] and part.launches == {"H4096 T1024": "a"}
    assert {m.row for m in part.measurements} == {"H4096 T1024"}
    (part,) = run.reusable([("old.json", back)], prints, env, ["fwd"])
    assert [r.id for r in part.rows] == ["H4096 T1024", "H4096 T16384"]
    # a row this tree has no fingerprint for (a block row; fingerprints not taken) is never taken
    assert run.reusable([("old.json", back)], {}, env, ops)[0].rows == []
    # another GPU, Triton or peer version: an error naming the file and the field
    for k, v in (("gpu", "NVIDIA H100 80GB HBM3"), ("triton", "3.7.0"), ("peers", {"liger": "0.9.0"})):
        with pytest.raises(ValueError, match=f"old.json ran .*{'liger' if k == 'peers' else k}"):
            run.reusable([("old.json", back)], prints, dict(env, **{k: v}), ops)


def test_merge_keeps_the_fingerprint_of_the_part_each_rows_cells_come_from():
    a = fake_result(_three_ops("H4096 T1024") + _three_ops("H4096 T4096"))
    a.launches = {"H4096 T1024": "a1", "H4096 T4096": "a4"}
    b = fake_result(_three_ops("H4096 T4096", 0.9))
    b.launches = {"H4096 T4096": "b4"}
    m = report.merge([a, b])
    assert m.launches == {"H4096 T1024": "a1", "H4096 T4096": "b4"}
    assert report.subset(m, ["H4096 T1024"]).launches == {"H4096 T1024": "a1"}
    assert {x.row for x in report.subset(m, ["H4096 T1024"]).measurements} == {"H4096 T1024"}


def test_fingerprints_follow_the_rows_launches_and_the_kernels_source(monkeypatch):
    from trainnorm import configs
    from trainnorm.dev import launches
    rows = by_id()
    a = run.fingerprints([rows["H512 T4096"], rows["H4096 T1024"], rows["block T4096"]], 132)
    assert set(a) == {"H512 T4096", "H4096 T1024"}, "block rows have none"
    with configs.override(backward=lambda key, cur: cur.replace(max_chunks=66, rows_max_chunks=())
                          if key.hidden == 512 else cur):
        b = run.fingerprints([rows["H512 T4096"], rows["H4096 T1024"]], 132)
    assert b["H512 T4096"] != a["H512 T4096"] and b["H4096 T1024"] == a["H4096 T1024"]
    assert launches.fingerprint(rows["H4096 T1024"], 132, digest="another source") != a["H4096 T1024"]
    # a GPU whose architecture has a table of its own: none (the CPU's launches follow sm_90's)
    assert run.fingerprints([rows["H4096 T1024"]], 132, "sm_90") == {"H4096 T1024": a["H4096 T1024"]}
    from trainnorm.configs import table
    monkeypatch.setattr(table, "archs", lambda: ("sm_90", "sm_100"))
    assert run.fingerprints([rows["H4096 T1024"]], 132, "sm_100") == {}


@pytest.mark.gpu
def test_reuse_end_to_end(tmp_path, capsys):
    # a one-row run, then the same selection with --reuse of it: the row is taken (its cells
    # and fingerprint carried over), nothing is timed again
    args = ["--shapes", "^H512 T256$", "--impls", "trainnorm,trainnorm-fast,eager", "--passes", "1",
            "--samples", "2", "--ops", "fwd,bwd"]
    assert run.main(args + ["--out", str(tmp_path / "a")]) == 0
    a = json.loads((tmp_path / "a" / "bench.json").read_text())
    assert set(a["launches"]) == {"H512 T256"} and len(a["launches"]["H512 T256"]) == 40
    capsys.readouterr()
    assert run.main(args + ["--out", str(tmp_path / "b"), "--reuse", str(tmp_path / "a" / "bench.json")]) == 0
    assert "1 of 1 rows taken" in capsys.readouterr().err
    b = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert b["measurements"] == a["measurements"] and b["launches"] == a["launches"]


# --- rows beyond the measured table ---------------------------------------------------------

def test_beyond_rows_are_public_widths_the_table_does_not_hold():
    from trainnorm import configs
    from trainnorm.configs import table
    rows = shapes.beyond_rows()
    widths = sorted({r.hidden for r in rows if not r.per_head})
    assert len(widths) >= 10 and all(128 <= h <= 8192 for h in widths)
    heads = {(r.heads, r.hidden) for r in rows if r.per_head}
    assert heads == {(32, 128), (8, 128), (24, 64)}
    # tuned for nothing: no entry of the measured table (plain bf16 norm, forward or backward)
    for h in widths + sorted({hd for _, hd in heads}):
        assert table.lookup("forward", configs.forward_key(h, 2, 2, arch="sm_90")) is None, h
        assert table.lookup("backward", configs.backward_key(h, 2, arch="sm_90")) is None, h
    # ... where the seed widths have one (the check can fail)
    assert table.lookup("backward", configs.backward_key(4096, 2, arch="sm_90")) is not None
    for series in {r.series for r in rows}:
        assert sorted(r.tokens for r in rows if r.series == series) == [4096, 16384, 65536], series
    assert all(r.group == "beyond" and not (r.w32 or r.residual or r.strided or r.gated) for r in rows)
    assert not {r.id for r in rows} & {r.id for r in shapes.default_rows()}
    q = next(r for r in rows if r.id == "[T,32,128] T4096")
    assert q.shape == (4096, 32, 128) and q.rows == 4096 * 32
    # per-head bytes: x read and y written, w[128], rstd per (token, head)
    assert shapes.op_bytes(q, "fwd") == 4096 * 32 * 128 * 2 * 2 + 128 * 2 + 4096 * 32 * 4
    d = impls.make_row_data(Row(64, 3, heads=24, beyond=True), "cpu")
    assert d.x.shape == (3, 24, 64) and d.x.is_contiguous() and d.w.dtype == torch.bfloat16


def test_row_sets_on_the_command_line(capsys):
    assert shapes.parse_sets("all") == ["default", "beyond", "block", "stack"]
    assert shapes.parse_sets(" beyond, block,beyond") == ["beyond", "block"]
    for bad in ("", "beyond,sideways"):
        with pytest.raises(ValueError, match="--set"):
            shapes.parse_sets(bad)
    assert run.main(["--list", "--set", "beyond"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("42 rows x 3 ops") and "H8192 T65536  (beyond the table)" in out
    assert "H4096 T1024" not in out
    assert run.main(["--list", "--set", "beyond", "--shapes", "[T,8,128]"]) == 0
    assert capsys.readouterr().out.startswith("3 rows")
    assert run.main(["--list", "--set", "all"]) == 0
    assert capsys.readouterr().out.startswith("164 rows")
    assert run.main(["--list", "--set", "block,default", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(shapes.QUICK_IDS) + 1} rows") and "block T4096  (decoder block)" in out
    assert run.main(["--list", "--set", "block"]) == 0
    assert capsys.readouterr().out.startswith("2 rows")
    assert run.main(["--list", "--set", "nope"]) == 2
    assert "--set" in capsys.readouterr().err
    assert run.main(["--list", "--set", "block", "--shapes", "H4096"]) == 2


def test_block_rows_have_no_floor():
    row = shapes.block_rows()[0]
    assert (row.id, row.series, row.group, row.shape) == ("block T4096", "block", "block", (1, 4096, 4096))
    with pytest.raises(ValueError, match="no copy floor"):
        shapes.op_bytes(row, "fwd")
    res = fake_result([("H4096 T1024", "bwd", 1.0)])
    assert res.floor_us(row, "fwd") is None and res.floor_us(by_id()["H4096 T1024"], "fwd") is not None
    with pytest.raises(ValueError, match="block"):
        impls.make_row_data(row, "cpu")
    assert shapes.describe(shapes.all_rows()) == ("164 (78 seed, 20 small-T, 42 beyond the table, 2 block, "
                                                  "15 training stack)")


# --- report: the new groups, the block's peer, the summary without quack-f32dw ---------------

def test_summary_counts_rows_at_par_and_reports_the_beyond_group():
    res = fake_result([("H4096 T1024", "bwd", 0.97), ("H4096 T4096", "bwd", 0.969), ("H768 T4096", "bwd", 1.3),
                       ("[T,24,64] T16384", "bwd", 0.9)])
    summ = {(s["group"], s["op"]): s for s in report.summarize(report.compare(res))}
    seed = summ[("seed", "bwd")]
    assert seed["det_at_par"] == 1 and seed["det_below_1"] == 2      # 0.97 is at par, 0.969 is not
    beyond = summ[("beyond", "bwd")]
    assert beyond["rows"] == 2 and beyond["det_at_par"] == 1
    assert beyond["det_geomean"] == pytest.approx(math.sqrt(1.3 * 0.9)) and beyond["det_min"] == pytest.approx(0.9)
    md = report.render_markdown(res)
    assert "| beyond the table | bwd | 2 | 0 | 1.08x | 0.90x | 1 | 1 |" in md


def block_cells(row="block T4096", op="step"):
    return [M("trainnorm", 100.0, op=op, row=row), M("trainnorm-fast", 98.0, op=op, row=row),
            M("torch-compile", 110.0, op=op, row=row), M("trainnorm-eager", 200.0, op=op, row=row),
            M("eager", 90.0, op=op, row=row)]   # an eager block faster than the compiled one: not its peer


def test_block_rows_compare_compiled_blocks_without_dw():
    rows = by_id()
    res = fake_result([("H4096 T1024", "bwd", 1.2)])
    res.rows = res.rows + [rows["block T4096"]]
    res.measurements += block_cells(op="fwd") + block_cells(op="step")
    # the block's bwd alone: skipped by every implementation, so no comparison and no table line
    res.measurements += [Measurement("block T4096", "bwd", m.impl, mode="skipped", note="bwd skipped: why")
                         for m in block_cells()]
    res.impls = ["trainnorm", "trainnorm-fast", "trainnorm-eager", "torch-compile", "liger", "eager"]
    cs = {(c.row.id, c.op): c for c in report.compare(res)}
    assert ("block T4096", "bwd") not in cs
    blk = cs[("block T4096", "fwd")]
    # no dw on block rows, yet the compiled torch block is matched; eager never is the peer
    assert blk.peer.impl == "torch-compile" and blk.ratio_det == pytest.approx(1.1) and blk.outside == []
    assert blk.floor_us is None
    # on step (dw-checked ops for norm rows) the block's peer needs no dw either
    assert cs[("block T4096", "step")].peer.impl == "torch-compile"
    # the norm rows keep their dw condition: the BF16-dw liger is not matched there
    assert cs[("H4096 T1024", "bwd")].peer.impl == "torch-compile"
    summ = {(s["group"], s["op"]): s for s in report.summarize(report.compare(res))}
    assert summ[("block", "step")]["det_geomean"] == pytest.approx(1.1)
    assert summ[("block", "step")]["det_at_par"] == 1
    assert ("block", "bwd") not in summ
    md = report.render_markdown(res)
    assert "| decoder block, compiled | step | 1 | 0 | 1.10x |" in md
    assert "| block T4096 | bwd |" not in md and "- trainnorm: bwd skipped: why (1 row: block T4096)" in md
    # a note on every row an implementation was given is said once, not row by row
    res.rows.append(rows["block T16384"])
    res.measurements += [Measurement("block T16384", "bwd", m.impl, mode="skipped", note="bwd skipped: why")
                         for m in block_cells()]
    md = report.render_markdown(res)
    assert "- eager: bwd skipped: why (2 rows: block T4096, block T16384)" in md   # eager ran H4096 T1024 too
    assert "- trainnorm-eager: bwd skipped: why (all 2 of its rows)" in md
    assert "| block T4096 | step | 100.00 | 98.00 | 110.00 | 1.10x | 200.00 | 90.00 | 0.45x |" in md
    data = json.loads(json.dumps(report.to_json(res), allow_nan=False))
    blk_row = next(r for r in data["rows"] if r["id"] == "block T4096")
    assert blk_row["bytes"] == {"fwd": None, "bwd": None, "step": None}
    assert report.from_json(data).rows[-1].block


def test_summary_with_and_without_quack_f32dw():
    res = fake_result([("H4096 T1024", "bwd", 1.25), ("H4096 T4096", "bwd", 1.25)])
    assert report.without_peers(res) == []
    assert "without quack-f32dw" not in report.render_markdown(res)
    # quack-f32dw: float32 dw in budget, faster than torch-compile on one row
    res.measurements += [M("quack-f32dw", 10.0, 0.6, "float32", row="H4096 T1024"),
                         M("quack-f32dw", 13.0, 0.6, "float32", row="H4096 T4096")]
    res.impls.append("quack-f32dw")
    titles = [t for t, _ in report.summaries(res)]
    assert titles == ["Summary", "Summary without quack-f32dw"]
    (_, with_it), (_, without) = report.summaries(res)
    s_with = next(s for s in with_it if s["op"] == "bwd")
    s_without = next(s for s in without if s["op"] == "bwd")
    # with it: 10 us (1.0x) on the first row, torch-compile's 12.5 us still the faster on the second
    assert s_with["det_geomean"] == pytest.approx(math.sqrt(1.25)) and s_with["det_min"] == pytest.approx(1.0)
    assert s_without["det_geomean"] == pytest.approx(1.25) and s_without["det_min"] == pytest.approx(1.25)
    md = report.render_markdown(res)
    assert "## Summary without quack-f32dw" in md and "| 78-shape list | bwd | 2 | 0 | 1.25x |" in md
    data = report.to_json(res)
    assert data["summary_without"]["quack-f32dw"][0]["det_geomean"] == pytest.approx(1.25)
    assert data["summary"][0]["det_geomean"] == pytest.approx(math.sqrt(1.25))


# --- quack-f32dw: QuACK's float32 partials summed in float32 ---------------------------------

class StubQuack:
    """QuACK's functions with their documented signatures, computed by the FP32 reference:
    rmsnorm_fwd, get_sm_count, rmsnorm_bwd (dw cast to the weight's dtype, as QuACK's is),
    and bwd_partials standing for torch.ops.quack.rmsnorm_bwd_f (float32 partials, one per
    block of rows)."""

    def __init__(self):
        self.sm_counts = []

    def rmsnorm_fwd(self, x, w, residual=None, eps=1e-6, store_rstd=False):
        y, rstd, h = impls.ref_forward_residual(x, w, residual) if residual is not None else (
            *impls.ref_forward(x, w), x)
        return y, h, rstd

    def get_sm_count(self, n, device):
        return 3

    def bwd_partials(self, x, w, dout, rstd, dresidual_out=None, sm_count=0):
        self.sm_counts.append(sm_count)
        dx, _ = impls.ref_backward(dout, x, w, rstd, dresidual_out)
        terms = dout.float() * (x.float() * rstd.float()[:, None])
        return dx, torch.stack([c.sum(0) for c in terms.chunk(sm_count, dim=0)])

    def rmsnorm_bwd(self, x, w, dout, rstd, dresidual_out=None, has_residual=False):
        dx, partials = self.bwd_partials(x, w, dout, rstd, dresidual_out, self.get_sm_count(x.shape[-1], x.device))
        return dx, partials.sum(0).to(w.dtype), None, dx if has_residual else None


def test_quack_f32dw_sums_the_float32_partials_and_is_matched():
    stub = StubQuack()
    public, f32 = impls.Quack(), impls.QuackF32dw()
    public.qr = f32.qr = stub
    f32.bwd_partials = stub.bwd_partials
    for row in (Row(256, 40), Row(256, 40, residual=True)):
        d = impls.make_row_data(row, "cpu")
        err, dtype = impls.dw_check(f32, d)
        assert dtype == "float32" and err < 0.5, (row, err)
        assert impls.dw_check(public, d)[1] == "bfloat16"
        dx, dw = f32.prepare(d, "bwd")()
        ref_dx, ref_dw = impls.ref_backward(d.dy, d.x if d.r is None else d.x + d.r, d.w,
                                            impls.ref_forward(d.x if d.r is None else d.x + d.r, d.w)[1], d.dh)
        torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5)
    assert set(stub.sm_counts) == {3}
    # the stricter peer set: with quack-f32dw matched, the bwd peer can be QuACK's kernels
    cells = {m.impl: m for m in [M("trainnorm", 10.0, 0.1, "float32"), M("quack", 6.0, 0.3, "bfloat16"),
                                 M("quack-f32dw", 6.5, err, dtype), M("torch-compile", 9.0, 0.5, "float32")]}
    assert report.best_peer(cells, "bwd")[0].impl == "quack-f32dw"
    assert report.best_peer(cells, "bwd", without=("quack-f32dw",))[0].impl == "torch-compile"
    # what it leaves to the quack adapter: the forward, FP32-weight rows; no gated norm
    assert f32.op_skip_reason("fwd") and f32.op_skip_reason("bwd") is None and f32.op_skip_reason("step") is None
    assert f32.skip_reason(by_id()["H6144 T1024 w32"]) and f32.skip_reason(by_id()["H6144 T1024"]) is None
    assert f32.skip_reason(by_id()["H4096 T1024 gate"])


def test_quack_f32dw_without_quack_says_why():
    import importlib.util
    if importlib.util.find_spec("quack") is not None:
        pytest.skip("QuACK is installed here")
    impl = impls.QuackF32dw()
    assert not impl.available() and "not importable" in impl.reason


def test_peer_modules_land_in_their_attributes(monkeypatch):
    import sys
    import types
    ln, gate = types.ModuleType("fla.modules.norm.layernorm"), types.ModuleType("fla.modules.norm.fused_norm_gate")
    monkeypatch.setitem(sys.modules, "fla.modules.norm.layernorm", ln)
    monkeypatch.setitem(sys.modules, "fla.modules.norm.fused_norm_gate", gate)
    fla = impls.Fla()
    assert fla.available() and fla.ln is ln and fla.gate is gate and not fla.reason
    monkeypatch.setitem(sys.modules, "fla.modules.norm.fused_norm_gate", None)   # import fails
    fla = impls.Fla()
    assert not fla.available() and "not importable" in fla.reason


# --- the decoder block (CPU, tiny) -----------------------------------------------------------

TINY = block.BlockConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128)


def test_block_config_and_inputs_reject_bad_values():
    for kw, word in (({"heads": 5}, "heads"), ({"hidden": 0}, "hidden"), ({"eps": -1.0}, "eps"),
                     ({"head_dim": 15}, "head_dim"), ({"rope_theta": float("inf")}, "rope_theta")):
        with pytest.raises(ValueError, match=word):
            block.BlockConfig(**{**TINY.__dict__, **kw})
    with pytest.raises(TypeError, match="kv_heads"):
        block.BlockConfig(kv_heads="2")
    with pytest.raises(ValueError, match="norm"):
        block.DecoderBlock(TINY, "apex")
    with pytest.raises(ValueError, match="not a block row"):
        block.make_block_data(Row(64, 8), "cpu", cfg=TINY)
    with pytest.raises(ValueError, match="hidden"):
        block.make_block_data(Row(128, 8, block=True), "cpu", cfg=TINY)
    with pytest.raises(ValueError, match="no block implementation"):
        block.BlockImpl("torch", True, deterministic=False)


def test_block_norm_variants_agree_in_eager_mode():
    ref = block.build_block(TINY, "torch", seed=3, dtype=torch.float32)
    mine = block.build_block(TINY, "trainnorm", ref.state_dict(), dtype=torch.float32)
    import trainnorm
    assert sum(isinstance(m, torch.nn.RMSNorm) for m in ref.modules()) == 4
    assert sum(isinstance(m, trainnorm.RMSNorm) for m in mine.modules()) == 4
    # trainnorm.RMSNorm subclasses torch.nn.RMSNorm: no module of the block is torch's own
    assert not any(type(m) is torch.nn.RMSNorm for m in mine.modules())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 64, generator=gen, requires_grad=True)
    dy = torch.randn(1, 8, 64, generator=gen)
    cos, sin = block.rope_tables(8, TINY, dtype=torch.float32)
    outs = []
    for b in (ref, mine):
        y = b(x, cos, sin)
        outs.append((y, torch.autograd.grad(y, (x, *b.parameters()), dy)))
    (y_ref, g_ref), (y, g) = outs
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    names = ["x"] + [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in mine.named_parameters()] == names[1:]
    for name, a, b in zip(names, g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    # the rotary tables: position 0 is the identity, and the block is causal
    assert torch.equal(cos[0], torch.ones_like(cos[0])) and torch.equal(sin[0], torch.zeros_like(sin[0]))
    x2 = x.detach().clone()
    x2[0, -1] += 1.0
    torch.testing.assert_close(mine(x2, cos, sin)[0, :-1], y[0, :-1].detach(), rtol=0, atol=0)


def test_block_adapters_time_forward_and_step():
    """Every block adapter's ops on the CPU: compiled whole (fullgraph, AOTAutograd through
    the aot_eager backend: Inductor's code generation is left to the GPU run) and eager agree."""
    d = block.make_block_data(Row(64, 8, block=True), "cpu", cfg=TINY, dtype=torch.float32)
    assert d.x.shape == (1, 8, 64) and set(d.state) == {n for n, _ in block.DecoderBlock(TINY).named_parameters()}
    got = {}
    for impl in block.make_block_impls(backend="aot_eager"):
        assert not impl.checks_dw and impl.skip_reason(by_id()["H4096 T1024"])
        # Inductor's backward overwrites the forward's saved tensors: no bwd alone
        assert impl.op_skip_reason("bwd") and impl.op_skip_reason("fwd") is None
        with pytest.raises(ValueError, match="bwd"):
            impl.prepare(d, "bwd")
        impl.begin_row(d)
        calls = []
        forward = impl.forward
        impl.forward = lambda data: calls.append(1) or forward(data)
        y = impl.prepare(d, "fwd")()
        assert y.shape == (1, 8, 64) and y.requires_grad and len(calls) == 1
        step = impl.prepare(d, "step")
        assert len(calls) == 1
        first, again = step(), step()       # each step: one forward, then the backward
        assert len(calls) == 3
        assert len(first) == 1 + len(d.state) and first[0].shape == d.x.shape
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        got[impl.name] = first
        impl.end_row()
        assert impl.mod is None
    ref = got["eager"]
    for name in ("trainnorm", "trainnorm-fast", "torch-compile", "trainnorm-eager"):
        for a, b in zip(got[name], ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


# --- the stack set: a float32 residual stream and (1 + w) weights beside their bf16 rows -------

def test_stack_rows_are_well_formed_and_paired(capsys):
    rows = shapes.ROW_SETS["stack"].rows()
    ids = [r.id for r in rows]
    assert len(rows) == 20 and len(set(ids)) == 20
    r32 = [r for r in rows if r.r32]
    offset = [r for r in rows if r.weight_offset]
    assert len(r32) == 5 and len(offset) == 5
    assert all(r.residual and not r.w32 and r.weight_offset == 0 and r.id.endswith(" res r32") for r in r32)
    assert all(r.weight_offset == 1.0 and not r.residual and r.id.endswith(" 1+w") for r in offset)
    assert {(r.hidden, r.tokens) for r in r32} == {(r.hidden, r.tokens) for r in offset} == set(shapes.STACK_SHAPES)
    assert {r.hidden for r in r32} == {2048, 4096, 5120} and {r.tokens for r in r32} == {4096, 16384, 65536}
    seed_ids = {r.id for r in shapes.seed_rows()}
    for r in r32 + offset:
        assert r.group == "stack" and r.stack_feature
        pair = by_id()[r.pair_id]
        assert pair.id in ids and pair.shape == r.shape and not pair.stack_feature
        assert pair.residual == r.residual and pair.w32 == r.w32
    # the (1 + w) rows' pairs are the seed rows themselves, the float32 stream's the bf16 residual rows
    assert {r.pair_id for r in offset} <= seed_ids
    assert all(by_id()[r.pair_id].group == "stack" and by_id()[r.pair_id].residual for r in r32)
    assert by_id()["H4096 T16384 res r32"].pair_id == "H4096 T16384 res"
    assert by_id()["H4096 T16384 1+w"].series == "H4096 1+w" and by_id()["H4096 T16384"].pair_id is None
    assert shapes.describe(rows) == "20 (5 seed, 0 small-T, 15 training stack)"
    assert len(shapes.select_rows(shapes.all_rows(), ["1+w"])) == 5
    assert len(shapes.select_rows(shapes.all_rows(), ["res r32"])) == 5
    assert {r.id for r in shapes.ROW_SETS["stack"].quick()} == set(shapes.QUICK_STACK_IDS)
    with pytest.raises(ValueError, match="residual"):
        Row(64, 4, r32=True)
    with pytest.raises(ValueError, match="finite"):
        Row(64, 4, weight_offset=float("nan"))
    # on the command line: alone, and with the default set (its 5 plain pairs timed once)
    assert run.main(["--list", "--set", "stack"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("20 rows x 3 ops") and "H5120 T16384 res r32  (training stack)" in out
    assert run.main(["--list", "--set", "default,stack"]) == 0
    assert capsys.readouterr().out.startswith("120 rows")
    assert "stack (20 rows" in run.build_parser().format_help().replace("\n", " ").replace("  ", " ")


def test_stack_op_bytes_count_the_float32_stream():
    rows = by_id()
    n, h, t = 16384 * 4096, 4096, 16384
    f32, pair = rows["H4096 T16384 res r32"], rows["H4096 T16384 res"]
    # forward: x read, y written (2 B); r read, h written (4 B); bf16 weight, rstd
    assert shapes.op_bytes(f32, "fwd") == n * (2 + 2 + 4 + 4) + h * 2 + t * 4
    # backward: dy read (2 B); h, dh read and dx written (4 B); weight, rstd, float32 dw
    assert shapes.op_bytes(f32, "bwd") == n * (2 + 4 + 4 + 4) + h * 2 + t * 4 + h * 4
    # exactly the wider stream's bytes more than the bf16 pair: r and h in the forward,
    # h, dh and dx in the backward, 2 B each
    assert shapes.op_bytes(f32, "fwd") - shapes.op_bytes(pair, "fwd") == 2 * 2 * n
    assert shapes.op_bytes(f32, "bwd") - shapes.op_bytes(pair, "bwd") == 3 * 2 * n
    assert shapes.op_bytes(f32, "step") - shapes.op_bytes(pair, "step") == (2 * 2 + 3) * 2 * n
    # a weight offset moves no more bytes than the plain row
    for op in shapes.OPS:
        assert shapes.op_bytes(rows["H4096 T16384 1+w"], op) == shapes.op_bytes(rows["H4096 T16384"], op)


STACK_CPU_ROWS = (Row(64, 6, residual=True, r32=True), Row(96, 5, weight_offset=1.0),
                  Row(64, 6, residual=True, r32=True, weight_offset=1.0))


@pytest.mark.parametrize("row", STACK_CPU_ROWS, ids=lambda r: r.id)
def test_stack_reference_impls_agree_with_trainnorm_and_fp64(row):
    """trainnorm's CPU path and the reference the eager and compiled peers time do the
    row's math: h = f32(x) + r kept in float32, y = x_hat * (1 + w) in bf16, dx in h's
    dtype, against the float64 formula."""
    d = impls.make_row_data(row, "cpu")
    assert d.x.dtype == d.dy.dtype == torch.bfloat16
    stream = torch.float32 if row.r32 else torch.bfloat16
    assert d.stream_dtype == stream and (d.r is None or d.r.dtype == d.dh.dtype == stream)
    if row.weight_offset:
        assert d.w.float().abs().mean() < 0.3          # zero-centred: the scale is 1 + w
    y64, rstd64, h_ref = reference.forward_fp64(d.x, d.w, impls.EPS, d.r, weight_offset=row.weight_offset)
    ys = {}
    for impl in (impls.Trainnorm(True), impls.Trainnorm(False), impls.Eager(),
                 impls.Compiled("default", backend="aot_eager")):
        impl.begin_row(d)
        y, rstd, h = impl.forward(d)
        dx, dw = impl.backward(d, (y, rstd, h))
        err, dtype = impls.dw_check(impl, d)
        impl.end_row()
        assert y.dtype == torch.bfloat16 and h.dtype == stream and dx.dtype == stream, impl.name
        assert torch.equal(h, h_ref), impl.name
        torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0, msg=impl.name)
        torch.testing.assert_close(y.double(), y64, rtol=8e-3, atol=1e-2, msg=impl.name)
        dx64, dw64 = reference.backward_fp64(d.dy, h, d.w, rstd, d.dh, weight_offset=row.weight_offset)
        tol = 1e-4 if stream == torch.float32 else 1e-2
        torch.testing.assert_close(dx.double(), dx64, rtol=tol, atol=tol, msg=impl.name)
        torch.testing.assert_close(dw.double(), dw64, rtol=1e-4, atol=1e-4, msg=impl.name)
        assert dtype == "float32" and err < 0.05, (impl.name, err)
        ys[impl.name] = y
    # the compiled reference is the eager one; trainnorm within one bf16 rounding of it
    assert torch.equal(ys["torch-compile"], ys["eager"])
    torch.testing.assert_close(ys["trainnorm"].float(), ys["eager"].float(), rtol=8e-3, atol=8e-3)


def test_stack_dw_check_takes_the_rows_stream():
    d = impls.make_row_data(Row(64, 9, residual=True, r32=True), "cpu")
    y, rstd, h = impls.ref_forward_residual(d.x, d.w, d.r)
    # dw depends on the float32 stream (not on a weight offset)
    ref32 = impls.reference_dw(d.dy, h, d.w, rstd, d.dh)
    assert not torch.equal(ref32, impls.reference_dw(d.dy, h.bfloat16(), d.w, rstd, d.dh))
    torch.testing.assert_close(ref32, impls.reference_dw(d.dy, h, d.w, rstd, d.dh, weight_offset=1.0),
                               rtol=0, atol=0)

    class RoundedStream(impls.Eager):
        name = "rounded"

        def saved(self, d, state):
            return state[2].bfloat16(), state[1]

    with pytest.raises(ValueError, match="float32"):
        impls.dw_check(RoundedStream(), d)
    assert impls.dw_check(impls.Eager(), d)[0] < 0.05


class StubQuackStack(StubQuack):
    """StubQuack with the keywords of QuACK versions that have a float32 residual stream
    and weight_offset; records what the adapters pass."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def rmsnorm_fwd(self, x, w, residual=None, eps=1e-6, store_rstd=False, residual_dtype=None,
                    weight_offset=0.0):
        self.calls.append(("fwd", residual_dtype, weight_offset))
        if residual is not None:
            assert residual_dtype in (None, residual.dtype)
            y, rstd, h = impls.ref_forward_residual(x, w, residual, weight_offset)
        else:
            (y, rstd), h = impls.ref_forward(x, w, weight_offset), x
        return y, h, rstd

    def bwd_partials(self, x, w, dout, rstd, dresidual_out=None, sm_count=0, weight_offset=0.0):
        self.calls.append(("bwd", None, weight_offset))
        dx, _ = impls.ref_backward(dout, x, w, rstd, dresidual_out, weight_offset)
        terms = dout.float() * (x.float() * rstd.float()[:, None])
        return dx, torch.stack([c.sum(0) for c in terms.chunk(sm_count, dim=0)])

    def rmsnorm_bwd(self, x, w, dout, rstd, dresidual_out=None, has_residual=False, weight_offset=0.0):
        dx, partials = self.bwd_partials(x, w, dout, rstd, dresidual_out, 3, weight_offset=weight_offset)
        return dx, partials.sum(0).to(w.dtype), None, dx if has_residual else None


class StubLigerOps:
    """liger_kernel.ops.rms_norm's two functions (documented signatures), computed by the
    reference; records the offsets they are given."""

    def __init__(self):
        self.offsets = []

    def rms_norm_forward(self, X, W, eps, offset, casting_mode, row_mode):
        self.offsets.append(offset)
        y, rstd = impls.ref_forward(X, W, offset)
        return y, X, rstd, 1024, 4, casting_mode

    def rms_norm_backward(self, dY, X, W, RSTD, offset, casting_mode, BLOCK_SIZE, num_warps, in_place, row_mode,
                          needs_dw=None):
        self.offsets.append(offset)
        dx, dw = impls.ref_backward(dY, X, W, RSTD, None, offset)
        return dx, dw.to(W.dtype)


class StubTE:
    """transformer_engine.pytorch with an RMSNorm module (y = x_hat * (1 + gamma) when
    zero_centered_gamma); records the keywords of each construction."""

    def __init__(self):
        self.kwargs = []
        stub = self

        class RMSNorm(torch.nn.Module):
            def __init__(self, hidden, eps=1e-5, params_dtype=torch.float32, device=None, zero_centered_gamma=False):
                super().__init__()
                stub.kwargs.append({"zero_centered_gamma": zero_centered_gamma})
                self.weight = torch.nn.Parameter(torch.zeros(hidden, dtype=params_dtype, device=device))
                self.offset = 1.0 if zero_centered_gamma else 0.0

            def forward(self, x):
                xf = x.float()
                y = xf * reference.rstd_fp32(xf, impls.EPS).unsqueeze(-1) * (self.weight.float() + self.offset)
                return y.to(x.dtype)

        self.RMSNorm = RMSNorm


def test_stack_peers_run_the_feature_or_skip_with_a_reason():
    rows = by_id()
    f32, offset = rows["H4096 T16384 res r32"], rows["H4096 T16384 1+w"]
    # no residual add: no float32 residual stream either
    for impl in (impls.Liger(), impls.TransformerEngine()):
        why = impl.skip_reason(f32)
        assert why and "residual" in why and "float32" in why, impl.name
        assert impl.skip_reason(offset) is None, impl.name
    assert "zero_centered_gamma" in impls.TransformerEngine().skip_reason(Row(64, 4, weight_offset=0.5))
    # a QuACK whose functions take no weight_offset leaves the (1 + w) rows out, with a reason
    old, new = StubQuack(), StubQuackStack()
    for cls in (impls.Quack, impls.QuackF32dw):
        impl = cls()
        impl.qr, impl.bwd_partials = old, old.bwd_partials
        assert "weight_offset" in impl.skip_reason(offset) and impl.skip_reason(f32) is None, cls.name
        impl.qr, impl.bwd_partials = new, new.bwd_partials
        assert impl.skip_reason(offset) is None and impl.skip_reason(f32) is None, cls.name

    # what the peers are given, and their dw on small rows of each kind (CPU stubs)
    for row in (Row(64, 8, residual=True, r32=True), Row(64, 8, weight_offset=1.0)):
        d = impls.make_row_data(row, "cpu")
        for cls in (impls.Quack, impls.QuackF32dw):
            new.calls.clear()
            impl = cls()
            impl.qr, impl.bwd_partials = new, new.bwd_partials
            err, dtype = impls.dw_check(impl, d)
            # quack casts dw to the bf16 weight's dtype; quack-f32dw sums its float32 partials
            if cls is impls.QuackF32dw:
                assert dtype == "float32" and err < 0.5, (row.id, err)
            else:
                assert dtype == "bfloat16", row.id
            fwd = [c for c in new.calls if c[0] == "fwd"]
            assert fwd == [("fwd", torch.float32 if row.r32 else None, row.weight_offset)], cls.name
            assert [c[2] for c in new.calls if c[0] == "bwd"] == [row.weight_offset], cls.name
            _, _, h = impl.forward(d)
            dx, _ = impl.backward(d, impl.forward(d))
            assert h.dtype == dx.dtype == d.stream_dtype, cls.name
        if row.r32:
            continue
        # Liger and Transformer Engine return dw in the bf16 weight's dtype: held to bf16 rounding here
        y_ref, rstd_ref = impls.ref_forward(d.x, d.w, 1.0)
        dw_ref = impls.reference_dw(d.dy, d.x, d.w, rstd_ref).float()
        liger = impls.Liger()
        liger.ops = StubLigerOps()
        liger.begin_row(d)
        assert torch.equal(liger.forward(d)[0], y_ref) and liger.ops.offsets == [1.0]
        dw, _, _ = liger.compute_dw(d)
        assert liger.ops.offsets == [1.0] * 3 and dw.dtype == torch.bfloat16
        torch.testing.assert_close(dw.float(), dw_ref, rtol=1e-2, atol=1e-2)
        te = impls.TransformerEngine()
        te.te = StubTE()
        te.begin_row(d)
        assert te.te.kwargs == [{"zero_centered_gamma": True}]
        assert torch.equal(te.forward(d), y_ref)
        dw, _, _ = te.compute_dw(d)
        torch.testing.assert_close(dw.float(), dw_ref, rtol=1e-2, atol=1e-2)
        te.begin_row(impls.make_row_data(Row(64, 8), "cpu"))
        assert te.te.kwargs[-1] == {"zero_centered_gamma": False}


def stack_result():
    """The H4096 T16384 quartet, fwd and bwd: the float32 stream at 1.5x (fwd) and 1.6x (bwd) its pair's
    time, (1 + w) at 1.0x and 1.1x; trainnorm-fast 0.8x of det throughout, one peer."""
    rows = by_id()
    times = {("H4096 T16384 res", "fwd"): 100.0, ("H4096 T16384 res r32", "fwd"): 150.0,
             ("H4096 T16384 res", "bwd"): 200.0, ("H4096 T16384 res r32", "bwd"): 320.0,
             ("H4096 T16384", "fwd"): 60.0, ("H4096 T16384 1+w", "fwd"): 60.0,
             ("H4096 T16384", "bwd"): 100.0, ("H4096 T16384 1+w", "bwd"): 110.0}
    ms = []
    for (rid, op), us in times.items():
        ms += [M("trainnorm", us, 0.2, "float32", op=op, row=rid), M("trainnorm-fast", 0.8 * us, 0.3, "float32",
                                                                       op=op, row=rid),
               M("torch-compile", 2 * us, 0.5, "float32", op=op, row=rid)]
    used = [rows[i] for i in ("H4096 T16384", "H4096 T16384 res", "H4096 T16384 res r32", "H4096 T16384 1+w")]
    return BenchResult({"gpu": "NVIDIA H100"}, {}, used, ["fwd", "bwd"],
                       ["trainnorm", "trainnorm-fast", "torch-compile"], 4.0e12, ms)


def test_stack_table_sets_each_feature_row_against_its_pair():
    res = stack_result()
    costs = {(e["row"], e["op"]): e for e in report.stack_costs(res)}
    assert set(costs) == {(r, op) for r in ("H4096 T16384 res r32", "H4096 T16384 1+w") for op in ("fwd", "bwd")}
    f32 = costs[("H4096 T16384 res r32", "fwd")]
    assert f32["pair"] == "H4096 T16384 res" and f32["det_vs_pair"] == pytest.approx(1.5)
    assert f32["fast_vs_pair"] == pytest.approx(1.5)
    rows = by_id()
    fb, pb = shapes.op_bytes(rows["H4096 T16384 res r32"], "fwd"), shapes.op_bytes(rows["H4096 T16384 res"], "fwd")
    assert f32["bytes_vs_pair"] == pytest.approx(fb / pb)
    assert f32["det_floor_pct"] == pytest.approx(100 * fb / 4e12 * 1e6 / 150.0)
    assert f32["pair_det_floor_pct"] == pytest.approx(100 * pb / 4e12 * 1e6 / 100.0)
    assert costs[("H4096 T16384 1+w", "bwd")]["det_vs_pair"] == pytest.approx(1.1)
    assert costs[("H4096 T16384 1+w", "bwd")]["bytes_vs_pair"] == 1.0
    md = report.render_markdown(res)
    assert "## Training-stack features against their bf16 rows (trainnorm)" in md
    pct = lambda b, us: f"{100 * b / 4e12 * 1e6 / us:.0f}%"   # noqa: E731
    assert (f"| H4096 T16384 res r32 | fwd | H4096 T16384 res | {fb / pb:.2f}x | 150.00 ({pct(fb, 150.0)}) "
            f"| 100.00 ({pct(pb, 100.0)}) | 1.50x | 120.00 ({pct(fb, 120.0)}) | 80.00 ({pct(pb, 80.0)}) "
            f"| 1.50x |") in md
    bb = shapes.op_bytes(rows["H4096 T16384"], "bwd")
    assert (f"| H4096 T16384 1+w | bwd | H4096 T16384 | 1.00x | 110.00 ({pct(bb, 110.0)}) "
            f"| 100.00 ({pct(bb, 100.0)}) | 1.10x |") in md
    # the summary's training-stack group: the three stack rows (the plain pair is a seed row)
    assert "| training stack | fwd | 3 | 0 | 2.00x |" in md and "| 78-shape list | fwd | 1 | 0 | 2.00x |" in md
    data = json.loads(json.dumps(report.to_json(res), allow_nan=False))
    assert {(e["row"], e["op"]) for e in data["stack"]} == set(costs)
    back = report.from_json(data)
    assert [r.id for r in back.rows] == [r.id for r in res.rows] and back.rows[2].r32
    # a pair that was not timed: the feature row's numbers, dashes for the pair's
    res.measurements = [m for m in res.measurements if m.row != "H4096 T16384 res"]
    md = report.render_markdown(res)
    assert f"| H4096 T16384 res r32 | fwd | H4096 T16384 res | {fb / pb:.2f}x | 150.00 ({pct(fb, 150.0)}) | — | — |" in md
    # no stack rows, no stack section
    assert "Training-stack" not in report.render_markdown(fake_result([("H4096 T1024", "bwd", 1.2)]))
    assert report.stack_table(fake_result([("H4096 T1024", "bwd", 1.2)])) == []
