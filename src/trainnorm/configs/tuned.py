"""Measured configurations, keyed by (H, activation element size in bytes).

Measured on one H200 (132 SMs, torch 2.11, Triton 3.6), bf16 activations and
weight, random normal inputs; times are medians of CUDA-graph replays after an
L2 flush.

FWD, FWD_W32: `tools/tune.py --sweep-fwd`: every forward tile (block_m,
num_warps) timed interleaved at T = 1, 16, 1024, 16384, 65536; the entry is the
tile with the lowest geomean of its time relative to the best tile at each T
(the line above it gives its times and those of the previous entry). H = 256
keeps its stage-1 entry ([16384, 24, 256]).

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
    # bm2 w2: T1 4.61, T16 4.64, T1024 5.17, T16384 14.19, T65536 39.07 us; x1.022 geomean, worst x1.05 of the best per T over 17; previous bm4 w2 x1.074: T1 4.86, T16 4.86, T1024 5.89, T16384 14.59, T65536 38.67
    (512, 2): dict(block_m=2, block_n=512, num_warps=2),
    # bm2 w4: T1 4.64, T16 4.83, T1024 6.90, T16384 30.08, T65536 100.64 us; x1.023 geomean, worst x1.06 of the best per T over 12; previous bm2 w4 x1.023: T1 4.64, T16 4.83, T1024 6.90, T16384 30.08, T65536 100.64
    (1536, 2): dict(block_m=2, block_n=2048, num_warps=4),
    # bm2 w4: T1 4.74, T16 4.90, T1024 7.33, T16384 38.26, T65536 135.65 us; x1.018 geomean, worst x1.04 of the best per T over 12; previous bm1 w4 x1.045: T1 5.33, T16 5.12, T1024 7.31, T16384 38.45, T65536 131.26
    (2048, 2): dict(block_m=2, block_n=2048, num_warps=4),
    # bm2 w8: T1 5.12, T16 5.22, T1024 8.93, T16384 70.40, T65536 263.04 us; x1.018 geomean, worst x1.04 of the best per T over 9; previous bm4 w16 x1.067: T1 5.34, T16 5.82, T1024 9.58, T16384 71.47, T65536 262.69
    (4096, 2): dict(block_m=2, block_n=4096, num_warps=8),
    # bm1 w4: T1 5.09, T16 5.97, T1024 11.49, T16384 92.72, T65536 351.12 us; x1.022 geomean, worst x1.11 of the best per T over 6; previous bm1 w4 x1.022: T1 5.09, T16 5.97, T1024 11.49, T16384 92.72, T65536 351.12
    (5120, 2): dict(block_m=1, block_n=8192, num_warps=4),
    # bm1 w4: T1 5.46, T16 5.86, T1024 12.40, T16384 102.29, T65536 388.53 us; x1.035 geomean, worst x1.10 of the best per T over 6; previous bm1 w4 x1.035: T1 5.46, T16 5.86, T1024 12.40, T16384 102.29, T65536 388.53
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
    # bm2 w8: T1 5.57, T16 5.66, T1024 12.70, T16384 104.10, T65536 390.46 us; x1.024 geomean, worst x1.06 of the best per T over 6; previous bm2 w8 x1.024: T1 5.57, T16 5.66, T1024 12.70, T16384 104.10, T65536 390.46
    (5120, 2): dict(block_m=2, block_n=8192, num_warps=8),
    # bm2 w8: T1 5.34, T16 5.92, T1024 13.82, T16384 112.70, T65536 425.02 us; x1.026 geomean, worst x1.12 of the best per T over 6; previous bm2 w8 x1.026: T1 5.34, T16 5.92, T1024 13.82, T16384 112.70, T65536 425.02
    (6144, 2): dict(block_m=2, block_n=8192, num_warps=8),
}
# (H, elt) -> BwdConfig fields
BWD: dict = {
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
    # bm32 w4 pf c2 max264: T1024 27.7, T4096 75.0, T16384 255.7 us; x1.007 geomean, worst x1.02 of the best per T over 36 candidates
    (256, 2): dict(block_m=32, block_n=256, num_warps=4, min_rows_per_chunk=32, max_chunks=264,
                   ctas_per_sm=2, prefetch=True,
                   # det/atomic us: T1024 28.2/32.2, T4096 74.9/79.5, T16384 254.9/273.2
                   atomic_min_rows=NEVER),
}

# The gated backward (rms_norm_gated), keyed like BWD: `tools/tune.py
# --sweep-bwd --gated`, the same sweep with a gate. A width without an entry
# takes its BWD entry with twice the warps (configs.backward_config).
BWD_GATED: dict = {
}

# The small-T forms of the plain backward, merged into the BWD entry: the
# one-chunk window (BwdConfig.direct_max_rows and the one-chunk form's loads)
# and the column-slice dw window (cols_max_rows, cols_block_m, cols_block_n).
# `tools/tune.py --sweep-small` times the BWD entry's chunking against one
# chunk with each load form and against each column-slice tile at small T.
# The entries below predate the column-slice form: none of them takes it.
BWD_DIRECT: dict = {
    # table/one-chunk plain us: T1 6.40/5.89, T2 6.74/6.24, T4 6.61/6.35, T8 6.75/6.59, T16 8.86/7.50, T32 8.86/9.89, T64 8.86/14.61, T128 9.18/24.21
    (512, 2): dict(direct_max_rows=16, direct_prefetch=False, direct_tma_stages=0),
    # table/one-chunk prefetch us: T1 4.96/4.45, T2 4.96/4.83, T4 7.98/5.89, T8 8.13/7.62, T16 8.18/11.36, T32 8.13/18.98, T64 8.45/34.02, T128 8.54/63.36
    (1536, 2): dict(direct_max_rows=8, direct_prefetch=True, direct_tma_stages=0),
    # table/one-chunk prefetch us: T1 5.26/4.35, T2 5.60/5.14, T4 5.68/5.44, T8 8.56/6.75, T16 8.51/10.53, T32 8.90/17.44, T64 9.22/30.90, T128 9.28/57.10
    (2048, 2): dict(direct_max_rows=8, direct_prefetch=True, direct_tma_stages=0),
    # table/one-chunk prefetch us: T1 5.54/4.80, T2 5.65/5.70, T4 9.36/6.78, T8 9.34/9.07, T16 9.23/13.04, T32 9.79/21.38, T64 9.98/37.86, T128 10.40/71.06
    # (written by the rule before tune.py's SMALL_NOISE, which ended the window at T2's 5.70 vs 5.65;
    #  today's rule gives direct_max_rows=8 from these numbers: not timed by the bench yet, so not taken)
    (4096, 2): dict(direct_max_rows=0, direct_prefetch=True, direct_tma_stages=0),
    # table/one-chunk prefetch us: T1 6.02/5.30, T2 9.82/7.18, T4 9.73/10.02, T8 9.78/15.23, T16 10.05/26.42, T32 10.46/48.86, T64 11.17/91.78, T128 13.06/177.30
    (5120, 2): dict(direct_max_rows=2, direct_prefetch=True, direct_tma_stages=0),
    # table/one-chunk prefetch us: T1 6.05/5.41, T2 9.65/7.41, T4 9.89/10.37, T8 10.13/16.05, T16 10.50/27.09, T32 10.30/49.02, T64 11.46/94.83, T128 13.62/181.70
    (6144, 2): dict(direct_max_rows=2, direct_prefetch=True, direct_tma_stages=0),
}
