"""Test set-up.

Without a GPU the Triton kernels run on CPU tensors through Triton's
interpreter: TRITON_INTERPRET must be set before triton is first imported.
Every test runs with torch's deterministic mode, whose
fill_uninitialized_memory poisons torch.empty outputs (NaN for floats, the
largest value for integers, so the uint8 workspace reads as NaN partials):
an element a kernel fails to write shows up as NaN.
"""
import os

import pytest

try:
    import torch
    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _poison_uninitialized():
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(old)
    if HAS_CUDA:
        # give the caching allocator's blocks back: workers sharing one GPU otherwise keep
        # what their largest test held (12-26 GiB each in the first whole-suite run on an
        # H100, where the bigmem tests then ran out of memory)
        torch.cuda.empty_cache()


@pytest.fixture
def device():
    return DEVICE


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    # One GPU shared by pytest-xdist workers: the bigmem tests hold up to ~20 GiB each
    # (FP64 references of 65,536 x 6144 rows): 8 workers on an 80 GB H100 ran out of
    # memory in 82 of tests/test_gpu.py's 163 tests. In one group they run one after
    # another on one worker (`-n 4 --dist loadgroup`); with 6 workers on an H100 that
    # still left 67 out of memory beside the other workers' tests, so tools/h200.sh
    # runs them in a second, serial pass (`-m bigmem`) after `-m "not bigmem"`.
    one_at_a_time = pytest.mark.xdist_group("gpu-memory")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
        if "bigmem" in item.keywords:
            item.add_marker(one_at_a_time)


@pytest.fixture
def use_configs():
    """use_configs(forward=..., backward=...): a configs.override for the rest of the test."""
    import contextlib

    from trainnorm import configs
    with contextlib.ExitStack() as stack:
        yield lambda **kw: stack.enter_context(configs.override(**kw))


@pytest.fixture
def force_atomic():
    """deterministic=False takes its one-launch atomic form wherever it applies
    (from the first row on), whatever edge configs/tuned.py measured: the tests
    of that form do not depend on the tuned table."""
    from trainnorm import configs
    with configs.override(backward=lambda key, cfg: cfg.replace(atomic_min_rows=0)):
        yield
