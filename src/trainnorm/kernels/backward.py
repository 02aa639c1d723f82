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

With DW_COLS (small T, where a second launch costs more than the work) the
row loop runs with DW_MODE 0 and dw is summed by column slices instead: the
program takes slices pid, pid + grid, ... of DW_BN columns and adds, for each,
the terms of every row, DW_BM rows at a time in row order (float64, rounded
once). dw needs no c, so no program waits for another: one launch, no
workspace, the same form in both modes, every slice computed the same way
whatever the grid. dy and h are read a second time (from L2 at these sizes).

With COL_TILES > 1 (rows too wide for one tile) each row is walked twice
(c, then dx) and the chunk's partial is accumulated in place in PARTIAL;
only DW_MODE 0 and 1 apply there.

With a gate z (HAS_GATE), s = silu(f32(z)), s' its derivative:
    norm, then gate:  dy is replaced by dy * s above (g = dy * s * w), and
                      dz_j = round(dy_j * xhat_j * w_j * s'_j)
    GATE_FIRST:       u = f32(h) * s takes h's place (uhat = u * rstd), the
                      norm's gradient du = rstd * (g - uhat * c) gives
                      dx_j = round(du_j * s_j + f32(dh_j)), dz_j = round(du_j * f32(h_j) * s'_j)
    dw_j = sum over rows of f32(dy_j) * s_j * xhat_j (both forms).

With DW_2D (rows that fit one tile) each position of the row tile keeps its
own float64 dw sum, and the tile's rows are added together once per chunk
rather than once per tile: no exchange between threads inside the row loop.
The order of dw's additions changes (still a function of the chunking and
the tile); dx does not.

With TMA_STAGES (rows that fit one tile, one-level rows with 16-byte aligned
strides; Hopper and later), h and dy are read through tensor descriptors
(DESC_H, DESC_DY: [rows, H] with a [BLOCK_M, BLOCK_N] block) by the bulk copy
engine into shared memory, and the row loop is software-pipelined
TMA_STAGES deep: several row tiles are in flight without holding registers.
The arithmetic is the same, in the same order: the bits do not change.

With PREFETCH (rows that fit one tile), the loads of a chunk's next row tile
are issued before the current one is computed, so two tiles per program are
in flight: the same operations in the same order, only earlier loads.

The row reduction (c) uses the same tile shape whatever the mode, chunking or
number of rows, so dx is bitwise identical across modes and batch-invariant.
"""
import triton
import triton.language as tl

from .common import load_gate, round_to, row_offsets


@triton.jit
def _norm_inputs(b_h, b_dy, b_rstd, b_w, b_z, b_sig,
                 HAS_WEIGHT: tl.constexpr, HAS_GATE: tl.constexpr, GATE_FIRST: tl.constexpr):
    """(uhat, g): the normalised input u * rstd (u = h, or h * silu(z) with
    GATE_FIRST) and g, the gradient reaching uhat (dy * w, with dy * silu(z)
    in place of dy when the gate follows the norm)."""
    b_u = b_h
    b_dyn = b_dy
    if HAS_GATE:
        if GATE_FIRST:
            b_u = b_h * (b_z * b_sig)
        else:
            b_dyn = b_dy * (b_z * b_sig)
    b_xhat = b_u * b_rstd[:, None]
    if HAS_WEIGHT:
        b_g = b_dyn * b_w
    else:
        b_g = b_dyn
    return b_xhat, b_g


@triton.jit
def _input_grads(b_h, b_dy, b_rstd, b_w, b_z, b_sig, b_xhat, b_g, b_c,
                 HAS_WEIGHT: tl.constexpr, HAS_GATE: tl.constexpr, GATE_FIRST: tl.constexpr):
    """(dx, dz) before the residual's dh is added; dz is meaningful with HAS_GATE only."""
    b_dx = b_rstd[:, None] * (b_g - b_xhat * b_c[:, None])
    b_dz = b_dx
    if HAS_GATE:
        b_dsilu = b_sig * (1.0 + b_z * (1.0 - b_sig))
        if GATE_FIRST:
            b_dz = b_dx * b_h * b_dsilu
            b_dx = b_dx * (b_z * b_sig)
        else:
            if HAS_WEIGHT:
                b_dz = b_dy * (b_xhat * b_w) * b_dsilu
            else:
                b_dz = b_dy * b_xhat * b_dsilu
    return b_dx, b_dz


@triton.jit
def _dw_terms(b_dy, b_h, b_rstd, b_z, b_sig, HAS_GATE: tl.constexpr, WIDE_TERMS: tl.constexpr):
    """f64(dy * h) * f64(rstd) [* f64(silu(z))]: dy * h is exact in float32 for
    16-bit inputs and the float64 product with rstd is exact, so without a gate
    dw's terms carry no rounding (with one, only silu(z)'s float32 rounding).
    WIDE_TERMS (dy or h in float32): float32 dy * h would round (24 + 24 bits),
    so the product is taken in float64, where it is exact."""
    if WIDE_TERMS:
        b_t = b_dy.to(tl.float64) * b_h.to(tl.float64) * b_rstd.to(tl.float64)[:, None]
    else:
        b_t = (b_dy * b_h).to(tl.float64) * b_rstd.to(tl.float64)[:, None]
    if HAS_GATE:
        b_t = b_t * (b_z * b_sig).to(tl.float64)
    return b_t


@triton.jit
def _load_row_tile(HX, DY, Z, RSTD, o_m, row_end, o_n, m_n, NH, stride_ht, stride_hh, stride_dyt, stride_dyh,
                   stride_zt, stride_zh, TWO_LEVEL: tl.constexpr, HAS_GATE: tl.constexpr):
    """h, dy (and z) of rows o_m as stored, and their rstd; rows at or past row_end are masked off."""
    m_m = o_m < row_end
    mask = m_m[:, None] & m_n[None, :]
    o_h = row_offsets(o_m, NH, stride_ht, stride_hh, TWO_LEVEL)[:, None] + o_n[None, :]
    o_dy = row_offsets(o_m, NH, stride_dyt, stride_dyh, TWO_LEVEL)[:, None] + o_n[None, :]
    b_h = tl.load(HX + o_h, mask=mask, other=0.0)
    b_dy = tl.load(DY + o_dy, mask=mask, other=0.0)
    b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
    if HAS_GATE:
        o_z = row_offsets(o_m, NH, stride_zt, stride_zh, TWO_LEVEL)[:, None] + o_n[None, :]
        b_z = tl.load(Z + o_z, mask=mask, other=0.0)
    else:
        b_z = b_h
    return b_h, b_dy, b_rstd, b_z


@triton.jit
def _load_col_tile(HX, DY, Z, W, o_hr, o_dyr, o_zr, o_c, mask, m_n, HAS_WEIGHT: tl.constexpr, HAS_GATE: tl.constexpr):
    """One column tile of a wide row: f32 h, dy, w (as [1, BLOCK_N]) and the gate's z, sigmoid(z)."""
    b_h = tl.load(HX + o_hr + o_c[None, :], mask=mask, other=0.0).to(tl.float32)
    b_dy = tl.load(DY + o_dyr + o_c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        b_w = tl.load(W + o_c, mask=m_n, other=0.0).to(tl.float32)[None, :]
    else:
        b_w = b_h
    if HAS_GATE:
        b_z, b_sig = load_gate(Z, o_zr + o_c[None, :], mask)
    else:
        b_z, b_sig = b_h, b_h
    return b_h, b_dy, b_w, b_z, b_sig


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
    DY, HX, Z, W, RSTD, DH, DX, DZ, DW, PARTIAL, COUNTER, DESC_DY, DESC_H,
    rows, n_cols, NH,
    stride_dyt, stride_dyh, stride_ht, stride_hh, stride_zt, stride_zh, stride_dht, stride_dhh,
    rows_per_chunk, num_chunks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_TILES: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    GATE_FIRST: tl.constexpr,
    DW_MODE: tl.constexpr,
    DW_COLS: tl.constexpr,
    DW_BM: tl.constexpr,
    DW_BN: tl.constexpr,
    PREFETCH: tl.constexpr,
    TMA_STAGES: tl.constexpr,
    DW_2D: tl.constexpr,
    WIDE_TERMS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    o_n = tl.arange(0, BLOCK_N)
    o_mb = tl.arange(0, BLOCK_M)

    if COL_TILES == 1:
        m_n = o_n < n_cols
        if HAS_WEIGHT:
            b_w = tl.load(W + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        else:
            b_w = tl.zeros([1, BLOCK_N], dtype=tl.float32)
        b_dw = tl.zeros([BLOCK_N], dtype=tl.float64)
        if DW_2D:
            b_dw2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
        else:
            b_dw2 = tl.zeros([1, 1], dtype=tl.float64)
        for chunk in tl.range(pid, num_chunks, grid):
            row_start = chunk * rows_per_chunk
            row_end = tl.minimum(row_start + rows_per_chunk, rows)
            if PREFETCH:
                p_h, p_dy, p_rstd, p_z = _load_row_tile(HX, DY, Z, RSTD, row_start + o_mb, row_end, o_n, m_n, NH,
                                                        stride_ht, stride_hh, stride_dyt, stride_dyh,
                                                        stride_zt, stride_zh, TWO_LEVEL, HAS_GATE)
            for m0 in tl.range(row_start, row_end, BLOCK_M, num_stages=TMA_STAGES):
                o_m = m0 + o_mb
                m_m = o_m < row_end
                mask = m_m[:, None] & m_n[None, :]
                if TMA_STAGES is not None:
                    # bulk tensor copies into shared memory, TMA_STAGES tiles in flight (the
                    # compiler's software pipeline); rows and columns past the tensor read as zero
                    r_h = DESC_H.load([m0, 0])
                    r_dy = DESC_DY.load([m0, 0])
                    r_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
                    if HAS_GATE:
                        o_z = row_offsets(o_m, NH, stride_zt, stride_zh, TWO_LEVEL)[:, None] + o_n[None, :]
                        r_z = tl.load(Z + o_z, mask=mask, other=0.0)
                    else:
                        r_z = r_h
                elif PREFETCH:
                    # this tile was loaded during the previous one; issue the next tile's loads now
                    # (masked off past the chunk), so they are in flight while this one is computed
                    r_h, r_dy, r_rstd, r_z = p_h, p_dy, p_rstd, p_z
                    p_h, p_dy, p_rstd, p_z = _load_row_tile(HX, DY, Z, RSTD, o_m + BLOCK_M, row_end, o_n, m_n, NH,
                                                            stride_ht, stride_hh, stride_dyt, stride_dyh,
                                                            stride_zt, stride_zh, TWO_LEVEL, HAS_GATE)
                else:
                    r_h, r_dy, r_rstd, r_z = _load_row_tile(HX, DY, Z, RSTD, o_m, row_end, o_n, m_n, NH,
                                                            stride_ht, stride_hh, stride_dyt, stride_dyh,
                                                            stride_zt, stride_zh, TWO_LEVEL, HAS_GATE)
                b_h = r_h.to(tl.float32)
                b_dy = r_dy.to(tl.float32)
                b_rstd = r_rstd
                if HAS_GATE:
                    b_z = r_z.to(tl.float32)
                    b_sig = tl.sigmoid(b_z)
                else:
                    b_z, b_sig = b_h, b_h
                b_xhat, b_g = _norm_inputs(b_h, b_dy, b_rstd, b_w, b_z, b_sig, HAS_WEIGHT, HAS_GATE, GATE_FIRST)
                b_c = tl.sum(b_g * b_xhat, axis=1) / n_cols
                b_dx, b_dz = _input_grads(b_h, b_dy, b_rstd, b_w, b_z, b_sig, b_xhat, b_g, b_c,
                                          HAS_WEIGHT, HAS_GATE, GATE_FIRST)
                if HAS_DH:
                    o_dh = row_offsets(o_m, NH, stride_dht, stride_dhh, TWO_LEVEL)[:, None] + o_n[None, :]
                    b_dx += tl.load(DH + o_dh, mask=mask, other=0.0).to(tl.float32)
                o_dx = (o_m.to(tl.int64) * n_cols)[:, None] + o_n[None, :]
                tl.store(DX + o_dx, round_to(b_dx, DX.dtype.element_ty, INTERPRETED), mask=mask)
                if HAS_GATE:
                    tl.store(DZ + o_dx, round_to(b_dz, DZ.dtype.element_ty, INTERPRETED), mask=mask)
                if DW_MODE != 0:
                    if DW_2D:
                        b_dw2 += _dw_terms(b_dy, b_h, b_rstd, b_z, b_sig, HAS_GATE, WIDE_TERMS)
                    else:
                        b_dw += tl.sum(_dw_terms(b_dy, b_h, b_rstd, b_z, b_sig, HAS_GATE, WIDE_TERMS), axis=0)
            if DW_2D and DW_MODE != 2:
                b_dw = tl.sum(b_dw2, axis=0)
                b_dw2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
            if DW_MODE == 1:
                tl.store(PARTIAL + chunk * n_cols + o_n, b_dw, mask=m_n)
                b_dw = tl.zeros([BLOCK_N], dtype=tl.float64)
            elif DW_MODE == 3:
                tl.store(DW + o_n, b_dw.to(tl.float32), mask=m_n)
        if DW_MODE == 2:
            if DW_2D:
                b_dw = tl.sum(b_dw2, axis=0)
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
                o_zr = row_offsets(o_m, NH, stride_zt, stride_zh, TWO_LEVEL)[:, None]
                b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
                # pass 1: c = sum_j g_j * uhat_j / H
                b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N):
                    o_c = n0 + o_n
                    m_n = o_c < n_cols
                    mask = m_m[:, None] & m_n[None, :]
                    b_h, b_dy, b_w, b_z, b_sig = _load_col_tile(HX, DY, Z, W, o_hr, o_dyr, o_zr, o_c, mask, m_n,
                                                                HAS_WEIGHT, HAS_GATE)
                    b_xhat, b_g = _norm_inputs(b_h, b_dy, b_rstd, b_w, b_z, b_sig, HAS_WEIGHT, HAS_GATE, GATE_FIRST)
                    b_acc += b_g * b_xhat
                b_c = tl.sum(b_acc, axis=1) / n_cols
                # pass 2: dx (dz), and the chunk's dw partial accumulated in place
                for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N):
                    o_c = n0 + o_n
                    m_n = o_c < n_cols
                    mask = m_m[:, None] & m_n[None, :]
                    b_h, b_dy, b_w, b_z, b_sig = _load_col_tile(HX, DY, Z, W, o_hr, o_dyr, o_zr, o_c, mask, m_n,
                                                                HAS_WEIGHT, HAS_GATE)
                    b_xhat, b_g = _norm_inputs(b_h, b_dy, b_rstd, b_w, b_z, b_sig, HAS_WEIGHT, HAS_GATE, GATE_FIRST)
                    b_dx, b_dz = _input_grads(b_h, b_dy, b_rstd, b_w, b_z, b_sig, b_xhat, b_g, b_c,
                                              HAS_WEIGHT, HAS_GATE, GATE_FIRST)
                    if HAS_DH:
                        o_dh = row_offsets(o_m, NH, stride_dht, stride_dhh, TWO_LEVEL)[:, None] + o_c[None, :]
                        b_dx += tl.load(DH + o_dh, mask=mask, other=0.0).to(tl.float32)
                    o_dx = (o_m.to(tl.int64) * n_cols)[:, None] + o_c[None, :]
                    tl.store(DX + o_dx, round_to(b_dx, DX.dtype.element_ty, INTERPRETED), mask=mask)
                    if HAS_GATE:
                        tl.store(DZ + o_dx, round_to(b_dz, DZ.dtype.element_ty, INTERPRETED), mask=mask)
                    if DW_MODE != 0:
                        b_old = tl.load(p_part + o_c, mask=m_n, other=0.0)
                        b_new = b_old + tl.sum(_dw_terms(b_dy, b_h, b_rstd, b_z, b_sig, HAS_GATE, WIDE_TERMS), axis=0)
                        tl.store(p_part + o_c, b_new, mask=m_n)
                # the next tile re-reads this partial: order it after these stores
                tl.debug_barrier()

    if DW_COLS:
        # dw by column slices, each over all rows in row order (see above); names of its own,
        # so nothing is carried over from the row loop's variables
        s_cn = tl.arange(0, DW_BN)
        s_cm = tl.arange(0, DW_BM)
        for sl in tl.range(pid, tl.cdiv(n_cols, DW_BN), grid):
            s_c = sl * DW_BN + s_cn
            s_mc = s_c < n_cols
            s_sum = tl.zeros([DW_BN], dtype=tl.float64)
            for s0 in tl.range(0, rows, DW_BM):
                s_m = s0 + s_cm
                s_mm = s_m < rows
                s_mask = s_mm[:, None] & s_mc[None, :]
                s_h, s_dy, s_w, s_z, s_sig = _load_col_tile(
                    HX, DY, Z, W, row_offsets(s_m, NH, stride_ht, stride_hh, TWO_LEVEL)[:, None],
                    row_offsets(s_m, NH, stride_dyt, stride_dyh, TWO_LEVEL)[:, None],
                    row_offsets(s_m, NH, stride_zt, stride_zh, TWO_LEVEL)[:, None], s_c, s_mask, s_mc,
                    False, HAS_GATE)
                s_rstd = tl.load(RSTD + s_m, mask=s_mm, other=0.0)
                s_sum += tl.sum(_dw_terms(s_dy, s_h, s_rstd, s_z, s_sig, HAS_GATE, WIDE_TERMS), axis=0)
            tl.store(DW + s_c, s_sum.to(tl.float32), mask=s_mc)
