"""The measured tables: one JSON file per GPU architecture, beside this module.

    sm_90.json  {"arch": ..., "measured_on": ..., "method": [...],
                 "forward":  [{"hidden", "elt", "kind", "tile", "schedule", "notes"}, ...],
                 "backward": [{"hidden", "elt", "kind", "tile", "windows", "schedule", "notes"}, ...]}

`elt` is the activation element size in bytes; `kind` is the variant's table
("plain", "weight_fp32" for the forward with a float32 weight and 16-bit
activations, "gated" for the gated forms). `notes` carry the measurements
that chose the entry (times, the candidates it beat, why an entry overrules
its sweep); `method` says how the table was measured. Parts not given take
their defaults (configs.FwdSchedule(), ...).

The tuner (`trainnorm.dev.tune`) writes entries through `put` and `save`:
the file is data, never edited by pattern. Changing an entry changes bits
(see configs/__init__.py): re-verify with `trainnorm verify` and the GPU suite.
"""
from __future__ import annotations

import json
import os
from dataclasses import fields
from functools import lru_cache

from . import BwdConfig, FwdConfig, Key

HERE = os.path.dirname(os.path.abspath(__file__))
_CONFIG = {"forward": FwdConfig, "backward": BwdConfig}
_tables: dict[str, dict] = {}


def path(arch: str) -> str:
    return os.path.join(HERE, f"{arch}.json")


@lru_cache(maxsize=None)
def archs() -> tuple[str, ...]:
    return tuple(sorted(f[:-5] for f in os.listdir(HERE) if f.startswith("sm_") and f.endswith(".json")))


def load(arch: str) -> dict:
    """The table of an architecture as stored (cached)."""
    if arch not in _tables:
        with open(path(arch)) as f:
            _tables[arch] = json.load(f)
    return _tables[arch]


def clear() -> None:
    _tables.clear()
    _indexes.clear()
    archs.cache_clear()


def _entry_key(e: dict) -> tuple:
    return e["hidden"], e["elt"], e["kind"]


def to_config(op: str, entry: dict):
    cls = _CONFIG[op]
    flat = {}
    for f in fields(cls):
        flat.update(entry.get(f.name, {}))
    return cls.from_fields(**flat)


def to_entry(op: str, hidden: int, elt: int, kind: str, cfg, notes=()) -> dict:
    """The stored form of a config: its parts, each with the fields that differ from the part's defaults
    (and the tile's fields that have none)."""
    entry = {"hidden": hidden, "elt": elt, "kind": kind}
    for f in fields(cfg):
        part = getattr(cfg, f.name)
        vals = {pf.name: _stored(getattr(part, pf.name)) for pf in fields(part)
                if getattr(part, pf.name) != pf.default}
        if vals:
            entry[f.name] = vals
    entry["notes"] = list(notes)
    return entry


def _stored(value):
    """A field as JSON reads it back: tuples (rows_block_m's windows) as lists."""
    return [_stored(v) for v in value] if isinstance(value, tuple) else value


def lookup(op: str, key: Key):
    """The measured config of a key, or None."""
    if key.arch not in archs():
        return None
    idx = _index(key.arch, op)
    e = idx.get((key.hidden, key.elt, key.kind))
    return None if e is None else to_config(op, e)


_indexes: dict = {}


def _index(arch: str, op: str) -> dict:
    t = load(arch)
    k = (arch, op, id(t))
    if k not in _indexes:
        _indexes[k] = {_entry_key(e): e for e in t[op]}
    return _indexes[k]


def put(table: dict, op: str, entry: dict) -> None:
    """Add or replace an entry of a loaded table (in memory), keeping the table's order."""
    rows = table[op]
    for i, e in enumerate(rows):
        if _entry_key(e) == _entry_key(entry):
            rows[i] = entry
            return
    rows.append(entry)
    rows.sort(key=lambda e: (e["kind"], e["elt"], e["hidden"]))


def dumps(table: dict) -> str:
    """The file's text: one key per line down to each part, so that a diff shows the entry that changed."""
    def entry_text(e: dict) -> str:
        parts = [f'"{k}": {json.dumps(e[k])}' for k in ("hidden", "elt", "kind")]
        body = [", ".join(parts)]
        for k in ("tile", "windows", "schedule"):
            if k in e:
                body.append(f'"{k}": {json.dumps(e[k])}')
        notes = ",\n     ".join(json.dumps(n) for n in e.get("notes", []))
        body.append(f'"notes": [{notes}]' if notes else '"notes": []')
        return "  {" + ",\n   ".join(body) + "}"

    head = {k: v for k, v in table.items() if k not in ("forward", "backward")}
    lines = ["{"]
    for k, v in head.items():
        if isinstance(v, list):
            v_text = "[" + ",\n  ".join(json.dumps(x) for x in v) + "]"
        else:
            v_text = json.dumps(v)
        lines.append(f' {json.dumps(k)}: {v_text},')
    for op in ("forward", "backward"):
        lines.append(f' "{op}": [')
        lines.append(",\n".join(entry_text(e) for e in table[op]))
        lines.append(" ]" + ("," if op == "forward" else ""))
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == table, "the table's text does not read back as the table"
    return text


def save(table: dict, out: str) -> None:
    with open(out, "w") as f:
        f.write(dumps(table))
