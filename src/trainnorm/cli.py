"""Command line: `trainnorm demo | verify | bench`."""
from __future__ import annotations

import sys

USAGE = """usage: trainnorm {demo,verify,bench} [options]

  demo    forward + backward on this machine (GPU, or the CPU path): accuracy,
          bitwise reproducibility, and time against torch
  verify  accuracy and determinism report (tables + JSON)
  bench   side-by-side latency against torch.compile, QuACK, Liger-Kernel (GPU)
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as run
    elif cmd == "verify":
        from .verify import main as run
    elif cmd == "bench":
        from .bench.run import main as run
    else:
        print(f"trainnorm: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
