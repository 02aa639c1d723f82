"""Training with trainnorm's modules: activation checkpointing and the demo's two training runs.

(The CUDA-graph forward + backward step with a workspace is tests/test_gpu.py::test_cuda_graph_replay_bitwise.)"""
import pytest
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
    # the kernels: on the GPU, or in Triton's interpreter on a CPU machine (tests/conftest.py)
    from trainnorm.demo import main
    assert main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "final weights bitwise identical: True; loss curves identical: True" in out
    # progress as it trains, one line per run; the path named; timed on the GPU only
    assert "run 1/2: loss at step 1 " in out and "run 2/2: loss at step 1 " in out
    if torch.cuda.is_available():
        assert f"norms run on the Triton kernels on {torch.cuda.get_device_name()}" in out
        assert "through autograd: trainnorm " in out and " us, torch.nn.functional.rms_norm " in out
    else:
        assert "norms run on the CPU, the Triton kernels in Triton's interpreter" in out
        assert "speed: not timed here: Triton's interpreter runs the kernels on the CPU to test them" in out
        assert " us" not in out


def test_demo_reference_path_says_what_it_is(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from trainnorm.demo import main
    assert main(["--tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    why = "--device cpu" if torch.cuda.is_available() else "no GPU here"
    assert f"norms run on the CPU, trainnorm's float64 reference path ({why}): exact results" in out
    assert "speed: not timed here: the CPU path is a float64 reference kept for exactness" in out
    assert " us" not in out


def test_demo_progress_reports_the_losses():
    from trainnorm.demo import _marks, train
    cfg = dict(vocab=32, dim=32, heads=2, layers=1, batch=2, seq=4, steps=9)
    seen = []
    losses, _ = train(cfg, "cpu", progress=lambda step, loss: seen.append((step, loss)))
    assert [s for s, _ in seen] == _marks(9) == [0, 2, 4, 6, 8]
    assert [v for _, v in seen] == [losses[s] for s in _marks(9)]


@pytest.mark.parametrize("interpreter", ["0", pytest.param("1", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton's interpreter is chosen when Triton loads: on a GPU machine "
    "the kernels were built for the GPU (the CPU machine's run covers it)"))])
def test_verify_says_what_it_writes_and_leaves_out(capsys, monkeypatch, tmp_path, interpreter):
    monkeypatch.setenv("TRITON_INTERPRET", interpreter)
    from trainnorm.verify import main
    out_dir = tmp_path / "report"
    assert main(["--shapes", "[T,4", "--tokens", "1,3", "--seeds", "1", "--out", str(out_dir), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("# trainnorm verify") == 1, "the header is printed once"
    assert f"wrote {out_dir / 'verify.md'} and {out_dir / 'verify.json'}" in out
    assert (out_dir / "verify.md").is_file() and (out_dir / "verify.json").is_file()
    gpu_line = ("not checked here, since they need a GPU: CUDA-graph replay against eager, torch.compile "
                "(inductor) against eager, and the real sizes")
    assert gpu_line in out and gpu_line in (out_dir / "verify.md").read_text()
    reference_line = "the Triton kernels do not run on this path"
    assert (reference_line in out) == (interpreter == "0")
    import json
    report = json.loads((out_dir / "verify.json").read_text())
    assert report["not_checked"] and all(line in out for line in report["not_checked"])


def test_verify_compares_the_residual_forward_with_the_norm_of_h(monkeypatch):
    # SPEC: rms_norm(x, w, residual=r) is rms_norm(h, w) bit for bit; verify's determinism table
    # says so for every shape (r: the shape's residual, else its dy), and fails where it is not
    import trainnorm
    from trainnorm import verify
    shapes = {s.name: s for s in verify.SHAPES}
    for name in ("H512", "H6144 res w32", "[T,24,256]"):
        assert verify.determinism(shapes[name], 3, "cpu")["residual_is_h"] is True
    real = trainnorm.rms_norm_forward

    def nudged(x, w, eps=1e-6, *, residual=None, **kw):
        y, rstd, h = real(x, w, eps, residual=residual, **kw)
        return (y.neg() if residual is not None else y), rstd, h
    monkeypatch.setattr(trainnorm, "rms_norm_forward", nudged)
    case = verify._case(shapes["H512"], 3, "outlier", 1, "cpu")
    assert verify._residual_is_h(case) is False
    assert not verify.passed([], [{"shape": "H512", "tokens": 3, "residual_is_h": False}])


def test_cli_device_choice():
    # demo and verify run the kernels on the GPU only where they can: a GPU and Triton
    from trainnorm import rows
    usable = torch.cuda.is_available() and rows.triton_installed()
    assert rows.cli_device("cpu") == "cpu"
    assert rows.cli_device("auto") == ("cuda" if usable else "cpu")
    if usable:
        assert rows.cli_device("cuda") == "cuda"
    else:
        with pytest.raises(ValueError, match="--device cuda: the kernels cannot run here"):
            rows.cli_device("cuda")
    with pytest.raises(ValueError, match="device must be auto, cuda or cpu"):
        rows.cli_device("gpu")
