"""The implementations a row is timed with, behind one small adapter interface.

Every adapter has a ``name``, ``available()`` (with ``reason`` set when it is
not), ``version()``, ``skip_reason(row)`` for shapes it cannot run, and
``row_note(row)`` for what the reader should know about its timing on a row.
Per row, ``begin_row(data)`` allocates what the adapter keeps (workspaces,
compiled functions, its own dy buffer) once, outside the timing, and
``end_row()`` drops it. ``prepare(data, op)`` returns the zero-argument
callable that is timed:

- fwd:  the forward, storing what the backward needs (rstd, and h with a residual);
- bwd:  the backward alone, on the saved tensors of one forward run in prepare;
- step: forward, forward, backward (activation checkpointing recomputes the
  forward), the backward consuming the second forward's outputs.

``compute_dw(data)`` runs forward and backward once and returns the dw, h and
rstd the implementation produced, for the accuracy check: dw against the FP64
evaluation of the formula at the implementation's own rstd
(``reference.backward_fp64``), as ``err/tol`` with the per-element tolerance
1e-4 + 1e-4 |ref|, on the row's h (x, or x + r rounded to the stream's dtype:
float32 on "res r32" rows). A dw returned in BF16 is checked as returned.

Rows of the stack set: on "res r32" rows r, dh and h are float32 (y, dy BF16),
and every adapter that runs them keeps h and the stream's gradient dx in float32;
on "1+w" rows y = x_hat * (1 + w), with the weight 0.1 N(0, 1) around zero.

Peers are imported lazily; one that does not import is reported with a
one-line reason and left out.
"""
from __future__ import annotations

import importlib
import inspect
import types
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

import trainnorm
from trainnorm import reference

from .shapes import STRIDED_ROW, Row
from .timing import first_line

EPS = 1e-6
ACT_DTYPE = torch.bfloat16


def _dist_version(*names: str) -> str | None:
    from importlib import metadata
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


# --- inputs ---------------------------------------------------------------------------------

@dataclass
class RowData:
    """A row's inputs, allocated once and shared (read-only) by every implementation."""

    row: Row
    x: torch.Tensor                 # [T, H], or [T, heads, 256] (a strided view for [T,24,256])
    w: torch.Tensor                 # [H], BF16 or FP32
    dy: torch.Tensor                # like x, contiguous
    r: torch.Tensor | None = None   # residual (float32 on "res r32" rows)
    dh: torch.Tensor | None = None  # gradient reaching h (residual rows; float32 on "res r32" rows)
    base: torch.Tensor | None = None  # storage behind the strided per-head view
    z: torch.Tensor | None = None   # gate (gated rows), like x

    @property
    def hidden(self) -> int:
        return self.x.shape[-1]

    @property
    def offset(self) -> float:
        """The row's weight offset: y = x_hat * (offset + w)."""
        return self.row.weight_offset

    @property
    def stream_dtype(self) -> torch.dtype:
        """The dtype of h and of the backward's dx: the residual's, else x's."""
        return self.x.dtype if self.r is None else self.r.dtype

    def h(self) -> torch.Tensor:
        """The row's h: x, or round(f32(x) + f32(r)) into the residual's dtype."""
        return reference.residual_sum(self.x, self.r)

    def flat(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """[rows, H] view (every layout of the benchmark flattens without a copy)."""
        return None if t is None else t.view(-1, t.shape[-1])


def row_generator(row: Row, device, seed: int = 0) -> torch.Generator:
    """The random generator of a row's inputs: one seed per (seed, row id)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + zlib.crc32(row.id.encode()))
    return gen


def make_row_data(row: Row, device, seed: int = 0, fill: bool = True) -> RowData:
    """Standard-normal activations and gradients, weight 1 + 0.1 N(0, 1) (with a weight
    offset, (1 - offset) + 0.1 N(0, 1): the same scale offset + w); a seed per row id.
    r and dh are float32 on "res r32" rows. fill False: the same shapes, dtypes and layouts
    left uninitialised (what the launches a row makes depend on; trainnorm.dev.launches)."""
    if row.block:
        raise ValueError(f"row {row.id!r} is a block row: its data is bench.block.make_block_data's")
    gen = row_generator(row, device, seed) if fill else None

    def randn(*shape, dtype=ACT_DTYPE):
        if not fill:
            return torch.empty(shape, device=device, dtype=dtype)
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    base = None
    if row.strided:
        # every other 256-slice of a 12288-wide projection: strides (12288, 512, 1)
        base = randn(row.tokens, STRIDED_ROW)
        x = base.view(row.tokens, row.heads, STRIDED_ROW // row.heads)[:, :, : row.hidden]
    else:
        x = randn(*row.shape)
    wdtype = torch.float32 if row.w32 else ACT_DTYPE
    w = (1.0 - row.weight_offset + 0.1 * randn(row.hidden, dtype=torch.float32)).to(wdtype)
    dy = randn(*row.shape)
    sdtype = torch.float32 if row.r32 else ACT_DTYPE
    r = randn(*row.shape, dtype=sdtype) if row.residual else None
    dh = randn(*row.shape, dtype=sdtype) if row.residual else None
    z = randn(*row.shape) if row.gated else None
    return RowData(row, x, w, dy, r, dh, base, z)


# --- the explicit FP32-statistics reference (eager and torch.compile) -----------------------
# The formulas are reference.py's; these bind the benchmark's eps and the forms it times
# (gated rows: norm, then a silu gate). torch.compile compiles these functions, tracing
# into reference.py. A float32 residual r makes h float32 (reference.residual_sum), y stays
# x's dtype and the backward's dx takes h's dtype. A weight offset is one op on [H]:
# w.float() + offset, the scale the formulas then use (dw does not depend on it).

def _scale(w, offset):
    """The weight the formulas multiply by: w, or f32(w) + offset (1 + w for offset 1)."""
    return w if not offset else w.float() + offset


def ref_forward(x, w, offset=0.0):
    """(y, rstd) of ``reference.forward_fp32``, y = x_hat * (offset + w)."""
    return reference.forward_fp32(x, _scale(w, offset), EPS)[:2]


def ref_forward_residual(x, w, r, offset=0.0):
    """(y, rstd, h) of ``reference.forward_fp32`` with the residual add (h in r's dtype)."""
    return reference.forward_fp32(x, _scale(w, offset), EPS, r)


def ref_forward_gated(x, w, z):
    """(y, rstd) of ``reference.forward_gated_fp32`` (norm, then gate)."""
    return reference.forward_gated_fp32(x, z, w, EPS)


def ref_backward_gated(dy, x, w, z, rstd):
    """(dx, dw, dz) of ``reference.backward_gated_fp32`` (norm, then gate); dw is FP32 [H]."""
    return reference.backward_gated_fp32(dy, x, z, w, rstd)


def ref_backward(dy, h, w, rstd, dh, offset=0.0):
    """(dx, dw) of ``reference.backward_fp32``; dx has h's dtype, dw is FP32 [H]."""
    return reference.backward_fp32(dy, h, _scale(w, offset), rstd, dh)


def _fresh(fn):
    """A copy of fn with its own code object.

    torch.compile (dynamo) keeps its compiled variants and its recompile limit
    per code object; one copy per (row, implementation) keeps every compile
    static-shape and independent of the other rows and of the other mode."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def compile_reference(fn, mode: str = "default", backend: str = "inductor"):
    """torch.compile of a reference function as the bench's peer runs it: a fresh copy
    (_fresh), static shapes, fullgraph, and under Inductor rounding to BF16 where eager
    rounds (emulate_precision_casts, a global setting); ``mode`` is Inductor's, and any
    other backend (the tests' aot_eager on the CPU) takes no mode."""
    if backend == "inductor":
        import torch._inductor.config as inductor_config
        if hasattr(inductor_config, "emulate_precision_casts"):
            inductor_config.emulate_precision_casts = True
    how = {"mode": mode} if backend == "inductor" else {"backend": backend}
    return torch.compile(_fresh(fn), dynamic=False, fullgraph=True, **how)


# --- accuracy ------------------------------------------------------------------------------

def reference_dw(dy, h, w, rstd, dh=None, gate=None, chunk_elems: int = 1 << 25,
                 weight_offset: float = 0.0) -> torch.Tensor:
    """FP64 dw of the formula at the given rstd (``reference.backward_fp64``), in row
    chunks so that the FP64 temporaries of a 65536 x 6144 row stay small. h is the row's
    (float32 on "res r32" rows); the weight offset is passed on (it leaves dw unchanged)."""
    hidden = h.shape[-1]
    dy2, h2 = dy.reshape(-1, hidden), h.reshape(-1, hidden)
    dh2 = dh.reshape(-1, hidden) if dh is not None else None
    z2 = gate.reshape(-1, hidden) if gate is not None else None
    r2 = rstd.reshape(-1)
    step = max(1, chunk_elems // hidden)
    acc = torch.zeros(hidden, dtype=torch.float64, device=h.device)
    for i in range(0, h2.shape[0], step):
        sl = slice(i, i + step)
        out = reference.backward_fp64(dy2[sl], h2[sl], w, r2[sl], dh2[sl] if dh2 is not None else None,
                                      z2[sl] if z2 is not None else None, weight_offset=weight_offset)
        acc += out[1]
    return acc


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dw_check(impl: "Impl", d: RowData) -> tuple[float, str]:
    """(err/tol, dw dtype) of the implementation's dw on this row.

    The reference takes the row's h (``RowData.h``: float32 on "res r32" rows), not the
    one the implementation returned; an h in another dtype than the row's stream is an
    error (ValueError), since a dw from a rounded stream would be checked against itself."""
    dw, h, rstd = impl.compute_dw(d)
    if h.dtype != d.stream_dtype:
        raise ValueError(f"{impl.name} returned h in {dtype_name(h.dtype)}; the row's stream is "
                         f"{dtype_name(d.stream_dtype)}")
    ref = reference_dw(d.dy, d.h(), d.w, rstd.float(), d.dh, d.z, weight_offset=d.offset)
    return reference.dw_err_over_tol(dw, ref), dtype_name(dw.dtype)


def _accepts(fn, name: str) -> bool:
    """Whether a peer's function (or torch.ops op) takes the keyword `name`; True when its
    signature cannot be read (the call then says)."""
    schema = getattr(getattr(fn, "default", None), "_schema", None)
    if schema is not None:
        return any(a.name == name for a in schema.arguments)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


# --- adapters ------------------------------------------------------------------------------

class Impl:
    """Base adapter: subclasses define forward / backward / saved."""

    name = ""
    description = ""
    checks_dw = True      # compute_dw gives a dw to check against FP64 on bwd and step rows

    def __init__(self):
        self.reason = ""

    # a peer's (attribute, module) pairs: available() imports each module into its attribute
    # (import_module: a package attribute cannot shadow a submodule, as QuACK's function
    # rmsnorm shadows quack.rmsnorm)
    modules: tuple[tuple[str, str], ...] = ()

    def available(self) -> bool:
        for attr, module in self.modules:
            try:
                setattr(self, attr, importlib.import_module(module))
            except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
                self.reason = f"not importable ({first_line(exc)})"
                return False
        return True

    def version(self) -> str | None:
        return None

    def skip_reason(self, row: Row) -> str | None:
        return None

    # who makes strided rows contiguous before the peer's kernels read them (None: they
    # read strided rows in place); that copy is timed, and row_note says so
    copies_strided: str | None = None

    def row_note(self, row: Row) -> str:
        if row.strided and self.copies_strided:
            return f"input made contiguous first (as {self.copies_strided} does); the copy is timed"
        return ""

    def op_skip_reason(self, op: str) -> str | None:
        """Why the adapter leaves out an op on every row (None: it times the op)."""
        return None

    def begin_row(self, d: RowData) -> None:
        pass

    def end_row(self) -> None:
        pass

    # forward(d) -> state; backward(d, state) -> (dx, dw); saved(d, state) -> (h, rstd)
    def forward(self, d: RowData):
        raise NotImplementedError

    def backward(self, d: RowData, state):
        raise NotImplementedError

    def saved(self, d: RowData, state):
        raise NotImplementedError

    def prepare(self, d: RowData, op: str) -> Callable[[], object]:
        if op == "fwd":
            return lambda: self.forward(d)
        if op == "bwd":
            state = self.forward(d)
            return lambda: self.backward(d, state)
        if op == "step":
            def step():
                self.forward(d)
                return self.backward(d, self.forward(d))
            return step
        raise ValueError(f"unknown op {op!r}")

    def compute_dw(self, d: RowData):
        state = self.forward(d)
        _, dw = self.backward(d, state)
        h, rstd = self.saved(d, state)
        return dw, h, rstd


class Trainnorm(Impl):
    """trainnorm's explicit entry points, with a preallocated backward workspace."""

    def __init__(self, deterministic: bool):
        super().__init__()
        self.deterministic = deterministic
        self.name = "trainnorm" if deterministic else "trainnorm-fast"
        self.description = f"trainnorm.rms_norm_forward / rms_norm_backward(deterministic={deterministic})"
        self.ws = None

    def version(self):
        return trainnorm.__version__

    def begin_row(self, d):
        # sized for x's dtype, as the README says (also on "res r32" rows)
        self.ws = trainnorm.backward_workspace(d.row.rows, d.hidden, deterministic=self.deterministic,
                                               device=d.x.device, dtype=d.x.dtype, gated=d.z is not None)

    def end_row(self):
        self.ws = None

    def forward(self, d):
        if d.z is not None:
            y, rstd = trainnorm.rms_norm_gated_forward(d.x, d.z, d.w, EPS)
            return y, rstd, d.x
        return trainnorm.rms_norm_forward(d.x, d.w, EPS, residual=d.r, weight_offset=d.offset)   # (y, rstd, h)

    def backward(self, d, state):
        _, rstd, h = state
        if d.z is not None:
            dx, _, dw = trainnorm.rms_norm_gated_backward(d.dy, h, d.z, d.w, rstd, deterministic=self.deterministic,
                                                          workspace=self.ws)
            return dx, dw
        return trainnorm.rms_norm_backward(d.dy, h, d.w, rstd, dh=d.dh, deterministic=self.deterministic,
                                           workspace=self.ws, weight_offset=d.offset)

    def saved(self, d, state):
        return state[2], state[1]


class Eager(Impl):
    """The explicit FP32-statistics reference in PyTorch eager (one kernel per op); on
    "res r32" rows h = f32(x) + r stays float32 and so does dx, on "1+w" rows the
    weight is f32(w) + 1."""

    name = "eager"
    description = "PyTorch eager, explicit FP32-statistics reference"

    def _fns(self):
        return ref_forward, ref_forward_residual, ref_backward, ref_forward_gated, ref_backward_gated

    def version(self):
        return torch.__version__

    def forward(self, d):
        fwd, fwd_res, _, fwd_gated, _ = self._fns()
        if d.z is not None:
            y, rstd = fwd_gated(d.x, d.w, d.z)
            return y, rstd, d.x
        if d.r is None:
            y, rstd = fwd(d.x, d.w, d.offset)
            return y, rstd, d.x
        return fwd_res(d.x, d.w, d.r, d.offset)

    def backward(self, d, state):
        _, rstd, h = state
        if d.z is not None:
            dx, dw, _ = self._fns()[4](d.dy, h, d.w, d.z, rstd)
            return dx, dw
        return self._fns()[2](d.dy, h, d.w, rstd, d.dh, d.offset)

    def saved(self, d, state):
        return state[2], state[1]


class Compiled(Eager):
    """torch.compile of the explicit reference, forward and backward compiled
    separately (static shapes, fullgraph), so the timed backward holds no forward.
    The weight offset is a Python float argument: with dynamic=False it is a
    constant of the graph. ``backend`` is torch.compile's (Inductor; the tests
    use "aot_eager" on the CPU, where the mode does not apply)."""

    def __init__(self, mode: str, backend: str = "inductor"):
        super().__init__()
        self.mode = mode
        self.backend = backend
        self.name = "torch-compile" if mode == "default" else "torch-compile-maxat"
        self.description = f"torch.compile(mode={mode!r}, dynamic=False) of the explicit reference"
        self._compiled = None

    def begin_row(self, d):
        # rounds to BF16 where the eager reference rounds (h before y), as eager does
        self._compiled = tuple(compile_reference(f, self.mode, self.backend) for f in Eager._fns(self))

    def end_row(self):
        self._compiled = None

    def _fns(self):
        return self._compiled


class Quack(Impl):
    """QuACK (CuTe DSL) with its analytical heuristic configuration.

    ``quack.rmsnorm.rmsnorm_fwd(x, weight, bias=None, residual=None, out_dtype=None,
    residual_dtype=None, eps=1e-6, store_rstd=False, weight_offset=0.0)
    -> (out, residual_out, rstd)`` and ``rmsnorm_bwd(x, weight, dout, rstd,
    dresidual_out=None, has_bias=False, has_residual=False, weight_offset=0.0)
    -> (dx, dw, db, dresidual)``, the functions its autograd Function calls.
    Inputs are flattened to [rows, H] (a view: the strided per-head rows keep
    their row stride of 512 and are read in place, as QuACK's own rmsnorm()
    does). dw comes back in the weight's dtype (its FP32 partials summed and
    cast), so BF16-weight rows carry a BF16 dw. The residual is fused (h
    returned as residual_out; the backward adds dh via dresidual_out). On
    "res r32" rows the residual is float32 and residual_dtype=torch.float32: h
    comes back float32, and the backward on it writes dx in float32 (its dx is
    empty_like(x), dresidual_out having x's dtype), as the stream's gradient.
    On "1+w" rows weight_offset=1.0 goes to both functions; a QuACK whose
    functions take no weight_offset skips those rows. The keywords are passed
    only on the rows that need them."""

    name = "quack"
    description = "QuACK rmsnorm_fwd / rmsnorm_bwd, heuristic config"

    modules = (("qr", "quack.rmsnorm"),)
    qr = None

    def version(self):
        try:
            import quack
            return getattr(quack, "__version__", None) or _dist_version("quack-kernels")
        except Exception:  # noqa: BLE001
            return None

    def skip_reason(self, row):
        if row.gated:
            return "no gated norm"
        if row.weight_offset and self.qr is not None:
            lacking = [getattr(f, "__name__", str(f)) for f in self._offset_fns() if not _accepts(f, "weight_offset")]
            if lacking:
                return f"this QuACK's {', '.join(lacking)} take no weight_offset"
        return None

    def _offset_fns(self):
        """The functions that get weight_offset on "1+w" rows."""
        return self.qr.rmsnorm_fwd, self.qr.rmsnorm_bwd

    @staticmethod
    def _fwd_kw(d) -> dict:
        kw = {"residual_dtype": torch.float32} if d.row.r32 else {}
        if d.offset:
            kw["weight_offset"] = d.offset
        return kw

    @staticmethod
    def _offset_kw(d) -> dict:
        return {"weight_offset": d.offset} if d.offset else {}

    def forward(self, d):
        out, res_out, rstd = self.qr.rmsnorm_fwd(d.flat(d.x), d.w, residual=d.flat(d.r), eps=EPS,
                                                 store_rstd=True, **self._fwd_kw(d))
        return out, rstd, res_out      # res_out is x itself without a residual

    def backward(self, d, state):
        _, rstd, h = state
        dx, dw, _, _ = self.qr.rmsnorm_bwd(h, d.w, d.flat(d.dy), rstd, dresidual_out=d.flat(d.dh),
                                           has_residual=d.r is not None, **self._offset_kw(d))
        return dx, dw

    def saved(self, d, state):
        return state[2], state[1]


class QuackF32dw(Quack):
    """QuACK's forward and backward kernels, with the backward's float32 dw partials
    summed in float32.

    QuACK's rmsnorm_bwd computes dw as float32 partials, one row per program,
    sums them in float32 and casts the sum to the weight's dtype: BF16 on
    BF16-weight rows, outside the contract's dw dtype. Here the backward calls
    the op rmsnorm_bwd does on these inputs (2-D, with a weight),
    ``torch.ops.quack.rmsnorm_bwd_f(x, weight, dout, rstd, dresidual_out, sm_count)
    -> (dx, dw_partial)`` (registered by quack.rmsnorm, QuACK >= 0.6.2), with
    ``quack.rmsnorm.get_sm_count(H, device)`` partials as rmsnorm_bwd takes, and
    sums dw_partial [sm_count, H] in float32 (dh has h's dtype on the bench's
    residual rows, float32 on "res r32" ones: the kernel adds it into dx). On
    "1+w" rows the op gets weight_offset= (QuACK versions whose op has that
    argument; others skip those rows). The forward is Quack's: the fwd op is
    left to that adapter, and FP32-weight rows too, where QuACK's own dw is
    already the float32 sum."""

    name = "quack-f32dw"
    description = "QuACK rmsnorm_fwd / torch.ops.quack.rmsnorm_bwd_f, dw partials summed in float32"

    def __init__(self):
        super().__init__()
        self.bwd_partials = None

    def available(self):
        if not super().available():
            return False
        try:
            self.bwd_partials = torch.ops.quack.rmsnorm_bwd_f
        except (AttributeError, RuntimeError) as exc:
            self.reason = f"QuACK has no rmsnorm_bwd_f op (it came in 0.6.2; {first_line(exc)})"
            return False
        return True

    def skip_reason(self, row):
        if row.w32:
            return "quack's own dw is the float32 sum on FP32-weight rows"
        return super().skip_reason(row)

    def op_skip_reason(self, op):
        return "its forward is quack's" if op == "fwd" else None

    def _offset_fns(self):
        return self.qr.rmsnorm_fwd, self.bwd_partials

    def backward(self, d, state):
        _, rstd, h = state
        sm_count = self.qr.get_sm_count(h.shape[-1], h.device)
        dx, dw_partial = self.bwd_partials(h, d.w, d.flat(d.dy), rstd, d.flat(d.dh), sm_count,
                                           **self._offset_kw(d))
        return dx, dw_partial.sum(dim=0, dtype=torch.float32)


class QuackAutotune(Quack):
    """QuACK with its exhaustive per-shape autotune (``rmsnorm_fwd_tuned`` /
    ``rmsnorm_bwd_tuned``); the search runs in the warm-up, before capture."""

    name = "quack-autotune"
    description = "QuACK rmsnorm_fwd_tuned / rmsnorm_bwd_tuned, exhaustive autotune"

    def _offset_fns(self):
        return self.qr.rmsnorm_fwd_tuned, self.qr.rmsnorm_bwd_tuned

    def forward(self, d):
        x, r = d.flat(d.x), d.flat(d.r)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        # h in the residual's dtype: float32 on "res r32" rows
        res_out = torch.empty(x.shape, dtype=r.dtype, device=x.device) if r is not None else None
        self.qr.rmsnorm_fwd_tuned(x, d.w, out, None, rstd, None, r, res_out,
                                  eps=EPS, is_layernorm=False, per_head=False, **self._offset_kw(d))
        return out, rstd, (res_out if r is not None else x)

    def backward(self, d, state):
        _, rstd, h = state
        n = h.shape[-1]
        sm = self.qr.get_sm_count(n, h.device)
        dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        dw_partial = torch.empty((sm, n), dtype=torch.float32, device=h.device)
        self.qr.rmsnorm_bwd_tuned(h, d.w, d.flat(d.dy), rstd, dx, dw_partial, None, d.flat(d.dh), None, sm,
                                  per_head=False, has_dw_partial=True, has_db_partial=False,
                                  is_layernorm=False, **self._offset_kw(d))
        return dx, dw_partial.sum(dim=0).to(d.w.dtype)


class Liger(Impl):
    """Liger-Kernel's RMSNorm in casting mode "gemma" (everything in FP32), offset 0, or
    the row's weight offset (1.0 on the "1+w" rows: LigerRMSNormFunction's ``offset``).

    ``liger_kernel.ops.rms_norm.rms_norm_forward(X, W, eps, offset, casting_mode,
    row_mode) -> (Y, X, RSTD, BLOCK_SIZE, num_warps, casting_mode)`` and
    ``rms_norm_backward(dY, X, W, RSTD, offset, casting_mode, BLOCK_SIZE,
    num_warps, in_place, row_mode, needs_dw=None) -> (dX, dW)``: the helpers
    ``LigerRMSNormFunction.forward(ctx, X, W, eps, offset=0.0,
    casting_mode="llama", in_place=True, row_mode=None)`` and its backward call.
    As that Function does, inputs are made contiguous first (a copy, timed, on
    the strided per-head rows) and the backward writes dx into dy
    (in_place=True, its default): the adapter keeps its own dy buffer.
    dW comes back in the weight's dtype. No residual, so no float32 residual stream."""

    name = "liger"
    description = 'Liger-Kernel rms_norm_forward / rms_norm_backward, casting_mode="gemma"'

    modules = (("ops", "liger_kernel.ops.rms_norm"),)
    copies_strided = "LigerRMSNormFunction"

    def __init__(self):
        super().__init__()
        self.dy = None

    def version(self):
        return _dist_version("liger-kernel", "liger_kernel")

    def skip_reason(self, row):
        if row.residual:
            return "no fused residual add" + (" (so no float32 residual stream)" if row.r32 else "")
        if row.gated:
            return "no gated norm"
        return None

    def begin_row(self, d):
        self.dy = d.dy.clone()

    def end_row(self):
        self.dy = None

    def forward(self, d):
        return self.ops.rms_norm_forward(d.x.contiguous(), d.w, EPS, d.offset, "gemma", None)

    def _backward(self, d, state, dy):
        _, x, rstd, block, warps, mode = state
        return self.ops.rms_norm_backward(dy, x, d.w, rstd, d.offset, mode, block, warps, True, None,
                                          needs_dw=True)

    def backward(self, d, state):
        return self._backward(d, state, self.dy)

    def saved(self, d, state):
        return state[1], state[2]

    def compute_dw(self, d):
        state = self.forward(d)
        _, dw = self._backward(d, state, d.dy.clone())   # a fresh dy: the backward overwrites it
        h, rstd = self.saved(d, state)
        return dw, h, rstd


class Fla(Impl):
    """flash-linear-attention's Triton norms (fla-core): ``fla.modules.norm.layernorm``'s
    ``layer_norm_fwd(x, weight, bias, eps, residual, out_dtype, residual_dtype,
    is_rms_norm) -> (y, mean, rstd, residual_out)`` and ``layer_norm_bwd(dy, x, weight,
    bias, mean, rstd, dres, has_residual, is_rms_norm, x_dtype) -> (dx, dw, db,
    dres_in)``, the functions its RMSNorm's autograd Function calls; gated rows take
    ``fused_norm_gate``'s ``layer_norm_gated_fwd`` / ``layer_norm_gated_bwd`` with
    activation "swish" (norm, then x * sigmoid(z): the gated rows' form). Its kernels
    read contiguous rows (the Function makes inputs contiguous first): the strided
    per-head rows are copied, and the copy is timed. The residual is fused (its
    residual_out is h, float32 on "res r32" rows; the backward adds dh as dres). dw
    comes back in the weight's dtype (float32 partials, one per SM, summed in float32
    and cast). No weight offset, so no "1+w" rows."""

    name = "fla"
    description = "fla-core layer_norm_fwd / layer_norm_bwd (is_rms_norm=True), gated: layer_norm_gated_*"

    modules = (("ln", "fla.modules.norm.layernorm"), ("gate", "fla.modules.norm.fused_norm_gate"))
    copies_strided = "fla's autograd Function"

    def version(self):
        return _dist_version("fla-core", "flash-linear-attention", "fla")

    def skip_reason(self, row):
        if row.weight_offset:
            return "no weight offset"
        return None

    @staticmethod
    def _rows(t):
        return None if t is None else t.reshape(-1, t.shape[-1]).contiguous()

    def forward(self, d):
        x = self._rows(d.x)
        if d.z is not None:
            y, _, rstd, _ = self.gate.layer_norm_gated_fwd(x, self._rows(d.z), d.w, None, "swish", EPS,
                                                           is_rms_norm=True)
            return y, rstd, x
        y, _, rstd, h = self.ln.layer_norm_fwd(x, d.w, None, EPS, residual=self._rows(d.r), is_rms_norm=True)
        return y, rstd, h

    def backward(self, d, state):
        _, rstd, h = state
        if d.z is not None:
            dx, _, dw, _, _ = self.gate.layer_norm_gated_bwd(d.flat(d.dy), h, self._rows(d.z), d.w, None, "swish",
                                                             EPS, rstd=rstd, is_rms_norm=True)
            return dx, dw
        dx, dw, _, _ = self.ln.layer_norm_bwd(d.flat(d.dy), h, d.w, None, rstd=rstd, dres=d.flat(d.dh),
                                              has_residual=d.r is not None, is_rms_norm=True, x_dtype=h.dtype)
        return dx, dw

    def saved(self, d, state):
        return state[2], state[1]


class TransformerEngine(Impl):
    """Transformer Engine's ``transformer_engine.pytorch.RMSNorm`` module, through
    autograd: fwd is the module call, bwd is ``torch.autograd.grad`` of a kept
    output (the only public entry). Its rstd is internal, so dw is checked
    against FP64 at the FP32 rstd of the eager formula. No residual (so no
    float32 residual stream). On "1+w" rows the module is built with
    ``zero_centered_gamma=True`` (y = x_hat * (1 + gamma)); other offsets are
    skipped."""

    name = "transformer-engine"
    description = "transformer_engine.pytorch.RMSNorm (autograd)"
    modules = (("te", "transformer_engine.pytorch"),)

    def __init__(self):
        super().__init__()
        self.mod = None
        self.x = None

    def version(self):
        try:
            import transformer_engine
            return getattr(transformer_engine, "__version__", None) or _dist_version("transformer-engine")
        except Exception:  # noqa: BLE001
            return None

    def skip_reason(self, row):
        if row.residual:
            return "no fused residual add" + (" (so no float32 residual stream)" if row.r32 else "")
        if row.gated:
            return "no gated norm"
        if row.weight_offset not in (0.0, 1.0):
            return "zero_centered_gamma is a weight offset of 1 only"
        return None

    def begin_row(self, d):
        kw = {"zero_centered_gamma": True} if d.offset == 1.0 else {}
        self.mod = self.te.RMSNorm(d.hidden, eps=EPS, params_dtype=d.w.dtype, device=d.x.device, **kw)
        with torch.no_grad():
            self.mod.weight.copy_(d.w)
        self.x = d.x.detach().requires_grad_(True)

    def end_row(self):
        self.mod = None
        self.x = None

    def forward(self, d):
        return self.mod(self.x)

    def backward(self, d, state):
        dx, dw = torch.autograd.grad(state, (self.x, self.mod.weight), d.dy, retain_graph=True)
        return dx, dw

    def saved(self, d, state):
        return d.x, reference.rstd_fp32(d.x.float(), EPS)


# every name `--impls` takes; trainnorm-eager is the eager block with trainnorm's norms (block rows only)
IMPL_NAMES = ("trainnorm", "trainnorm-fast", "trainnorm-eager", "torch-compile", "torch-compile-maxat", "quack",
              "quack-f32dw", "quack-autotune", "liger", "fla", "transformer-engine", "eager")


def make_impls(quack_autotune: bool = False) -> list[Impl]:
    """Every adapter of the norm rows, in the order of the report (trainnorm first, eager last)."""
    impls: list[Impl] = [Trainnorm(True), Trainnorm(False), Compiled("default"),
                         Compiled("max-autotune-no-cudagraphs"), Quack(), QuackF32dw()]
    if quack_autotune:
        impls.append(QuackAutotune())
    impls += [Liger(), Fla(), TransformerEngine(), Eager()]
    return impls
