"""Argument checking, the CPU reference path, and the nn.Module drop-in."""
import pytest
import torch

import trainnorm
from trainnorm import dispatch, reference
from trainnorm.rows import runs_kernels

from helpers import assert_bits_equal, check_backward, check_forward

H = 512


def _x(device, dtype=torch.bfloat16, shape=(4, H)):
    return torch.randn(shape, device=device).to(dtype)


def _w(device, dtype=torch.bfloat16, n=H):
    return torch.ones(n, device=device, dtype=dtype)


# --- bad input: a clear error naming the argument, before any launch ------------------------

@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the dispatcher runs (kernels or the CPU reference path) or a kernel is launched."""
    class Boom:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for bad input")

    def boom(*a, **k):
        raise AssertionError("the dispatcher ran for bad input")
    from trainnorm import kernels
    for name in kernels.__all__:
        monkeypatch.setattr(dispatch, name, Boom())
    monkeypatch.setattr(dispatch, "forward", boom)
    monkeypatch.setattr(dispatch, "backward", boom)


BAD_FORWARD = [
    (lambda d: dict(x=[1.0, 2.0], weight=None), TypeError, "x must be a torch.Tensor"),
    (lambda d: dict(x=_x(d).double(), weight=None), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.ones(4, H, dtype=torch.int32, device=d), weight=None), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.tensor(1.0, device=d), weight=None), ValueError, "at least one dimension"),
    (lambda d: dict(x=_x(d, shape=(4, 65537)), weight=None), ValueError, "H = x.shape"),
    (lambda d: dict(x=_x(d, shape=(4, 0)), weight=None), ValueError, "H = x.shape"),
    (lambda d: dict(x=_x(d), weight=_w(d, n=H + 1)), ValueError, "weight must have shape"),
    (lambda d: dict(x=_x(d), weight=torch.ones(1, H, device=d, dtype=torch.bfloat16)), ValueError, "weight must have shape"),
    (lambda d: dict(x=_x(d), weight=_w(d, torch.float16)), TypeError, "weight must have x's dtype"),
    (lambda d: dict(x=_x(d, torch.float32), weight=_w(d, torch.bfloat16)), TypeError, "weight must have x's dtype"),
    (lambda d: dict(x=_x(d), weight="w"), TypeError, "weight must be a torch.Tensor"),
    (lambda d: dict(x=_x(d), weight=_w(d), residual=_x(d, shape=(4, H - 1))), ValueError, "residual must have the shape"),
    (lambda d: dict(x=_x(d), weight=_w(d), residual=_x(d, torch.float16)), TypeError,
     "residual must have x.s dtype .* or float32"),
    (lambda d: dict(x=_x(d), weight=_w(d), eps=0.0), ValueError, "eps must be finite and > 0"),
    (lambda d: dict(x=_x(d), weight=_w(d), eps=-1e-6), ValueError, "eps must be finite and > 0"),
    (lambda d: dict(x=_x(d), weight=_w(d), eps=float("nan")), ValueError, "eps must be finite and > 0"),
    (lambda d: dict(x=_x(d), weight=_w(d), eps=float("inf")), ValueError, "eps must be finite and > 0"),
    (lambda d: dict(x=_x(d), weight=_w(d), eps="1e-6"), TypeError, "eps must be a real number"),
    (lambda d: dict(x=_x(d), weight=_w(d), eps=True), TypeError, "eps must be a real number"),
    # without a weight key: weight [H] of x's dtype
    (lambda d: dict(x=torch.ones(4, H, dtype=torch.bool, device=d)), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.ones(4, H, dtype=torch.uint8, device=d)), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.ones(4, H, dtype=torch.int64, device=d)), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.ones(4, H, dtype=torch.complex64, device=d)), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.ones(4, H, dtype=torch.float8_e4m3fn, device=d)), TypeError, "x must have dtype"),
    (lambda d: dict(x=torch.empty(0, 0, dtype=torch.bfloat16, device=d)), ValueError, "H = x.shape"),
    (lambda d: dict(x=torch.empty(4, H, dtype=torch.bfloat16, device="meta")), ValueError, "x must be on a CUDA or CPU"),
    (lambda d: dict(x=_x(d), weight=torch.tensor(1.0, dtype=torch.bfloat16, device=d)), ValueError,
     "weight must have shape"),
    (lambda d: dict(x=_x(d), weight=_w(d, torch.float64)), TypeError, "weight must have x's dtype"),
    (lambda d: dict(x=_x(d), weight=_w(d, torch.int32)), TypeError, "weight must have x's dtype"),
    (lambda d: dict(x=_x(d), weight=_w(d).to("meta")), ValueError,
     "weight must be on x's device"),
    (lambda d: dict(x=_x(d), weight=[1.0] * H), TypeError, "weight must be a torch.Tensor"),
    (lambda d: dict(x=_x(d), residual=_x(d).tolist()), TypeError, "residual must be a torch.Tensor"),
    (lambda d: dict(x=_x(d), residual=_x(d, shape=(H, 4))), ValueError, "residual must have the shape"),
    (lambda d: dict(x=_x(d), residual=_x(d, shape=(1, H))), ValueError, "residual must have the shape"),
    (lambda d: dict(x=_x(d), residual=_x(d, torch.float64)), TypeError, "residual must have x.s dtype"),
    (lambda d: dict(x=_x(d), residual=_x(d).to("meta")), ValueError, "residual must be on x's device"),
    (lambda d: dict(x=_x(d), eps=-0.0), ValueError, "eps must be finite and > 0"),
    (lambda d: dict(x=_x(d), eps=float("-inf")), ValueError, "eps must be finite and > 0"),
    (lambda d: dict(x=_x(d), eps=torch.tensor(1e-6)), TypeError, "eps must be a real number"),
    (lambda d: dict(x=_x(d), eps=1e-6j), TypeError, "eps must be a real number"),
    # eps that float32 cannot hold: 0 (a zero row's y NaN), a subnormal, or inf (y all zeros) in the kernels
    (lambda d: dict(x=_x(d), eps=1e-50), ValueError, "eps must be a normal float32 number.*got 1e-50"),
    (lambda d: dict(x=_x(d), eps=1e-40), ValueError, "eps must be a normal float32 number.*got 1e-40"),
    (lambda d: dict(x=_x(d), eps=1e39), ValueError, "eps must be a normal float32 number.*got 1e\\+39"),
    (lambda d: dict(x=_x(d), weight_offset=True), TypeError, "weight_offset must be a real number, got bool"),
    (lambda d: dict(x=_x(d), weight_offset="1"), TypeError, "weight_offset must be a real number, got str"),
    (lambda d: dict(x=_x(d), weight_offset=float("inf")), ValueError, "weight_offset must be finite"),
    # offsets float32 cannot hold: in the kernels y turned to inf and dx to NaN (1e39), or
    # a subnormal became a float64 constant
    (lambda d: dict(x=_x(d), weight_offset=1e39), ValueError, "weight_offset must be 0 or a normal float32.*1e\\+39"),
    (lambda d: dict(x=_x(d), weight_offset=-1e39), ValueError, "weight_offset must be 0 or a normal float32"),
    (lambda d: dict(x=_x(d), weight_offset=1e-40), ValueError, "weight_offset must be 0 or a normal float32"),
    (lambda d: dict(x=_x(d), weight=None, weight_offset=1.0), ValueError, "weight_offset=1.0 needs a weight"),
    (lambda d: dict(x=_x(d), out_dtype=torch.float64), TypeError, "out_dtype must be None or one of"),
    (lambda d: dict(x=_x(d), out_dtype="float32"), TypeError, "out_dtype must be None or one of"),
]


@pytest.mark.parametrize("make,exc,msg", BAD_FORWARD)
@pytest.mark.parametrize("entry", ["rms_norm", "rms_norm_forward"])
def test_bad_forward_input(device, no_launch, make, exc, msg, entry):
    kwargs = make(device)
    x, weight = kwargs.pop("x"), kwargs.pop("weight", _w(device))
    eps = kwargs.pop("eps", 1e-6)
    with pytest.raises(exc, match=msg):
        getattr(trainnorm, entry)(x, weight, eps, **kwargs)


def test_bad_deterministic_flag(device, no_launch):
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        trainnorm.rms_norm(_x(device), _w(device), deterministic="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for a device mismatch")
def test_device_mismatch(no_launch):
    with pytest.raises(ValueError, match="weight must be on x's device"):
        trainnorm.rms_norm(_x("cuda"), _w("cpu"))
    with pytest.raises(ValueError, match="residual must be on x's device"):
        trainnorm.rms_norm(_x("cuda"), _w("cuda"), residual=_x("cpu"))


def _bwd_args(device, rows=4, hidden=H):
    x = _x(device, shape=(rows, hidden))
    return dict(dy=torch.randn_like(x, dtype=torch.float32).to(x.dtype), h=x, weight=_w(device, n=hidden),
                rstd=torch.ones(rows, device=device))


BAD_BACKWARD = [
    (dict(dy=lambda a: a["dy"].double()), TypeError, "dy must have dtype bfloat16, float16, float32 .y's"),
    (dict(dy=lambda a: a["dy"].to(torch.int32)), TypeError, "dy must have dtype"),
    (dict(dy=lambda a: a["dy"][:3]), ValueError, "dy must have the shape of h"),
    (dict(rstd=lambda a: a["rstd"].double()), TypeError, "rstd must be float32"),
    (dict(rstd=lambda a: a["rstd"][:3]), ValueError, "rstd must have shape"),
    (dict(rstd=lambda a: "r"), TypeError, "rstd must be a torch.Tensor"),
    (dict(weight=lambda a: a["weight"][:7]), ValueError, "weight must have shape"),
    (dict(dh=lambda a: a["dy"][:, :5]), ValueError, "dh must have the shape of h"),
    (dict(workspace=lambda a: torch.empty(3, device=a["h"].device)), TypeError, "workspace must be a torch.uint8"),
    (dict(deterministic=lambda a: 1), TypeError, "deterministic must be a bool"),
    (dict(h=lambda a: a["h"].to(torch.int16)), TypeError, "h must have dtype"),
    (dict(h=lambda a: a["h"][:, :0], dy=lambda a: a["dy"][:, :0]), ValueError, "H = h.shape"),
    (dict(dy=lambda a: a["dy"].t()), ValueError, "dy must have the shape of h"),
    (dict(dy=lambda a: a["dy"].tolist()), TypeError, "dy must be a torch.Tensor"),
    (dict(dy=lambda a: a["dy"].to("meta")), ValueError, "dy must be on h's device"),
    (dict(rstd=lambda a: a["rstd"].bfloat16()), TypeError, "rstd must be float32"),
    (dict(rstd=lambda a: a["rstd"][:, None]), ValueError, "rstd must have shape"),
    (dict(rstd=lambda a: a["rstd"].to("meta")), ValueError, "rstd must be on h's device"),
    (dict(weight=lambda a: a["weight"].double()), TypeError, "weight must have h's dtype"),
    (dict(weight=lambda a: a["weight"].to("meta")), ValueError, "weight must be on h's device"),
    (dict(dh=lambda a: a["dy"].float()), TypeError, "dh must have dtype"),
    (dict(workspace=lambda a: torch.zeros(4096, dtype=torch.int8, device=a["h"].device)), TypeError,
     "workspace must be a torch.uint8"),
    (dict(workspace=lambda a: torch.zeros(8192, dtype=torch.uint8, device=a["h"].device)[::2]), ValueError,
     "workspace must be a contiguous"),
    (dict(workspace=lambda a: torch.zeros(4096, dtype=torch.uint8, device="meta")), ValueError,
     "workspace must be a contiguous tensor on h's device"),
    (dict(deterministic=lambda a: None), TypeError, "deterministic must be a bool"),
]


@pytest.mark.parametrize("change,exc,msg", BAD_BACKWARD)
def test_bad_backward_input(device, no_launch, change, exc, msg):
    args = _bwd_args(device)
    for k, f in change.items():
        args[k] = f(args)
    with pytest.raises(exc, match=msg):
        trainnorm.rms_norm_backward(args.pop("dy"), args.pop("h"), args.pop("weight"), args.pop("rstd"), **args)


def test_workspace_too_small(device, no_launch):
    rows, hidden = 4096, 2048
    need = trainnorm.backward_workspace_bytes(rows, hidden)
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=f"workspace must hold {need} bytes"):
        trainnorm.rms_norm_backward(x, x, _w(device, n=hidden), torch.ones(rows, device=device),
                                    workspace=torch.empty(need - 1, dtype=torch.uint8, device=device))


BAD_GATED = [
    (lambda d: dict(gate=None), TypeError, "gate must be a torch.Tensor"),
    (lambda d: dict(gate=_x(d, shape=(4, H + 1))), ValueError, "gate must have the shape of x"),
    (lambda d: dict(gate=_x(d, torch.float16)), TypeError, "gate must have dtype"),
    (lambda d: dict(gate=_x(d).to("meta")), ValueError, "gate must be on x's device"),
    (lambda d: dict(x=_x(d, shape=(4, 65537)), gate=_x(d, shape=(4, 65537))), ValueError, "H = x.shape"),
    (lambda d: dict(weight=_w(d, n=H - 1)), ValueError, "weight must have shape"),
    (lambda d: dict(eps=float("nan")), ValueError, "eps must be finite and > 0"),
    (lambda d: dict(norm_before_gate=1), TypeError, "norm_before_gate must be a bool"),
    (lambda d: dict(norm_before_gate=None), TypeError, "norm_before_gate must be a bool"),
]


@pytest.mark.parametrize("make,exc,msg", BAD_GATED)
@pytest.mark.parametrize("entry", ["rms_norm_gated", "rms_norm_gated_forward"])
def test_bad_gated_input_no_launch(device, no_launch, make, exc, msg, entry):
    kw = dict(x=_x(device), gate=_x(device), weight=_w(device), eps=1e-6)
    kw.update(make(device))
    args = (kw.pop("x"), kw.pop("gate"), kw.pop("weight"), kw.pop("eps"))
    with pytest.raises(exc, match=msg):
        getattr(trainnorm, entry)(*args, **kw)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("rows,hidden", [(300, 512), (40, 8200)])
def test_workspace_too_small_both_modes(device, no_launch, deterministic, rows, hidden):
    need = trainnorm.backward_workspace_bytes(rows, hidden, deterministic=deterministic)
    assert need > 0
    a = _bwd_args(device, rows, hidden)
    ws = torch.zeros(need - 1, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=f"workspace must hold {need} bytes"):
        trainnorm.rms_norm_backward(a["dy"], a["h"], a["weight"], a["rstd"], deterministic=deterministic,
                                    workspace=ws)
    # a workspace sized for the other mode: the check is per mode
    other = trainnorm.backward_workspace_bytes(rows, hidden, deterministic=not deterministic)
    if other < need:
        with pytest.raises(ValueError, match="workspace must hold"):
            trainnorm.rms_norm_backward(a["dy"], a["h"], a["weight"], a["rstd"], deterministic=deterministic,
                                        workspace=torch.zeros(other, dtype=torch.uint8, device=device))


def test_bad_gated_backward_no_launch(device, no_launch):
    a = _bwd_args(device)
    g = _x(device)
    with pytest.raises(ValueError, match="gate must have the shape of x"):
        trainnorm.rms_norm_gated_backward(a["dy"], a["h"], g[:2], a["weight"], a["rstd"])
    with pytest.raises(TypeError, match="gate must have dtype"):
        trainnorm.rms_norm_gated_backward(a["dy"], a["h"], g.half(), a["weight"], a["rstd"])
    with pytest.raises(TypeError, match="norm_before_gate must be a bool"):
        trainnorm.rms_norm_gated_backward(a["dy"], a["h"], g, a["weight"], a["rstd"], norm_before_gate="no")
    with pytest.raises(ValueError, match="rstd must have shape"):
        trainnorm.rms_norm_gated_backward(a["dy"], a["h"], g, a["weight"], a["rstd"][1:])
    with pytest.raises(ValueError, match="workspace must hold"):
        need = trainnorm.backward_workspace_bytes(300, 512)
        b = _bwd_args(device, 300, 512)
        trainnorm.rms_norm_gated_backward(b["dy"], b["h"], b["h"], b["weight"], b["rstd"],
                                          workspace=torch.zeros(need - 8, dtype=torch.uint8, device=device))


def test_misaligned_workspace_is_a_value_error(device):
    a = _bwd_args(device, 300, 512)
    need = trainnorm.backward_workspace_bytes(300, 512)
    ws = torch.zeros(need + 8, dtype=torch.uint8, device=device)[3:3 + need]
    with pytest.raises(ValueError, match="workspace"):
        trainnorm.rms_norm_backward(a["dy"], a["h"], a["weight"], a["rstd"], workspace=ws)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(rows=True, hidden=512), TypeError, "rows must be an int"),
    (dict(rows=4, hidden=65537), ValueError, "hidden must be in"),
    (dict(rows=4, hidden=512.0), TypeError, "hidden must be an int"),
    (dict(rows=4, hidden=512, deterministic=0), TypeError, "deterministic must be a bool"),
    (dict(rows=4, hidden=512, dtype=torch.float64), TypeError, "dtype must be one of"),
    (dict(rows=-1, hidden=512), ValueError, "rows must be >= 0"),
    (dict(rows=1.5, hidden=512), TypeError, "rows must be an int"),
    (dict(rows=4, hidden=0), ValueError, "hidden must be in"),
    (dict(rows=4, hidden=512, dtype=torch.int8), TypeError, "dtype must be one of"),
])
def test_bad_workspace_query(no_launch, kwargs, exc, msg):
    rows, hidden = kwargs.pop("rows"), kwargs.pop("hidden")
    for fn in (trainnorm.backward_workspace_bytes, trainnorm.backward_workspace):
        with pytest.raises(exc, match=msg):
            fn(rows, hidden, **kwargs)


def test_op_checks_eps_before_any_kernel(device, no_launch):
    # the op itself checks eps (under torch.compile it may be traced as a symbolic value)
    for bad in (1e-50, 1e39, 0.0, float("nan")):
        with pytest.raises(ValueError, match="eps must"):
            torch.ops.trainnorm.rms_norm_fwd(_x(device), _w(device), None, None, bad, "")


def test_op_checks_weight_offset_before_any_kernel(device, no_launch):
    # RMSNormFunction and the raw ops take the offset in the variant string: checked there too
    for spec in ("w+nan", "w+inf", "w+-1e+39", "w+1e-40"):
        with pytest.raises(ValueError, match="weight_offset must"):
            torch.ops.trainnorm.rms_norm_fwd(_x(device), _w(device), None, None, 1e-6, spec)
        with pytest.raises(ValueError, match="weight_offset must"):
            trainnorm.RMSNormFunction.apply(_x(device), _w(device), 1e-6, None, True, None, spec)


@pytest.mark.parametrize("eps", [float(torch.finfo(torch.float32).tiny), float(torch.finfo(torch.float32).max)])
def test_eps_at_the_float32_limits(device, eps):
    # the ends of the accepted range give the float64 formula's result on a zero row and an ordinary one
    x = _x(device, torch.float32, shape=(2, H))
    x[0] = 0
    y, rstd, _ = trainnorm.rms_norm_forward(x, _w(device, torch.float32), eps)
    y64, rstd64, _ = reference.forward_fp64(x, _w(device, torch.float32), eps)
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all()
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-6, atol=0)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-30)


# --- eps=None is torch's default ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_eps_none_is_torchs_default(device, dtype):
    """torch.nn.functional.rms_norm with eps=None uses the float32 machine epsilon for
    16- and 32-bit inputs, not finfo(x.dtype).eps: rows of rms ~3e-3, where the two differ."""
    x = (torch.randn(4, H, device=device) * 3e-3).to(dtype)
    w = _w(device, dtype)
    want = torch.nn.functional.rms_norm(x.float(), (H,), w.float(), None).double()
    got = trainnorm.rms_norm(x, w, None).double()
    rtol = 1e-2 if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)
    module = trainnorm.RMSNorm(H, device=device, dtype=dtype)
    assert module.eps is None and torch.nn.RMSNorm(H).eps is None
    torch.testing.assert_close(module(x).double(), want, rtol=rtol, atol=0)
    if dtype != torch.float32:   # the dtype's own epsilon would give another result
        other = trainnorm.rms_norm(x, w, float(torch.finfo(dtype).eps)).double()
        assert not torch.allclose(other, want, rtol=0.1, atol=0)


# --- flags: bools, numpy's too ----------------------------------------------------------------

def test_numpy_bool_flags(device):
    np = pytest.importorskip("numpy")
    x, w = _x(device), _w(device)
    assert_bits_equal(trainnorm.rms_norm(x, w, deterministic=np.True_), trainnorm.rms_norm(x, w))
    z = _x(device)
    assert_bits_equal(trainnorm.rms_norm_gated(x, z, w, norm_before_gate=np.False_, deterministic=np.False_),
                      trainnorm.rms_norm_gated(x, z, w, norm_before_gate=False))
    y, rstd, h = trainnorm.rms_norm_forward(x, w)
    dy = _x(device)
    for a, b in zip(trainnorm.rms_norm_backward(dy, h, w, rstd, deterministic=np.False_),
                    trainnorm.rms_norm_backward(dy, h, w, rstd, deterministic=False)):
        assert_bits_equal(a, b)
    assert trainnorm.backward_workspace_bytes(300, 512, deterministic=np.False_) == \
        trainnorm.backward_workspace_bytes(300, 512, deterministic=False)
    m = trainnorm.RMSNorm(H, elementwise_affine=np.True_, deterministic=np.False_)
    assert m.deterministic is False and m.elementwise_affine is True
    # anything else is named by its real type
    for bad, name in ((np.int64(1), "numpy.int64"), (torch.tensor(True), "torch.Tensor"), (1, "int"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"deterministic must be a bool, got {name}$"):
            trainnorm.rms_norm(x, w, deterministic=bad)


# --- double backward -------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["plain", "residual", "gated"])
def test_double_backward_is_a_clear_error(device, form):
    x0 = _x(device, torch.float32, shape=(3, 64))
    x = x0.clone().requires_grad_()
    w = torch.rand(64, device=device).add_(0.5).requires_grad_()
    r = x0.flip(0).clone().requires_grad_()
    z = x0.flip(1).clone().requires_grad_()
    inputs = {"plain": (x, w), "residual": (x, w, r), "gated": (x, w, z)}[form]

    def loss():
        if form == "residual":
            y, h = trainnorm.rms_norm(x, w, residual=r)
            return (y.square() + h).sum()
        y = trainnorm.rms_norm_gated(x, z, w) if form == "gated" else trainnorm.rms_norm(x, w)
        return y.square().sum()

    first = torch.autograd.grad(loss(), inputs)
    grads = torch.autograd.grad(loss(), inputs, create_graph=True)
    for a, b in zip(grads, first):   # create_graph=True still gives the gradients
        assert_bits_equal(a.detach(), b)
    with pytest.raises(RuntimeError, match="trainnorm does not support double backward"):
        sum(g.sum() for g in grads).backward()
    # also when the incoming gradient is constant (y.sum()): the second backward is still an error
    y = trainnorm.rms_norm(x, w)
    gx, = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        gx.sum().backward()


# --- the module: a drop-in for torch.nn.RMSNorm -------------------------------------------------

def test_module_is_a_torch_rmsnorm():
    import inspect
    m = trainnorm.RMSNorm(H)
    assert isinstance(m, torch.nn.RMSNorm) and isinstance(m, torch.nn.Module)
    assert not isinstance(trainnorm.RMSNormGated(H), torch.nn.RMSNorm)    # it takes (x, gate)
    theirs = list(inspect.signature(torch.nn.RMSNorm.__init__).parameters.values())
    ours = list(inspect.signature(trainnorm.RMSNorm.__init__).parameters.values())
    # torch's parameters, in order, with torch's defaults; trainnorm's own only keyword-only after them
    assert [(p.name, p.default, p.kind) for p in ours[:len(theirs)]] == \
        [(p.name, p.default, p.kind) for p in theirs]
    assert all(p.kind is p.KEYWORD_ONLY for p in ours[len(theirs):])
    assert m.eps is None and m.elementwise_affine is True and m.normalized_shape == (H,)
    assert torch.equal(m.weight, torch.ones(H)) and m.deterministic is True


BAD_MODULE = [
    (dict(normalized_shape=True), TypeError, "normalized_shape must be an int or a sequence of ints, got bool"),
    (dict(normalized_shape=0), ValueError, r"normalized_shape must hold sizes >= 1.*got \(0,\)"),
    (dict(normalized_shape=-3), ValueError, "normalized_shape must hold sizes >= 1"),
    (dict(normalized_shape=65537), ValueError, r"normalized_shape.*\[1, 65536\]"),
    (dict(normalized_shape=(512, 512)), ValueError, r"normalized_shape.*\[1, 65536\]"),
    (dict(normalized_shape=(4, 0)), ValueError, "normalized_shape must hold sizes >= 1"),
    (dict(normalized_shape=[]), ValueError, "normalized_shape must hold sizes >= 1"),
    (dict(normalized_shape=2.5), TypeError, "normalized_shape must be an int or a sequence of ints, got float"),
    (dict(normalized_shape="512"), TypeError, "normalized_shape must hold ints, got str"),
    (dict(normalized_shape=(4, True)), TypeError, "normalized_shape must hold ints, got bool"),
    (dict(normalized_shape=None), TypeError, "normalized_shape must be an int or a sequence of ints, got NoneType"),
    (dict(eps=0), ValueError, "eps must be finite and > 0"),
    (dict(eps=-1e-6), ValueError, "eps must be finite and > 0"),
    (dict(eps=float("nan")), ValueError, "eps must be finite and > 0"),
    (dict(eps=1e-50), ValueError, "eps must be a normal float32 number"),
    (dict(eps=1e39), ValueError, "eps must be a normal float32 number"),
    (dict(eps="1e-6"), TypeError, "eps must be a real number or None, got str"),
    (dict(eps=True), TypeError, "eps must be a real number or None, got bool"),
    (dict(elementwise_affine="yes"), TypeError, "elementwise_affine must be a bool, got str"),
    (dict(elementwise_affine=None), TypeError, "elementwise_affine must be a bool, got NoneType"),
    (dict(dtype=torch.float64), TypeError, "dtype must be None or one of bfloat16, float16, float32, got torch.float64"),
    (dict(dtype=torch.int32), TypeError, "dtype must be None or one of"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool, got int"),
    (dict(weight_offset=None), TypeError, "weight_offset must be a real number, got NoneType"),
    (dict(weight_offset=float("nan")), ValueError, "weight_offset must be finite"),
    (dict(weight_offset=1.0, elementwise_affine=False), ValueError, "weight_offset=1.0 needs elementwise_affine"),
]


@pytest.mark.parametrize("cls", [trainnorm.RMSNorm, trainnorm.RMSNormGated])
@pytest.mark.parametrize("kwargs,exc,msg", BAD_MODULE)
def test_module_constructor_checks(cls, kwargs, exc, msg):
    kwargs = dict(kwargs)
    shape = kwargs.pop("normalized_shape", H)
    if (cls is trainnorm.RMSNormGated and isinstance(shape, (tuple, list)) and len(shape) != 1
            and all(type(d) is int for d in shape)):
        exc, msg = ValueError, "normalized_shape must be one dimension"     # the gated norm takes one only
    with pytest.raises(exc, match=msg):
        cls(shape, **kwargs)


def test_gated_module_constructor_checks():
    with pytest.raises(ValueError, match="normalized_shape must be one dimension"):
        trainnorm.RMSNormGated((4, 8))
    with pytest.raises(TypeError, match="norm_before_gate must be a bool"):
        trainnorm.RMSNormGated(H, norm_before_gate="no")


@pytest.mark.parametrize("shape", [H, (4, 16), [2, 3, 5]])
@pytest.mark.parametrize("affine", [True, False])
def test_module_state_dict_both_ways(device, shape, affine):
    torch.manual_seed(3)
    ours = trainnorm.RMSNorm(shape, eps=1e-5, elementwise_affine=affine, device=device)
    theirs = torch.nn.RMSNorm(shape, eps=1e-5, elementwise_affine=affine, device=device)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == (["weight"] if affine else [])
    if affine:
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    if affine:
        assert torch.equal(ours.weight, theirs.weight) and ours.weight.shape == theirs.weight.shape
        with torch.no_grad():
            ours.weight.mul_(2)
        theirs.load_state_dict(ours.state_dict(), strict=True)
        assert torch.equal(ours.weight, theirs.weight)
    x = torch.randn((3, 5) + tuple(ours.normalized_shape), device=device)
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yt = ours(xo), theirs(xt)
    torch.testing.assert_close(yo, yt, atol=1e-5, rtol=1e-5)
    dy = torch.randn_like(x)
    yo.backward(dy)
    yt.backward(dy)
    torch.testing.assert_close(xo.grad, xt.grad, atol=1e-4, rtol=1e-4)
    if affine:
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, atol=1e-4, rtol=1e-4)


def test_module_multi_dim_residual_and_bad_x(device):
    m = trainnorm.RMSNorm((4, 16), device=device, dtype=torch.bfloat16)
    x, r = _x(device, shape=(3, 4, 16)), _x(device, shape=(3, 4, 16))
    y, h = m(x, r)
    assert y.shape == h.shape == x.shape
    assert_bits_equal(h, (x.float() + r.float()).to(torch.bfloat16))
    assert_bits_equal(y, trainnorm.rms_norm(h.reshape(3, 64), m.weight.reshape(64)).reshape(x.shape))
    assert m(_x(device, shape=(0, 4, 16))).shape == (0, 4, 16)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 4, 16\] \(normalized_shape\), got \[3, 16, 4\]"):
        m(_x(device, shape=(3, 16, 4)))
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        m(x, r[:2])
    one = trainnorm.RMSNorm(H, elementwise_affine=False, device=device)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., 512\]"):
        one(_x(device, shape=(2, 256)))


# --- NaN / Inf propagate as the math says ----------------------------------------------------

def test_nan_inf_propagate(device):
    x = _x(device, shape=(3, H))
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    y, rstd, _ = trainnorm.rms_norm_forward(x, _w(device))
    assert torch.isnan(rstd[0]) and torch.isnan(y[0]).all()
    assert rstd[1] == 0 and torch.isnan(y[1, 7])       # inf * 0
    assert torch.isfinite(y[2]).all() and torch.isfinite(rstd[2])


def test_zero_row(device):
    x = torch.zeros(2, H, dtype=torch.bfloat16, device=device)
    y, rstd, _ = trainnorm.rms_norm_forward(x, _w(device), 1e-6)
    torch.testing.assert_close(rstd.double(), torch.full((2,), 1e-6 ** -0.5, dtype=torch.float64, device=device),
                               rtol=1e-6, atol=0)
    assert torch.equal(y, torch.zeros_like(y))


# --- the CPU path (pure PyTorch, no interpreter) ------------------------------------------

def test_cpu_reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runs_kernels(torch.empty(1))
    torch.manual_seed(0)
    x = torch.randn(6, 5, 384).to(torch.bfloat16)
    r = torch.randn(6, 5, 384).to(torch.bfloat16)
    w = torch.randn(384).float()
    y, rstd, h = trainnorm.rms_norm_forward(x, w, residual=r)
    check_forward(x, w, 1e-6, r, y, rstd, h)
    y2, rstd2, _ = trainnorm.rms_norm_forward(h, w)
    assert_bits_equal(y, y2)
    dy = torch.randn_like(x, dtype=torch.float32).to(x.dtype)
    dx, dw = trainnorm.rms_norm_backward(dy, h, w, rstd, dh=r)
    check_backward(dy, h, w, rstd, r, dx, dw)
    dx2, dw2 = trainnorm.rms_norm_backward(dy, h, w, rstd, dh=r, deterministic=False)
    assert_bits_equal(dx, dx2) and assert_bits_equal(dw, dw2)


# --- module --------------------------------------------------------------------------------

def test_module_drop_in(device):
    torch.manual_seed(1)
    ours = trainnorm.RMSNorm(H, eps=1e-6, device=device, dtype=torch.float32)
    theirs = torch.nn.RMSNorm(H, eps=1e-6, device=device, dtype=torch.float32)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    with torch.no_grad():
        theirs.weight.normal_()
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 7, H, device=device)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    assert "deterministic=True" in repr(ours)


def test_module_options(device):
    m = trainnorm.RMSNorm([H], eps=None, elementwise_affine=False, device=device, deterministic=False)
    assert m.weight is None and list(m.state_dict()) == []
    x = _x(device, torch.float32)
    y = m(x)
    ref = torch.nn.functional.rms_norm(x, (H,), None, None)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    m2 = trainnorm.RMSNorm(H, device=device, dtype=torch.bfloat16)
    x, r = _x(device), _x(device)
    y, h = m2(x, r)
    assert_bits_equal(h, (x.float() + r.float()).to(torch.bfloat16))


@pytest.mark.parametrize("cls", [trainnorm.RMSNorm, trainnorm.RMSNormGated])
def test_module_weight_offset_starts_at_the_identity_scale(cls):
    # (weight_offset + weight) is one when built and after reset_parameters: zeros for offset 1
    m = cls(H, weight_offset=1.0)
    assert torch.equal(m.weight, torch.zeros(H)) and "weight_offset=1.0" in repr(m)
    m.weight.data.fill_(3.0)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.zeros(H))
    assert torch.equal(cls(H, weight_offset=0.5).weight, torch.full((H,), 0.5))
    assert torch.equal(cls(H).weight, torch.ones(H)) and "weight_offset" not in repr(cls(H))
