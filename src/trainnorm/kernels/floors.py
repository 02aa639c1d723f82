"""Two kernels that measure floors for `python -m trainnorm.dev.tune --probe-latency`: what
a launch costs with nothing to do, and what reading and writing rows costs with nothing
computed. No entry point launches them: they sit beside the data path's kernels because the
package imports Triton in kernels/ alone."""
import triton
import triton.language as tl


@triton.jit
def empty_kernel(SINK):
    """One program a row, each writing one value: a launch and a store."""
    tl.store(SINK + tl.program_id(0), 1.0)


@triton.jit
def copy_rows_kernel(X, Y, n_cols, BLOCK: tl.constexpr):
    """One program a row of contiguous [rows, n_cols]: the row loaded and stored."""
    o_n = tl.arange(0, BLOCK)
    o = tl.program_id(0).to(tl.int64) * n_cols + o_n
    m = o_n < n_cols
    tl.store(Y + o, tl.load(X + o, mask=m), mask=m)
