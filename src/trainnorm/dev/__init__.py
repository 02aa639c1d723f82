"""Development tools: measure, soak and inspect the kernels. Each module runs as
``python -m trainnorm.dev.NAME`` (argparse; ``--help``) and as ``main(argv)``;
``trainnorm tune | soak | compile-check | ncu | multigpu`` delegate to them.

    tune           time kernel configurations on the GPU and write the measured
                   table (configs/<arch>.json format) through configs.table
    soak           random cases of every input class against the FP64 reference
    compile_check  compile every kernel form for sm_90 without a GPU: registers, spills
    ncu_rows       Nsight Compute counters of bench rows; the graph-replay launch floor
    multigpu       DDP / FSDP2 / sequence-parallel checks under torchrun
    bits           bit fingerprints of every output, to compare two builds
    checks         the accuracy and bitwise assertions the soak applies

They use the package as a user would, plus ``configs.override(...)`` for every
config they try; none of them patches the package's lookups. Importing this
package imports none of its modules.
"""
