"""Triton kernels, one per form (see each module's docstring for the maths and
the forms). Launch them through trainnorm.dispatch, which launches what
trainnorm.plan chose; nothing here branches on shapes."""
from .backward import bwd_col_slices_kernel, bwd_col_tiles_kernel, bwd_one_tile_kernel
from .combine import dw_combine_kernel
from .forward import fwd_col_tiles_kernel, fwd_one_tile_kernel

__all__ = ["fwd_one_tile_kernel", "fwd_col_tiles_kernel", "bwd_one_tile_kernel", "bwd_col_tiles_kernel",
           "bwd_col_slices_kernel", "dw_combine_kernel"]
