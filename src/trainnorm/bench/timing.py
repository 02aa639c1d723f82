"""How a latency is measured.

One sample is one CUDA-graph replay of an implementation's op, timed with a
pair of CUDA events around the replay, after an L2 flush that runs outside
the timed region (a fill kernel writes a 256 MB buffer, five times the H200's
L2, so every sample starts with a cold L2, as a training step does after the
neighbouring GEMMs). Replaying a graph removes the Python and launch overhead
that would otherwise dominate the small rows: what is timed is the GPU work the
implementation issues, including its own allocations' memsets, partial
reductions, casts and copies.

Samples are taken in interleaved passes (every implementation of a row, then
again in the reverse order, ...) so that slow drifts of clock or temperature
hit all of them alike; the reported latency is the median over all samples
of all passes, with the 20th and 80th percentiles as its spread.

A replay of a few microseconds also depends on the graph that was captured:
on an H100 trainnorm's forward, timed as "trainnorm" and as "trainnorm-fast"
(one call, the same inputs, two graphs), read up to 8% apart at T 1-64, and in
4 of 30 rows one graph was slower in all three passes (docs/benchmarks/h100-small;
the step, a longer replay, within 1.3%). So a short row captures each
implementation several times (make_timer's captures: each capture has its own
outputs), and its samples go to the captures in turn: the median then stands
for the captures, not for one of them.

An implementation whose op cannot be captured in a CUDA graph is timed as
eager calls between the same events, and the result says so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

FLUSH_BYTES = 256 << 20
COPY_BYTES = 1 << 30      # copied buffer: 1 GiB read + 1 GiB written per sample
WARMUP_CALLS = 3


# --- statistics (pure Python: used by the report and its tests) ----------------------------

def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Stats:
    median: float
    p20: float
    p80: float
    n: int

    @classmethod
    def of(cls, samples) -> "Stats":
        return cls(percentile(samples, 50), percentile(samples, 20), percentile(samples, 80), len(samples))


# --- L2 flush ------------------------------------------------------------------------------

class L2Flush:
    """Writes a 256 MB buffer with one fill kernel: evicts the inputs from L2."""

    def __init__(self, device, nbytes: int = FLUSH_BYTES):
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)
        self._k = 0

    def __call__(self) -> None:
        self._k ^= 1
        self.buf.fill_(self._k)


# --- one implementation's op, captured (or not) --------------------------------------------

@dataclass
class Timer:
    """A zero-argument callable made replayable: a CUDA graph, or eager calls if capture failed."""

    name: str
    fn: Callable[[], object]
    graphs: list = field(default_factory=list)     # the captures, replayed in turn
    mode: str = "graph"     # "graph" | "eager"
    note: str = ""
    keep: list = field(default_factory=list)   # outputs of the captures, alive with the graphs
    turn: int = 0

    def run(self) -> None:
        if self.graphs:
            self.graphs[self.turn % len(self.graphs)].replay()
            self.turn += 1
        else:
            self.fn()

    def sample(self, flush: L2Flush, n: int) -> list[float]:
        """n latencies in microseconds, each after an L2 flush."""
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            flush()
            s.record()
            self.run()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    def release(self) -> None:
        self.graphs.clear()
        self.keep.clear()
        self.fn = None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:160]


def make_timer(name: str, fn: Callable[[], object], stream: torch.cuda.Stream,
               warmup: int = WARMUP_CALLS, captures: int = 1, pool=None) -> Timer:
    """Warm fn up and capture it in `captures` CUDA graphs of its own on `stream`
    (each with its own outputs; the timer replays them in turn).

    The first call runs alone and is synchronized (it compiles: Triton JIT,
    torch.compile, CuTe DSL, autotuning); the next ones are plain warm-up calls.
    The caller has made `stream` (a side stream, as torch's CUDA-graph docs
    ask) current. If capture fails the timer replays eager calls instead and
    carries a note; exceptions of the warm-up itself propagate (the
    implementation does not run on this row).

    With `pool` (torch.cuda.graph_pool_handle(), shared by the caller's timers) the
    captures draw on that pool and their outputs are not kept: a later capture, of this
    timer or another, may take the same memory, and replays overwrite each other's
    outputs. For callers that never read them and time many candidates: the tuner's
    forward sweep at H 6144 with a residual, 51 candidates each holding 1.5 GiB of y
    and h at 65536 rows, ran an 80 GiB H100 out of memory with every output kept."""
    fn()
    torch.cuda.synchronize()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    timer = Timer(name, fn)
    try:
        for _ in range(captures):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream, pool=pool):
                out = fn()
            timer.graphs.append(graph)
            if pool is None:
                timer.keep.append(out)
            del out
            graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager timing
        timer.graphs.clear()
        timer.keep.clear()
        graph = None
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        timer.mode = "eager"
        timer.note = f"eager timing, graph capture failed ({first_line(exc)})"
        fn()
        torch.cuda.synchronize()
    return timer


def sample_interleaved(timers: list[Timer], flush: L2Flush, passes: int, samples: int,
                       on_pass: Callable[[], None] | None = None) -> dict[str, list[list[float]]]:
    """Samples of every timer in `passes` passes; the order reverses on every other pass.

    Returns {name: [samples of pass 0, samples of pass 1, ...]}."""
    out: dict[str, list[list[float]]] = {t.name: [] for t in timers}
    for p in range(passes):
        order = timers if p % 2 == 0 else list(reversed(timers))
        for t in order:
            out[t.name].append(t.sample(flush, samples))
        if on_pass is not None:
            on_pass()
    return out


# --- the floor's denominator ---------------------------------------------------------------

def copy_bandwidth(device, nbytes: int = COPY_BYTES, reps: int = 15) -> float:
    """Device-to-device copy bandwidth in bytes/s: (bytes read + bytes written) / time,
    median of `reps` copies of an `nbytes` buffer (far larger than L2)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / percentile(times, 50)
