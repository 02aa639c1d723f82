"""trainnorm: RMSNorm for training, forward and backward in Triton.

Deterministic by default (bitwise reproducible dw, independent of the GPU's SM
count); deterministic=False for a faster dw with the same y, rstd, h and dx.
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
