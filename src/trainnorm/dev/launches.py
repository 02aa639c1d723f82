"""Every kernel launch trainnorm makes on the bench's rows, one line each, without a GPU.

For each selected row (`trainnorm bench`'s sets and --shapes), the bench's trainnorm
adapters (deterministic and fast) run their forward and backward on uninitialised CPU
tensors of the row's shapes, dtypes and layouts with the launches recorded instead of run
(trainnorm.dev.compile_check.recording). Each line names the row, the op and mode, the
kernel, its grid, and every argument: a tensor as dtype, shape and strides, a number or
flag by value. The first line is a digest of the kernels' source (kernels_digest): two
trees that print the same lines, that one included, launch the same kernel code with the
same configurations on every row, so a bench part run at one joins a part run at the other.
Equal launch lines under another digest are not enough: a kernel's body may have changed
(the one-tile forward's loop, 22b7663) while every argument stayed the same.

    PYTHONPATH=A/src python -m trainnorm.dev.launches --set default,beyond > a.txt
    PYTHONPATH=B/src python -m trainnorm.dev.launches --set default,beyond > b.txt
    diff a.txt b.txt

The lines hold the configs' values as the kernels receive them (constexpr tile sizes,
warps, chunk counts through the grid and the rows per chunk), never a timing; the
persistent grids as on a GPU of --sms multiprocessors (132: the H100 and H200).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

from trainnorm.bench import impls, shapes
from trainnorm.dev.compile_check import recording
from trainnorm.rows import simulate_sm_count


def _arg(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}/{list(v.stride())}"
    if hasattr(v, "base") and hasattr(v, "block_shape"):     # a tensor descriptor
        return f"desc({_arg(v.base)}, block {list(v.block_shape)})"
    return repr(v)


class LaunchLog:
    """The launches of a block, in order, as text."""

    def __init__(self):
        self.lines: list[str] = []

    def add(self, kernel, args, kw, grid=None) -> None:
        grid = grid if isinstance(grid, tuple) else (grid,)
        parts = [_arg(a) for a in args] + [f"{k}={_arg(v)}" for k, v in sorted(kw.items())]
        self.lines.append(f"{kernel.fn.__name__} grid {list(grid)} " + " ".join(parts))


def kernels_digest() -> str:
    """sha1 over the kernels package's source files (each file's name and bytes, in name
    order). Conservative: a change to a comment changes it too."""
    from trainnorm import kernels
    h = hashlib.sha1()
    for f in sorted(Path(kernels.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def row_launches(row: shapes.Row, sms: int = 132) -> list[str]:
    """'op mode: launch' lines of one row (trainnorm and trainnorm-fast; fwd and bwd), the
    dispatcher seeing `sms` multiprocessors (the persistent grids follow it; dw's chunking
    never does)."""
    d = impls.make_row_data(row, "cpu", fill=False)
    out = []
    with simulate_sm_count(sms):
        for impl in (impls.Trainnorm(True), impls.Trainnorm(False)):
            impl.begin_row(d)
            try:
                fwd, bwd = LaunchLog(), LaunchLog()
                with recording(fwd):
                    state = impl.forward(d)
                with recording(bwd):
                    impl.backward(d, state)
                out += [f"{op} {impl.name}: {line}" for op, log in (("fwd", fwd), ("bwd", bwd)) for line in log.lines]
            finally:
                impl.end_row()
    return out


def fingerprint(row: shapes.Row, sms: int = 132, digest: str | None = None) -> str | None:
    """sha1 over the kernels' source digest and the row's launch lines: equal at two trees
    where they run the same kernel code with the same arguments on the row (what `trainnorm
    bench --reuse` compares). None for a decoder-block row, whose norms run inside a compiled
    model: such a row is never reused."""
    if row.block:
        return None
    h = hashlib.sha1((digest or kernels_digest()).encode())
    for line in row_launches(row, sms):
        h.update(b"\n" + line.encode())
    return h.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainnorm.dev.launches", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="default", help="comma-separated row sets, as `trainnorm bench --set`")
    p.add_argument("--shapes", action="append", default=None, help="row ids to keep, as `trainnorm bench --shapes`")
    p.add_argument("--sms", type=int, default=132, help="the multiprocessors the dispatcher sees (default 132: H100, H200)")
    args = p.parse_args(argv)
    try:
        rows = shapes.select_rows(shapes.set_rows(shapes.parse_sets(args.set)), args.shapes)
    except ValueError as exc:
        print(f"launches: {exc}", file=sys.stderr)
        return 2
    print(f"# kernels' source sha1 {kernels_digest()}")
    for row in rows:
        if row.block:
            print(f"{row.id}: a decoder block (its norms' launches are the block's; not listed)")
            continue
        for line in row_launches(row, args.sms):
            print(f"{row.id} | {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
