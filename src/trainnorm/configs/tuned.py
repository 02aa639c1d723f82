"""Measured configurations, keyed by (H, activation element size in bytes).

Measured with tools/tune.py on one H200 (132 SMs, torch 2.11, Triton 3.6),
bf16 activations and weight, random normal inputs; times are the median of
CUDA-graph replays after an L2 flush. Forward and backward tiles were picked
at T = 16384 tokens (H = 256: [16384, 24, 256]); the backward's chunking
(min_rows_per_chunk, max_chunks) by the geomean over T = 16, 256, 1024, 4096,
16384, 65536 (H = 256: T = 1024, 4096, 16384) of its time relative to the
best chunking at each T ("x1.04, worst x1.19" below). Shapes absent here use
the analytical defaults in __init__.py.

atomic_min_rows: from how many rows deterministic=False uses its one-launch
atomic form; the times quoted are (deterministic form / atomic form) with the
entry's own tile and chunking, so below the edge the atomic form was slower.

Changing an entry changes the bits of dw (the chunking) and possibly of dx
(the tile): it is a numerics change, to be re-verified with `trainnorm verify`
and the GPU tests.
"""
# (H, elt) -> FwdConfig fields
FWD: dict = {
    (512, 2): dict(block_m=4, block_n=512, num_warps=2),      # 13.9 us; bm8 w2 14.1, bm8 w4 14.1
    (1536, 2): dict(block_m=2, block_n=2048, num_warps=4),    # 29.6 us; bm2 w2 30.0, bm4 w4 30.0
    (2048, 2): dict(block_m=1, block_n=2048, num_warps=4),    # 38.1 us; bm2 w8 38.2, bm4 w8 38.4
    (4096, 2): dict(block_m=4, block_n=4096, num_warps=16),   # 71.4 us; bm2 w2 71.5, bm4 w4 71.5
    (5120, 2): dict(block_m=1, block_n=8192, num_warps=4),    # 92.8 us; bm1 w8 93.0, bm1 w2 98.1
    (6144, 2): dict(block_m=1, block_n=8192, num_warps=4),    # 102.6 us; bm1 w8 103.1, bm2 w4 108.0
    (256, 2): dict(block_m=8, block_n=256, num_warps=2),      # 101.1 us; bm32 w16 100.8, bm8 w4 101.4
}
# (H, elt) -> BwdConfig fields
BWD: dict = {
    # tile 56.8 us (bm8 w4 60.1, bm16 w8 68.5; default bm4 w8 98.9 in the bench); chunking x1.04, worst x1.15
    (512, 2): dict(block_m=16, block_n=512, num_warps=4, min_rows_per_chunk=16, max_chunks=264,
                   # atomic faster at every T: x1.01 (T16) to x1.15 (T16384)
                   atomic_min_rows=0),
    # tile 95.4 us (bm2 w4 97.6, bm4 w4 101.2); chunking x1.05, worst x1.19
    (1536, 2): dict(block_m=2, block_n=2048, num_warps=8, min_rows_per_chunk=2, max_chunks=264,
                    # T256 13.1/14.9, T1024 21.2/21.5; T4096 32.7/30.7, T65536 236.9/216.1
                    atomic_min_rows=4096),
    # tile 106.2 us (bm2 w4 107.9, bm4 w4 110.7); chunking x1.04, worst x1.18
    (2048, 2): dict(block_m=2, block_n=2048, num_warps=8, min_rows_per_chunk=2, max_chunks=264,
                    # T256 13.8/15.8; T1024 22.1/21.8, T4096 37.1/33.4, T65536 270.0/250.9
                    atomic_min_rows=1024),
    # tile 169.1 us (bm2 w4 185.9, bm2 w16 188.5); chunking x1.07, worst x1.36
    (4096, 2): dict(block_m=1, block_n=4096, num_warps=4, min_rows_per_chunk=1, max_chunks=264,
                    # T4096 53.7/57.4, T16384 144.5/145.5; T65536 499.4/493.0
                    atomic_min_rows=65536),
    # tile 270.6 us (bm1 w16 272.1, bm1 w4 4310: spills); chunking x1.01, worst x1.02
    (5120, 2): dict(block_m=1, block_n=8192, num_warps=8, min_rows_per_chunk=1, max_chunks=132,
                    # T4096 71.9/73.3; T16384 228.7/225.6, T65536 856.9/843.7
                    atomic_min_rows=16384),
    # tile 288.2 us (bm1 w16 292.3, bm1 w4 4350: spills); chunking x1.01, worst x1.02
    (6144, 2): dict(block_m=1, block_n=8192, num_warps=8, min_rows_per_chunk=1, max_chunks=132,
                    # T4096 76.4/78.2; T16384 242.1/239.7, T65536 905.3/889.3
                    atomic_min_rows=16384),
    # tile 295.9 us (bm16 w4 469.8, bm32 w8 477.2; default bm8 w8 1005 in the bench); chunking x1.00
    (256, 2): dict(block_m=32, block_n=256, num_warps=4, min_rows_per_chunk=32, max_chunks=264,
                   # rows = T x 24: T1024 36.2/30.8 (lowest measured), T16384 270.5/253.7
                   atomic_min_rows=24576),
}
