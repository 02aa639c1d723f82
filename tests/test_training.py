"""Training with trainnorm's modules: activation checkpointing and the demo's two training runs.

(The CUDA-graph forward + backward step with a workspace is tests/test_gpu.py::test_cuda_graph_replay_bitwise.)"""
import torch
from torch.utils.checkpoint import checkpoint

import trainnorm

from helpers import assert_bits_equal


class Block(torch.nn.Module):
    """Pre-norm MLP block with a residual stream through the fused residual add."""

    def __init__(self, hidden, device):
        super().__init__()
        self.norm = trainnorm.RMSNorm(hidden, device=device)
        self.up = torch.nn.Linear(hidden, 2 * hidden, device=device)
        self.down = torch.nn.Linear(2 * hidden, hidden, device=device)
        self.gnorm = trainnorm.RMSNormGated(2 * hidden, device=device)

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        u = self.up(y)
        return self.down(self.gnorm(u, u.flip(-1))), h


def _grads(model, x, r, use_checkpoint):
    model.zero_grad()
    xr, rr = x.clone().requires_grad_(), r.clone().requires_grad_()
    if use_checkpoint:
        out, h = checkpoint(model, xr, rr, use_reentrant=False)
    else:
        out, h = model(xr, rr)
    (out.square().sum() + h.sum()).backward()
    return [xr.grad, rr.grad] + [p.grad.clone() for p in model.parameters()]


def test_checkpoint_bitwise_equal(device):
    # the recomputed forward is deterministic and batch-invariant: the same bits
    torch.manual_seed(0)
    model = Block(64, device)
    x = torch.randn(3, 5, 64, device=device)
    r = torch.randn(3, 5, 64, device=device)
    plain = _grads(model, x, r, False)
    ckpt = _grads(model, x, r, True)
    for i, (a, b) in enumerate(zip(plain, ckpt)):
        assert_bits_equal(a, b, f"gradient {i}")


def test_demo_trains_twice_bitwise(capsys):
    from trainnorm.demo import main
    assert main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "final weights bitwise identical: True; loss curves identical: True" in out
