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


def test_write_tuned_replaces_one_table(tmp_path):
    sys.path.insert(0, TOOLS)
    try:
        tune = _load(os.path.join(TOOLS, "tune.py"), "tune_under_test")
    finally:
        sys.path.remove(TOOLS)
    cfg = BwdConfig(16, 128, 4, min_rows_per_chunk=16, max_chunks=264, ctas_per_sm=2, atomic_min_rows=tuned.NEVER)
    chosen = {128: dict(cfg=cfg, note="bm16 w4 c2 max264: T1024 9.9 us", edge_note="det/atomic us: T1024 9.9/12.0")}
    tune.write_tuned(chosen, str(tmp_path / "gated.py"), gated=True)
    tune.write_tuned(chosen, str(tmp_path / "plain.py"), gated=False)
    gated = _load(str(tmp_path / "gated.py"), "tuned_gated")
    plain = _load(str(tmp_path / "plain.py"), "tuned_plain")
    assert gated.BWD == tuned.BWD and gated.FWD == tuned.FWD
    assert gated.BWD_GATED == {**tuned.BWD_GATED, (128, 2): cfg.__dict__}
    assert plain.BWD_GATED == tuned.BWD_GATED
    assert plain.BWD == {**tuned.BWD, (128, 2): cfg.__dict__}
    assert "T1024 9.9 us" in (tmp_path / "gated.py").read_text()
