"""torch.compile with dynamic shapes: T dynamic (dynamic=True, or mark_dynamic) and eps a
changing Python float, with no graph break (fullgraph=True) and no recompilation per
token count; each distinct eps value compiles once, exactly as for torch.nn.functional.rms_norm.

CPU: dynamo + AOTAutograd (aot_eager) over the kernels in Triton's interpreter, and one
inductor compile of a module; frames compiled are counted with torch._dynamo's counters.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import trainnorm

from helpers import assert_bits_equal

H = 64
# T = 0 and 1 are specialised by dynamo for every op (its 0/1 specialisation): start at 2
TOKENS = (2, 3, 5, 17, 40)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _frames() -> int:
    return counters["stats"]["unique_graphs"]


def _fwd_bwd(fn, x, w, eps, mark=False, **kw):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if mark:
        torch._dynamo.mark_dynamic(x, 0)
    out = fn(x, w, eps, **kw)
    y = out[0] if isinstance(out, tuple) else out
    dy = torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _ours(x, w, eps):
    return trainnorm.rms_norm(x, w, eps)


def _torch(x, w, eps):
    return F.rms_norm(x, (H,), w, eps)


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_no_recompile_per_token_count(how):
    dynamic = True if how == "dynamic=True" else None
    compiled = torch.compile(_ours, backend="aot_eager", dynamic=dynamic, fullgraph=True)
    w = torch.randn(H).to(torch.bfloat16)
    for i, t in enumerate(TOKENS):
        x = torch.randn(t, H).to(torch.bfloat16)
        got = _fwd_bwd(compiled, x, w, 1e-6, mark=how == "mark_dynamic")
        want = _fwd_bwd(_ours, x, w, 1e-6)
        for a, b in zip(got, want):
            assert_bits_equal(a, b, f"T={t}")
        assert _frames() == 1, f"recompiled at T={t}"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_fail_on_recompile_stance():
    # the same, as torch.compiler's own guard: any recompilation after the first call is an error
    compiled = torch.compile(_ours, backend="aot_eager", dynamic=True, fullgraph=True)
    w = torch.ones(H)
    compiled(torch.randn(TOKENS[0], H), w, 1e-5)
    with torch.compiler.set_stance("fail_on_recompile"):
        for t in TOKENS[1:]:
            x = torch.randn(t, H)
            assert_bits_equal(compiled(x, w, 1e-5), _ours(x, w, 1e-5))


@pytest.mark.parametrize("dynamic", [True, None])
def test_changing_eps_compiles_like_torch(dynamic):
    """eps as a changing Python float: no graph break, no recompilation per T, and the
    frames compiled are those torch.nn.functional.rms_norm compiles for the same calls
    (one per distinct eps value: aten ops and custom ops alike take eps as a concrete float)."""
    calls = [(3, 1e-6), (5, 1e-5), (17, 1e-5), (4, 2e-6), (40, 1e-6), (9, 2e-6)]
    frames = {}
    for name, fn in (("trainnorm", _ours), ("torch", _torch)):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend="aot_eager", dynamic=dynamic, fullgraph=True)
        w = torch.rand(H) + 0.5
        for t, eps in calls:
            x = torch.randn(t, H)
            if dynamic is None:
                torch._dynamo.mark_dynamic(x, 0)
            y = compiled(x, w, eps)
            if name == "trainnorm":
                assert_bits_equal(y, _ours(x, w, eps), f"T={t} eps={eps}")
        assert not counters["graph_break"], (name, dict(counters["graph_break"]))
        frames[name] = _frames()
    assert frames["trainnorm"] == frames["torch"] <= len({e for _, e in calls}), frames


def test_residual_and_gated_dynamic():
    def f(x, r, z, w, eps):
        y, h = trainnorm.rms_norm(x, w, eps, residual=r)
        return trainnorm.rms_norm_gated(y, z, w, eps), h

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    w = torch.rand(H) + 0.5
    for t in TOKENS:
        x, r, z = (torch.randn(t, 4, H) for _ in range(3))     # 4 heads: no T in TOKENS equals it
        got, want = compiled(x, r, z, w, 1e-6), f(x, r, z, w, 1e-6)
        for a, b in zip(got, want):
            assert_bits_equal(a, b, f"T={t}")
    assert _frames() == 1 and not counters["graph_break"]


def test_bad_eps_under_compile_is_a_value_error():
    # a symbolic eps is checked when the op runs, still before any kernel
    compiled = torch.compile(_ours, backend="aot_eager", dynamic=True, fullgraph=True)
    w = torch.ones(H)
    compiled(torch.randn(3, H), w, 1e-6)
    for bad in (1e-50, 1e39, -1e-6):
        with pytest.raises(ValueError, match="eps must"):
            compiled(torch.randn(4, H), w, bad)


def test_module_dynamic_inductor(monkeypatch):
    # a block with trainnorm.RMSNorm compiled whole by inductor, forward and backward, over
    # the CPU reference path (the interpreter adds nothing here and inductor's CPU build is slow)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(H, H), trainnorm.RMSNorm(H), torch.nn.Linear(H, H))
    compiled = torch.compile(block, dynamic=True, fullgraph=True)
    for t in TOKENS[:3]:
        x = torch.randn(t, H)
        block.zero_grad()
        compiled(x).square().sum().backward()
        got = [p.grad.clone() for p in block.parameters()]
        block.zero_grad()
        block(x).square().sum().backward()
        for a, b in zip(got, [p.grad for p in block.parameters()]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert _frames() == 1 and not counters["graph_break"]


def test_weight_offset_and_out_dtype_compile():
    # the offset and y's dtype travel in the op's variant string: fullgraph, one graph for
    # every token count, the same bits as eager
    def f(x, r, w):
        y, h = trainnorm.rms_norm(x, w, 1e-6, residual=r, weight_offset=1.0, out_dtype=torch.float32)
        return y, h

    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    w = (0.1 * torch.randn(H)).to(torch.bfloat16)
    for t in TOKENS:
        x = torch.randn(t, H).to(torch.bfloat16)
        r = torch.randn(t, H)                                  # a float32 residual stream
        got, want = compiled(x, r, w), f(x, r, w)
        assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
        for a, b in zip(got, want):
            assert_bits_equal(a, b, f"T={t}")
    assert _frames() == 1 and not counters["graph_break"]
