"""Triton kernels. Launch them through trainnorm.dispatch, which picks the
tile, the chunking and the dw mode; nothing here branches on shapes."""
from .backward import rms_norm_bwd_kernel
from .combine import dw_combine_kernel
from .forward import rms_norm_fwd_kernel

__all__ = ["rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "dw_combine_kernel"]
