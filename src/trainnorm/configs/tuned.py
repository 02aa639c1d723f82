"""Measured configurations, keyed by (H, activation element size in bytes).

Measured on one H200 (132 SMs, torch 2.11, Triton 3.6), bf16 activations and
weight, random normal inputs; times are medians of CUDA-graph replays after an
L2 flush.

FWD, FWD_W32: `tools/tune.py --sweep-fwd`: every forward tile (block_m,
num_warps), with plain loads and (tiles of at most 64 elements a thread)
through tensor descriptors 3 or 4 deep at 1, 2 or 4 programs per SM, timed
interleaved at T = 1, 16, 1024, 16384, 65536; the entry is the tile with the
lowest geomean of its time relative to the best tile at each T (the line
above it gives its times and those of the previous entry; a "kept" line says
where the bench overruled the sweep). H = 256 keeps its stage-1 entry
([16384, 24, 256]). Raw data: docs/benchmarks/tune/h200-sweep2-fwd.*.

BWD_DIRECT: `tools/tune.py --sweep-small` (see the table).

BWD: `tools/tune.py --sweep-bwd` (raw data: docs/benchmarks/tune/h200-sweep-bwd.*):
every candidate tile (block_m, num_warps), with and without prefetch, 2 or 4
programs per SM and 132 / 264 / 528 chunks at most, timed interleaved at
T = 256, 1024, 4096, 16384, 65536 (H = 256: T = 1024, 4096, 16384 with 24 rows
per token); the entry is the candidate with the lowest geomean over those T of
its time relative to the best candidate at each T ("x1.008 geomean, worst
x1.03" below). The comment above an entry gives its deterministic times.

atomic_min_rows: from how many rows deterministic=False uses its one-launch
atomic form; the "det/atomic" times are the entry's deterministic form and its
atomic form at each T. NEVER: the atomic form was not faster from any measured
T on (the combine of the deterministic form is one small, well-spread launch),
so deterministic=False runs the deterministic form.

tma_stages / dw_2d (added after the sweep): the sweep's entry with plain loads
against the same tile with tensor-descriptor loads pipelined 2 / 3 / 4 deep
(prefetch off) and, at H <= 2048, with dw_2d; one interleaved group per T,
same process (raw data: docs/benchmarks/tune/h200-tma-probe.*). The comment
"tma" line gives those times; the previous entries' det/atomic lines were
measured with plain loads.

Changing an entry changes the bits of dw (the chunking) and possibly of dx
(the tile): it is a numerics change, to be re-verified with `trainnorm verify`
and the GPU tests.
"""
NEVER = 1 << 40
# (H, elt) -> FwdConfig fields
FWD: dict = {
    # bm2 w2: T1 4.46, T16 4.83, T1024 5.62, T16384 13.98, T65536 38.88 us; x1.044 geomean, worst x1.09 of the best per T over 59; previous bm2 w2 x1.044: T1 4.46, T16 4.83, T1024 5.62, T16384 13.98, T65536 38.88
    (512, 2): dict(block_m=2, block_n=512, num_warps=2),
    # bm2 w4 tma3 c4: T1 4.58, T16 4.93, T1024 7.25, T16384 31.07, T65536 106.11 us; x1.044 geomean, worst x1.08 of the best per T over 54; previous bm2 w4 x1.044: T1 4.35, T16 5.02, T1024 7.39, T16384 31.46, T65536 106.19
    (1536, 2): dict(block_m=2, block_n=2048, num_warps=4, tma_stages=3, ctas_per_sm=4),
    # bm1 w4: T1 4.45, T16 4.70, T1024 6.94, T16384 38.66, T65536 134.11 us; x1.027 geomean, worst x1.06 of the best per T over 54; previous bm2 w4 x1.057: T1 4.46, T16 5.15, T1024 7.57, T16384 37.23, T65536 134.66
    (2048, 2): dict(block_m=1, block_n=2048, num_warps=4),
    # bm1 w4 tma3 c4: T1 4.46, T16 4.80, T1024 9.34, T16384 74.38, T65536 279.04 us; x1.026 geomean, worst x1.07 of the best per T over 39; previous bm2 w8 x1.061: T1 4.48, T16 5.49, T1024 10.32, T16384 72.19, T65536 268.26
    # kept: bm2 w8 (plain loads) for T >= 14928, where `trainnorm bench` had the descriptor form 4.6-5.6%
    # slower than it (T65536 279.7 vs 264.0 us, T16384 72.8 vs 69.5; docs/benchmarks/h200.md)
    (4096, 2): dict(block_m=2, block_n=4096, num_warps=8),
    # sweep of 2026-12-04 (35 candidates, docs/benchmarks/tune/h200-sweep3-fwd.txt): the geomean pick was
    # bm1 w4 tma3 c2: T1 5.02, T16 4.99, T1024 11.28, T16384 94.45, T65536 363.68 us; the one-tile bm1 w4
    # 5.38, 5.18, 11.42, 94.94, 358.54. Taken instead: two passes over three 2048-column tiles (no padding
    # columns), bm1 w8 n2048: 5.81, 5.97, 12.22, 87.14, 327.39 -- the fastest at T 16384 and 65536, where the
    # floor is 81 / 325 us, for 0.4-0.8 us more at T <= 16 and 0.8 us at T 1024
    (5120, 2): dict(block_m=1, block_n=2048, num_warps=8),
    # bm1 w4 tma4 c2: T1 4.86, T16 5.31, T1024 12.03, T16384 113.49, T65536 422.29 us; x1.032 geomean, worst x1.05 of the best per T over 24; previous bm1 w4 x1.181: T1 4.96, T16 5.63, T1024 14.18, T16384 138.06, T65536 535.89
    # kept: bm1 w4 with plain loads and the weight read late (dispatch.EARLY_WEIGHT_COLS_PER_WARP):
    # `trainnorm bench` had the descriptor form 5-9% slower from T 4096 on (T65536 422.6 vs 387.6 us, T16384 110.9 vs 102.6)
    (6144, 2): dict(block_m=1, block_n=8192, num_warps=4),
    # not swept (stage 1 at [16384, 24, 256]): 101.1 us; bm32 w16 100.8, bm8 w4 101.4
    (256, 2): dict(block_m=8, block_n=256, num_warps=2),
}
# (H, elt) -> FwdConfig fields with a float32 weight (16-bit activations), where they
# differ from FWD. One H200, T = 16384 / 65536, us (float32 weight; bf16 weight in brackets):
#   H5120 bm1 w4 (the FWD entry) 115.4 / 433.9 (93.3 / 351.2), bm2 w8 104.0 / 391.9 (99.9 / 376.2)
#   H6144 bm1 w4 (the FWD entry) 130.5 / 497.5 (102.3 / 389.6), bm2 w8 112.7 / 426.3 (108.4 / 409.3)
# A two-row tile reads the float32 weight once for two rows.
FWD_W32: dict = {
    # sweep of 2026-12-04: two passes over five 1024-column tiles, bm2 w8 n1024: T1 7.39, T16 7.90, T1024 11.60,
    # T16384 89.92, T65536 330.77 us, the fastest from T 16384 on and within 1% at T 1024; the geomean pick
    # bm1 w4 tma3 c2: 5.71, 6.02, 12.22, 94.77, 371.82; previous bm1 w8 tma3 c2: 5.70, 6.29, 12.26, 95.52, 370.74.
    # The float32-weight rows start at T 256, so T <= 16 does not weigh here
    (5120, 2): dict(block_m=2, block_n=1024, num_warps=8),
    # bm1 w4 tma4 c2: T1 5.66, T16 6.05, T1024 12.59, T16384 112.48, T65536 419.73 us; x1.028 geomean, worst x1.07 of the best per T over 24; previous bm2 w8 x1.302: T1 5.66, T16 6.24, T1024 16.67, T16384 170.91, T65536 657.23
    (6144, 2): dict(block_m=1, block_n=8192, num_warps=4, tma_stages=4, ctas_per_sm=2),
}
# (H, elt) -> BwdConfig fields
BWD: dict = {
    # bm8 w4 tma4 d2 c4 max264: T1024 22.0, T4096 51.6, T16384 162.5 us; x1.000 geomean, worst x1.00 of the best per T over 144 candidates
    (256, 2): dict(block_m=8, block_n=256, num_warps=4, min_rows_per_chunk=8, max_chunks=264,
                   ctas_per_sm=4, prefetch=False, tma_stages=4, dw_2d=True,
                   # det/atomic us: T1024 22.4/26.1, T4096 52.0/53.1, T16384 162.6/160.6
                   atomic_min_rows=393216),
    # bm8 w4 c2 max264: T256 8.8, T1024 10.3, T4096 17.2, T16384 40.2, T65536 124.9 us; x1.053 geomean, worst x1.15 of the best per T over 60 candidates
    # tma us (T1024, 4096, 16384, 65536): plain 10.0, 17.3, 40.0, 125.0; dw_2d 10.2, 15.3, 28.3, 74.2;
    #   dw_2d + tma3 10.7, 15.5, 27.3, 65.4; tma3 alone 10.4, 17.7, 38.1, 119.8 (the per-tile dw
    #   exchange between threads was the cost: nodw 58.2 us at T65536, docs/benchmarks/tune/h200-probe-1.txt)
    (512, 2): dict(block_m=8, block_n=512, num_warps=4, min_rows_per_chunk=8, max_chunks=264,
                   ctas_per_sm=2, prefetch=False, tma_stages=3, dw_2d=True,
                   # det/atomic us: T256 9.1/9.1, T1024 10.2/13.3, T4096 17.3/21.9, T16384 40.3/43.0, T65536 125.3/128.8
                   atomic_min_rows=NEVER),
    # bm2 w4 pf c2 max264: T256 9.0, T1024 12.7, T4096 22.0, T16384 58.2, T65536 193.4 us; x1.022 geomean, worst x1.07 of the best per T over 48 candidates
    # tma us (T4096, 65536): plain+prefetch 21.6, 192.1; tma2 24.9, 223.6; tma3 20.5, 163.5; tma4 20.5, 162.8
    (1536, 2): dict(block_m=2, block_n=2048, num_warps=4, min_rows_per_chunk=2, max_chunks=264,
                   ctas_per_sm=2, prefetch=False, tma_stages=4,
                   # det/atomic us: T256 9.3/15.1, T1024 12.5/28.7, T4096 22.1/31.6, T16384 58.0/64.6, T65536 191.8/191.7
                   atomic_min_rows=65536),
    # bm4 w8 pf c4 max132: T256 9.3, T1024 12.6, T4096 24.5, T16384 67.3, T65536 230.4 us; x1.019 geomean, worst x1.05 of the best per T over 48 candidates
    # tma us (T1024, 4096, 16384, 65536): plain+prefetch 12.7, 24.7, 67.5, 231.7; tma3 13.3, 24.1, 62.3, 211.5;
    #   tma4 13.3, 24.9, 63.9, 214.4; dw_2d + tma3 13.4, 24.0, 62.4, 212.1
    (2048, 2): dict(block_m=4, block_n=2048, num_warps=8, min_rows_per_chunk=4, max_chunks=132,
                   ctas_per_sm=4, prefetch=False, tma_stages=3,
                   # det/atomic us: T256 9.6/13.3, T1024 12.8/18.4, T4096 24.7/28.0, T16384 67.7/67.9, T65536 231.1/233.3
                   atomic_min_rows=NEVER),
    # bm2 w8 pf c4 max132: T256 11.8, T1024 17.6, T4096 38.8, T16384 122.3, T65536 439.8 us; x1.008 geomean, worst x1.03 of the best per T over 36 candidates
    # tma us (T1024, 4096, 16384, 65536): plain+prefetch 17.2, 38.8, 121.1, 438.0; tma2 20.2, 47.9, 145.2, 532.4;
    #   tma3 17.3, 37.5, 113.6, 406.6; tma4 17.5, 38.1, 115.6, 411.4
    (4096, 2): dict(block_m=2, block_n=4096, num_warps=8, min_rows_per_chunk=2, max_chunks=132,
                   ctas_per_sm=4, prefetch=False, tma_stages=3,
                   # det/atomic us: T256 12.0/22.8, T1024 17.3/26.9, T4096 39.1/47.0, T16384 121.0/124.0, T65536 438.1/441.2
                   atomic_min_rows=NEVER),
    # bm1 w8 c2 max132: T256 14.4, T1024 25.9, T4096 67.9, T16384 221.5, T65536 835.3 us; x1.003 geomean, worst x1.01 of the best per T over 36 candidates
    # tma us (T1024, 4096, 16384, 65536): plain 26.2, 68.2, 221.7, 843.8; tma2 27.2, 71.9, 235.9, 933.4;
    #   tma3 23.0, 51.3, 160.6, 769.4; tma4 22.2, 48.9, 152.9, 644.1; tma3 w16 23.0, 53.6, 165.0, 748.2
    (5120, 2): dict(block_m=1, block_n=8192, num_warps=8, min_rows_per_chunk=1, max_chunks=132,
                   ctas_per_sm=2, prefetch=False, tma_stages=4,
                   # det/atomic us: T256 14.5/26.3, T1024 26.1/33.9, T4096 68.2/73.3, T16384 221.8/223.4, T65536 842.8/833.9
                   atomic_min_rows=65536),
    # bm1 w8 c2 max132: T256 14.9, T1024 27.7, T4096 72.7, T16384 238.0, T65536 890.8 us; x1.003 geomean, worst x1.01 of the best per T over 36 candidates
    # tma us (T1024, 4096, 16384, 65536): plain 27.7, 72.8, 236.5, 889.2; tma2 28.9, 76.6, 248.7, 936.4;
    #   tma3 23.4, 56.3, 175.4, 650.4; tma4 22.7, 54.6, 164.5, 638.9; tma3 w16 24.2, 58.4, 178.5, 664.0
    (6144, 2): dict(block_m=1, block_n=8192, num_warps=8, min_rows_per_chunk=1, max_chunks=132,
                   ctas_per_sm=2, prefetch=False, tma_stages=4,
                   # det/atomic us: T256 15.4/28.2, T1024 27.6/35.8, T4096 72.5/78.9, T16384 236.6/239.5, T65536 891.7/879.6
                   # (plain loads); with tma4, `trainnorm bench` (docs/benchmarks/h200, T65536 det/atomic):
                   #   634.1/656.3, res 817.0/837.8, w32 637.2/648.1, res w32 809.9/834.3: the atomic form lost
                   atomic_min_rows=NEVER),
}

# The gated backward (rms_norm_gated), keyed like BWD: `tools/tune.py
# --sweep-bwd --gated`, the same sweep with a gate. A width without an entry
# takes its BWD entry with twice the warps (configs.backward_config).
BWD_GATED: dict = {
    # bm1 w8 tma4 c2 max132: T256 13.9, T1024 23.1, T4096 57.7, T16384 192.1, T65536 720.9 us; x1.004 geomean, worst x1.02 of the best per T over 72 candidates
    (4096, 2): dict(block_m=1, block_n=4096, num_warps=8, min_rows_per_chunk=1, max_chunks=132,
                   ctas_per_sm=2, prefetch=False, tma_stages=4, dw_2d=False,
                   # det/atomic us: T256 13.9/23.8, T1024 23.2/31.8, T4096 57.1/64.9, T16384 191.6/193.7, T65536 719.6/705.9
                   atomic_min_rows=65536),
    # bm32 w8 tma4 d2 c2 max132: T1024 23.1, T4096 57.0, T16384 185.9 us; x1.000 geomean, worst x1.00 of the best per T over 144 candidates
    (128, 2): dict(block_m=32, block_n=128, num_warps=8, min_rows_per_chunk=32, max_chunks=132,
                   ctas_per_sm=2, prefetch=False, tma_stages=4, dw_2d=True,
                   # det/atomic us: T1024 23.3/22.6, T4096 56.8/56.1, T16384 188.2/188.1
                   atomic_min_rows=0),
}

# The small-T forms of the plain backward, merged into the BWD entry: the
# one-chunk window (BwdConfig.direct_max_rows and the one-chunk form's loads)
# and the column-slice dw window (cols_max_rows, cols_block_m, cols_block_n).
# `tools/tune.py --sweep-small` times the BWD entry's chunking against one
# chunk with each load form and against each column-slice tile at small T.
# Each entry: the one-chunk window, then the column-slice window past it, with its tile.
BWD_DIRECT: dict = {
    # table/one-chunk plain us: T1 6.53/5.95, T2 6.78/6.35, T4 6.75/6.37, T8 6.66/6.21, T16 9.04/7.54, T32 9.18/9.86, T64 8.90/14.85, T128 9.09/24.16, T256 9.09/42.78, T512 9.71/81.33
    # table/cols32x128 us: T32 9.18/7.04, T64 8.90/8.58, T128 9.09/11.58, T256 9.09/17.41, T512 9.71/29.34
    (512, 2): dict(direct_max_rows=16, direct_prefetch=False, direct_tma_stages=0, cols_max_rows=64, cols_block_m=32, cols_block_n=128),
    # table/one-chunk prefetch us: T1 4.91/4.51, T2 5.39/4.93, T4 8.53/5.73, T8 8.21/7.62, T16 8.51/11.62, T32 8.26/18.69, T64 8.50/33.89, T128 8.93/63.28, T256 9.23/121.71, T512 11.36/236.67
    # table/cols16x64 us: T16 8.51/6.59, T32 8.26/7.44, T64 8.50/9.39, T128 8.93/12.90, T256 9.23/19.68, T512 11.36/34.13
    (1536, 2): dict(direct_max_rows=8, direct_prefetch=True, direct_tma_stages=0, cols_max_rows=32, cols_block_m=16, cols_block_n=64),
    # table/one-chunk prefetch us: T1 5.31/4.54, T2 5.95/5.57, T4 6.05/5.71, T8 8.67/6.70, T16 8.80/10.78, T32 9.14/17.58, T64 8.85/31.44, T128 9.33/58.26, T256 9.87/111.10, T512 11.07/216.18
    # table/cols16x64 us: T16 8.80/7.07, T32 9.14/8.74, T64 8.85/10.75, T128 9.33/15.62, T256 9.87/25.07, T512 11.07/43.87
    (2048, 2): dict(direct_max_rows=8, direct_prefetch=True, direct_tma_stages=0, cols_max_rows=32, cols_block_m=16, cols_block_n=64),
    # table/one-chunk prefetch us: T1 5.95/5.12, T2 5.92/5.76, T4 9.50/6.91, T8 9.28/9.10, T16 9.86/13.31, T32 9.54/21.25, T64 10.05/38.45, T128 10.48/71.34, T256 12.13/136.93, T512 13.92/268.11
    # table/cols16x64 us: T16 9.86/7.65, T32 9.54/8.61, T64 10.05/11.30, T128 10.48/16.11, T256 12.13/26.10, T512 13.92/45.58
    (4096, 2): dict(direct_max_rows=8, direct_prefetch=True, direct_tma_stages=0, cols_max_rows=32, cols_block_m=16, cols_block_n=64),
    # table/one-chunk tma3 us: T1 6.30/6.19, T2 9.57/7.20, T4 10.02/9.50, T8 9.66/13.49, T16 10.16/22.18, T32 10.35/38.78, T64 11.36/72.78, T128 12.83/140.32, T256 14.56/274.70, T512 16.94/545.20
    # table/cols16x64 us: T8 9.66/7.30, T16 10.16/7.94, T32 10.35/8.88, T64 11.36/11.49, T128 12.83/16.80, T256 14.56/27.17, T512 16.94/47.22
    (5120, 2): dict(direct_max_rows=4, direct_prefetch=False, direct_tma_stages=3, cols_max_rows=32, cols_block_m=16, cols_block_n=64),
    # table/one-chunk prefetch us: T1 6.21/5.58, T2 9.68/7.55, T4 10.02/10.43, T8 9.97/15.94, T16 10.74/27.22, T32 10.86/49.34, T64 11.81/95.23, T128 13.55/180.80, T256 14.96/358.11, T512 17.58/707.28
    # table/cols16x64 us: T4 10.02/7.46, T8 9.97/7.49, T16 10.74/7.62, T32 10.86/9.04, T64 11.81/12.05, T128 13.55/16.91, T256 14.96/27.46, T512 17.58/47.39
    (6144, 2): dict(direct_max_rows=2, direct_prefetch=True, direct_tma_stages=0, cols_max_rows=32, cols_block_m=16, cols_block_n=64),
}
