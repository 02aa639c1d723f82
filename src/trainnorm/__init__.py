"""trainnorm: RMSNorm for training, forward and backward in Triton.

Deterministic by default (bitwise reproducible dw, independent of the GPU's SM
count); deterministic=False for a faster dw with the same y, rstd, h and dx.

One path for the data, each module importing only those below it:

    functional.py, modules.py   validate the arguments; build the Variant (variant.py)
    ops.py                      torch.library custom ops, fake implementations, autograd
    dispatch.py                 allocate and launch (or the float64 reference on the CPU)
    plan.py                     the kernel form, dw form and config for a shape and mode
    configs/, rows.py           tiles, schedules and windows as data; row views, SM count
    kernels/                    one Triton kernel per form, shared @triton.jit helpers
    reference.py                every formula once (FP64, and the FP32 eager forms)

`bench/`, `verify.py`, `demo.py` and `dev/` (tuning, soak, compile checks)
sit above the API and use it as a user would, plus configs.override.
"""
from .functional import (
    backward_workspace,
    backward_workspace_bytes,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_gated,
    rms_norm_gated_backward,
    rms_norm_gated_forward,
)
from .modules import RMSNorm, RMSNormGated
from .ops import RMSNormFunction
from . import integrations  # matches HF modules by name and behaviour; never imports transformers

__version__ = "0.1.0"

__all__ = [
    "rms_norm",
    "rms_norm_forward",
    "rms_norm_backward",
    "backward_workspace",
    "backward_workspace_bytes",
    "rms_norm_gated",
    "rms_norm_gated_forward",
    "rms_norm_gated_backward",
    "RMSNorm",
    "RMSNormGated",
    "RMSNormFunction",
]
