"""RMSNorm forward: y, float32 rstd and (with a residual) h. Two forms, one kernel each.

    h    = x                         or  round(f32(x) + f32(r))   (R given)
    rstd = 1 / sqrt(sum_j f32(h_j)^2 / H + eps)    (float32 sum; rows where it overflows are
                                                   summed again scaled down, see common.py)
    y_j  = round(f32(h_j) * rstd * f32(w_j))                      (w_j = 1 when W is None)

With a gate z (Z given; a = the activation GATE, kernels/gate.py):
    y_j  = round(f32(h_j) * rstd * f32(w_j) * a(z_j))             (norm, then gate)
or, with GATE_FIRST, u = f32(h) * a(z) normalised in place of h:
    rstd = 1 / sqrt(sum_j u_j^2 / H + eps),  y_j = round(u_j * rstd * f32(w_j))

The forms (plan.py picks one from the row width and the tile):

- `fwd_one_tile_kernel`: a row fits one tile of BLOCK_N columns (`_row_tile`
  computes a tile of BLOCK_M rows). With plain loads the grid has one program
  per row tile and no loop: nothing is loop-invariant, so the compiler hoists
  no conversion ahead of the rows' loads, and the program holds no loop
  barrier. WEIGHT says when such a program reads the weight: "early", as
  stored before the rows (converted after their sum); "rows", beside the
  rows' loads; "late", after the tile's sum of squares (no registers held for
  it while the rows are in flight). Programs of the descriptor form take row
  tiles pid, pid + grid, ... and read the weight once, in float32, before
  their tile loop.
  With TMA_STAGES (one-level rows with 16-byte aligned strides, Hopper and
  later) x (and r) are read through tensor descriptors (DESC_X, DESC_R: [rows,
  H] with a [BLOCK_M, BLOCK_N] block) by the bulk copy engine into shared
  memory and the tile loop is software-pipelined TMA_STAGES deep, the grid a
  few programs per SM: several row tiles in flight per program without
  holding registers. Every tile
  is computed the same way in both load forms, whichever program takes it:
  the bits do not change. With BLOCK_N2 > 0 a row is held as two pieces of
  BLOCK_N and BLOCK_N2 columns (plain loads), its sum of squares the sum of
  the pieces' sums: 5120 = 4096 + 1024 in one pass, no column masked.
- `fwd_col_tiles_kernel`: wider rows, walked in COL_TILES tiles twice (sum of
  squares, then normalise; the second walk re-reads x, and r, which the first
  left in L1 / L2). The walks are unrolled COL_UNROLL times: with all of a
  row's tiles in one straight run their loads are in flight together, as in
  the one-tile form, but a row holds no padding columns (H 5120 as five tiles
  of 1024 against one of 8192). With HOLD (unrolled walks only) the first
  walk's tiles stay in registers for the second: x (and r) read once, the same
  additions in the same order. With WEIGHT "rows" (unrolled walks only) the
  weight's tiles are read before the first walk's, all in flight together,
  and held for the second; "late" reads each in the second walk.

The tile's columns (block_n, warps, and so the split of a row's sum over a
thread's values, the lanes and the warps) are a function of (H, dtype) only;
the rows a tile holds may follow the row count (FwdSchedule.rows_block_m), which
moves no addition of a row's sum. So the reduction order of a row never depends
on how many rows there are: y and rstd are batch-invariant.
"""
import triton
import triton.language as tl

from .common import (SCALE_DOWN, add_residual, grid_dependency, load_h, load_weight, round_to, row_offsets,
                     rstd_from_sums, rstd_from_sumsq, rstd_of_rows, weight_tile, weight_values)
from .gate import load_gate


@triton.jit
def _row_addresses(o_m, NH, stride_xt, stride_xh, stride_rt, stride_rh, stride_zt, stride_zh, n_cols,
                   TWO_LEVEL: tl.constexpr):
    """Row starts of x, r and z as stored, and of the contiguous outputs, as [BLOCK_M, 1]."""
    o_x = row_offsets(o_m, NH, stride_xt, stride_xh, TWO_LEVEL)[:, None]
    o_r = row_offsets(o_m, NH, stride_rt, stride_rh, TWO_LEVEL)[:, None]
    o_z = row_offsets(o_m, NH, stride_zt, stride_zh, TWO_LEVEL)[:, None]
    o_out = (o_m.to(tl.int64) * n_cols)[:, None]
    return o_x, o_r, o_z, o_out


@triton.jit
def _normalise(b_h, b_rstd, b_w, b_a, GATE_AFTER: tl.constexpr):
    """f32(h) * rstd [* w] [* a(z) with the gate after the norm]; b_w None without a weight."""
    b_y = b_h * b_rstd[:, None]
    if b_w is not None:
        b_y = b_y * b_w
    if GATE_AFTER:
        b_y = b_y * b_a
    return b_y


@triton.jit
def _with_gate(b_h, Z, o_z, mask, GATE: tl.constexpr, GATE_FIRST: tl.constexpr):
    """(u, a(z)) of a tile of f32 h: u = h, times a(z) with GATE_FIRST (a is h without a gate)."""
    b_a = b_h
    if GATE is not None:
        b_a, _ = load_gate(Z, o_z, mask, GATE)
        if GATE_FIRST:
            b_h = b_h * b_a
    return b_h, b_a


@triton.jit
def _store_y(Y, W, b_w, b_h, b_rstd, b_a, o_out, o_c, m_c, mask, WEIGHT: tl.constexpr, CONVERTED: tl.constexpr,
             GATE_AFTER: tl.constexpr, W_OFFSET: tl.constexpr, C0: tl.constexpr, n_cols, W_HALVES: tl.constexpr):
    """y of a tile (or a piece, from column C0) of rows, stored; the weight is b_w (read before:
    float32 with CONVERTED, else as stored) or read now ("late", by halves with W_HALVES)."""
    if W is not None:
        if CONVERTED:
            b_wt = b_w
        elif WEIGHT == "late":
            b_wt = weight_values(weight_tile(W, C0, n_cols, o_c.shape[0], W_HALVES), W_OFFSET)
        else:
            b_wt = weight_values(b_w, W_OFFSET)
    else:
        b_wt = None
    b_y = _normalise(b_h, b_rstd, b_wt, b_a, GATE_AFTER)
    tl.store(Y + o_out + o_c[None, :], round_to(b_y, Y.dtype.element_ty), mask=mask)


@triton.jit
def fwd_one_tile_kernel(
    X, R, Z, W, Y, H_OUT, RSTD, DESC_X, DESC_R,
    rows, n_cols, NH,
    stride_xt, stride_xh, stride_rt, stride_rh, stride_zt, stride_zh,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    GATE: tl.constexpr,
    GATE_FIRST: tl.constexpr,
    W_OFFSET: tl.constexpr,
    TMA_STAGES: tl.constexpr,
    WEIGHT: tl.constexpr,
    W_HALVES: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    grid_dependency(PDL)
    pid = tl.program_id(0)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < n_cols
    if BLOCK_N2 > 0:
        o_n2 = BLOCK_N + tl.arange(0, BLOCK_N2)
        m_n2 = o_n2 < n_cols
    else:
        o_n2 = o_n
        m_n2 = m_n
    if TMA_STAGES is not None:
        # a persistent program: the weight converted once, then its row tiles pipelined
        b_w = tl.zeros([1, 1], dtype=tl.float32)
        if W is not None:
            b_w = load_weight(W, o_n, m_n, W_OFFSET)
        for tile in tl.range(pid, tl.cdiv(rows, BLOCK_M), tl.num_programs(0), num_stages=TMA_STAGES):
            _row_tile(X, R, Z, W, Y, H_OUT, RSTD, DESC_X, DESC_R, tile, b_w, b_w, rows, n_cols, NH,
                      stride_xt, stride_xh, stride_rt, stride_rh, stride_zt, stride_zh, eps, o_n, m_n, o_n2, m_n2,
                      BLOCK_M, BLOCK_N2, TWO_LEVEL, GATE, GATE_FIRST, W_OFFSET, True, "early", 0)
    else:
        # one program, one row tile, no loop: nothing loop-invariant for the compiler to
        # hoist, so a weight read "early" is issued ahead of the rows and converted after them
        r_w = tl.zeros([1, 1], dtype=tl.float32)
        r_w2 = r_w
        if W is not None and WEIGHT == "early":
            r_w = weight_tile(W, 0, n_cols, BLOCK_N, W_HALVES >= 1)
            if BLOCK_N2 > 0:
                r_w2 = weight_tile(W, BLOCK_N, n_cols, BLOCK_N2, W_HALVES >= 2)
        _row_tile(X, R, Z, W, Y, H_OUT, RSTD, DESC_X, DESC_R, pid, r_w, r_w2, rows, n_cols, NH,
                  stride_xt, stride_xh, stride_rt, stride_rh, stride_zt, stride_zh, eps, o_n, m_n, o_n2, m_n2,
                  BLOCK_M, BLOCK_N2, TWO_LEVEL, GATE, GATE_FIRST, W_OFFSET, False, WEIGHT, W_HALVES)


@triton.jit
def _row_tile(X, R, Z, W, Y, H_OUT, RSTD, DESC_X, DESC_R, tile, r_w, r_w2, rows, n_cols, NH,
              stride_xt, stride_xh, stride_rt, stride_rh, stride_zt, stride_zh, eps, o_n, m_n, o_n2, m_n2,
              BLOCK_M: tl.constexpr, BLOCK_N2: tl.constexpr, TWO_LEVEL: tl.constexpr, GATE: tl.constexpr,
              GATE_FIRST: tl.constexpr, W_OFFSET: tl.constexpr, DESCRIPTORS: tl.constexpr, WEIGHT: tl.constexpr,
              W_HALVES: tl.constexpr):
    """Row tile `tile` of the one-tile form: y, rstd (and h) of its BLOCK_M rows. The weight r_w (r_w2:
    the second piece's) is float32 with DESCRIPTORS, else as stored where WEIGHT is "early"; the
    first W_HALVES pieces' weight is read by halves (common.weight_tile)."""
    BLOCK_N: tl.constexpr = o_n.shape[0]
    m0 = tile * BLOCK_M
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_m = o_m < rows
    mask = m_m[:, None] & m_n[None, :]
    o_x, o_r, o_z, o_out = _row_addresses(o_m, NH, stride_xt, stride_xh, stride_rt, stride_rh,
                                          stride_zt, stride_zh, n_cols, TWO_LEVEL)
    if W is not None and WEIGHT == "rows":
        # issued before the rows' loads and converted after them (_store_y): a
        # conversion right here would make the rows' loads wait for the weight
        r_w = weight_tile(W, 0, n_cols, BLOCK_N, W_HALVES >= 1)
        r_w2 = r_w
        if BLOCK_N2 > 0:
            r_w2 = weight_tile(W, BLOCK_N, n_cols, BLOCK_N2, W_HALVES >= 2)
    if DESCRIPTORS:
        # bulk tensor copies into shared memory, TMA_STAGES tiles in flight (the compiler's
        # software pipeline); rows and columns past the tensor read as zero
        r_x = DESC_X.load([m0, 0])
        if R is not None:
            r_r = DESC_R.load([m0, 0])
        else:
            r_r = None
        b_h = add_residual(r_x, r_r, H_OUT, o_out + o_n[None, :], mask, True)
    else:
        b_h = load_h(X, R, H_OUT, o_x + o_n[None, :], o_r + o_n[None, :], o_out + o_n[None, :], mask, True)
    b_h, b_a = _with_gate(b_h, Z, o_z + o_n[None, :], mask, GATE, GATE_FIRST)
    if BLOCK_N2 > 0:
        # the row's second piece (plain loads)
        mask2 = m_m[:, None] & m_n2[None, :]
        q_h = load_h(X, R, H_OUT, o_x + o_n2[None, :], o_r + o_n2[None, :], o_out + o_n2[None, :], mask2, True)
        q_h, q_a = _with_gate(q_h, Z, o_z + o_n2[None, :], mask2, GATE, GATE_FIRST)
        b_rstd = rstd_of_rows(b_h, q_h, n_cols, eps)
    else:
        b_rstd = rstd_of_rows(b_h, None, n_cols, eps)
    gate_after: tl.constexpr = GATE is not None and not GATE_FIRST
    _store_y(Y, W, r_w, b_h, b_rstd, b_a, o_out, o_n, m_n, mask, WEIGHT, DESCRIPTORS, gate_after, W_OFFSET,
             0, n_cols, W_HALVES >= 1)
    if BLOCK_N2 > 0:
        _store_y(Y, W, r_w2, q_h, b_rstd, q_a, o_out, o_n2, m_n2, mask2, WEIGHT, DESCRIPTORS, gate_after, W_OFFSET,
                 BLOCK_N, n_cols, W_HALVES >= 2)
    tl.store(RSTD + o_m, b_rstd, mask=m_m)


@triton.jit
def fwd_col_tiles_kernel(
    X, R, Z, W, Y, H_OUT, RSTD,
    rows, n_cols, NH,
    stride_xt, stride_xh, stride_rt, stride_rh, stride_zt, stride_zh,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COL_TILES: tl.constexpr,
    COL_UNROLL: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    GATE: tl.constexpr,
    GATE_FIRST: tl.constexpr,
    W_OFFSET: tl.constexpr,
    HOLD: tl.constexpr,
    WEIGHT: tl.constexpr,
    W_HALVES: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    grid_dependency(PDL)
    pid = tl.program_id(0)
    o_n = tl.arange(0, BLOCK_N)
    o_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < rows
    o_x, o_r, o_z, o_out = _row_addresses(o_m, NH, stride_xt, stride_xh, stride_rt, stride_rh,
                                          stride_zt, stride_zh, n_cols, TWO_LEVEL)
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    weights = ()
    if W is not None and WEIGHT == "rows":
        # every weight tile's load issued before the rows', held as stored for the second walk
        for t in tl.static_range(COL_TILES):
            weights = weights + (weight_tile(W, t * BLOCK_N, n_cols, BLOCK_N, W_HALVES >= 1),)
    if HOLD:
        # every tile of the row in registers, read once: the same additions in the same order
        held = ()
        for t in tl.static_range(COL_TILES):
            b_h, b_acc = _sum_tile(X, R, Z, H_OUT, t * BLOCK_N + o_n, o_x, o_r, o_z, o_out, m_m, n_cols, b_acc,
                                   GATE, GATE_FIRST)
            held = held + (b_h,)
    else:
        for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N, loop_unroll_factor=COL_UNROLL):
            _, b_acc = _sum_tile(X, R, Z, H_OUT, n0 + o_n, o_x, o_r, o_z, o_out, m_m, n_cols, b_acc, GATE,
                                 GATE_FIRST)
    b_ss = tl.sum(b_acc, axis=1)
    b_rstd = rstd_from_sumsq(b_ss, n_cols, eps)
    if tl.max(b_ss, axis=0) == float("inf"):
        # some row's float32 sum of squares overflowed: its scaled squares, from the held
        # tiles or walked again, unrolled as the first walk (the plain rows keep
        # rstd_from_sumsq's bits, rstd_from_sums' plain branch). Held tiles walked again took
        # the held forms from 60 to 74 registers (bf16, one row a tile) and 94 to 123 (float32
        # weight, two) for sm_90 under Triton 3.6; a rolled walk beside the held tiles'
        # unrolled one gave the two forms other float instructions (compile_check --load-forms)
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if HOLD:
            for t in tl.static_range(COL_TILES):
                b_s = held[t] * SCALE_DOWN
                b_acc += b_s * b_s
        else:
            for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N, loop_unroll_factor=COL_UNROLL):
                b_s = _load_u(X, R, Z, H_OUT, n0 + o_n, o_x, o_r, o_z, o_out, m_m, n_cols, False, GATE,
                              GATE_FIRST) * SCALE_DOWN
                b_acc += b_s * b_s
        b_rstd = rstd_from_sums(b_ss, tl.sum(b_acc, axis=1), n_cols, eps)
    if HOLD or WEIGHT == "rows":
        for t in tl.static_range(COL_TILES):
            if HOLD:
                b_u = held[t]
            else:
                b_u = _load_u(X, R, Z, H_OUT, t * BLOCK_N + o_n, o_x, o_r, o_z, o_out, m_m, n_cols, False, GATE,
                              GATE_FIRST)
            if W is not None and WEIGHT == "rows":
                b_w = weights[t]
            else:
                b_w = None
            _store_tile(Y, W, Z, b_u, b_rstd, t * BLOCK_N, o_n, o_z, o_out, m_m, n_cols, b_w, GATE, GATE_FIRST,
                        W_OFFSET, W_HALVES >= 1)
    else:
        for n0 in tl.range(0, COL_TILES * BLOCK_N, BLOCK_N, loop_unroll_factor=COL_UNROLL):
            # h is recomputed from x (+ r) rather than re-read from H_OUT: no
            # ordering between this program's own stores and loads is needed.
            b_u = _load_u(X, R, Z, H_OUT, n0 + o_n, o_x, o_r, o_z, o_out, m_m, n_cols, False, GATE, GATE_FIRST)
            _store_tile(Y, W, Z, b_u, b_rstd, n0, o_n, o_z, o_out, m_m, n_cols, None, GATE, GATE_FIRST, W_OFFSET,
                        W_HALVES >= 1)
    tl.store(RSTD + o_m, b_rstd, mask=m_m)


@triton.jit
def _load_u(X, R, Z, H_OUT, o_c, o_x, o_r, o_z, o_out, m_m, n_cols, STORE_H: tl.constexpr, GATE: tl.constexpr,
            GATE_FIRST: tl.constexpr):
    """u of the columns o_c: f32(h), times a(z) with the gate first; h stored with STORE_H."""
    mask = m_m[:, None] & (o_c < n_cols)[None, :]
    b_h = load_h(X, R, H_OUT, o_x + o_c[None, :], o_r + o_c[None, :], o_out + o_c[None, :], mask, STORE_H)
    if GATE is not None and GATE_FIRST:
        b_a, _ = load_gate(Z, o_z + o_c[None, :], mask, GATE)
        b_h = b_h * b_a
    return b_h


@triton.jit
def _sum_tile(X, R, Z, H_OUT, o_c, o_x, o_r, o_z, o_out, m_m, n_cols, b_acc, GATE: tl.constexpr,
              GATE_FIRST: tl.constexpr):
    """The first walk's step over the columns o_c: (u, the sums of squares with u's added); h stored."""
    b_h = _load_u(X, R, Z, H_OUT, o_c, o_x, o_r, o_z, o_out, m_m, n_cols, True, GATE, GATE_FIRST)
    b_acc += b_h * b_h
    return b_h, b_acc


@triton.jit
def _store_tile(Y, W, Z, b_u, b_rstd, c0, o_n, o_z, o_out, m_m, n_cols, r_w, GATE: tl.constexpr,
                GATE_FIRST: tl.constexpr, W_OFFSET: tl.constexpr, W_HALVES: tl.constexpr):
    """The second walk's step: y of the columns c0 + o_n from u (the first walk's), stored; the
    weight r_w as stored (read before), or read now (r_w None; by halves with W_HALVES)."""
    o_c = c0 + o_n
    m_n = o_c < n_cols
    mask = m_m[:, None] & m_n[None, :]
    b_a = b_u
    if GATE is not None and not GATE_FIRST:
        b_a, _ = load_gate(Z, o_z + o_c[None, :], mask, GATE)
    if W is None:
        b_w = None
    elif r_w is None:
        b_w = weight_values(weight_tile(W, c0, n_cols, o_n.shape[0], W_HALVES), W_OFFSET)
    else:
        b_w = weight_values(r_w, W_OFFSET)
    b_y = _normalise(b_u, b_rstd, b_w, b_a, GATE is not None and not GATE_FIRST)
    tl.store(Y + o_out + o_c[None, :], round_to(b_y, Y.dtype.element_ty), mask=mask)
