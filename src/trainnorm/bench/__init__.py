"""trainnorm's benchmark: ``trainnorm bench``.

Latency of the forward, the backward and a checkpointed training step
(fwd + fwd + bwd) of trainnorm (deterministic and fast dw) against
torch.compile of an explicit FP32-statistics reference, QuACK (its public
API, and its float32 dw partials summed in float32), Liger-Kernel,
Transformer Engine and PyTorch eager, on 78 shapes plus 20 small-T and 7
gated shapes; on request, widths and head counts the measured table does not
hold, a decoder block compiled whole with trainnorm's norms against
torch.nn.RMSNorm, and training-stack features (a float32 residual stream,
(1 + w) weights) each beside the bf16 row of its shape.

- shapes: the rows, their ids and sets, and the bytes each op must move (the floor);
- timing: CUDA-graph replays after an L2 flush, interleaved passes;
- impls: one adapter per implementation, and the dw accuracy check;
- block: the Qwen3-style decoder block and its adapters;
- report: matching, ratios, summary, markdown, JSON and plots;
- run: the command line (``main(argv)``).
"""


def main(argv: list[str] | None = None) -> int:
    """Run ``trainnorm bench`` with the given arguments; returns the exit status."""
    from .run import main as _main
    return _main(argv)


__all__ = ["main"]
