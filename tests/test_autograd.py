"""Autograd, custom ops (opcheck) and torch.compile."""
import pytest
import torch

import trainnorm
from trainnorm import reference
from trainnorm.families import make_case

from helpers import assert_bits_equal, check_backward


def test_reference_formula_gradcheck():
    # the backward formulas of SPEC section 1 are the derivatives of the forward
    torch.manual_seed(0)
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: reference.RMSNormFP64.apply(x, w, None, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda x, w, r: reference.RMSNormFP64.apply(x, w, r, 1e-5), (x, w, r))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_autograd_matches_formulas(device, residual, weight_dtype):
    case = make_case("normal", (2, 17), 1536, weight_dtype=weight_dtype, residual=residual, seed=1, device=device)
    x = case.x.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    r = case.residual.clone().requires_grad_() if residual else None
    out = trainnorm.rms_norm(x, w, 1e-6, residual=r)
    y, h = out if residual else (out, x)
    loss = (y.float() * case.dy.float()).sum()
    if residual:
        loss = loss + (h.float() * case.dh.float()).sum()
    loss.backward()
    assert w.grad.dtype == weight_dtype
    _, rstd, _ = trainnorm.rms_norm_forward(case.x, case.weight, 1e-6, residual=case.residual)
    h_det = h.detach()
    dw_expected = trainnorm.rms_norm_backward(case.dy, h_det, case.weight, rstd, dh=case.dh)[1]
    check_backward(case.dy, h_det, case.weight, rstd, case.dh, x.grad, dw_expected)
    assert_bits_equal(w.grad, dw_expected.to(weight_dtype), "weight.grad")
    if residual:
        assert_bits_equal(r.grad, x.grad, "residual.grad")


def test_autograd_partial_needs(device):
    case = make_case("normal", (8,), 512, seed=2, device=device)
    x = case.x.clone().requires_grad_()
    y = trainnorm.rms_norm(x, case.weight)            # weight without grad: no dw
    y.backward(case.dy)
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    w = case.weight.clone().requires_grad_()
    trainnorm.rms_norm(case.x, w).backward(case.dy)   # only dw
    assert w.grad is not None and torch.isfinite(w.grad.float()).all()
    # h used, y unused: dy arrives as None
    r = case.x.clone().requires_grad_()
    x2 = case.x.clone().requires_grad_()
    _, h = trainnorm.rms_norm(x2, case.weight, residual=r)
    h.float().sum().backward()
    assert_bits_equal(x2.grad, torch.ones_like(x2))


def test_opcheck(device):
    case = make_case("normal", (2, 3), 256, residual=True, seed=3, device=device)
    fwd, bwd = torch.ops.trainnorm.rms_norm_fwd.default, torch.ops.trainnorm.rms_norm_bwd.default
    z = case.dh
    # the variant string: "" (no gate), "silu" (gate after the norm), "silu:first", "sigmoid"
    for args in [(case.x, case.weight, case.residual, None, 1e-6, ""), (case.x, None, None, None, 1e-5, ""),
                 (case.x, case.weight, None, z, 1e-6, "silu"), (case.x, case.weight, None, z, 1e-6, "silu:first"),
                 (case.x, case.weight, None, z, 1e-6, "sigmoid")]:
        torch.library.opcheck(fwd, args)
    y, rstd, h = fwd(case.x, case.weight, case.residual, None, 1e-6, "")
    ws = trainnorm.backward_workspace(6, 256, device=device)
    for args in [(case.dy, h, case.weight, rstd, case.dh, None, "", True, True, None),
                 (case.dy, h, case.weight, rstd, None, None, "", False, True, None),
                 (case.dy, h, case.weight, rstd, None, None, "", True, True, ws),
                 (case.dy, h, None, rstd, None, None, "", True, False, None),
                 (case.dy, h, case.weight, rstd, None, z, "silu", True, True, None),
                 (case.dy, h, case.weight, rstd, None, z, "silu:first", False, True, None),
                 (case.dy, h, case.weight, rstd, None, z, "sigmoid:first", True, True, None)]:
        torch.library.opcheck(bwd, args)


def _block(norm_cls, hidden, device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden, device=device),
        norm_cls(hidden, device=device),
        torch.nn.Linear(hidden, hidden, device=device),
    )


def test_torch_compile_fullgraph(device):
    # CPU: trace through dynamo + AOTAutograd (aot_eager); the GPU suite compiles with inductor
    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    model = _block(trainnorm.RMSNorm, 256, device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(4, 8, 256, device=device)
    y_eager = model(x)
    y_eager.sum().backward()
    g_eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y_comp = compiled(x)
    y_comp.sum().backward()
    torch.testing.assert_close(y_comp, y_eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_eager, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the residual form traces too
    torch._dynamo.reset()
    f = torch.compile(lambda x, r, w: trainnorm.rms_norm(x, w, residual=r), fullgraph=True, backend=backend)
    xr = torch.randn(5, 256, device=device)
    y, h = f(xr, xr, torch.ones(256, device=device))
    assert_bits_equal(h, xr + xr)


def test_direct_op_call_with_grad_has_no_formula(device):
    # the ops' autograd is RMSNormFunction: a direct call on tensors that require grad computes,
    # and its backward is a clear error rather than a silent wrong gradient
    case = make_case("normal", (3,), 64, seed=4, device=device)
    x = case.x.clone().requires_grad_()
    y, rstd, h = torch.ops.trainnorm.rms_norm_fwd(x, case.weight, None, None, 1e-6, "")
    with torch.no_grad():
        y0, rstd0, _ = torch.ops.trainnorm.rms_norm_fwd(case.x, case.weight, None, None, 1e-6, "")
    assert y.requires_grad and not y0.requires_grad
    assert_bits_equal(y.detach(), y0, "y")
    with pytest.raises(RuntimeError, match="no autograd formula"):
        y.float().sum().backward()
