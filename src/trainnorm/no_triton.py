"""Stand-ins for the Triton kernels where Triton is not installed.

Triton ships Linux wheels only; elsewhere trainnorm still imports, and CPU
tensors run the float64 reference path. A launch (a CUDA tensor, or
TRITON_INTERPRET=1) then raises an ImportError that says so, instead of a
NameError from deep inside the dispatcher.
"""
from __future__ import annotations


class MissingKernel:
    def __init__(self, name: str, error: ImportError):
        self.name = name
        self.error = error

    def __getitem__(self, grid):
        raise ImportError(
            f"trainnorm's Triton kernel {self.name} cannot run: {self.error}. Triton is needed for CUDA tensors "
            "and for TRITON_INTERPRET=1 (pip install triton, on Linux); CPU tensors without TRITON_INTERPRET "
            "run the float64 reference path and need no Triton.") from self.error


def missing_kernels(names, error: ImportError) -> list[MissingKernel]:
    return [MissingKernel(n, error) for n in names]


def is_missing_triton(error: ImportError) -> bool:
    """Whether an ImportError is Triton itself missing (not a fault inside an installed one)."""
    name = getattr(error, "name", None) or ""
    return name == "triton" or name.startswith("triton.")
