"""RMSNorm backward: dx (plus the residual stream's gradient) and dw, in one kernel.

Given dy, the saved h (x when there is no residual), w, the saved float32
rstd and optionally dh (the gradient reaching the returned h):

    g_j    = f32(dy_j) * f32(w_j)          (g = dy without a weight)
    xhat_j = f32(h_j) * rstd
    c      = sum_j g_j * xhat_j / H
    dx_j   = round(rstd * (g_j - xhat_j * c) + f32(dh_j))
    dw_j   = sum over rows of f32(dy_j) * xhat_j            (float32 result)

The rows are split into `num_chunks` chunks of `rows_per_chunk` rows; both
numbers are a function of (rows, H) only (see dispatch.py). A program takes
chunks `pid, pid + grid, ...`; every chunk is processed the same way whichever
program takes it, so the grid may follow the SM count without changing a bit.
dw's terms are formed exactly in float64 (see _dw_terms) and summed in float64
within and across chunks (float64 partials), so dw is the exact sum rounded
once to float32, up to float64 rounding: far inside the budget on every input
family and never worse than the FP32 eager reduction.

DW_MODE selects what happens to the dw partials:
    0  no dw (weight absent or not requiring grad)
    1  each chunk's partial goes to PARTIAL[chunk, :] (float64); combine.py sums
       the chunks in a fixed order
    2  each program sums its chunks and adds the float64 result atomically into
       a zeroed float64 accumulator (PARTIAL[0, :]); the last program to arrive
       rounds it into DW and re-zeroes it. One launch; the order of the float64
       additions varies, so dw's last bits may too (deterministic=False)
    3  a single chunk: stored straight to DW (deterministic and one launch)

With COL_TILES > 1 (rows too wide for one tile) each row is walked twice
(c, then dx) and the chunk's partial is accumulated in place in PARTIAL;
only DW_MODE 0 and 1 apply there.

The row reduction (c) uses the same tile shape whatever the mode, chunking or
number of rows, so dx is bitwise identical across modes and batch-invariant.
"""
import triton
import triton.language as tl

from .common import round_to, row_offsets


@triton.jit
def _dw_terms(b_dy, b_h, b_rstd):
    """f64(dy * h) * f64(rstd): dy * h is exact in float32 for 16-bit inputs and
    the float64 product with rstd is exact, so dw's terms carry no rounding."""
    return (b_dy * b_h).to(tl.float64) * b_rstd.to(tl.float64)[:, None]


@triton.jit
def _add_and_finish(DW, ACC, COUNTER, o_n, m_n, b_dw, INTERPRETED: tl.constexpr):
    """DW_MODE 2: add this program's float64 dw into ACC; the last program to
    arrive (an atomic ticket; nobody waits) rounds ACC into DW and leaves ACC
    and COUNTER zeroed for the next call.

    Triton's interpreter has no float64 atomics; it runs programs one after
    another, so there plain loads and stores do the same."""
    if INTERPRETED:
        tl.store(ACC + o_n, tl.load(ACC + o_n, mask=m_n, other=0.0) + b_dw, mask=m_n)
    else:
        tl.atomic_add(ACC + o_n, b_dw, mask=m_n, sem="relaxed")
    # every thread's adds precede the ticket: barrier, then an acq_rel ticket
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        if INTERPRETED:
            b_tot = tl.load(ACC + o_n, mask=m_n, other=0.0)
            tl.store(ACC + o_n, tl.zeros_like(b_dw), mask=m_n)
        else:
            b_tot = tl.atomic_xchg(ACC + o_n, tl.zeros_like(b_dw), mask=m_n, sem="relaxed")
        tl.store(DW + o_n, b_tot.to(tl.float32), mask=m_n)
        tl.atomic_xchg(COUNTER, 0, sem="relaxed")


@triton.jit
def rms_norm_bwd_kernel(
    DY, HX, W, RSTD, DH, DX, DW, PARTIAL, COUNTER,
    rows, n_cols, NH,
    stride_dyt, stride_dyh, stride_ht, stride_hh, stride_dht, stride_dhh,
    rows_per_chunk, num_chunks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_TILES: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    DW_MODE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    o_n = tl.arange(0, BLOCK_N)
    o_mb = tl.arange(0, BLOCK_M)

    if COL_TILES == 1:
        m_n = o_n < n_cols
        if HAS_WEIGHT:
            b_w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_dw = tl.zeros([BLOCK_N], dtype=tl.float64)
        for chunk in tl.range(pid, num_chunks, grid):
            row_start = chunk * rows_per_chunk
            row_end = tl.minimum(row_start + rows_per_chunk, rows)
            for m0 in tl.range(row_start, row_end, BLOCK_M):
                o_m = m0 + o_mb
                m_m = o_m < row_end
                mask = m_m[:, None] & m_n[None, :]
                o_h = row_offsets(o_m, NH, stride_ht, stride_hh, TWO_LEVEL)[:, None] + o_n[None, :]
                o_dy = row_offsets(o_m, NH, stride_dyt, stride_dyh, TWO_LEVEL)[:, None] + o_n[None, :]
                b_h = tl.load(HX + o_h, mask=mask, other=0.0).to(tl.float32)
                b_dy = tl.load(DY + o_dy, mask=mask, other=0.0).to(tl.float32)
                b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
                b_xhat = b_h * b_rstd[:, None]
                if HAS_WEIGHT:
                    b_g = b_dy * b_w[None, :]
                else:
                    b_g = b_dy
                b_c = tl.sum(b_g * b_xhat, axis=1) / n_cols
                b_dx = b_rstd[:, None] * (b_g - b_xhat * b_c[:, None])
                if HAS_DH:
                    o_dh = row_offsets(o_m, NH, stride_dht, stride_dhh, TWO_LEVEL)[:, None] + o_n[None, :]
                    b_dx += tl.load(DH + o_dh, mask=mask, other=0.0).to(tl.float32)
                o_dx = (o_m.to(tl.int64) * n_cols)[:, None] + o_n[None, :]
                tl.store(DX + o_dx, round_to(b_dx, DX.dtype.element_ty, INTERPRETED), mask=mask)
                if DW_MODE != 0:
                    b_dw += tl.sum(_dw_terms(b_dy, b_h, b_rstd), axis=0)
            if DW_MODE == 1:
                tl.store(PARTIAL + chunk * n_cols + o_n, b_dw, mask=m_n)
                b_dw = tl.zeros([BLOCK_N], dtype=tl.float64)
            elif DW_MODE == 3:
                tl.store(DW + o_n, b_dw.to(tl.float32), mask=m_n)
        if DW_MODE == 2:
            _add_and_finish(DW, PARTIAL, COUNTER, o_n, m_n, b_dw, INTERPRETED)
    else:
        for chunk in tl.range(pid, num_chunks, grid):
            row_start = chunk * rows_per_chunk
            row_end = tl.minimum(row_start + rows_per_chunk, rows)
            p_part = PARTIAL + chunk * n_cols
            if DW_MODE != 0:
                for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N):
                    o_c = n0 + o_n
                    tl.store(p_part + o_c, tl.zeros([BLOCK_N], dtype=tl.float64), mask=o_c < n_cols)
                tl.debug_barrier()
            for m0 in tl.range(row_start, row_end, BLOCK_M):
                o_m = m0 + o_mb
                m_m = o_m < row_end
                o_hr = row_offsets(o_m, NH, stride_ht, stride_hh, TWO_LEVEL)[:, None]
                o_dyr = row_offsets(o_m, NH, stride_dyt, stride_dyh, TWO_LEVEL)[:, None]
                b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
                # pass 1: c = sum_j g_j * xhat_j / H
                b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N):
                    o_c = n0 + o_n
                    m_n = o_c < n_cols
                    mask = m_m[:, None] & m_n[None, :]
                    b_xhat = tl.load(HX + o_hr + o_c[None, :], mask=mask, other=0.0).to(tl.float32) * b_rstd[:, None]
                    b_g = tl.load(DY + o_dyr + o_c[None, :], mask=mask, other=0.0).to(tl.float32)
                    if HAS_WEIGHT:
                        b_g = b_g * tl.load(W + o_c, mask=m_n, other=0.0).to(tl.float32)[None, :]
                    b_acc += b_g * b_xhat
                b_c = tl.sum(b_acc, axis=1) / n_cols
                # pass 2: dx, and the chunk's dw partial accumulated in place
                for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N):
                    o_c = n0 + o_n
                    m_n = o_c < n_cols
                    mask = m_m[:, None] & m_n[None, :]
                    b_h = tl.load(HX + o_hr + o_c[None, :], mask=mask, other=0.0).to(tl.float32)
                    b_xhat = b_h * b_rstd[:, None]
                    b_dy = tl.load(DY + o_dyr + o_c[None, :], mask=mask, other=0.0).to(tl.float32)
                    if HAS_WEIGHT:
                        b_g = b_dy * tl.load(W + o_c, mask=m_n, other=0.0).to(tl.float32)[None, :]
                    else:
                        b_g = b_dy
                    b_dx = b_rstd[:, None] * (b_g - b_xhat * b_c[:, None])
                    if HAS_DH:
                        o_dh = row_offsets(o_m, NH, stride_dht, stride_dhh, TWO_LEVEL)[:, None] + o_c[None, :]
                        b_dx += tl.load(DH + o_dh, mask=mask, other=0.0).to(tl.float32)
                    o_dx = (o_m.to(tl.int64) * n_cols)[:, None] + o_c[None, :]
                    tl.store(DX + o_dx, round_to(b_dx, DX.dtype.element_ty, INTERPRETED), mask=mask)
                    if DW_MODE != 0:
                        b_old = tl.load(p_part + o_c, mask=m_n, other=0.0)
                        tl.store(p_part + o_c, b_old + tl.sum(_dw_terms(b_dy, b_h, b_rstd), axis=0), mask=m_n)
                # the next tile re-reads this partial: order it after these stores
                tl.debug_barrier()
