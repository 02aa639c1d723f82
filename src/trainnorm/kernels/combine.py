"""Fixed-order combine of the backward's dw partials.

    dw_j = sum_{p < num_chunks} PARTIAL[p, j]      accumulated in float64

Each program owns BLOCK_N columns and walks the chunks in BLOCK_P steps; the
order of additions depends only on (num_chunks, H) and the constexpr tile, so
dw is bitwise reproducible on any GPU.
"""
import triton
import triton.language as tl

from .common import grid_dependency


@triton.jit
def dw_combine_kernel(PARTIAL, DW, num_chunks, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                      PDL: tl.constexpr = False):
    grid_dependency(PDL)
    pid = tl.program_id(0)
    o_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < n_cols
    o_p = tl.arange(0, BLOCK_P)
    b_acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float64)
    for p0 in tl.range(0, num_chunks, BLOCK_P):
        o_pp = p0 + o_p
        mask = (o_pp < num_chunks)[:, None] & m_n[None, :]
        p_part = PARTIAL + (o_pp.to(tl.int64) * n_cols)[:, None] + o_n[None, :]
        b_acc += tl.load(p_part, mask=mask, other=0.0).to(tl.float64)
    tl.store(DW + o_n, tl.sum(b_acc, axis=0).to(tl.float32), mask=m_n)
