"""RMSNorm backward: dx (plus the residual stream's gradient) and dw. One kernel per form.

Given dy, the saved h (x when there is no residual), w, the saved float32
rstd and optionally dh (the gradient reaching the returned h):

    g_j    = f32(dy_j) * f32(w_j)          (g = dy without a weight)
    xhat_j = f32(h_j) * rstd
    c      = sum_j g_j * xhat_j / H
    dx_j   = round(rstd * (g_j - xhat_j * c) + f32(dh_j))
    dw_j   = sum over rows of f32(dy_j) * xhat_j            (float32 result)

With a gate z (Z given), a = the activation GATE and a' its derivative (kernels/gate.py):
    norm, then gate:  dy is replaced by dy * a(z) above (g = dy * a * w), and
                      dz_j = round(dy_j * xhat_j * w_j * a'_j)
    GATE_FIRST:       u = f32(h) * a(z) takes h's place (uhat = u * rstd), the
                      norm's gradient du = rstd * (g - uhat * c) gives
                      dx_j = round(du_j * a_j + f32(dh_j)), dz_j = round(du_j * f32(h_j) * a'_j)
    dw_j = sum over rows of f32(dy_j) * a_j * xhat_j (both forms).

The rows are split into `num_chunks` chunks of `rows_per_chunk` rows; both
numbers are a function of (rows, H) only (plan.py). A program takes chunks
pid, pid + grid, ...; every chunk is processed the same way whichever program
takes it, so the grid may follow the SM count without changing a bit. With
DEAL_ROWS the rows are dealt to the chunks a row tile at a time instead (tile t
to chunk t mod num_chunks, each chunk's tiles in row order): the programs then
read neighbouring rows at any moment rather than one contiguous run each, rows
per chunk apart (_chunk_span); another order of dw's additions, the same dx. dw's
terms are formed exactly in float64 (_dw_terms) and summed in float64 within
and across chunks (float64 partials), so dw is the exact sum rounded once to
float32, up to float64 rounding: far inside the budget on every input family
and never worse than the FP32 eager reduction.

The forms (plan.py picks one; its DwForm names how dw is delivered):

- `bwd_one_tile_kernel`: a row fits one tile. DW_FORM "none", "partial" (each
  chunk's float64 partial to PARTIAL[chunk, :], summed by combine.py),
  "atomic" (each program adds its float64 sum atomically into a zeroed
  accumulator; the last program to arrive rounds it into DW and re-zeroes it:
  one launch, last bits may vary, deterministic=False only), "direct" (one
  chunk, stored straight to DW) or "row" (direct over one row, whose dw terms
  are formed in float32 where that gives their float64 bits). Row-tile loads (LOADS): "plain", "prefetch"
  (the next tile's loads issued before the current one is computed) or "tma"
  (tensor descriptors DESC_H, DESC_DY); the row loop is software-pipelined
  STAGES deep (None: not). With DW_2D each tile position keeps its own
  float64 dw sum and the tile's rows are added together once per chunk
  rather than once per tile (another order of dw's additions, a function of
  the chunking and the tile; dx does not change). With BLOCK_N2 > 0 a row is
  held as two pieces, BLOCK_N columns and then BLOCK_N2 (plain loads; 5120 =
  4096 + 1024 holds no masked column where one tile would hold 8192): c is
  the sum of the two pieces' sums, and each piece keeps its own dw sum.
  The one-chunk forms read the first W_HALVES pieces of a float32 weight as
  two runs of 4 values a thread (common.weight_tile), into the registers of
  a tile holding 8 a thread: plan.BackwardPlan.weight_halves.
- `bwd_col_tiles_kernel`: rows too wide for one tile, walked in COL_TILES
  column tiles twice (c, then dx); the chunk's partial is accumulated in
  place in PARTIAL. DW_FORM "none" or "partial".
- `bwd_col_slices_kernel` (small T, where a second launch costs more than
  the work): the row loop of either form above without dw, and dw by column
  slices in the same launch: a slice of DW_BN columns adds the terms of every
  row, DW_BM rows at a time in row order (float64, rounded once). dw needs no
  c, so no program waits for another: one launch, no workspace, the same form
  in both modes, every slice computed the same way whatever the grid. The
  programs share the roles (each takes its rows, then its slices) or split
  them (rows in some programs, slices in the others: the launch then lasts
  the longer of the two, not their sum); the bits are the same. dy and h are
  read a second time (from L2 at these sizes).

The row reduction (c) uses the same tile shape whatever the form, chunking
or number of rows, so dx is bitwise identical across forms and modes and
batch-invariant.
"""
import triton
import triton.language as tl

from .common import (INTERPRETED, grid_dependency, load_weight, negated, round_to, row_dot, row_offsets,
                     weight_tile, weight_values)
from .gate import gate_activation, load_gate


@triton.jit
def _norm_inputs(b_h, b_dy, b_rstd, W, b_w, b_a, GATE: tl.constexpr, GATE_FIRST: tl.constexpr):
    """(uhat, g): the normalised input u * rstd (u = h, or h * a(z) with
    GATE_FIRST) and g, the gradient reaching uhat (dy * w, with dy * a(z) in
    place of dy when the gate follows the norm); b_w is read only when W is given."""
    b_u = b_h
    b_dyn = b_dy
    if GATE is not None:
        if GATE_FIRST:
            b_u = b_h * b_a
        else:
            b_dyn = b_dy * b_a
    b_xhat = b_u * b_rstd[:, None]
    if W is not None:
        b_g = b_dyn * b_w
    else:
        b_g = b_dyn
    return b_xhat, b_g


@triton.jit
def _store_input_grads(b_h, b_dy, b_rstd, W, b_w, b_a, b_da, b_xhat, b_g, b_c, DH, DX, DR, DZ, o_m, o_c, mask,
                       n_cols, NH, stride_dht, stride_dhh, TWO_LEVEL: tl.constexpr, GATE: tl.constexpr,
                       GATE_FIRST: tl.constexpr):
    """dx (+ dh) and, with a gate, dz of a tile (rows o_m, columns o_c), rounded and stored."""
    # g - xhat * c and rstd * (...) + dh are written as the fused multiply-adds they
    # compile to: left to the compiler, whether a product is fused depends on the code
    # around it (with h read through a tensor descriptor, a float32 dx and dh, the
    # product crossed a layout conversion before the add and was rounded on its own),
    # and dx's bits would depend on the load form
    b_t = tl.fma(b_xhat, negated(b_c)[:, None], b_g)
    b_dx = b_rstd[:, None] * b_t
    b_dz = b_dx
    if GATE is not None:
        if GATE_FIRST:
            b_dz = b_dx * b_h * b_da
            b_dx = b_dx * b_a
        else:
            if W is not None:
                b_dz = b_dy * (b_xhat * b_w) * b_da
            else:
                b_dz = b_dy * b_xhat * b_da
    if DH is not None:
        o_dh = row_offsets(o_m, NH, stride_dht, stride_dhh, TWO_LEVEL)[:, None] + o_c[None, :]
        b_dh = tl.load(DH + o_dh, mask=mask, other=0.0).to(tl.float32)
        if GATE is not None and GATE_FIRST:
            b_dx += b_dh
        else:
            b_dx = tl.fma(b_rstd[:, None], b_t, b_dh)
    o_dx = (o_m.to(tl.int64) * n_cols)[:, None] + o_c[None, :]
    tl.store(DX + o_dx, round_to(b_dx, DX.dtype.element_ty), mask=mask)
    if DR is not None:
        # a float32 residual stream: its gradient too, unrounded, beside x's (in x's dtype)
        tl.store(DR + o_dx, round_to(b_dx, DR.dtype.element_ty), mask=mask)
    if GATE is not None:
        tl.store(DZ + o_dx, round_to(b_dz, DZ.dtype.element_ty), mask=mask)


@triton.jit
def _dw_terms(b_dy, b_h, b_rstd, b_a, GATE: tl.constexpr, WIDE_TERMS: tl.constexpr, F32: tl.constexpr = False):
    """f64(dy * h) * f64(rstd) [* f64(a(z))]: dy * h is exact in float32 for
    16-bit inputs and the float64 product with rstd is exact, so without a gate
    dw's terms carry no rounding (with one, only a(z)'s float32 rounding).
    WIDE_TERMS (dy or h in float32): float32 dy * h would round (24 + 24 bits),
    so the product is taken in float64, where it is exact.
    F32 (one row, 16-bit inputs, no gate: the terms are dw): float32 dy * h * rstd,
    the exact product rounded once, which is what the float64 term rounded to
    float32 is: the same bits without a conversion to float64 and back."""
    if F32:
        b_t = (b_dy * b_h) * b_rstd[:, None]
    elif WIDE_TERMS:
        b_t = b_dy.to(tl.float64) * b_h.to(tl.float64) * b_rstd.to(tl.float64)[:, None]
    else:
        b_t = (b_dy * b_h).to(tl.float64) * b_rstd.to(tl.float64)[:, None]
    if GATE is not None:
        b_t = b_t * b_a.to(tl.float64)
    return b_t


@triton.jit
def _load_row_tile(HX, DY, Z, RSTD, o_m, row_end, o_n, m_n, NH, stride_ht, stride_hh, stride_dyt, stride_dyh,
                   stride_zt, stride_zh, TWO_LEVEL: tl.constexpr):
    """h, dy (and z; h again without a gate) of rows o_m as stored, and their rstd;
    rows at or past row_end are masked off. (A Triton function returns no None.)"""
    m_m = o_m < row_end
    mask = m_m[:, None] & m_n[None, :]
    o_h = row_offsets(o_m, NH, stride_ht, stride_hh, TWO_LEVEL)[:, None] + o_n[None, :]
    o_dy = row_offsets(o_m, NH, stride_dyt, stride_dyh, TWO_LEVEL)[:, None] + o_n[None, :]
    b_h = tl.load(HX + o_h, mask=mask, other=0.0)
    b_dy = tl.load(DY + o_dy, mask=mask, other=0.0)
    b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
    if Z is not None:
        o_z = row_offsets(o_m, NH, stride_zt, stride_zh, TWO_LEVEL)[:, None] + o_n[None, :]
        b_z = tl.load(Z + o_z, mask=mask, other=0.0)
    else:
        b_z = b_h
    return b_h, b_dy, b_rstd, b_z


@triton.jit
def _tile_terms(r_h, r_dy, r_z, b_rstd, W, b_w, GATE: tl.constexpr, GATE_FIRST: tl.constexpr):
    """f32 h, dy, a(z), a'(z), uhat and g of a tile (or piece) as loaded."""
    b_h = r_h.to(tl.float32)
    b_dy = r_dy.to(tl.float32)
    if GATE is not None:
        b_a, b_da = gate_activation(r_z.to(tl.float32), GATE)
    else:
        b_a, b_da = b_h, b_h
    b_xhat, b_g = _norm_inputs(b_h, b_dy, b_rstd, W, b_w, b_a, GATE, GATE_FIRST)
    return b_h, b_dy, b_a, b_da, b_xhat, b_g


@triton.jit
def _chunk_span(chunk, rows, rows_per_chunk, num_chunks, BLOCK_M: tl.constexpr, DEAL_ROWS: tl.constexpr):
    """(first row, end, step) of a chunk's row tiles: rows_per_chunk rows from chunk x
    rows_per_chunk, a tile at a time; with DEAL_ROWS every num_chunks-th tile from the
    chunk's own, to the last row (a chunk then ends where the rows do)."""
    if DEAL_ROWS:
        return chunk * BLOCK_M, rows, num_chunks * BLOCK_M
    else:
        row_start = chunk * rows_per_chunk
        return row_start, tl.minimum(row_start + rows_per_chunk, rows), BLOCK_M


@triton.jit
def _chunk_rows(DY, HX, Z, W, RSTD, DH, DX, DR, DZ, DESC_DY, DESC_H, b_w, b_w2, b_dw, b_dw2, b_dwb, row_start, row_end,
                row_step, n_cols, NH, stride_dyt, stride_dyh, stride_ht, stride_hh, stride_zt, stride_zh, stride_dht,
                stride_dhh, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr,
                TWO_LEVEL: tl.constexpr, GATE: tl.constexpr, GATE_FIRST: tl.constexpr, NEED_DW: tl.constexpr,
                LOADS: tl.constexpr, STAGES: tl.constexpr, DW_2D: tl.constexpr, F32_TERMS: tl.constexpr = False):
    """One chunk of rows that fit one tile (its tiles from row_start, row_step rows
    apart, before row_end: _chunk_span): dx (dz) stored, dw's terms added to b_dw (or, with
    DW_2D, to b_dw2 per tile position; the second piece's to b_dwb) with NEED_DW."""
    o_n = tl.arange(0, BLOCK_N)
    o_mb = tl.arange(0, BLOCK_M)
    m_n = o_n < n_cols
    wide = HX.dtype.element_ty.primitive_bitwidth > 16 or DY.dtype.element_ty.primitive_bitwidth > 16
    if BLOCK_N2 > 0:
        o_n2 = BLOCK_N + tl.arange(0, BLOCK_N2)
        m_n2 = o_n2 < n_cols
    if LOADS == "prefetch":
        p_h, p_dy, p_rstd, p_z = _load_row_tile(HX, DY, Z, RSTD, row_start + o_mb, row_end, o_n, m_n, NH,
                                                stride_ht, stride_hh, stride_dyt, stride_dyh,
                                                stride_zt, stride_zh, TWO_LEVEL)
    for m0 in tl.range(row_start, row_end, row_step, num_stages=STAGES):
        o_m = m0 + o_mb
        m_m = o_m < row_end
        mask = m_m[:, None] & m_n[None, :]
        if LOADS == "tma":
            # bulk tensor copies into shared memory, STAGES tiles in flight (the
            # compiler's software pipeline); rows and columns past the tensor read as zero
            r_h = DESC_H.load([m0, 0])
            r_dy = DESC_DY.load([m0, 0])
            r_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
            if Z is not None:
                o_z = row_offsets(o_m, NH, stride_zt, stride_zh, TWO_LEVEL)[:, None] + o_n[None, :]
                r_z = tl.load(Z + o_z, mask=mask, other=0.0)
            else:
                r_z = r_h
        elif LOADS == "prefetch":
            # this tile was loaded during the previous one; issue the next tile's loads now
            # (masked off past the chunk), so they are in flight while this one is computed
            r_h, r_dy, r_rstd, r_z = p_h, p_dy, p_rstd, p_z
            p_h, p_dy, p_rstd, p_z = _load_row_tile(HX, DY, Z, RSTD, o_m + row_step, row_end, o_n, m_n, NH,
                                                    stride_ht, stride_hh, stride_dyt, stride_dyh,
                                                    stride_zt, stride_zh, TWO_LEVEL)
        else:
            r_h, r_dy, r_rstd, r_z = _load_row_tile(HX, DY, Z, RSTD, o_m, row_end, o_n, m_n, NH,
                                                    stride_ht, stride_hh, stride_dyt, stride_dyh,
                                                    stride_zt, stride_zh, TWO_LEVEL)
        b_rstd = r_rstd
        b_h, b_dy, b_a, b_da, b_xhat, b_g = _tile_terms(r_h, r_dy, r_z, b_rstd, W, b_w, GATE, GATE_FIRST)
        b_s = row_dot(b_g, b_xhat)
        if BLOCK_N2 > 0:
            # the row's second piece (plain loads): its sum joins the first piece's
            mask2 = m_m[:, None] & m_n2[None, :]
            q_h, q_dy, _, q_z = _load_row_tile(HX, DY, Z, RSTD, o_m, row_end, o_n2, m_n2, NH, stride_ht, stride_hh,
                                               stride_dyt, stride_dyh, stride_zt, stride_zh, TWO_LEVEL)
            q_h, q_dy, q_a, q_da, q_xhat, q_g = _tile_terms(q_h, q_dy, q_z, b_rstd, W, b_w2, GATE, GATE_FIRST)
            b_s += row_dot(q_g, q_xhat)
        b_c = b_s / n_cols
        _store_input_grads(b_h, b_dy, b_rstd, W, b_w, b_a, b_da, b_xhat, b_g, b_c, DH, DX, DR, DZ, o_m, o_n, mask,
                           n_cols, NH, stride_dht, stride_dhh, TWO_LEVEL, GATE, GATE_FIRST)
        if NEED_DW:
            if DW_2D:
                b_dw2 += _dw_terms(b_dy, b_h, b_rstd, b_a, GATE, wide)
            else:
                b_dw += tl.sum(_dw_terms(b_dy, b_h, b_rstd, b_a, GATE, wide, F32_TERMS), axis=0)
        if BLOCK_N2 > 0:
            _store_input_grads(q_h, q_dy, b_rstd, W, b_w2, q_a, q_da, q_xhat, q_g, b_c, DH, DX, DR, DZ, o_m, o_n2,
                               mask2, n_cols, NH, stride_dht, stride_dhh, TWO_LEVEL, GATE, GATE_FIRST)
            if NEED_DW:
                b_dwb += tl.sum(_dw_terms(q_dy, q_h, b_rstd, q_a, GATE, wide, F32_TERMS), axis=0)
    return b_dw, b_dw2, b_dwb


@triton.jit
def _load_weight(W, COL0: tl.constexpr, BLOCK_N: tl.constexpr, n_cols, W_OFFSET: tl.constexpr,
                 HALVES: tl.constexpr = False):
    """f32 w (+ W_OFFSET) of columns COL0 + [0, BLOCK_N) as [1, BLOCK_N] (zeros without a
    weight, or for an absent piece, BLOCK_N 0: a Triton function returns no None); with
    HALVES a float32 weight read by halves (common.weight_tile)."""
    if W is not None and BLOCK_N > 0:
        b_w = weight_values(weight_tile(W, COL0, n_cols, BLOCK_N, HALVES), W_OFFSET)
    else:
        b_w = tl.zeros([1, 1], dtype=tl.float32)
    return b_w


@triton.jit
def _add_and_finish(DW, ACC, COUNTER, o_n, m_n, b_dw):
    """The "atomic" form: add this program's float64 dw into ACC; the last
    program to arrive (an atomic ticket; nobody waits) rounds ACC into DW and
    leaves ACC and COUNTER zeroed for the next call.

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
def _store_dw(DW, b_dw, b_dwb, o_n, m_n, n_cols, BLOCK_N: tl.constexpr, BLOCK_N2: tl.constexpr, F32: tl.constexpr):
    """Store dw's sums of both pieces at DW (rounded to float32 with F32)."""
    if F32:
        tl.store(DW + o_n, b_dw.to(tl.float32), mask=m_n)
    else:
        tl.store(DW + o_n, b_dw, mask=m_n)
    if BLOCK_N2 > 0:
        o_n2 = BLOCK_N + tl.arange(0, BLOCK_N2)
        if F32:
            tl.store(DW + o_n2, b_dwb.to(tl.float32), mask=o_n2 < n_cols)
        else:
            tl.store(DW + o_n2, b_dwb, mask=o_n2 < n_cols)


@triton.jit
def bwd_one_tile_kernel(
    DY, HX, Z, W, RSTD, DH, DX, DR, DZ, DW, PARTIAL, COUNTER, DESC_DY, DESC_H,
    rows, n_cols, NH,
    stride_dyt, stride_dyh, stride_ht, stride_hh, stride_zt, stride_zh, stride_dht, stride_dhh,
    rows_per_chunk, num_chunks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    GATE: tl.constexpr,
    GATE_FIRST: tl.constexpr,
    W_OFFSET: tl.constexpr,
    DW_FORM: tl.constexpr,
    LOADS: tl.constexpr,
    STAGES: tl.constexpr,
    DW_2D: tl.constexpr,
    W_HALVES: tl.constexpr = 0,
    PDL: tl.constexpr = False,
    DEAL_ROWS: tl.constexpr = False,
):
    grid_dependency(PDL)
    pid = tl.program_id(0)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < n_cols
    b_w = _load_weight(W, 0, BLOCK_N, n_cols, W_OFFSET, W_HALVES >= 1)
    b_w2 = _load_weight(W, BLOCK_N, BLOCK_N2, n_cols, W_OFFSET, W_HALVES >= 2)
    # one row ("row"): with 16-bit h and dy and no gate its dw terms are formed in float32
    # (_dw_terms), the same bits as float64 terms rounded once. sm_90 converts 16 values
    # between float32 and float64 a clock an SM: at T 1 one program did 2 x 8192 of them
    f32_terms: tl.constexpr = (DW_FORM == "row" and GATE is None and HX.dtype.element_ty.primitive_bitwidth <= 16
                               and DY.dtype.element_ty.primitive_bitwidth <= 16)
    if f32_terms:
        DW_DTYPE: tl.constexpr = tl.float32
    else:
        DW_DTYPE: tl.constexpr = tl.float64
    b_dw = tl.zeros([BLOCK_N], dtype=DW_DTYPE)
    if BLOCK_N2 > 0:
        b_dwb = tl.zeros([BLOCK_N2], dtype=DW_DTYPE)
    else:
        b_dwb = tl.zeros([1], dtype=DW_DTYPE)
    # one row has nothing to add per tile position: its terms go straight into b_dw
    dw_2d: tl.constexpr = DW_2D and not f32_terms
    if dw_2d:
        b_dw2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
    else:
        b_dw2 = tl.zeros([1, 1], dtype=tl.float64)
    for chunk in tl.range(pid, num_chunks, tl.num_programs(0)):
        row_start, row_end, row_step = _chunk_span(chunk, rows, rows_per_chunk, num_chunks, BLOCK_M, DEAL_ROWS)
        b_dw, b_dw2, b_dwb = _chunk_rows(DY, HX, Z, W, RSTD, DH, DX, DR, DZ, DESC_DY, DESC_H, b_w, b_w2, b_dw, b_dw2,
                                         b_dwb, row_start, row_end, row_step, n_cols, NH, stride_dyt, stride_dyh,
                                         stride_ht, stride_hh, stride_zt, stride_zh, stride_dht, stride_dhh, BLOCK_M,
                                         BLOCK_N, BLOCK_N2, TWO_LEVEL, GATE, GATE_FIRST, DW_FORM != "none", LOADS,
                                         STAGES, dw_2d, f32_terms)
        if dw_2d and DW_FORM != "atomic":
            b_dw = tl.sum(b_dw2, axis=0)
            b_dw2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
        if DW_FORM == "partial":
            _store_dw(PARTIAL + chunk * n_cols, b_dw, b_dwb, o_n, m_n, n_cols, BLOCK_N, BLOCK_N2, False)
            b_dw = tl.zeros([BLOCK_N], dtype=tl.float64)
            b_dwb = tl.zeros_like(b_dwb)
        elif DW_FORM == "direct" or DW_FORM == "row":
            _store_dw(DW, b_dw, b_dwb, o_n, m_n, n_cols, BLOCK_N, BLOCK_N2, True)
    if DW_FORM == "atomic":
        # (plan.py takes no two-piece tile here)
        if DW_2D:
            b_dw = tl.sum(b_dw2, axis=0)
        _add_and_finish(DW, PARTIAL, COUNTER, o_n, m_n, b_dw)


@triton.jit
def _load_col_tile(HX, DY, Z, W, o_hr, o_dyr, o_zr, o_c, mask, m_n, GATE: tl.constexpr, W_OFFSET: tl.constexpr):
    """One column tile of a wide row: f32 h, dy, w + W_OFFSET (as [1, BLOCK_N]; h again
    without a weight) and the gate's a(z), a'(z)."""
    b_h = tl.load(HX + o_hr + o_c[None, :], mask=mask, other=0.0).to(tl.float32)
    b_dy = tl.load(DY + o_dyr + o_c[None, :], mask=mask, other=0.0).to(tl.float32)
    if W is not None:
        b_w = load_weight(W, o_c, m_n, W_OFFSET)
    else:
        b_w = b_h
    if GATE is not None:
        b_a, b_da = load_gate(Z, o_zr + o_c[None, :], mask, GATE)
    else:
        b_a, b_da = b_h, b_h
    return b_h, b_dy, b_w, b_a, b_da


@triton.jit
def _wide_dx_tile(HX, DY, Z, W, DH, DX, DR, DZ, b_rstd, b_c, o_m, m_m, o_hr, o_dyr, o_zr, o_c, n_cols, NH,
                  stride_dht, stride_dhh, TWO_LEVEL: tl.constexpr, GATE: tl.constexpr, GATE_FIRST: tl.constexpr,
                  W_OFFSET: tl.constexpr):
    """The second walk's step over one column tile of a wide row: dx (dz) stored; returns
    h, dy and a(z) as f32 for dw's terms."""
    m_n = o_c < n_cols
    mask = m_m[:, None] & m_n[None, :]
    b_h, b_dy, b_w, b_a, b_da = _load_col_tile(HX, DY, Z, W, o_hr, o_dyr, o_zr, o_c, mask, m_n, GATE, W_OFFSET)
    b_xhat, b_g = _norm_inputs(b_h, b_dy, b_rstd, W, b_w, b_a, GATE, GATE_FIRST)
    _store_input_grads(b_h, b_dy, b_rstd, W, b_w, b_a, b_da, b_xhat, b_g, b_c, DH, DX, DR, DZ, o_m, o_c, mask,
                       n_cols, NH, stride_dht, stride_dhh, TWO_LEVEL, GATE, GATE_FIRST)
    return b_h, b_dy, b_a


@triton.jit
def _chunk_wide_rows(DY, HX, Z, W, RSTD, DH, DX, DR, DZ, P_PART, row_start, row_end, row_step, n_cols, NH,
                     stride_dyt, stride_dyh, stride_ht, stride_hh, stride_zt, stride_zh, stride_dht, stride_dhh,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COL_TILES: tl.constexpr,
                     TWO_LEVEL: tl.constexpr, GATE: tl.constexpr, GATE_FIRST: tl.constexpr,
                     W_OFFSET: tl.constexpr, HOLD_DW: tl.constexpr):
    """One chunk of rows walked in column tiles: dx (dz) stored and, with P_PART
    (the chunk's row of float64 partials), dw's terms accumulated there in place, or with
    HOLD_DW held in registers, one [BLOCK_N] sum a tile, and stored once (the same additions
    in the same order). HOLD_DW unrolls the second walk (with or without P_PART)."""
    o_n = tl.arange(0, BLOCK_N)
    o_mb = tl.arange(0, BLOCK_M)
    wide = HX.dtype.element_ty.primitive_bitwidth > 16 or DY.dtype.element_ty.primitive_bitwidth > 16
    if HOLD_DW:
        b_dws = ()
        for t in tl.static_range(COL_TILES):
            b_dws = b_dws + (tl.zeros([BLOCK_N], dtype=tl.float64),)
    elif P_PART is not None:
        for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N):
            o_c = n0 + o_n
            tl.store(P_PART + o_c, tl.zeros([BLOCK_N], dtype=tl.float64), mask=o_c < n_cols)
        tl.debug_barrier()
    for m0 in tl.range(row_start, row_end, row_step):
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
            b_h, b_dy, b_w, b_a, b_da = _load_col_tile(HX, DY, Z, W, o_hr, o_dyr, o_zr, o_c, mask, m_n, GATE,
                                                       W_OFFSET)
            b_xhat, b_g = _norm_inputs(b_h, b_dy, b_rstd, W, b_w, b_a, GATE, GATE_FIRST)
            b_acc += b_g * b_xhat
        b_c = tl.sum(b_acc, axis=1) / n_cols
        # pass 2: dx (dz), and the chunk's dw partial accumulated (held, or in place)
        if HOLD_DW:
            b_next = ()
            for t in tl.static_range(COL_TILES):
                o_c = t * BLOCK_N + o_n
                b_h, b_dy, b_a = _wide_dx_tile(HX, DY, Z, W, DH, DX, DR, DZ, b_rstd, b_c, o_m, m_m, o_hr, o_dyr, o_zr,
                                          o_c, n_cols, NH, stride_dht, stride_dhh, TWO_LEVEL, GATE, GATE_FIRST,
                                          W_OFFSET)
                if P_PART is not None:
                    b_next = b_next + (b_dws[t] + tl.sum(_dw_terms(b_dy, b_h, b_rstd, b_a, GATE, wide), axis=0),)
            if P_PART is not None:
                b_dws = b_next
        else:
            for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N):
                o_c = n0 + o_n
                b_h, b_dy, b_a = _wide_dx_tile(HX, DY, Z, W, DH, DX, DR, DZ, b_rstd, b_c, o_m, m_m, o_hr, o_dyr, o_zr,
                                          o_c, n_cols, NH, stride_dht, stride_dhh, TWO_LEVEL, GATE, GATE_FIRST,
                                          W_OFFSET)
                if P_PART is not None:
                    m_n = o_c < n_cols
                    b_old = tl.load(P_PART + o_c, mask=m_n, other=0.0)
                    b_new = b_old + tl.sum(_dw_terms(b_dy, b_h, b_rstd, b_a, GATE, wide), axis=0)
                    tl.store(P_PART + o_c, b_new, mask=m_n)
            # the next tile re-reads this partial: order it after these stores
            tl.debug_barrier()
    if HOLD_DW and P_PART is not None:
        for t in tl.static_range(COL_TILES):
            o_c = t * BLOCK_N + o_n
            tl.store(P_PART + o_c, b_dws[t], mask=o_c < n_cols)


@triton.jit
def bwd_col_tiles_kernel(
    DY, HX, Z, W, RSTD, DH, DX, DR, DZ, PARTIAL,
    rows, n_cols, NH,
    stride_dyt, stride_dyh, stride_ht, stride_hh, stride_zt, stride_zh, stride_dht, stride_dhh,
    rows_per_chunk, num_chunks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_TILES: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    GATE: tl.constexpr,
    GATE_FIRST: tl.constexpr,
    W_OFFSET: tl.constexpr,
    PDL: tl.constexpr = False,
    HOLD_DW: tl.constexpr = False,
    DEAL_ROWS: tl.constexpr = False,
):
    """dw partials go to PARTIAL (the "partial" form) when it is given, else no dw; HOLD_DW:
    each chunk's partial held in registers and stored once (configs.BwdTile.hold_dw)."""
    grid_dependency(PDL)
    pid = tl.program_id(0)
    for chunk in tl.range(pid, num_chunks, tl.num_programs(0)):
        row_start, row_end, row_step = _chunk_span(chunk, rows, rows_per_chunk, num_chunks, BLOCK_M, DEAL_ROWS)
        if PARTIAL is not None:
            p_part = PARTIAL + chunk * n_cols
        else:
            p_part = None
        _chunk_wide_rows(DY, HX, Z, W, RSTD, DH, DX, DR, DZ, p_part, row_start, row_end, row_step, n_cols, NH,
                         stride_dyt, stride_dyh, stride_ht, stride_hh, stride_zt, stride_zh, stride_dht, stride_dhh,
                         BLOCK_M, BLOCK_N, COL_TILES, TWO_LEVEL, GATE, GATE_FIRST, W_OFFSET, HOLD_DW)


@triton.jit
def bwd_col_slices_kernel(
    DY, HX, Z, W, RSTD, DH, DX, DR, DZ, DW, DESC_DY, DESC_H,
    rows, n_cols, NH,
    stride_dyt, stride_dyh, stride_ht, stride_hh, stride_zt, stride_zh, stride_dht, stride_dhh,
    rows_per_chunk, num_chunks, row_programs, slice_start,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    COL_TILES: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    GATE: tl.constexpr,
    GATE_FIRST: tl.constexpr,
    W_OFFSET: tl.constexpr,
    LOADS: tl.constexpr,
    STAGES: tl.constexpr,
    DW_BM: tl.constexpr,
    DW_BN: tl.constexpr,
    DW_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
    HOLD_DW: tl.constexpr = False,
    DEAL_ROWS: tl.constexpr = False,
):
    """Programs [0, row_programs) take the chunks of rows, programs [slice_start,
    grid) the column slices: slice_start 0 gives every program both roles, one
    after the other; slice_start = row_programs gives each program one role. A
    slice walks the rows DW_BM at a time, its loads pipelined DW_STAGES steps deep
    by the compiler (None: not); the additions keep their order either way."""
    grid_dependency(PDL)
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    if pid < row_programs:
        if COL_TILES == 1:
            b_w = _load_weight(W, 0, BLOCK_N, n_cols, W_OFFSET)
            b_w2 = _load_weight(W, BLOCK_N, BLOCK_N2, n_cols, W_OFFSET)
        b_none = tl.zeros([1, 1], dtype=tl.float64)
        for chunk in tl.range(pid, num_chunks, row_programs):
            row_start, row_end, row_step = _chunk_span(chunk, rows, rows_per_chunk, num_chunks, BLOCK_M, DEAL_ROWS)
            if COL_TILES == 1:
                _chunk_rows(DY, HX, Z, W, RSTD, DH, DX, DR, DZ, DESC_DY, DESC_H, b_w, b_w2, b_none, b_none, b_none,
                            row_start, row_end, row_step, n_cols, NH, stride_dyt, stride_dyh, stride_ht, stride_hh,
                            stride_zt, stride_zh, stride_dht, stride_dhh, BLOCK_M, BLOCK_N, BLOCK_N2, TWO_LEVEL, GATE,
                            GATE_FIRST, False, LOADS, STAGES, False)
            else:
                _chunk_wide_rows(DY, HX, Z, W, RSTD, DH, DX, DR, DZ, None, row_start, row_end, row_step, n_cols, NH,
                                 stride_dyt, stride_dyh, stride_ht, stride_hh, stride_zt, stride_zh, stride_dht,
                                 stride_dhh, BLOCK_M, BLOCK_N, COL_TILES, TWO_LEVEL, GATE, GATE_FIRST, W_OFFSET,
                                 HOLD_DW)
    if pid >= slice_start:
        # dw by column slices, each over all rows in row order (see above)
        wide = HX.dtype.element_ty.primitive_bitwidth > 16 or DY.dtype.element_ty.primitive_bitwidth > 16
        o_cn = tl.arange(0, DW_BN)
        o_cm = tl.arange(0, DW_BM)
        for sl in tl.range(pid - slice_start, tl.cdiv(n_cols, DW_BN), grid - slice_start):
            o_c = sl * DW_BN + o_cn
            m_c = o_c < n_cols
            b_sum = tl.zeros([DW_BN], dtype=tl.float64)
            for s0 in tl.range(0, rows, DW_BM, num_stages=DW_STAGES):
                o_m = s0 + o_cm
                m_m = o_m < rows
                mask = m_m[:, None] & m_c[None, :]
                b_h, b_dy, _, b_a, _ = _load_col_tile(
                    HX, DY, Z, None, row_offsets(o_m, NH, stride_ht, stride_hh, TWO_LEVEL)[:, None],
                    row_offsets(o_m, NH, stride_dyt, stride_dyh, TWO_LEVEL)[:, None],
                    row_offsets(o_m, NH, stride_zt, stride_zh, TWO_LEVEL)[:, None], o_c, mask, m_c, GATE, 0.0)
                b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
                b_sum += tl.sum(_dw_terms(b_dy, b_h, b_rstd, b_a, GATE, wide), axis=0)
            tl.store(DW + o_c, b_sum.to(tl.float32), mask=m_c)
