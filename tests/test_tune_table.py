"""tools/tune.py's table writer: a sweep rewrites its own table of configs/tuned.py and keeps the rest."""
import importlib.util
import os
import sys

from trainnorm.configs import BwdConfig, tuned

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tune():
    sys.path.insert(0, TOOLS)
    try:
        return _load(os.path.join(TOOLS, "tune.py"), "tune_under_test")
    finally:
        sys.path.remove(TOOLS)


def test_write_tuned_replaces_one_table(tmp_path):
    # a width no table has, so the other entries must come through untouched
    tune = _tune()
    assert (96, 2) not in tuned.BWD and (96, 2) not in tuned.BWD_GATED
    cfg = BwdConfig(16, 128, 4, min_rows_per_chunk=16, max_chunks=264, ctas_per_sm=2, atomic_min_rows=tuned.NEVER)
    chosen = {96: dict(cfg=cfg, note="bm16 w4 c2 max264: T1024 9.9 us", edge_note="det/atomic us: T1024 9.9/12.0")}
    tune.write_tuned(chosen, str(tmp_path / "gated.py"), gated=True)
    tune.write_tuned(chosen, str(tmp_path / "plain.py"), gated=False)
    gated = _load(str(tmp_path / "gated.py"), "tuned_gated")
    plain = _load(str(tmp_path / "plain.py"), "tuned_plain")
    assert gated.BWD == tuned.BWD and gated.FWD == tuned.FWD
    assert BwdConfig(**gated.BWD_GATED.pop((96, 2))) == cfg and gated.BWD_GATED == tuned.BWD_GATED
    assert plain.BWD_GATED == tuned.BWD_GATED
    assert BwdConfig(**plain.BWD.pop((96, 2))) == cfg and plain.BWD == tuned.BWD
    assert "T1024 9.9 us" in (tmp_path / "gated.py").read_text()


def test_tables_written_to_one_path_add_up(tmp_path):
    # the forward, float32-weight and one-chunk sweeps each replace their own table of one file
    tune = _tune()
    out = str(tmp_path / "tuned.py")
    tune.write_table(out, "FWD", "FWD: dict = {\n    (512, 2): dict(block_m=1, block_n=512, num_warps=4),\n}\n")
    tune.write_table(out, "FWD_W32", "FWD_W32: dict = {\n}\n")
    tune.write_table(out, "BWD_DIRECT", "BWD_DIRECT: dict = {\n    (4096, 2): dict(direct_max_rows=16),\n}\n")
    got = _load(out, "tuned_summed")
    assert got.FWD == {(512, 2): dict(block_m=1, block_n=512, num_warps=4)}
    assert got.FWD_W32 == {} and got.BWD_DIRECT == {(4096, 2): dict(direct_max_rows=16)}
    assert got.BWD == tuned.BWD and got.BWD_GATED == tuned.BWD_GATED


def test_choose_small_window():
    tune = _tune()
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
    assert tune.choose_cols(res, 4)[:2] == ("cols16x64", 64)
    assert tune.choose_cols(res, 512)[:2] == (None, 0)
    # nowhere faster: no entry
    res = {1: t(5.0, plain=5.1), 4: t(8.0, plain=8.5)}
    assert tune.choose_small(res)[:2] == (None, 0)
    # only the single row's loads pay: no window, the loads apply to one-chunk launches
    res = {1: t(5.0, plain=4.5), 4: t(8.0, plain=8.5)}
    assert tune.choose_small(res)[:2] == ("plain", 0)


def test_small_and_fwd_sweeps_end_to_end(tmp_path, monkeypatch, device):
    # the sweeps' plumbing on tiny sizes with a stub timer (every candidate still runs once,
    # through the kernels): each writes a loadable table whose entries the configs accept
    import argparse

    from trainnorm import configs
    tune = _tune()
    calls = []

    def fake_time(fns, flush, passes=3, samples=8):
        out = {}
        for i, (name, fn) in enumerate(fns.items()):
            fn()
            calls.append(name)
            out[name] = 10.0 if name == "table" else 1.0 + i
        return out

    monkeypatch.setattr(tune, "time_fns", fake_time)
    monkeypatch.setattr(tuned, "BWD_DIRECT", dict(tuned.BWD_DIRECT))    # the sweep empties it while it runs
    monkeypatch.setattr(tune, "SMALL_T", (1, 4))
    monkeypatch.setattr(tune, "FWD_T", (1, 4))
    monkeypatch.setattr(tune, "FWD_W32_WIDTHS", (64,))
    args = argparse.Namespace(out=str(tmp_path), hidden="64")
    try:
        tune.main_small(args, device, None, lambda s: None)
        tune.main_fwd(args, device, None, lambda s: None)
    finally:
        configs.forward_config.cache_clear()
        configs.backward_config.cache_clear()
    got = _load(str(tmp_path / "tuned.py"), "tuned_swept")
    # the stub makes one chunk with plain loads fastest at both counts, and bm4 w2 the first forward candidate
    assert got.BWD_DIRECT[(64, 2)] == dict(direct_max_rows=4, direct_prefetch=False, direct_tma_stages=0)
    assert got.FWD[(64, 2)] == got.FWD_W32[(64, 2)] == dict(block_m=4, block_n=64, num_warps=2)
    assert got.BWD == tuned.BWD
    assert BwdConfig(**{**tuned.BWD.get((64, 2), configs._default_bwd(64, 2).__dict__), **got.BWD_DIRECT[(64, 2)]})
    fwd_cands = list(tune.fwd_sweep_candidates(64))
    assert any(c.tma_stages for c in fwd_cands)      # the descriptor forms ran too
    assert calls.count("table") == 2 and len(calls) == (2 * (1 + len(tune.SMALL_LOADS) + len(tune.SMALL_COLS))
                                                        + 2 * 2 * len(fwd_cands))
    assert "cols16x128" in calls
    # entries not swept keep their text, measurement comments included
    text = (tmp_path / "tuned.py").read_text()
    for name in ("FWD", "FWD_W32", "BWD_DIRECT"):
        kept = tune._entry_texts(name)
        assert kept and all(entry.lstrip().startswith("#") and entry in text for entry in kept.values())
    assert tuned.FWD == tune.ORIGINAL_FWD and tuned.FWD_W32 == tune.ORIGINAL_FWD_W32
