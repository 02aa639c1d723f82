"""Helpers shared by the forward and backward kernels.

Rows are addressed through a two-level stride so that per-head views such as
``q[T, 24, 256]`` with strides ``(12288, 512, 1)`` are read in place: row
``r`` lives at ``(r // NH) * stride_t + (r % NH) * stride_h``. Plain
``[..., H]`` inputs use ``NH = 1`` (``TWO_LEVEL=False``) and skip the division.
Offsets are computed in int64 so tensors past 2**31 elements stay addressable.

Optional tensors (weight, residual, gate, dh, ...) are passed to the kernels
as None when absent: Triton specialises a None argument as a constant, so
`if W is not None` is decided at compile time, like a constexpr flag.
"""
import re

import triton
import triton.language as tl


try:    # Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_PDL = True
except ImportError:
    HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """The first thing a kernel launched with programmatic dependent launch does
    (dispatch.launch_options: sm_90 and later). Such a launch may start before the grid
    ahead of it in the stream has finished; gdc_wait holds this program until that grid
    has and its writes are visible, so every load and store of the kernel comes after it.
    Then the grid behind this one may launch early in turn: its programs wait the same
    way before they touch memory. No loads, no stores and no other instruction move, so
    the bits are those of a plain launch; only the gap between two launches shrinks."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def row_offsets(o_m, NH, stride_t, stride_h, TWO_LEVEL: tl.constexpr):
    o_m = o_m.to(tl.int64)
    if TWO_LEVEL:
        return (o_m // NH) * stride_t + (o_m % NH) * stride_h
    else:
        return o_m * stride_t


@triton.jit
def negated(b):
    """-b of float32 b, exactly: the sign bit flipped (Triton's unary minus is 0 - b, which
    turns -0 into +0)."""
    return (b.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def round_to(b, DTYPE: tl.constexpr):
    """Round float32 to DTYPE, to nearest even.

    The GPU's conversion does this natively. Triton's interpreter truncates
    float32 -> bfloat16, so there (INTERPRETED) the rounding is done on the
    bits, and the CPU tests see the GPU's results. This, row_dot (no inline PTX
    there) and the float64 atomics of kernels/backward.py are the only places that
    know of the interpreter."""
    if INTERPRETED and DTYPE == tl.bfloat16:
        u = b.to(tl.uint32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return b.to(DTYPE)


@triton.jit
def add_residual(b_x, b_r, H_OUT, o_out, mask, STORE_H: tl.constexpr):
    """Return f32(h) for a tile of x (and r, None without a residual) as stored:
    h = x, or h = round(f32(x) + f32(r)) into H_OUT's dtype (the residual
    stream's: x's, or float32), written to H_OUT with STORE_H."""
    if b_r is not None:
        b_x = round_to(b_x.to(tl.float32) + b_r.to(tl.float32), H_OUT.dtype.element_ty)
        if STORE_H:
            tl.store(H_OUT + o_out, b_x, mask=mask)
    return b_x.to(tl.float32)


@triton.jit
def load_h(X, R, H_OUT, o_x, o_r, o_out, mask, STORE_H: tl.constexpr):
    """add_residual of the tile of x (and r, None without a residual) at offsets o_x (o_r)."""
    b_x = tl.load(X + o_x, mask=mask, other=0.0)
    if R is not None:
        b_r = tl.load(R + o_r, mask=mask, other=0.0)
    else:
        b_r = None
    return add_residual(b_x, b_r, H_OUT, o_out, mask, STORE_H)


@triton.jit
def load_weight(W, o_c, m_c, W_OFFSET: tl.constexpr):
    """f32 (w + W_OFFSET) of columns o_c, as [1, N]: W_OFFSET 1 gives the (1 + w) weights
    of zero-centred norms (Gemma style), added in float32 (exact for 16-bit weights of
    magnitude at least 2**-16, else rounded once)."""
    return weight_values(weight_as_stored(W, o_c, m_c), W_OFFSET)


@triton.jit
def weight_as_stored(W, o_c, m_c):
    """The weight of columns o_c as stored (zeros past the row): loads that a form issues
    ahead of its rows and converts later (weight_values)."""
    return tl.load(W + o_c, mask=m_c, other=0.0)


@triton.jit
def load_halves(P, n, N: tl.constexpr):
    """N 32-bit values at P (n of them in bounds, zeros past them) read as two loads of 4
    (16 bytes) a thread into the registers of a tile of 16-bit rows, which holds 8 a thread
    along the row: one load would take 4 a thread (Triton's widest access is 16 bytes) and
    move them into place through shared memory, between barriers."""
    o0 = 8 * tl.arange(0, N // 8)[:, None] + tl.arange(0, 4)[None, :]      # values 0-3 of each 8
    v0 = tl.load(P + o0, mask=o0 < n, other=0.0)
    v1 = tl.load(P + o0 + 4, mask=o0 + 4 < n, other=0.0)                  # and 4-7
    return tl.reshape(tl.permute(tl.join(v0, v1), (0, 2, 1)), (N,))


@triton.jit
def weight_tile(W, c0, n_cols, N: tl.constexpr, HALVES: tl.constexpr):
    """The weight of columns c0 + [0, N) as stored (weight_as_stored); with HALVES a float32
    weight is read by load_halves (plan.py's weight_halves say where)."""
    if HALVES and W.dtype.element_ty.primitive_bitwidth == 32:
        r_w = load_halves(W + c0, n_cols - c0, N)
    else:
        o_c = c0 + tl.arange(0, N)
        r_w = weight_as_stored(W, o_c, o_c < n_cols)
    return r_w


@triton.jit
def weight_values(r_w, W_OFFSET: tl.constexpr):
    """load_weight's f32 (w + W_OFFSET), as [1, N], of weights r_w loaded as stored."""
    b_w = r_w.to(tl.float32)
    if W_OFFSET != 0.0:
        b_w = b_w + W_OFFSET
    return b_w[None, :]


@triton.jit
def rstd_from_sumsq(b_ss, n_cols, eps):
    """rstd = 1 / sqrt(sum / H + eps), with IEEE-rounded sqrt and division."""
    return tl.div_rn(1.0, tl.sqrt_rn(b_ss / n_cols + eps))


# Rows whose float32 sum of squares overflows (rms above ~1.8e19 / sqrt(H)) are
# summed again scaled by s = 2**-96 (exact; even 65536 squares of the bf16 / fp32
# maximum stay finite, and the elements that underflow are below 2**-60 of the
# row's largest): rstd = s / sqrt(sum (s u)^2 / H + eps s^2).
SCALE_DOWN = tl.constexpr(1.262177448353619e-29)     # 2**-96 (Triton 3.6 rejects an annotated global)


@triton.jit
def rstd_from_sums(b_ss, b_ss_scaled, n_cols, eps):
    """rstd from the plain float32 sum of squares, or, in rows where it is
    infinite, from the sum of the scaled squares. Rows whose plain sum
    is finite get exactly rstd_from_sumsq's bits."""
    b_big = b_ss == float("inf")
    b_rs = rstd_from_sumsq(tl.where(b_big, 0.0, b_ss), n_cols, eps)
    # eps s^2 added as one written-out multiply-add: left to the compiler, the product was
    # fused into the addition where both sat in one block (the one-tile form with plain
    # loads) and rounded on its own where the product was hoisted out of a loop (the
    # descriptor form), so the two load forms had different arithmetic (compile_check
    # --load-forms, Triton 3.9). The exact product is below 2**-149 for any eps under 2**43,
    # far under an overflowing row's scaled mean: the same bits as the rounded product.
    b_rb = tl.div_rn(SCALE_DOWN, tl.sqrt_rn(tl.fma(eps * SCALE_DOWN, SCALE_DOWN,
                                                   tl.where(b_big, b_ss_scaled, 1.0) / n_cols)))
    return tl.where(b_big, b_rb, b_rs)


@triton.jit
def row_dot(b_a, b_b):
    """sum_j a_j * b_j of each row of a [rows, columns] tile, in float32.

    Triton 3.6 sums a thread's values one after another, each product fused into its
    addition. Later Triton (3.7 on: TREE_SUMS) sums them as a tree, and LLVM's vectoriser
    regroups that tree's additions differently as the code around it changes, so the
    backend fuses other products into them: under Triton 3.9, compiled for sm_90, the
    backward of a float32 residual stream at H 256 fused 40 products into its row sums
    at T 1 and 38 at T >= 16 (H 128: 80 and 79), and a row's dx would follow T. There
    each product is rounded on its own (mul.rn, which no compiler fuses) before the tree,
    so every form of a kernel sums the same values in the same order. Triton 3.6 keeps its
    fused chain (the compiled code of every form is unchanged); the interpreter fuses nothing."""
    b_p = b_a * b_b
    if TREE_SUMS:
        if not INTERPRETED:
            b_p = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [b_a, b_b], dtype=tl.float32,
                                            is_pure=True, pack=1)
    return tl.sum(b_p, axis=1)


@triton.jit
def rstd_of_rows(b_u, b_u2, n_cols, eps):
    """rstd of each row of a tile holding whole rows (float32 u; b_u2 the rows'
    second piece, or None). The scaled sum is formed only when some row of the
    tile overflowed: a tile of ordinary rows does exactly what rstd_from_sumsq does."""
    b_ss = row_dot(b_u, b_u)
    if b_u2 is not None:
        b_ss += row_dot(b_u2, b_u2)
    b_rstd = rstd_from_sumsq(b_ss, n_cols, eps)
    if tl.max(b_ss, axis=0) == float("inf"):
        b_s = b_u * SCALE_DOWN
        b_ss_scaled = row_dot(b_s, b_s)
        if b_u2 is not None:
            b_s2 = b_u2 * SCALE_DOWN
            b_ss_scaled += row_dot(b_s2, b_s2)
        b_rstd = rstd_from_sums(b_ss, b_ss_scaled, n_cols, eps)
    return b_rstd


try:
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted
except ImportError:  # pragma: no cover - a Triton without the interpreter
    _Interpreted = ()
# Whether triton.jit built interpreter functions in this process (TRITON_INTERPRET
# when Triton first compiled these modules): the same decision Triton made, so the
# rounding shim applies exactly when the interpreter runs the kernels.
INTERPRETED = tl.constexpr(isinstance(round_to, _Interpreted))
# Whether this Triton sums a thread's values of a reduction as a tree (row_dot): from 3.7
# (the change came in with triton-lang/triton#9220, merged after 3.6); 3.6 and before sum
# them one after another
TREE_SUMS = tl.constexpr(tuple(int(v) for v in re.findall(r"\d+", triton.__version__)[:2]) >= (3, 7))
