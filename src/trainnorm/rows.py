"""Rows as the kernels see them, and the device facts a launch needs.

- Row views: any `[..., H]` tensor becomes rows with a two-level stride, so
  per-head views such as `q[T, 24, 256]` with strides `(12288, 512, 1)` are
  read in place: row r sits at `(r // NH) * stride_t + (r % NH) * stride_h`.
  A last dim whose stride is not 1 is copied once (the only copy made).
- Tensor descriptors: where a config asks for bulk-copy loads and the layout
  allows them (one-level rows, 16-byte aligned base and row stride, sm_90+).
- The SM count sizes the persistent grids, never the numerics; tests and
  `trainnorm verify` simulate other counts with `simulate_sm_count`.
- The architecture names the configuration table (configs.Key).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_installed() -> bool:
    """Whether Triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def why_no_gpu_kernels() -> str | None:
    """Why the kernels cannot run on a GPU here, or None where they can."""
    if not torch.cuda.is_available():
        return "no GPU here"
    return None if triton_installed() else "Triton is not installed"


def cli_device(choice: str = "auto") -> str:
    """The device a command (demo, verify) runs on: "cuda" where a GPU is there and Triton
    is installed (auto), else "cpu"; an explicit "cuda" that cannot run the kernels is a
    ValueError that says why."""
    if choice not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {choice!r}")
    if choice == "cpu":
        return "cpu"
    why = why_no_gpu_kernels()
    if choice == "cuda" and why:
        raise ValueError(f"--device cuda: the kernels cannot run here ({why})")
    return "cpu" if why else "cuda"


def runs_kernels(t: torch.Tensor) -> bool:
    """CUDA tensors run the kernels; CPU tensors too under TRITON_INTERPRET=1."""
    return t.is_cuda or (t.device.type == "cpu" and interpreter_enabled())


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# --- SM count ---------------------------------------------------------------------------------

_sm_override: int | None = None
_sm_cache: dict[int, int] = {}


@contextlib.contextmanager
def simulate_sm_count(n: int):
    """Run the dispatcher as if the GPU had `n` multiprocessors (tests, verify)."""
    global _sm_override
    old, _sm_override = _sm_override, int(n)
    try:
        yield
    finally:
        _sm_override = old


def sm_count(device: torch.device) -> int:
    if _sm_override is not None:
        return _sm_override
    if device.type != "cuda":
        return 4
    idx = _index(device)
    if idx not in _sm_cache:
        _sm_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_cache[idx]


_arch_cache: dict[int, str] = {}


def arch_of(device) -> str | None:
    """"sm_90" for a CUDA device of compute capability 9.0; None for the CPU
    (configs then use their default architecture's table)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    idx = _index(device)
    if idx not in _arch_cache:
        major, minor = torch.cuda.get_device_capability(idx)
        _arch_cache[idx] = f"sm_{major}{minor}"
    return _arch_cache[idx]


def device_guard(t: torch.Tensor):
    """Triton launches on the current device: make it the tensor's."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# --- row views --------------------------------------------------------------------------------

def _row_view(t: torch.Tensor):
    """(tensor, [(size, stride), ...]) with unit and mergeable leading dims collapsed.

    A last dim whose stride is not 1 is copied once (the only copy this makes)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    merged: list[tuple[int, int]] = []
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    return t, merged


def row_views(*tensors):
    """Express every tensor's rows with one inner count NH.

    Returns (NH, [(tensor, stride_t, stride_h), ...]); row r of a tensor sits at
    (r // NH) * stride_t + (r % NH) * stride_h. A one-level view fits any NH; a
    tensor whose two-level layout disagrees with the first one's is copied.
    None stands for an absent tensor and gives (None, 0, 0)."""
    views = [_row_view(t) if t is not None else None for t in tensors]
    nh = 1
    for v in views:
        if v is not None and len(v[1]) == 2:
            nh = v[1][1][0]
            break
    out = []
    for v in views:
        if v is None:
            out.append((None, 0, 0))
            continue
        t, dims = v
        if len(dims) > 2 or (len(dims) == 2 and dims[1][0] != nh):
            t = t.contiguous()
            dims = [(t.numel() // t.shape[-1], t.shape[-1])]
        if len(dims) == 2:
            out.append((t, dims[0][1], dims[1][1]))
            continue
        hidden = t.shape[-1]
        # one row: its stride addresses nothing; give it a contiguous row's
        stride = dims[0][1] if dims else hidden
        if nh == 1 and not _specialised_as_contiguous(t, stride, hidden):
            t, stride = t.contiguous(), hidden
        out.append((t, stride * nh, stride))
    return nh, out


def _specialised_as_contiguous(t: torch.Tensor, stride: int, hidden: int) -> bool:
    """Whether Triton specialises rows of this stride and base as it does contiguous rows:
    it marks an integer argument divisible by 16 and a pointer 16-byte aligned, and the
    compiler lays a tile's registers out from the loads that follow, which fixes the
    order of a row's additions (trainnorm.dev.compile_check.reduction_trees). Compiled
    for sm_90: at H 1000 a row stride of 0 (one row) gave one value a thread where 1000
    gave 8, a row-sum's other order; with a float32 stream beside a 16-bit one, rows of
    stride H + 4 took 4 values a thread where contiguous rows took 8 (H 512-6144). Rows
    that differ are copied once, so where they lie changes no bit."""
    return (stride % 16 == 0) == (hidden % 16 == 0) and t.data_ptr() % 16 == 0


# --- tensor descriptors -----------------------------------------------------------------------

def _tma_capable(device: torch.device) -> bool:
    """Tensor descriptors need the bulk copy engine (sm_90 and later); Triton's
    interpreter emulates them on the CPU."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(_index(device))[0] >= 9


# Tiles narrower than this read a stream wider than the key's plainly (see descriptor_depth).
MIXED_DESCRIPTOR_MIN_BLOCK_N = 1024


def descriptor_depth(stages: int, elts, key_elt: int, block_n: int, hidden: int) -> int:
    """The tile depth descriptor loads may pipeline for streams of `elts` bytes a value
    under a config of `stages` sized for `key_elt`, on rows of `hidden` values in tiles
    of `block_n` columns: the part of descriptor_stages that no address decides. The
    bits must not depend on the load form, and the compiler lays a tile's registers out
    from the loads and stores around it, which fixes the order of a row's additions.
    Compiled for sm_90 (`trainnorm compile-check --load-forms` compares every reduction's
    split, trainnorm.dev.compile_check.reduction_trees):

    - a row width that is not a multiple of 16 values leaves plain loads unvectorised,
      one value a thread (H 1000: 8 with descriptors), so such rows are read plainly;
    - a float32 stream beside 16-bit ones read through descriptors took another layout:
      h of a float32 residual stream in tiles of several narrow rows (H 64-512,
      block_n <= 512; under Triton 3.6 and 3.9 the same layout at block_n >= 1024),
      dy of a float32 y at every width under Triton 3.9 (H 1024-6144: 4 values a
      thread against 8). The descriptor form serves T past one chunk, so dx's bits
      followed T (an H100 found 5 values of one row at H 512 differ between the row
      alone and in 4096 rows). Those streams are read plainly there: elts[0], the
      stream the tile is keyed on (dy in the backward, x in the forward), must have
      the key's size, and a wider stream beside it needs block_n >= 1024.

    The config's shared memory holds `stages` tiles of every stream at the key's size; a
    wider stream makes each stage wider, so the footprint (and the programs per SM the
    config was timed with) is kept by pipelining fewer tiles: 4 bf16 stages of dy and h
    become 2 with h in float32 (4 deep asked 296 KiB at H 5120-6144 with both in
    float32, over sm_90's 227 KiB per block). Under 2 tiles in flight nothing is
    pipelined. No stream is narrower than the key (plan.backward_key_dtype), so the
    depth never grows past the config's."""
    if not stages or block_n * key_elt < 16 or hidden % 16 or elts[0] != key_elt:
        return 0
    if any(e != key_elt for e in elts) and block_n < MIXED_DESCRIPTOR_MIN_BLOCK_N:
        return 0
    fit = stages * key_elt * len(elts) // sum(elts)
    return fit if fit >= 2 else 0


def descriptor_stages(stages: int, col_tiles: int, nh: int, *views, elt: int, block_n: int, hidden: int) -> int:
    """How deep to pipeline rows read through tensor descriptors, 0 where they cannot be
    (rows that fit one tile, one level, base and row stride 16-byte aligned: the bulk
    copy's rules) or may not be (descriptor_depth). views: (tensor, row stride) pairs,
    None for an absent tensor; stages: the config's depth, chosen for streams of elt
    bytes (its key's); block_n: the tile's columns; hidden: the row's values. The layout
    is only inspected when a config asks for them."""
    if not stages or col_tiles != 1 or nh != 1:
        return 0
    present = [(t, stride) for t, stride in views if t is not None]
    for t, stride in present:
        e = t.element_size()
        if t.data_ptr() % 16 or (stride * e) % 16 or not _tma_capable(t.device):
            return 0
    return descriptor_depth(stages, [t.element_size() for t, _ in present], elt, block_n, hidden)


def loads_16_bytes(hidden: int, nh: int, *views) -> bool:
    """Whether Triton reads these rows 16 bytes a thread: one-level rows (row_views gives them
    the base and stride Triton specializes as it does contiguous rows) of 16-bit streams,
    and H a multiple of 16 values. views: (tensor, stride_t, stride_h) triples, None for
    an absent tensor. Compiled for sm_90 (Triton 3.6) a one-row backward at H 1000 and 3000
    took fewer values a thread."""
    if hidden % 16 or nh != 1:
        return False
    return all(t is None or (t.element_size() == 2 and t.data_ptr() % 16 == 0) for t, _, _ in views)


def row_descriptor(t: torch.Tensor, stride: int, rows: int, hidden: int, block_m: int, block_n: int):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, [rows, hidden], [stride, 1], [block_m, block_n])
