"""trainnorm.dev.tune's table writer: a sweep writes its entries into a copy of the measured
table (configs/sm_90.json) through configs.table and keeps every other entry and its notes."""
import copy
import json

import pytest

from trainnorm import configs, plan
from trainnorm.configs import BwdConfig, FwdConfig
from trainnorm.configs import table as tables
from trainnorm.dev import tune
from trainnorm.variant import Variant


def _as_stored(fields: dict) -> dict:
    """A config's fields as the raw JSON reads them back (tuples as lists)."""
    return json.loads(json.dumps(fields))


def stub_timer(calls: list, time_of):
    """A stand-in for tune.time_fns: runs each candidate once (through the kernels), records
    its name in calls and reports time_of(name, position) us."""
    def fake_time(fns, flush, passes=3, samples=8, captures=1):
        out = {}
        for i, (name, fn) in enumerate(fns.items()):
            fn()
            calls.append(name)
            out[name] = time_of(name, i)
        return out
    return fake_time


def _sm90() -> dict:
    with open(tables.path("sm_90")) as f:
        return json.load(f)


def _entries(table: dict) -> dict:
    return {(op, e["hidden"], e["elt"], e["kind"]): e for op in ("forward", "backward") for e in table[op]}


def _reread(path) -> dict:
    # what table.load does: the file parsed as JSON
    with open(path) as f:
        return json.load(f)


def test_written_entry_keeps_the_others(tmp_path):
    original = _sm90()
    table = copy.deepcopy(original)
    # replace a measured entry, and add a width the table does not hold
    cfg = BwdConfig.from_fields(block_m=2, block_n=4096, num_warps=8, min_rows_per_chunk=2, max_chunks=264,
                                ctas_per_sm=4, tma_stages=4, atomic_min_rows=tune.NEVER)
    tune.write_entry(table, "backward", 4096, "plain", cfg, ["bm2 w8 tma4 c4 max264: T1024 17.0 us"])
    new = FwdConfig.from_fields(block_m=4, block_n=128, num_warps=4)
    tune.write_entry(table, "forward", 96, "weight_fp32", new, ["bm4 w4: T1 4.0 us"])
    out = tmp_path / "sm_90.json"
    tables.save(table, str(out))
    got = _reread(out)

    assert {k: v for k, v in got.items() if k not in ("forward", "backward")} == \
        {k: v for k, v in original.items() if k not in ("forward", "backward")}      # arch, method, ...
    before, after = _entries(original), _entries(got)
    changed = {("backward", 4096, 2, "plain"), ("forward", 96, 2, "weight_fp32")}
    assert set(after) == set(before) | changed
    for key, e in before.items():
        if key not in changed:
            assert after[key] == e, key              # fields and notes, as they were
    assert tables.to_config("backward", after[("backward", 4096, 2, "plain")]) == cfg
    assert after[("backward", 4096, 2, "plain")]["notes"] == ["bm2 w8 tma4 c4 max264: T1024 17.0 us"]
    assert tables.to_config("forward", after[("forward", 96, 2, "weight_fp32")]) == new
    # entries stay in the table's order (kind, elt, hidden)
    for op in ("forward", "backward"):
        order = [(e["kind"], e["elt"], e["hidden"]) for e in got[op]]
        assert order == sorted(order)


def test_table_entries_round_trip():
    # every stored entry is what to_entry writes for its config: a sweep that rewrites an entry
    # with the same config leaves the file unchanged
    table = _sm90()
    for op in ("forward", "backward"):
        for e in table[op]:
            cfg = tables.to_config(op, e)
            assert tables.to_entry(op, e["hidden"], e["elt"], e["kind"], cfg, e["notes"]) == e
    assert json.loads(tables.dumps(table)) == table


def test_package_table_not_written_silently(tmp_path):
    with pytest.raises(SystemExit):
        tune.table_path_for(tables.HERE, None, "sm_90")
    assert tune.table_path_for(tables.HERE, tables.path("sm_90"), "sm_90") == tables.path("sm_90")
    assert tune.table_path_for(str(tmp_path), None, "sm_90") == str(tmp_path / "sm_90.json")
    # a run starts from the file already at its path (earlier sweeps), else the package's table
    assert tune.start_table(str(tmp_path / "sm_90.json"), "sm_90") == tables.load("sm_90")
    assert tune.start_table(str(tmp_path / "sm_90.json"), "sm_99")["backward"] == []


def test_choose_small_window():
    t = lambda table, **forms: {"table": table, **forms}
    # one chunk with tma3 pays up to T 16, then the chunked table wins
    res = {1: t(5.0, plain=4.8, tma3=4.9), 4: t(8.0, plain=6.0, tma3=5.5), 16: t(8.5, plain=7.5, tma3=7.0),
           64: t(9.0, plain=9.5, tma3=9.2)}
    best, edge, _ = tune.choose_small(res)
    assert (best, edge) == ("tma3", 16)
    # a count within the noise (T2, 0.9% slower, where the table is one chunk too) does not end it
    res = {1: t(5.54, prefetch=4.80), 2: t(5.65, prefetch=5.70), 4: t(9.36, prefetch=6.78),
           8: t(9.34, prefetch=9.07), 16: t(9.23, prefetch=13.04)}
    assert tune.choose_small(res)[:2] == ("prefetch", 8)
    # past the one-chunk window, the column-slice tile with the best geomean, up to its last win
    res = {1: t(5.0, plain=4.8, cols16x64=5.0, cols16x128=5.0), 4: t(8.0, plain=6.0, cols16x64=6.5, cols16x128=6.4),
           16: t(8.5, plain=9.5, cols16x64=6.8, cols16x128=7.0), 64: t(9.0, plain=20.0, cols16x64=8.0, cols16x128=8.2),
           256: t(12.0, plain=80.0, cols16x64=12.1, cols16x128=12.5), 512: t(14.0, plain=160.0, cols16x64=18.0,
                                                                              cols16x128=19.0)}
    assert tune.choose_small(res)[:2] == ("plain", 4)
    assert tune.choose_slices(res, 4)[:2] == ("cols16x64", 64)
    assert tune.choose_slices(res, 512)[:2] == (None, 0)
    # nowhere faster: no window
    res = {1: t(5.0, plain=5.1), 4: t(8.0, plain=8.5)}
    assert tune.choose_small(res)[:2] == (None, 0)
    # only the single row's loads pay: no window, the loads apply to one-chunk launches
    res = {1: t(5.0, plain=4.5), 4: t(8.0, plain=8.5)}
    assert tune.choose_small(res)[:2] == ("plain", 0)
    # one chunk beats the chunked table up to T 8, but split-role slices beat it from T 4 (the
    # H200 sweep of H 4096): the one-chunk window ends at T 2, the slices take over from there
    res = {1: t(5.52, prefetch=4.99, cols64x32s=5.66), 2: t(6.02, prefetch=5.66, cols64x32s=6.11),
           4: t(9.09, prefetch=6.80, cols64x32s=5.78), 8: t(9.34, prefetch=9.12, cols64x32s=5.79),
           16: t(9.63, prefetch=13.25, cols64x32s=6.00)}
    assert tune.choose_small(res)[:2] == ("prefetch", 8)
    assert tune.best_slices(res) == "cols64x32s" and tune.choose_slices(res, 0)[0] is None     # T1 slower
    assert tune.choose_small(res, "cols64x32s")[:2] == ("prefetch", 2)
    assert tune.choose_slices(res, 2)[:2] == ("cols64x32s", 16)


def test_rows_candidates_keep_the_column_layout():
    fwd = lambda bm, bn, nw, **kw: FwdConfig.from_fields(block_m=bm, block_n=bn, num_warps=nw, **kw)
    # 16-byte vectors of a row whatever the rows: every count up to 64 elements a thread
    assert tune.rows_candidates(fwd(2, 4096, 8), 4096) == [1, 2, 4]
    assert tune.rows_candidates(fwd(2, 512, 2), 512) == [1, 2, 4, 8]
    # a tile holding fewer elements than threads x vector keeps its narrower vector: only itself
    assert tune.rows_candidates(fwd(4, 64, 2), 64) == [4]
    assert tune.rows_candidates(fwd(4, 256, 4), 256, elt=4) == [2, 4, 8, 16, 32]      # float32: 4 a vector
    # rows walked in column tiles: every tile of a row in flight, 64 elements a thread at most
    assert tune.rows_candidates(fwd(1, 2048, 8), 5120) == [1, 2]


def test_choose_rows():
    t = {1: {1: 4.4, 2: 4.5, 4: 4.6}, 16: {1: 4.9, 2: 5.5, 4: 5.8}, 1024: {1: 10.1, 2: 10.3, 4: 9.7},
         65536: {1: 284.0, 2: 268.0, 4: 261.0}}
    # the fewest rows where they pay, the most from T 1024 on, up to any count; the tile keeps its own
    assert tune.choose_rows(t, 2) == ((16, 1), (tune.ALWAYS, 4))
    # within the noise of the entry's own count, the entry's own stays
    t = {1: {1: 4.46, 2: 4.48}, 16: {1: 4.83, 2: 4.90}, 65536: {1: 45.4, 2: 38.9}}
    assert tune.choose_rows(t, 2) == ()
    # a count that pays only in the middle: windows around it, the entry's own past the last
    t = {1: {1: 4.5, 2: 4.5}, 16: {1: 4.0, 2: 5.0}, 256: {1: 6.0, 2: 5.0}, 4096: {1: 5.0, 2: 6.0}}
    assert tune.choose_rows(t, 2) == ((1, 2), (16, 1), (256, 2), (tune.ALWAYS, 1))
    assert tune.choose_rows({1: {1: 4.0, 2: 5.0}, 16: {1: 5.0, 2: 5.0}}, 2) == ((1, 1),)


def test_rows_block_m_checked_and_stored():
    base = FwdConfig.from_fields(block_m=4, block_n=4096, num_warps=8)
    cfg = base.replace(rows_block_m=[[64, 1], [512, 2]])
    assert cfg.rows_block_m == ((64, 1), (512, 2))
    assert [cfg.tile_rows(r) for r in (1, 64, 65, 512, 513, 10 ** 6)] == [1, 1, 2, 2, 4, 4]
    assert base.tile_rows(1) == 4
    for bad in ([[64, 3]], [[512, 1], [64, 2]], [[0, 1]], [[64]]):
        with pytest.raises(ValueError, match="rows_block_m"):
            base.replace(rows_block_m=bad)
    entry = tables.to_entry("forward", 4096, 2, "plain", cfg, ["n"])
    assert entry["schedule"] == {"rows_block_m": [[64, 1], [512, 2]]}
    assert json.loads(json.dumps(entry)) == entry and tables.to_config("forward", entry) == cfg


def test_held_tile_checked_and_stored():
    base = FwdConfig.from_fields(block_m=2, block_n=1024, num_warps=8)
    cfg = base.replace(held_tile=[1, 4])
    assert cfg.held_tile == (1, 4) and base.held_tile == ()
    for bad in ([1, 8], [2, 4], [1, 3], [1], [0, 4]):     # other warps a row, not powers of two
        with pytest.raises(ValueError, match="held_tile"):
            base.replace(held_tile=bad)
    entry = tables.to_entry("forward", 5120, 2, "weight_fp32", cfg, ["n"])
    assert entry["schedule"] == {"held_tile": [1, 4]}
    assert json.loads(json.dumps(entry)) == entry and tables.to_config("forward", entry) == cfg


def test_rows_max_chunks_checked_stored_and_chunked():
    base = BwdConfig.from_fields(block_m=2, block_n=4096, num_warps=16, min_rows_per_chunk=16, max_chunks=256)
    cfg = base.replace(rows_max_chunks=[[16384, 132]])
    assert cfg.rows_max_chunks == ((16384, 132),)
    assert [cfg.tile.chunks_at_most(r) for r in (1, 16384, 16385)] == [132, 132, 256]
    # up to the window's rows at most 132 chunks, past it 256; under 16 rows a chunk as before
    assert plan.chunking(cfg, 4096) == (128, 32) and plan.chunking(base, 4096) == (256, 16)
    assert plan.chunking(cfg, 16384) == (131, 126) and plan.chunking(base, 16384) == (256, 64)
    assert plan.chunking(cfg, 65536) == plan.chunking(base, 65536) == (256, 256)
    assert plan.chunking(cfg, 1024) == plan.chunking(base, 1024) == (64, 16)
    for bad in ([[64, 0]], [[512, 8], [64, 16]], [[0, 8]], [[64]]):
        with pytest.raises(ValueError, match="rows_max_chunks"):
            base.replace(rows_max_chunks=bad)
    entry = tables.to_entry("backward", 4096, 2, "plain", cfg, ["n"])
    assert entry["tile"]["rows_max_chunks"] == [[16384, 132]]
    assert json.loads(json.dumps(entry)) == entry and tables.to_config("backward", entry) == cfg


def test_default_backward_takes_few_chunks_at_4096_columns_up_to_16384_rows():
    # rows of 2049-4096 columns (the rule's 4096-column tile): at most 132 chunks up to 16384 rows,
    # 256 past them; other tiles keep their one cap (the rule's measurements, configs.default_backward)
    for hidden in (2304, 3584, 4000):
        t = configs.default_backward(hidden, 2).tile
        assert (t.block_n, t.max_chunks, t.rows_max_chunks) == (4096, 256, ((16384, 132),)), hidden
    for hidden in (1024, 1792, 5376):
        assert configs.default_backward(hidden, 2).tile.rows_max_chunks == (), hidden


def test_gated_backward_halves_each_threads_share():
    # a width without a gated entry: the plain tile with half the rows (the table's H2048 and
    # H512 entries, the rules' tiles), or, where it has one row, twice the warps up to 16
    # (the table's H5120 entry); one row at 16 warps stays (configs.gated_from_plain)
    for hidden, plain, gated in ((1792, (2, 8), (1, 8)), (2304, (2, 16), (1, 16)), (3584, (2, 16), (1, 16)),
                                 (5376, (1, 16), (1, 16)), (1024, (2, 4), (1, 4)), (2048, (4, 8), (2, 8)),
                                 (512, (8, 4), (4, 4)), (5120, (1, 8), (1, 16))):
        p = configs.backward_config(configs.backward_key(hidden, 2)).tile
        g = configs.backward_config(configs.backward_key(hidden, 2, gated=True)).tile
        assert ((p.block_m, p.num_warps), (g.block_m, g.num_warps)) == (plain, gated), hidden
        assert (g.block_n, g.rows_max_chunks, g.min_rows_per_chunk) == (p.block_n, p.rows_max_chunks,
                                                                        p.min_rows_per_chunk), hidden


def test_gated_forward_halves_each_threads_share():
    # a gated forward (no table entry holds one): the plain tile with half its rows; a one-row
    # tile keeps its warps up to GATED_ONE_ROW_ELEMS elements a thread, past them twice the warps
    # (configs.gated_forward_from_plain)
    assert configs.GATED_ONE_ROW_ELEMS == 32
    for hidden, plain, gated in ((4096, (2, 8), (1, 8)), (1024, (4, 4), (2, 4)), (2304, (1, 4), (1, 4)),
                                 (3584, (1, 4), (1, 4)), (5376, (1, 8), (1, 8)), (6144, (1, 4), (1, 8)),
                                 (2048, (1, 4), (1, 4))):
        p = configs.forward_config(configs.forward_key(hidden, 2, 2))
        g = configs.forward_config(configs.forward_key(hidden, 2, 2, gated=True))
        assert ((p.tile.block_m, p.tile.num_warps), (g.tile.block_m, g.tile.num_warps)) == (plain, gated), hidden
        assert g.tile.block_n == p.tile.block_n and g.schedule.rows_block_m == (), hidden
    # where the rule is the plain tile the probe times it once
    assert "plain tile" not in tune.gated_forward_edits(2304) and "w*2" in tune.gated_forward_edits(2304)


def test_atomic_min_rows():
    # (det us, atomic us, rows) per T: from the first count from which the atomic form is never slower
    assert tune.atomic_min_rows({256: (9.0, 12.0, 0), 1024: (20.0, 19.0, 0), 4096: (50.0, 49.0, 0)}, 1) == 1024
    assert tune.atomic_min_rows({1024: (20.0, 19.0, 0), 4096: (50.0, 49.0, 0)}, 24) == 0
    assert tune.atomic_min_rows({1024: (20.0, 19.0, 0), 4096: (50.0, 51.0, 0)}, 24) == tune.NEVER
    assert tune.atomic_min_rows({1024: (20.0, 21.0, 0), 4096: (50.0, 49.0, 0)}, 24) == 4096 * 24


def test_sweeps_end_to_end(tmp_path, monkeypatch, device):
    # the sweeps' plumbing on tiny sizes with a stub timer (every candidate still runs once,
    # through the kernels, inside its configs.override): each writes its entries into one table
    # file, which keeps every other entry and reads back as configs the package accepts
    calls = []
    monkeypatch.setattr(tune, "time_fns", stub_timer(calls, lambda name, i: 10.0 if name == "table" else 1.0 + i))
    monkeypatch.setattr(tune, "SMALL_T", (1, 4))
    monkeypatch.setattr(tune, "FWD_T", (1, 4))
    monkeypatch.setattr(tune, "FWD_W32_T", (2, 4))
    monkeypatch.setattr(tune, "FWD_W32_WIDTHS", (64,))
    monkeypatch.setitem(tune.SWEEP_TILES, 64, [(16, 4)])
    monkeypatch.setattr(tune, "SWEEP_T", (4,))
    monkeypatch.setattr(tune, "SWEEP_LOADS", ((False, 0),))
    monkeypatch.setattr(tune, "SWEEP_SCHED", [(2, 132), (4, 264)])
    path = str(tmp_path / "sm_90.json")
    original = _sm90()
    run = tune.Run(table=tune.start_table(path, "sm_90"), table_path=path, out=str(tmp_path), device=device,
                   log=lambda s: None)

    tune.tune_bwd(run, [64])
    tune.tune_small(run, [64])
    small = copy.deepcopy(tune.find_entry(run.table, "backward", 64, "plain"))
    tune.tune_bwd(run, [64])            # again: the small-T windows and their notes stay
    tune.tune_fwd(run, [64])
    got = _reread(path)
    after = _entries(got)

    # the backward sweep: the stub ties the first candidate of each group; the name breaks the tie
    # (dw_2d off); the atomic form (2.0 against 1.0 us) never pays
    bwd = tables.to_config("backward", after[("backward", 64, 2, "plain")])
    assert bwd.tile == BwdConfig.from_fields(block_m=16, block_n=64, num_warps=4, min_rows_per_chunk=16,
                                             max_chunks=132).tile
    assert (bwd.ctas_per_sm, bwd.prefetch, bwd.tma_stages, bwd.atomic_min_rows) == (2, False, 0, tune.NEVER)
    # then the small-T sweep: one chunk with plain loads fastest at both counts, no slice window past it
    assert (bwd.direct_max_rows, bwd.direct_prefetch, bwd.direct_tma_stages, bwd.slices_max_rows) == (4, False, 0, 0)
    assert after[("backward", 64, 2, "plain")]["windows"] == small["windows"]
    notes = after[("backward", 64, 2, "plain")]["notes"]
    assert notes[0].startswith("bm16 w4 c2 max132: T4 1.0 us") and notes[1].startswith("det/atomic us: T4 1.0/2.0")
    assert notes[2].startswith("small-T windows, one-chunk loads and slice tile kept from the previous entry")
    assert notes[3:] == [n for n in small["notes"] if n.startswith("table/")]
    assert notes[3].startswith("table/one-chunk plain us (the table: the faster of it and cols16x64): T1 7.00/2.00")
    # the forward sweep: bm4 w2, the first candidate, for the plain and the float32-weight entry,
    # each chosen over its kind's row counts
    first = FwdConfig.from_fields(block_m=4, block_n=64, num_warps=2)
    for kind, counts in (("plain", "T1 1.00, T4 1.00 us"), ("weight_fp32", "T2 1.00, T4 1.00 us")):
        assert tables.to_config("forward", after[("forward", 64, 2, kind)]) == first
        assert after[("forward", 64, 2, kind)]["notes"][0].startswith(f"bm4 w2: {counts}")

    # every other entry as it was, notes included
    before = _entries(original)
    assert set(after) - set(before) == {("backward", 64, 2, "plain"), ("forward", 64, 2, "plain"),
                                        ("forward", 64, 2, "weight_fp32")}
    assert all(after[k] == e for k, e in before.items())
    assert got["method"] == original["method"]

    # every candidate ran once per point
    fwd_cands = list(tune.fwd_sweep_candidates(64))
    assert any(c.tma_stages for c in fwd_cands)      # the descriptor forms ran too
    n_bwd = 2 * (2 * 2 + 2)    # twice: (dw_2d off, on) x the two schedules at T 4, then det / atomic
    n_small = 2 * (1 + len(tune.SMALL_LOADS) + len(tune.SMALL_SLICES))
    assert len(calls) == n_bwd + n_small + 2 * 2 * len(fwd_cands)
    assert calls.count("table") == 2 and "cols16x128" in calls
    assert (tmp_path / "sweep-bwd.json").exists() and (tmp_path / "sweep-fwd.json").exists()

    # the written table serves the package: its entries run under configs.override
    import torch

    import trainnorm
    x = torch.randn(3, 64, device=device, dtype=torch.bfloat16)
    w = torch.ones(64, device=device, dtype=torch.bfloat16)
    with configs.override(forward=tune.only(64, "plain", first), backward=tune.only(64, "plain", bwd)):
        y, rstd, _ = trainnorm.rms_norm_forward(x, w)
        dx, dw = trainnorm.rms_norm_backward(torch.ones_like(x), x, w, rstd)
    assert torch.isfinite(dx.float()).all() and torch.isfinite(dw).all()


def test_sweep_rows_end_to_end(tmp_path, monkeypatch, device):
    # --sweep-rows on an H 512 entry (bm2 w2, no windows) under a stub timer that makes one row a
    # tile fastest at T 1 and four from T 4: the entry keeps its tile and gets the windows
    # (1, 1) and (ALWAYS, 4) and a 'rows:' note replacing any earlier one, and the package runs
    # it with the bits of the entry's own tile
    import torch

    import trainnorm
    times = {1: {1: 1.0, 2: 2.0, 4: 3.0, 8: 4.0}, 4: {1: 3.0, 2: 2.0, 4: 1.0, 8: 2.5}}
    seen = []

    def timer(fns, flush, **kw):
        tokens = tune.ROWS_T[len(seen)]
        seen.append(sorted(fns))
        for fn in fns.values():
            fn()
        return {bm: times[tokens][bm] for bm in fns}
    monkeypatch.setattr(tune, "time_fns", timer)
    monkeypatch.setattr(tune, "ROWS_T", (1, 4))
    monkeypatch.setattr(tune, "ROWS_BITS_T", 24)
    path = str(tmp_path / "sm_90.json")
    table = tune.start_table(path, "sm_90")
    entry = tune.find_entry(table, "forward", 512, "plain")
    own = tables.to_config("forward", entry).replace(rows_block_m=())
    tune.write_entry(table, "forward", 512, "plain", own, [n for n in entry["notes"] if not n.startswith("rows:")]
                     + ["rows: an earlier sweep's note"])
    before = copy.deepcopy(tune.find_entry(table, "forward", 512, "plain"))
    run = tune.Run(table=table, table_path=path, out=str(tmp_path), device=device, log=lambda s: None)
    tune.tune_rows(run, [512])
    assert seen == [[1, 2, 4, 8], [1, 2, 4, 8]]
    entry = tune.find_entry(_reread(path), "forward", 512, "plain")
    cfg = tables.to_config("forward", entry)
    assert cfg == own.replace(rows_block_m=((1, 1), (tune.ALWAYS, 4)))
    assert entry["notes"][:-1] == before["notes"][:-1]
    assert entry["notes"][-1].startswith("rows: windows [[1, 1], [1099511627776, 4]] past which the tile's bm2")
    x = torch.randn(37, 512, device=device).to(torch.bfloat16)
    w = torch.randn(512, device=device).to(torch.bfloat16)
    with configs.override(forward=tune.only(512, "plain", own)):
        ref = [trainnorm.rms_norm_forward(x[:n], w)[:2] for n in (1, 37)]
    with configs.override(forward=tune.only(512, "plain", cfg)):
        assert [plan.forward_plan(512, torch.bfloat16, torch.bfloat16, Variant()).block_m(n) for n in (1, 2, 37)] \
            == [1, 4, 4]
        got = [trainnorm.rms_norm_forward(x[:n], w)[:2] for n in (1, 37)]
    for (y0, r0), (y1, r1) in zip(ref, got):
        assert torch.equal(y0, y1) and torch.equal(r0, r1)


def test_probe_defaults_times_the_rules_and_their_edits(tmp_path, monkeypatch, device):
    # --probe-defaults: at widths the table does not hold, the rules' configs and single edits
    # of them each run once through the kernels (a stub timer), agree with the rule's outputs,
    # and land in probe-defaults.json with their fields; no table is written
    monkeypatch.setattr(tune, "time_fns", stub_timer([], lambda name, i: 1.0 + i))
    run = tune.Run(table=tune.start_table(str(tmp_path / "sm_90.json"), "sm_90"), table_path=None,
                   out=str(tmp_path), device=device, log=lambda s: None)
    cases = ((96, 40), (320, 24))          # a two-piece width (256 + 64) and a dw_2d tile
    for hidden, _ in cases:
        assert not any(e["hidden"] == hidden for e in _sm90()["backward"]), "a width the table holds"
    tune.probe_defaults(run, cases)
    raw = json.loads((tmp_path / "probe-defaults.json").read_text())
    for hidden, rows in cases:
        bwd, fwd = tune.default_edits(hidden)
        got = raw[f"bwd H{hidden} rows {rows}"]
        assert set(got["times"]) == set(bwd), "every backward edit agreed with the rule and was timed"
        assert got["configs"]["rule"] == _as_stored(configs.default_backward(hidden, 2).fields())
        assert set(raw[f"fwd H{hidden} rows {rows}"]["times"]) == set(fwd)
        assert {"w/2", "plain loads", "two pieces" if hidden == 96 else "no dw_2d"} <= set(bwd)
    # the forward's edits that keep its bits: rows per tile, descriptor loads, the weight read
    _, fwd = tune.default_edits(96)           # the rule: 32 x 128 at 4 warps, weight read early
    assert {"rows 16", "rows 8", "rows 64", "tma3 c2", "tma3 c4", "weight rows", "weight late"} <= set(fwd)
    assert "weight early" not in fwd and fwd["rows 16"].tile == fwd["rule"].tile
    # the gated forward's rule against the plain tile and its edits, at a width the table holds too
    tune.probe_gated_forward(run, ((4096, 3), (96, 40)))
    raw = json.loads((tmp_path / "probe-defaults.json").read_text())
    for hidden, rows in ((4096, 3), (96, 40)):
        got = raw[f"gated fwd H{hidden} rows {rows}"]
        cands = tune.gated_forward_edits(hidden)
        assert set(got["times"]) == set(cands) and {"rule", "plain tile", "w/2"} <= set(cands)
        if hidden == 4096:    # the rule's one-row tile: two rows a tile at every count, and descriptor loads
            assert {"rows 2", "tma3 c2", "tma3 c4"} <= set(cands)
        # the weight read ahead of the rows and after the sum against the rule's, beside the rows
        assert {"weight early", "weight late"} <= set(cands) and "weight rows" not in cands
        assert cands["weight late"].gate_weight_read == "late" and cands["rule"].gate_weight_read == ""
        assert got["configs"]["rule"] == _as_stored(
            configs.forward_config(configs.forward_key(hidden, 2, gated=True)).fields())
        assert got["configs"]["plain tile"] == _as_stored(configs.forward_config(configs.forward_key(hidden, 2)).fields())
    # the gated backward's config against its edits: at a width the table holds a gated entry
    # for (4096) and at one it derives from the plain rule (96)
    tune.probe_gated_backward(run, ((4096, 3), (96, 40)))
    raw = json.loads((tmp_path / "probe-defaults.json").read_text())
    for hidden, rows in ((4096, 3), (96, 40)):
        got = raw[f"gated bwd H{hidden} rows {rows}"]
        cands = tune.gated_backward_edits(hidden)
        assert set(got["times"]) == set(cands) and {"rule", "w/2"} <= set(cands), hidden
        assert got["configs"]["rule"] == _as_stored(
            configs.backward_config(configs.backward_key(hidden, 2, gated=True)).fields())
    # where the plain tile has 16 warps the rule halves its rows: the plain tile is the edit back
    cands = tune.gated_backward_edits(2304)
    assert (cands["rule"].block_m, cands["rule"].num_warps) == (1, 16)
    assert (cands["plain tile"].block_m, cands["plain tile"].num_warps) == (2, 16) and "bm/2" not in cands
    # a rule holding one masked row (H 5120 in 8192 columns) is timed against the row as two
    # unmasked pieces, read plainly; a width its tile holds exactly (4096) has no pieces
    cands = tune.gated_backward_edits(5120)
    pieces = {k: v for k, v in cands.items() if k.startswith("pieces")}
    assert cands["rule"].block_n == 8192 and len(pieces) == 3
    for cfg in pieces.values():
        assert (cfg.block_m, cfg.block_n, cfg.block_n2, cfg.tma_stages) == (1, 4096, 1024, 0)
        assert cfg.col_tiles(5120) == 1
    assert not any(k.startswith("pieces") for k in tune.gated_backward_edits(4096))
    # one tile wider than 4096 columns: the row walked in 2048-column tiles too, one row a tile
    for hidden in (5120, 8192):
        walks = {k: v for k, v in tune.gated_backward_edits(hidden).items() if k.startswith("walk")}
        assert len(walks) == 4 and all(v.block_n == 2048 and v.block_m == 1 for v in walks.values()), hidden
        assert {v.hold_dw for v in walks.values()} == {False, True}
    assert not any(k.startswith("walk") for k in tune.gated_backward_edits(4096))
    assert not (tmp_path / "sm_90.json").exists()


def test_sweep_weight_end_to_end(tmp_path, monkeypatch, device):
    # --sweep-weight on a one-tile entry (H 512) and a column-tile one (H 5120, three tiles of
    # 2048): every read its form takes is bit-compared and timed; a read faster by more than
    # WEIGHT_NOISE replaces the entry's own with a 'weight:' note, one within it does not
    times = {"early": 1.0, "rows": 1.005, "late": 2.0, "rows held": 0.5, "late held": 3.0}
    seen = []

    def timer(fns, flush, **kw):
        seen.append(sorted(fns))
        for fn in fns.values():
            fn()
        return {n: times[n] for n in fns}
    monkeypatch.setattr(tune, "time_fns", timer)
    monkeypatch.setattr(tune, "ROWS_T", (1, 4))
    monkeypatch.setattr(tune, "ROWS_BITS_T", 24)
    path = str(tmp_path / "sm_90.json")
    table = tune.start_table(path, "sm_90")
    for hidden, cfg in ((512, dict(tma_stages=0, weight_read="early")),
                        (5120, dict(block_n=2048, tma_stages=0, weight_read="", hold_tiles=False))):
        entry = tune.find_entry(table, "forward", hidden, "plain")
        tune.write_entry(table, "forward", hidden, "plain", tables.to_config("forward", entry).replace(**cfg),
                         entry["notes"] + ["weight: an earlier sweep's note"])
    run = tune.Run(table=table, table_path=path, out=str(tmp_path), device=device, log=lambda s: None)
    tune.tune_weight(run, [512, 5120])
    # H 5120's float32-weight entry (five column tiles) is swept too
    assert seen == [["early", "late", "rows"]] * 2 + [["late", "late held", "rows", "rows held"]] * 4
    after = _reread(path)
    one = tune.find_entry(after, "forward", 512, "plain")
    assert tables.to_config("forward", one).weight_read == "early"      # rows within the noise
    cols = tune.find_entry(after, "forward", 5120, "plain")
    cfg = tables.to_config("forward", cols)
    assert (cfg.weight_read, cfg.hold_tiles) == ("rows", True)
    for e, own in ((one, "early"), (cols, "late")):
        assert sum(n.startswith(tune.WEIGHT_NOTE) for n in e["notes"]) == 1
        assert e["notes"][-1].startswith(f"{tune.WEIGHT_NOTE}{'early' if own == 'early' else 'rows held'} (was {own};")


def test_short_candidates_are_captured_as_the_bench_does():
    # the tuner's candidates take the bench's several captures where their rows are short
    from trainnorm.bench import run as bench_run
    assert tune.captures(1, 6144) == tune.captures(256, 6144) == bench_run.ROTATE_CAPTURES > 1
    assert tune.captures(65536, 4096) == 1
    assert tune.captures(1024, 8192) == bench_run.ROTATE_CAPTURES       # 64 MiB at 8 bytes an element
    assert tune.captures(1025, 8192) == 1


def test_probe_chunks_times_the_entry_against_fewer_chunks(tmp_path, monkeypatch, device):
    # --probe-chunks: the table's H 256 entry at 300 rows (38 chunks of 8 rows) against at most
    # 33 chunks there; both run through the kernels (a stub timer), agree with each other up to
    # the reduction order, and land in probe-chunks.json with their fields; no table is written
    monkeypatch.setattr(tune, "time_fns", stub_timer([], lambda name, i: 1.0 + i))
    run = tune.Run(table=tune.start_table(str(tmp_path / "sm_90.json"), "sm_90"), table_path=None,
                   out=str(tmp_path), device=device, log=lambda s: None)
    entry = configs.backward_config(configs.backward_key(256, 2))
    assert any(e["hidden"] == 256 for e in _sm90()["backward"]), "a width the table holds"
    cands = tune.chunk_edits(256, 300)
    assert set(cands) == {"rule", "m33"} and cands["rule"] == entry
    assert plan.chunking(entry, 300)[0] == 38 and plan.chunking(cands["m33"], 300)[0] <= 33
    assert plan.chunking(cands["m33"], 301) == plan.chunking(entry, 301), "the window ends at the case's rows"
    tune.probe_chunks(run, ((256, 300),))
    got = json.loads((tmp_path / "probe-chunks.json").read_text())["chunks bwd H256 rows 300"]
    assert set(got["times"]) == {"rule", "m33"}
    assert got["configs"]["m33"]["rows_max_chunks"] == [[300, 33]]
    assert not (tmp_path / "sm_90.json").exists()
    # a case that takes no more chunks than the smallest cap: the rule alone
    assert set(tune.chunk_edits(256, 64)) == {"rule"}


def test_probe_schedule_times_a_descriptor_entry_against_its_plain_loads(tmp_path, monkeypatch, device):
    # --probe-schedule: a forward entry and the edits that keep its bits, without and with a
    # residual; a descriptor entry (here the H 6144 float32-weight entry, whatever the table
    # holds, made one: one row of 8192 columns, 4 warps, 4 deep, plain loads with a residual)
    # also with plain loads and each weight read. Every edit's y equals the entry's to the
    # bit, so every one is timed
    monkeypatch.setattr(tune, "time_fns", stub_timer([], lambda name, i: 1.0 + i))
    run = tune.Run(table=tune.start_table(str(tmp_path / "sm_90.json"), "sm_90"), table_path=None,
                   out=str(tmp_path), device=device, log=lambda s: None)
    desc = configs.FwdConfig.from_fields(block_m=1, block_n=8192, num_warps=4, tma_stages=4, ctas_per_sm=2,
                                         weight_read="rows", residual_plain=True)
    with configs.override(forward=tune.only(6144, "weight_fp32", desc)):
        tune.probe_schedule(run, ((6144, 3),))
        own = configs.forward_config(configs.forward_key(6144, 2, 4))
    assert own == desc
    raw = json.loads((tmp_path / "probe-schedule.json").read_text())
    for res in ("", " res"):
        got = raw[f"weight_fp32 fwd H6144{res} rows 3"]
        assert set(got["times"]) == {"entry", *tune.schedule_edits(own, 6144)}
        assert {"plain loads", "plain loads weight rows", "plain loads weight late"} <= set(got["times"])
        assert got["configs"]["plain loads weight rows"]["tma_stages"] == 0
        # the entry reads plainly with a residual (residual_plain): its descriptors an edit
        assert own.residual_plain and got["configs"]["residual descriptors"]["residual_plain"] is False
        assert f"plain fwd H6144{res} rows 3" in raw
        # the backward's entry (descriptors 4 deep) against plain loads and the other depths
        bwd = raw[f"plain bwd H6144{res} rows 3"]
        assert set(bwd["times"]) == {"entry", "plain loads", "plain loads prefetch", "tma2", "tma3"}
        assert bwd["configs"]["plain loads prefetch"]["tma_stages"] == 0
    assert not (tmp_path / "sm_90.json").exists()


def test_sweep_fwd_one_kind_at_given_counts(tmp_path, monkeypatch, device):
    # --sweep-fwd --kinds weight_fp32 --tokens 2,5: only the float32-weight entry is swept,
    # over exactly those row counts; the plain entry at the width stays as the table had it
    calls = []
    monkeypatch.setattr(tune, "time_fns", stub_timer(calls, lambda name, i: 1.0 + i))
    monkeypatch.setattr(tune, "FWD_W32_WIDTHS", (64,))
    path = str(tmp_path / "sm_90.json")
    run = tune.Run(table=tune.start_table(path, "sm_90"), table_path=path, out=str(tmp_path), device=device,
                   log=lambda s: None)
    tune.tune_fwd(run, [64], kinds=("weight_fp32",), counts=(2, 5))
    after = _entries(_reread(path))
    assert ("forward", 64, 2, "plain") not in after
    note = after[("forward", 64, 2, "weight_fp32")]["notes"][0]
    assert note.startswith("bm4 w2: T2 1.00, T5 1.00 us"), note
    assert len(calls) == 2 * len(list(tune.fwd_sweep_candidates(64)))


@pytest.mark.parametrize("argv, message", [
    (["--sweep-bwd", "--kinds", "plain"], "--kinds and --tokens need --sweep-fwd or --probe-tiles"),
    (["--sweep-fwd", "--kinds", "gated"], "--kinds: gated is not one of plain, weight_fp32"),
    (["--sweep-fwd", "--tokens", "256,x"], "--tokens: expected comma-separated positive row counts"),
    (["--sweep-fwd", "--tokens", "0"], "--tokens: expected comma-separated positive row counts"),
])
def test_sweep_fwd_arguments_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        tune.parse_args(argv)
    assert message in capsys.readouterr().err


def test_sweep_fwd_arguments_parsed():
    args = tune.parse_args(["--sweep-fwd", "--kinds", "weight_fp32", "--tokens", "256,4096"])
    assert (args.kinds, args.tokens) == (("weight_fp32",), (256, 4096))
    args = tune.parse_args(["--sweep-fwd"])
    assert (args.kinds, args.tokens) == (tune.FWD_KINDS, None)


def test_probe_tiles_times_entry_tiles_and_reference(tmp_path, monkeypatch, device):
    # --probe-tiles: per point the entry, each named tile and torch.compile of the reference
    # (aot_eager here), without and with a residual; raw times saved, no table written
    calls = []
    monkeypatch.setattr(tune, "time_fns", stub_timer(calls, lambda name, i: 2.0 if name == tune.REFERENCE else 1.0 + i))
    lines = []
    run = tune.Run(table=tune.start_table(str(tmp_path / "sm_90.json"), "sm_90"), out=str(tmp_path), device=device,
                   log=lines.append)
    tune.probe_tiles(run, [64], ("plain",), ("bm8 w2", "bm16 w4"), counts=(3,), backend="aot_eager")
    entry = tune.fwd_name(tune.fwd_key(tune.config_in(run.table, "forward", 64, "plain"), 64))
    names = [f"entry {entry}", "bm8 w2", "bm16 w4", tune.REFERENCE]
    assert calls == names * 2
    assert not (tmp_path / "sm_90.json").exists()
    raw = _reread(tmp_path / "probe-tiles.json")["plain 64"]
    assert sorted(raw) == ["T3", "res T3"] and sorted(raw["T3"]) == sorted(names)
    assert f"plain H64 res T3: entry {entry} 1.00 (2.000x), bm8 w2 2.00 (1.000x)" in "\n".join(lines)


@pytest.mark.parametrize("argv, message", [
    (["--probe-tiles", "--tiles", "bm8 w2"], "--probe-tiles needs --hidden and --tiles"),
    (["--probe-tiles", "--hidden", "64", "--tiles", "bm8 w2,bm3 w5"], "--tiles: not a forward tile at H 64: bm3 w5"),
    (["--sweep-fwd", "--tiles", "bm8 w2"], "--tiles needs --probe-tiles"),
    (["--probe-tiles", "--hidden", "64", "--tiles", "bm8 w2", "--cases", "64x4"], "--cases needs"),
])
def test_probe_tiles_arguments_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        tune.parse_args(argv)
    assert message in capsys.readouterr().err


def test_probe_tiles_arguments_parsed():
    args = tune.parse_args(["--probe-tiles", "--hidden", "6144", "--kinds", "weight_fp32", "--tokens", "256",
                            "--tiles", "bm2 w8 pieces, bm1 w16 n2048 held"])
    assert (args.kinds, args.tokens, args.tiles) == (("weight_fp32",), (256,), ("bm2 w8 pieces", "bm1 w16 n2048 held"))
