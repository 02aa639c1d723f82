"""reference.py: the gate activation table, the FP32 eager references against the
FP64 ones, and the gated FP64 formulas with a second activation (gradcheck)."""
import pytest
import torch

from trainnorm import reference

EPS = 1e-6
ACTIVATIONS = sorted(reference.GATE_ACTIVATIONS)


def _inputs(seed, rows=6, hidden=64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    x, r, z, dy, dh = (randn(rows, hidden) for _ in range(5))
    w = 1.0 + 0.1 * randn(hidden)
    return x, r, z * 2, dy, dh, w


def _close(got, want, name):
    # float32 arithmetic against float64: a few float32 roundings, per element
    assert got.dtype == torch.float32, name
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_activation_table():
    assert set(reference.GATE_ACTIVATIONS) == {"silu", "sigmoid"}
    z = torch.linspace(-8, 8, 101, dtype=torch.float64, requires_grad=True)
    for name, (act, act_grad) in reference.GATE_ACTIVATIONS.items():
        value = act(z)
        # the derivative is the value's derivative; a given sigmoid(z) changes nothing
        (auto,) = torch.autograd.grad(value.sum(), z)
        torch.testing.assert_close(act_grad(z), auto, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
        sig = torch.sigmoid(z)
        assert torch.equal(act(z, sig), value) and torch.equal(act_grad(z, sig), act_grad(z)), name
    zd = z.detach()
    assert torch.equal(reference.GATE_ACTIVATIONS["sigmoid"][0](zd), torch.sigmoid(zd))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weighted", [True, False])
def test_fp32_matches_fp64(residual, weighted):
    x, r, _, dy, dh, w = _inputs(1)
    w = w if weighted else None
    r, dh = (r, dh) if residual else (None, None)
    y, rstd, h = reference.forward_fp32(x, w, EPS, r)
    y64, rstd64, h64 = reference.forward_fp64(x, w, EPS, r)
    assert torch.equal(h, h64) and (residual or h is x)
    _close(y, y64, "y")
    _close(rstd, rstd64, "rstd")
    dx, dw = reference.backward_fp32(dy, h, w, rstd, dh)
    dx64, dw64 = reference.backward_fp64(dy, h, w, rstd, dh)
    _close(dx, dx64, "dx")
    if weighted:
        _close(dw, dw64, "dw")
    else:
        assert dw is None and dw64 is None


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_gated_fp32_matches_fp64(activation, norm_before_gate, weighted):
    x, _, z, dy, _, w = _inputs(2)
    w = w if weighted else None
    y, rstd = reference.forward_gated_fp32(x, z, w, EPS, norm_before_gate, activation=activation)
    y64, rstd64, _ = reference.forward_fp64(x, w, EPS, None, z, norm_before_gate, activation=activation)
    _close(y, y64, "y")
    _close(rstd, rstd64, "rstd")
    dx, dw, dz = reference.backward_gated_fp32(dy, x, z, w, rstd, norm_before_gate, activation=activation)
    dx64, dw64, dz64 = reference.backward_fp64(dy, x, w, rstd, None, z, norm_before_gate, activation=activation)
    _close(dx, dx64, "dx")
    _close(dz, dz64, "dgate")
    if weighted:
        _close(dw, dw64, "dw")
    else:
        assert dw is None and dw64 is None


def test_fp32_rounds_once_to_the_input_dtype():
    x, r, z, dy, dh, w = (t.bfloat16() for t in _inputs(3))
    y, rstd, h = reference.forward_fp32(x, w, EPS, r)
    assert y.dtype == h.dtype == torch.bfloat16 and rstd.dtype == torch.float32
    assert torch.equal(h, reference.residual_sum(x, r))
    dx, dw = reference.backward_fp32(dy, h, w, rstd, dh)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    yg, _ = reference.forward_gated_fp32(x, z, w, EPS)
    dxg, dwg, dz = reference.backward_gated_fp32(dy, x, z, w, rstd)
    assert yg.dtype == dxg.dtype == dz.dtype == torch.bfloat16 and dwg.dtype == torch.float32


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_sigmoid_gradcheck(norm_before_gate):
    torch.manual_seed(0)
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    z = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, z, w: reference.RMSNormGatedFP64.apply(x, z, w, 1e-5, norm_before_gate, "sigmoid"), (x, z, w))
    # the activation reaches both directions: a silu gate gives another value
    with torch.no_grad():
        sig = reference.RMSNormGatedFP64.apply(x, z, w, 1e-5, norm_before_gate, "sigmoid")
        silu = reference.RMSNormGatedFP64.apply(x, z, w, 1e-5, norm_before_gate)
    assert not torch.allclose(sig, silu)


@pytest.mark.parametrize("bad", ["tanh", "SiLU", None, ["silu"]])
def test_unknown_activation(bad):
    x, _, z, dy, _, w = _inputs(4, rows=2, hidden=8)
    rstd = torch.ones(2)
    calls = {
        "forward_fp64": lambda: reference.forward_fp64(x, w, EPS, None, z, activation=bad),
        "backward_fp64": lambda: reference.backward_fp64(dy, x, w, rstd, None, z, activation=bad),
        "RMSNormGatedFP64": lambda: reference.RMSNormGatedFP64.apply(x.double(), z.double(), w.double(), EPS,
                                                                     True, bad),
        "forward_gated_fp32": lambda: reference.forward_gated_fp32(x, z, w, EPS, activation=bad),
        "backward_gated_fp32": lambda: reference.backward_gated_fp32(dy, x, z, w, rstd, activation=bad),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"activation must be one of \['sigmoid', 'silu'\]"):
            call()
