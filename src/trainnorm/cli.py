"""Command line: `trainnorm demo | verify | bench`, and the development tools
`trainnorm tune | soak | compile-check | launches | ncu | multigpu` (trainnorm.dev)."""
from __future__ import annotations

import importlib
import sys

USAGE = """usage: trainnorm {demo,verify,bench,tune,soak,compile-check,launches,ncu,multigpu} [options]

  demo           train a tiny model twice on this machine (GPU, or the CPU path): bitwise
                 reproducibility, and on a GPU the norm's time against torch
  verify         accuracy and determinism report (tables + JSON)
  bench          side-by-side latency against torch.compile, QuACK, Liger-Kernel (GPU)

development tools (python -m trainnorm.dev.NAME; `trainnorm COMMAND --help`):
  tune           time kernel configurations on the GPU; writes a copy of the measured table
  soak           random cases of every input class against the FP64 reference
  compile-check  compile every kernel form for sm_90 without a GPU: registers, spills
  launches       every launch (kernel, grid, arguments) of the bench's rows, without a GPU
  ncu            Nsight Compute counters of bench rows; the launch floor (GPU)
  multigpu       DDP / FSDP2 / sequence-parallel checks (under torchrun)
"""

COMMANDS = {
    "demo": "trainnorm.demo",
    "verify": "trainnorm.verify",
    "bench": "trainnorm.bench.run",
    "tune": "trainnorm.dev.tune",
    "soak": "trainnorm.dev.soak",
    "compile-check": "trainnorm.dev.compile_check",
    "launches": "trainnorm.dev.launches",
    "ncu": "trainnorm.dev.ncu_rows",
    "multigpu": "trainnorm.dev.multigpu",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"trainnorm: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[cmd]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
