"""Turning measurements into the comparison: matching, ratios, summary, markdown, JSON, plots.

Everything here is pure Python on plain records (plots need matplotlib and are
skipped with a note without it), so it is tested without a GPU.

Matching. For fwd rows the best peer is the fastest implementation other than
trainnorm's two modes. For bwd and step rows a peer counts only if it returns
dw in float32 (the contract's dw dtype; Liger and QuACK return the weight's
dtype) and its dw meets the budget B = 1: err/tol <= 1 with
err/tol = max |dw - ref| / (1e-4 + 1e-4 |ref|) against FP64 at its own rstd.
Faster peers that fail either condition are listed under the table.

The decoder-block rows compare whole blocks: trainnorm's compiled block
against the same block with torch.nn.RMSNorm compiled (their only peer), with
no dw condition; the eager blocks are reported beside them.

Ratios are peer latency / trainnorm latency: above 1 trainnorm is faster.
The summary is given once with every peer and once without each peer of
WITHOUT_PEERS, to show what that peer changes.

The stack set's feature rows (a float32 residual stream, (1 + w) weights) are
also set against their BF16 pair rows (``Row.pair_id``), trainnorm against
trainnorm: the time ratio feature / pair beside the ratio of the bytes the two
rows must move, and both rows' % of the copy floor. A feature costs nothing
beyond its extra bytes when its % floor is the pair's (time ratio = bytes ratio).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from . import shapes
from .shapes import Row

DW_BUDGET = 1.0
PAR = 0.97             # level with the best matched peer: within 3% of its latency
TRAINNORM_DET = "trainnorm"
TRAINNORM_FAST = "trainnorm-fast"
TRAINNORM_EAGER = "trainnorm-eager"     # the eager block with trainnorm's norms (block rows)
TRAINNORM_NAMES = (TRAINNORM_DET, TRAINNORM_FAST, TRAINNORM_EAGER)
BLOCK_PEERS = ("torch-compile",)        # the block rows' peer: the same block with torch.nn.RMSNorm, compiled
BLOCK_EAGER_PEER = "eager"
WITHOUT_PEERS = ("quack-f32dw",)        # peers the summary is also given without
GROUPS = (("seed", "78-shape list"), ("small_t", "small T"), ("gated", "gated"),
          ("beyond", "beyond the table"), ("block", "decoder block, compiled"), ("stack", "training stack"))


@dataclass
class Measurement:
    """One implementation's op on one row: latency statistics over all passes (us)."""

    row: str
    op: str
    impl: str
    median_us: float | None = None
    p20_us: float | None = None
    p80_us: float | None = None
    pass_medians: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    mode: str = "graph"          # graph | eager | skipped | failed
    note: str = ""
    dw_err: float | None = None  # err/tol of its dw (bwd and step)
    dw_dtype: str | None = None

    @property
    def timed(self) -> bool:
        return self.median_us is not None


@dataclass
class BenchResult:
    env: dict
    config: dict
    rows: list[Row]
    ops: list[str]
    impls: list[str]
    copy_bytes_per_s: float | None
    measurements: list[Measurement]
    unavailable: dict[str, str] = field(default_factory=dict)
    # row id -> the launches' fingerprint at the run's tree (trainnorm.dev.launches.fingerprint:
    # its kernels' source and every launch of the row); what `trainnorm bench --reuse` compares
    launches: dict[str, str] = field(default_factory=dict)

    def floor_us(self, row: Row, op: str) -> float | None:
        if not self.copy_bytes_per_s or not row.has_floor:
            return None
        return shapes.floor_us(row, op, self.copy_bytes_per_s)


@dataclass
class Comparison:
    row: Row
    op: str
    floor_us: float | None
    det: Measurement | None
    fast: Measurement | None
    peer: Measurement | None
    outside: list[Measurement]   # faster peers that are not matched (dw budget or dtype)

    @property
    def ratio_det(self) -> float | None:
        return _ratio(self.peer, self.det)

    @property
    def ratio_fast(self) -> float | None:
        return _ratio(self.peer, self.fast)


def _ratio(peer: Measurement | None, mine: Measurement | None) -> float | None:
    if peer is None or mine is None or not peer.timed or not mine.timed or mine.median_us <= 0:
        return None
    return peer.median_us / mine.median_us


# --- matching -------------------------------------------------------------------------------

def is_matched(m: Measurement, op: str, budget: float = DW_BUDGET, needs_dw: bool = True) -> bool:
    """A peer's result can stand in for trainnorm's: timed, and for bwd/step (where the
    row checks dw) an FP32 dw within budget."""
    if not m.timed:
        return False
    if op == "fwd" or not needs_dw:
        return True
    return m.dw_dtype == "float32" and m.dw_err is not None and m.dw_err <= budget


def best_peer(cells: dict[str, Measurement], op: str, budget: float = DW_BUDGET, *, block: bool = False,
              without: tuple[str, ...] = ()):
    """(fastest matched peer or None, faster unmatched peers sorted by latency).

    block: a decoder-block row (its peers are BLOCK_PEERS, with no dw condition);
    without: peers left out of the comparison."""
    peers = [m for name, m in cells.items() if name not in TRAINNORM_NAMES and name not in without and m.timed
             and (not block or name in BLOCK_PEERS)]
    matched = [m for m in peers if is_matched(m, op, budget, needs_dw=not block)]
    best = min(matched, key=lambda m: m.median_us) if matched else None
    outside = sorted((m for m in peers if not is_matched(m, op, budget, needs_dw=not block)
                      and (best is None or m.median_us < best.median_us)), key=lambda m: m.median_us)
    return best, outside


def index(measurements: list[Measurement]) -> dict[tuple[str, str], dict[str, Measurement]]:
    out: dict[tuple[str, str], dict[str, Measurement]] = {}
    for m in measurements:
        out.setdefault((m.row, m.op), {})[m.impl] = m
    return out


def row_cells(cells: dict, row: Row, op: str) -> dict[str, Measurement] | None:
    """A (row, op)'s measurements, or None where there are none or every one was skipped
    (an op that no implementation takes on that row, like the block's bwd: the notes say why)."""
    c = cells.get((row.id, op))
    if c is None or all(m.mode == "skipped" for m in c.values()):
        return None
    return c


def compare(result: BenchResult, without: tuple[str, ...] = ()) -> list[Comparison]:
    """One comparison per (row, op) that has any measurement, in row order; `without`: peers left out."""
    cells = index(result.measurements)
    out = []
    for row in result.rows:
        for op in result.ops:
            c = row_cells(cells, row, op)
            if c is None:
                continue
            peer, outside = best_peer(c, op, block=row.block, without=without)
            out.append(Comparison(row, op, result.floor_us(row, op), c.get(TRAINNORM_DET),
                                  c.get(TRAINNORM_FAST), peer, outside))
    return out


# --- summary --------------------------------------------------------------------------------

def geomean(values) -> float | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def summarize(comparisons: list[Comparison]) -> list[dict]:
    """Geomean and minimum of the ratios vs the best matched peer, and the rows below 1 and
    at PAR or above, per op and group; rows without a matched peer are counted apart."""
    out = []
    for group, _ in GROUPS:
        for op in shapes.OPS:
            cs = [c for c in comparisons if c.op == op and c.row.group == group]
            if not cs:
                continue
            det = [c.ratio_det for c in cs if c.ratio_det is not None]
            fast = [c.ratio_fast for c in cs if c.ratio_fast is not None]
            fvd = [_ratio(c.det, c.fast) for c in cs if _ratio(c.det, c.fast) is not None]
            out.append({
                "group": group, "op": op, "rows": len(cs),
                "unmatched": sum(1 for c in cs if c.peer is None),
                "det_geomean": geomean(det), "det_min": min(det) if det else None,
                "det_below_1": sum(1 for r in det if r < 1),
                "det_at_par": sum(1 for r in det if r >= PAR),
                "fast_geomean": geomean(fast), "fast_min": min(fast) if fast else None,
                "fast_below_1": sum(1 for r in fast if r < 1),
                "fast_vs_det_geomean": geomean(fvd),
            })
    return out


# --- markdown -------------------------------------------------------------------------------

def _us(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _err(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def _lat_floor(m: Measurement | None, floor: float | None) -> str:
    if m is None or not m.timed:
        return "—"
    mark = " †" if m.mode == "eager" else ""
    if floor is None:
        return f"{m.median_us:.2f}{mark}"
    return f"{m.median_us:.2f} ({100 * floor / m.median_us:.0f}%){mark}"


def _env_lines(env: dict, result: BenchResult) -> list[str]:
    lines = []
    for k, v in env.items():
        if isinstance(v, dict):
            v = ", ".join(f"{kk} {vv}" for kk, vv in v.items())
        lines.append(f"- {k}: {v}")
    if result.copy_bytes_per_s:
        lines.append(f"- copy bandwidth (read + write, device to device): {result.copy_bytes_per_s / 1e9:.1f} GB/s")
    for k, v in result.config.items():
        lines.append(f"- {k}: {v}")
    return lines


def main_table(comparisons: list[Comparison]) -> list[str]:
    lines = [
        "| row | op | floor us | trainnorm det us (% floor) | trainnorm fast us (% floor) | best peer "
        "| peer us (% floor) | det vs peer | fast vs peer | det dw err/tol |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in comparisons:
        peer = c.peer.impl if c.peer is not None else "— (none matched)"
        if c.outside:
            peer += " *"
        err = c.det.dw_err if (c.det is not None and c.op != "fwd") else None
        lines.append(
            f"| {c.row.id} | {c.op} | {_us(c.floor_us)} | {_lat_floor(c.det, c.floor_us)} "
            f"| {_lat_floor(c.fast, c.floor_us)} | {peer} | {_lat_floor(c.peer, c.floor_us)} "
            f"| {_x(c.ratio_det)} | {_x(c.ratio_fast)} | {_err(err)} |")
    return lines


def summary_table(summary: list[dict]) -> list[str]:
    names = dict(GROUPS)
    lines = [
        "| rows | op | n | no matched peer | det vs peer geomean | det vs peer min | det rows < 1 "
        f"| det rows >= {PAR:g}x | fast vs peer geomean | fast vs peer min | fast rows < 1 | fast vs det geomean |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in summary:
        lines.append(
            f"| {names[s['group']]} | {s['op']} | {s['rows']} | {s['unmatched']} | {_x(s['det_geomean'])} "
            f"| {_x(s['det_min'])} | {s['det_below_1']} | {s['det_at_par']} | {_x(s['fast_geomean'])} "
            f"| {_x(s['fast_min'])} | {s['fast_below_1']} | {_x(s['fast_vs_det_geomean'])} |")
    return lines


def without_peers(result: BenchResult) -> list[str]:
    """The peers of WITHOUT_PEERS that timed anything in this result."""
    timed = {m.impl for m in result.measurements if m.timed}
    return [p for p in WITHOUT_PEERS if p in timed]


def summaries(result: BenchResult) -> list[tuple[str, list[dict]]]:
    """(title, summary): with every peer, then without each peer of WITHOUT_PEERS that ran."""
    out = [("Summary", summarize(compare(result)))]
    for p in without_peers(result):
        out.append((f"Summary without {p}", summarize(compare(result, without=(p,)))))
    return out


def summary_lines(result: BenchResult) -> list[str]:
    """The summaries as markdown sections (what the command line prints at the end)."""
    lines: list[str] = []
    for title, summ in summaries(result):
        lines += [f"## {title}", ""] + summary_table(summ) + [""]
    return lines


def block_table(result: BenchResult) -> list[str]:
    """The decoder-block rows: each block compiled and eager, and the ratios torch / trainnorm."""
    cells = index(result.measurements)
    rows = [r for r in result.rows if r.block]
    if not rows:
        return []

    def us(c, name):
        m = c.get(name)
        return m.median_us if m is not None and m.timed else None

    lines = ["| row | op | trainnorm compiled us | trainnorm-fast compiled us | torch.nn.RMSNorm compiled us "
             "| compiled: torch / trainnorm | trainnorm eager us | torch eager us | eager: torch / trainnorm |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        for op in result.ops:
            c = row_cells(cells, row, op)
            if c is None:
                continue
            det, fast, peer = us(c, TRAINNORM_DET), us(c, TRAINNORM_FAST), us(c, BLOCK_PEERS[0])
            eager, eager_peer = us(c, TRAINNORM_EAGER), us(c, BLOCK_EAGER_PEER)
            lines.append(f"| {row.id} | {op} | {_us(det)} | {_us(fast)} | {_us(peer)} "
                         f"| {_x(peer / det if peer and det else None)} | {_us(eager)} | {_us(eager_peer)} "
                         f"| {_x(eager_peer / eager if eager_peer and eager else None)} |")
    return lines


def _pct(m: Measurement | None, floor: float | None) -> float | None:
    if m is None or not m.timed or floor is None or m.median_us <= 0:
        return None
    return 100 * floor / m.median_us


def stack_costs(result: BenchResult) -> list[dict]:
    """Per feature row of the stack set and op: trainnorm's latency (det and fast) on the
    row and on its BF16 pair, the ratios feature / pair of time and of bytes, and each
    row's % of the copy floor (None where a side was not timed or has no floor)."""
    cells = index(result.measurements)
    out = []
    for row in result.rows:
        pair = row.pair
        if pair is None:
            continue
        for op in result.ops:
            c = row_cells(cells, row, op)
            if c is None:
                continue
            pc = cells.get((pair.id, op), {})
            floor, pfloor = result.floor_us(row, op), result.floor_us(pair, op)
            entry = {"row": row.id, "op": op, "pair": pair.id,
                     "bytes_vs_pair": shapes.op_bytes(row, op) / shapes.op_bytes(pair, op),
                     "floor_us": floor, "pair_floor_us": pfloor}
            for key, name in (("det", TRAINNORM_DET), ("fast", TRAINNORM_FAST)):
                m, pm = c.get(name), pc.get(name)
                entry[f"{key}_us"] = m.median_us if m is not None and m.timed else None
                entry[f"pair_{key}_us"] = pm.median_us if pm is not None and pm.timed else None
                entry[f"{key}_vs_pair"] = _ratio(m, pm)         # feature / pair: > 1 costs time
                entry[f"{key}_floor_pct"] = _pct(m, floor)
                entry[f"pair_{key}_floor_pct"] = _pct(pm, pfloor)
            out.append(entry)
    return out


def stack_table(result: BenchResult) -> list[str]:
    """The stack set's feature rows against their BF16 pairs (stack_costs), as markdown."""
    costs = stack_costs(result)
    if not costs:
        return []

    def lat(us, pct):
        if us is None:
            return "—"
        return f"{us:.2f}" + (f" ({pct:.0f}%)" if pct is not None else "")

    lines = ["| row | op | bf16 pair | bytes vs pair | trainnorm us (% floor) | pair us (% floor) "
             "| time vs pair | trainnorm fast us (% floor) | pair fast us (% floor) | fast time vs pair |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for e in costs:
        lines.append(
            f"| {e['row']} | {e['op']} | {e['pair']} | {_x(e['bytes_vs_pair'])} "
            f"| {lat(e['det_us'], e['det_floor_pct'])} | {lat(e['pair_det_us'], e['pair_det_floor_pct'])} "
            f"| {_x(e['det_vs_pair'])} | {lat(e['fast_us'], e['fast_floor_pct'])} "
            f"| {lat(e['pair_fast_us'], e['pair_fast_floor_pct'])} | {_x(e['fast_vs_pair'])} |")
    return lines


def all_impls_table(result: BenchResult) -> list[str]:
    cells = index(result.measurements)
    impls = result.impls
    lines = ["| row | op | " + " | ".join(impls) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in impls) + " |"]
    for row in result.rows:
        for op in result.ops:
            c = row_cells(cells, row, op)
            if c is None:
                continue
            vals = []
            for name in impls:
                m = c.get(name)
                if m is None or not m.timed:
                    vals.append("—")
                    continue
                mark = " †" if m.mode == "eager" else ""
                vals.append(f"{m.median_us:.2f} ({m.p20_us:.2f}–{m.p80_us:.2f}){mark}")
            lines.append(f"| {row.id} | {op} | " + " | ".join(vals) + " |")
    return lines


def dw_table(result: BenchResult) -> list[str]:
    """err/tol and dtype of each implementation's dw, per row (the same in bwd and step)."""
    cells = index(result.measurements)
    impls = result.impls
    lines = ["| row | " + " | ".join(impls) + " |", "| --- | " + " | ".join("---:" for _ in impls) + " |"]
    for row in result.rows:
        per_impl: dict[str, Measurement] = {}
        for op in ("bwd", "step"):
            for name, m in cells.get((row.id, op), {}).items():
                if m.dw_err is not None and name not in per_impl:
                    per_impl[name] = m
        if not per_impl:
            continue
        vals = []
        for name in impls:
            m = per_impl.get(name)
            if m is None:
                vals.append("—")
            else:
                dt = "" if m.dw_dtype == "float32" else f" ({m.dw_dtype})"
                vals.append(f"{m.dw_err:.3f}{dt}")
        lines.append(f"| {row.id} | " + " | ".join(vals) + " |")
    return lines


def notes(result: BenchResult, comparisons: list[Comparison]) -> list[str]:
    lines = []
    for name, why in result.unavailable.items():
        lines.append(f"- {name}: not run, {why}")
    grouped: dict[tuple[str, str], list[str]] = {}
    ran: dict[str, set[str]] = {}          # the rows each implementation was given
    for m in result.measurements:
        ran.setdefault(m.impl, set()).add(m.row)
        if m.note:
            rows = grouped.setdefault((m.impl, m.note), [])
            if m.row not in rows:
                rows.append(m.row)
    for (impl, note), rows in grouped.items():
        if len(rows) > 1 and set(rows) == ran[impl]:
            lines.append(f"- {impl}: {note} (all {len(rows)} of its rows)")
        else:
            lines.append(f"- {impl}: {note} ({len(rows)} row{'s' if len(rows) != 1 else ''}: {', '.join(rows)})")
    outside = [c for c in comparisons if c.outside]
    if outside:
        lines.append("")
        lines.append("`*` faster peers that are not matched (dw outside the budget or not float32), "
                     "us (dw err/tol, dw dtype):")
        for c in outside:
            parts = []
            for m in c.outside:
                if c.op == "fwd":
                    parts.append(f"{m.impl} {m.median_us:.2f}")
                else:
                    parts.append(f"{m.impl} {m.median_us:.2f} ({_err(m.dw_err)}, {m.dw_dtype})")
            lines.append(f"- {c.row.id} {c.op}: " + "; ".join(parts))
    return lines


def render_markdown(result: BenchResult) -> str:
    comparisons = compare(result)
    out = ["# trainnorm bench", ""]
    out += _env_lines(result.env, result)
    out += ["", "Method: one CUDA-graph replay per sample after an L2 flush (256 MB written outside the "
            "timed region), median over all samples of interleaved passes (order reversed every other "
            "pass), every implementation of a row in this process; short ops sample several captures of "
            "each implementation in turn (`captures` above). Floor = bytes the op must move / the "
            "copy bandwidth above. `% floor` = floor / latency. Ratios = peer latency / trainnorm "
            "latency (> 1: trainnorm is faster). Best peer for bwd and step: the fastest non-trainnorm "
            f"implementation whose dw is float32 and within err/tol <= {DW_BUDGET:g}. "
            "step = fwd + fwd + bwd in one graph. Block rows: the peer is the same block with "
            "torch.nn.RMSNorm compiled, no floor, step = fwd + bwd, no bwd alone. "
            "`†` = timed eagerly (graph capture failed).", ""]
    out += summary_lines(result)
    out += ["## Rows", ""] + main_table(comparisons) + [""]
    blocks = block_table(result)
    if blocks:
        out += ["## Decoder block: torch.compile of the whole block, trainnorm's norms vs torch.nn.RMSNorm", ""]
        if result.config.get("block"):
            out += [result.config["block"], ""]
        out += blocks + [""]
    stack = stack_table(result)
    if stack:
        out += ["## Training-stack features against their bf16 rows (trainnorm)", "",
                "A float32 residual stream (`res r32`: r, h, dh and dx in float32, y and dy bf16) against "
                "the bf16 residual row of its shape, and (1 + w) weights (`1+w`) against the plain row. "
                "`time vs pair` = feature row latency / pair latency (> 1: the feature costs time); "
                "`bytes vs pair` = the ratio of the bytes the two rows must move. A feature that costs "
                "nothing beyond its extra bytes keeps the pair's % floor (time vs pair = bytes vs pair).",
                ""] + stack + [""]
    n = notes(result, comparisons)
    if n:
        out += ["## Notes", ""] + n + [""]
    out += ["## All implementations: median us (p20–p80)", ""] + all_impls_table(result) + [""]
    dwt = dw_table(result)
    if len(dwt) > 2:
        out += ["## dw err/tol per implementation (FP64 at its own rstd; dtype if not float32)", ""] + dwt + [""]
    return "\n".join(out)


# --- JSON -----------------------------------------------------------------------------------

def _row_json(row: Row, result: BenchResult) -> dict:
    d = asdict(row)
    d.update(id=row.id, series=row.series, rows=row.rows, shape=list(row.shape),
             bytes={op: shapes.op_bytes(row, op) if row.has_floor else None for op in result.ops},
             floor_us={op: result.floor_us(row, op) for op in result.ops})
    return d


def _finite(obj):
    """NaN and infinities become null: the file stays strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def to_json(result: BenchResult) -> dict:
    comparisons = compare(result)
    return _finite({
        "env": result.env,
        "config": result.config,
        "copy_bandwidth_bytes_per_s": result.copy_bytes_per_s,
        "ops": list(result.ops),
        "impls": list(result.impls),
        "unavailable": dict(result.unavailable),
        "launches": dict(result.launches),
        "rows": [_row_json(r, result) for r in result.rows],
        "measurements": [asdict(m) for m in result.measurements],
        "comparisons": [{
            "row": c.row.id, "op": c.op, "floor_us": c.floor_us,
            "peer": c.peer.impl if c.peer else None,
            "det_us": c.det.median_us if c.det else None,
            "fast_us": c.fast.median_us if c.fast else None,
            "peer_us": c.peer.median_us if c.peer else None,
            "det_vs_peer": c.ratio_det, "fast_vs_peer": c.ratio_fast,
            "faster_unmatched": [m.impl for m in c.outside],
        } for c in comparisons],
        "summary": summarize(comparisons),
        "summary_without": {p: summarize(compare(result, without=(p,))) for p in without_peers(result)},
        "stack": stack_costs(result),
    })


def from_json(data: dict) -> BenchResult:
    """A BenchResult back from to_json's output (rows looked up by id)."""
    rows = {r.id: r for r in shapes.all_rows()}
    missing = [r["id"] for r in data["rows"] if r["id"] not in rows]
    if missing:
        raise ValueError(f"unknown row ids in the JSON: {missing[:5]}")
    fields = set(Measurement.__dataclass_fields__)
    return BenchResult(
        data["env"], data["config"], [rows[r["id"]] for r in data["rows"]], list(data["ops"]),
        list(data["impls"]), data["copy_bandwidth_bytes_per_s"],
        [Measurement(**{k: v for k, v in m.items() if k in fields}) for m in data["measurements"]],
        dict(data.get("unavailable", {})), dict(data.get("launches", {})))


def subset(result: BenchResult, row_ids) -> BenchResult:
    """The same run restricted to the rows `row_ids` (its rows, cells and fingerprints)."""
    keep = set(row_ids)
    return BenchResult(result.env, result.config, [r for r in result.rows if r.id in keep], list(result.ops),
                       list(result.impls), result.copy_bytes_per_s,
                       [m for m in result.measurements if m.row in keep], dict(result.unavailable),
                       {k: v for k, v in result.launches.items() if k in keep})


def merge(parts: list[BenchResult]) -> BenchResult:
    """One report from runs over different rows (e.g. a full run split across
    several processes or machines' sessions). Every row's implementations still
    come from one process: a (row, op, impl) measured twice keeps the later
    part's value. The floor uses the median of the parts' copy bandwidths; the
    header lists each part's GPU, date and bandwidth."""
    if not parts:
        raise ValueError("nothing to merge")
    order = {r.id: i for i, r in enumerate(shapes.all_rows())}
    # a cut part selected more rows than it measured: its unreached rows stay out
    reached = [{r.id for r in p.rows} & {m.row for m in p.measurements} for p in parts]
    rows = sorted({r.id: r for p, got in zip(parts, reached) for r in p.rows if r.id in got}.values(),
                  key=lambda r: order[r.id])
    ops = [o for o in shapes.OPS if any(o in p.ops for p in parts)]
    impls = list(dict.fromkeys(i for p in parts for i in p.impls))
    cells: dict = {}
    for p in parts:
        for m in p.measurements:
            cells[(m.row, m.op, m.impl)] = m
    bws = sorted(p.copy_bytes_per_s for p in parts if p.copy_bytes_per_s)
    env = dict(parts[-1].env)
    # each part's warm-up too: it differs between the parts of one merged run
    env["merged from"] = "; ".join(
        f"{p.env.get('gpu', '?')} {p.env.get('date', '?')} ({len(got)} of {len(p.rows)} selected rows "
        f"measured, copy {(p.copy_bytes_per_s or 0) / 1e9:.0f} GB/s, "
        f"warm-up: {p.config.get('compile warm-up', '?')})" for p, got in zip(parts, reached))
    unavailable = {}
    for p in parts:
        unavailable.update(p.unavailable)
    unavailable = {k: v for k, v in unavailable.items() if k not in impls}
    config = dict(parts[-1].config, rows=shapes.describe(rows))    # the merged rows, not the last part's
    if len({p.config.get("compile warm-up") for p in parts}) > 1:
        config["compile warm-up"] = "per part: see `merged from`"
    # a row's fingerprint is that of the part its cells come from (a later part's wins, as its cells do)
    launches = {}
    for p, got in zip(parts, reached):
        launches.update({k: v for k, v in p.launches.items() if k in got})
    return BenchResult(env, config, rows, ops, impls,
                       bws[len(bws) // 2] if bws else None, list(cells.values()), unavailable,
                       {r.id: launches[r.id] for r in rows if r.id in launches})


# --- plots ----------------------------------------------------------------------------------

def plot(result: BenchResult, out_dir: str) -> tuple[list[str], str]:
    """Latency vs T per series (log-log, floor dashed), one figure per op, and the
    ratios vs the best peer per row. Returns (paths written, note)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed: no plots (pip install matplotlib)"
    cells = index(result.measurements)
    paths = []
    fams = [f for f in shapes.series_order() if any(r.series == f for r in result.rows)]
    for op in result.ops:
        ncols = min(4, max(1, len(fams)))
        nrows = math.ceil(len(fams) / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
        handles: dict[str, object] = {}
        for ax, fam in zip(axes.flat, fams):
            rows = sorted((r for r in result.rows if r.series == fam), key=lambda r: r.tokens)
            for name in result.impls:
                pts = [(r.tokens, cells.get((r.id, op), {}).get(name)) for r in rows]
                pts = [(t, m.median_us) for t, m in pts if m is not None and m.timed]
                if pts:
                    (ln,) = ax.plot(*zip(*pts), marker="o", markersize=3, linewidth=1, label=name)
                    handles.setdefault(name, ln)
            floors = [(r.tokens, result.floor_us(r, op)) for r in rows if result.floor_us(r, op)]
            if floors:
                (ln,) = ax.plot(*zip(*floors), "k--", linewidth=1, label="copy floor")
                handles.setdefault("copy floor", ln)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(fam, fontsize=9)
            ax.set_xlabel("T", fontsize=8)
            ax.set_ylabel("us", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
        for ax in list(axes.flat)[len(fams):]:
            ax.set_visible(False)
        fig.suptitle(f"trainnorm bench: {op} latency (median, us)")
        fig.legend(list(handles.values()), list(handles.keys()), loc="lower center",
                   ncol=min(6, max(1, len(handles))), fontsize=8)
        fig.tight_layout(rect=(0, 0.06, 1, 0.96))
        path = os.path.join(out_dir, f"latency_{op}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    comparisons = compare(result)
    ops = [op for op in result.ops if any(c.op == op for c in comparisons)]
    if ops:
        fig, axes = plt.subplots(len(ops), 1, figsize=(max(8, 0.22 * len(result.rows) + 2), 3.6 * len(ops)),
                                 squeeze=False)
        for ax, op in zip(axes.flat, ops):
            cs = [c for c in comparisons if c.op == op]
            xs = list(range(len(cs)))
            det = [c.ratio_det or 0.0 for c in cs]
            fast = [c.ratio_fast or 0.0 for c in cs]
            ax.bar([x - 0.2 for x in xs], det, width=0.4, label="det vs peer")
            ax.bar([x + 0.2 for x in xs], fast, width=0.4, label="fast vs peer")
            ax.axhline(1.0, color="k", linewidth=0.8)
            ax.set_xticks(xs)
            ax.set_xticklabels([c.row.id for c in cs], rotation=90, fontsize=6)
            ax.set_ylabel("peer us / trainnorm us", fontsize=8)
            ax.set_title(f"{op}: ratio vs best matched peer (> 1: trainnorm faster)", fontsize=9)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        path = os.path.join(out_dir, "ratio_vs_peer.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths, ""


def write_outputs(result: BenchResult, out_dir: str, plots: bool = True) -> tuple[list[str], str]:
    """bench.md, bench.json and the plots in out_dir; returns (paths, plot note)."""
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "bench.md")
    js = os.path.join(out_dir, "bench.json")
    with open(md, "w") as f:
        f.write(render_markdown(result))
    with open(js, "w") as f:
        json.dump(to_json(result), f, allow_nan=False)
    paths, note = [md, js], ""
    if plots:
        more, note = plot(result, out_dir)
        paths += more
    return paths, note
