"""The same properties at real sizes, on a CUDA GPU (skipped without one).

T up to 65,536 tokens for every hidden-size family, and the per-head views up
to 65,536 x 24 rows.
"""
import pytest
import torch

import trainnorm
from trainnorm.rows import simulate_sm_count
from trainnorm.bench.shapes import BEYOND_H, BEYOND_HEADS
from trainnorm.families import FAMILIES, make_case

from helpers import assert_bits_equal, check_backward, check_forward

pytestmark = pytest.mark.gpu
EPS = 1e-6
HIDDEN = [512, 1536, 2048, 4096, 5120, 6144]


def run_both(case, deterministic=True):
    y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
    dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh, deterministic=deterministic)
    return y, rstd, h, dx, dw


def check(case, deterministic):
    out = run_both(case, deterministic)
    check_forward(case.x, case.weight, EPS, case.residual, *out[:3])
    check_backward(case.dy, out[2], case.weight, out[1], case.dh, out[3], out[4])
    return out


@pytest.mark.bigmem
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_accuracy_65536_tokens(hidden, family, weight_dtype, deterministic):
    check(make_case(family, (65536,), hidden, weight_dtype=weight_dtype, seed=hidden, device="cuda"), deterministic)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("tokens", [1, 4, 16, 64, 256, 1000, 4096, 14928])
@pytest.mark.parametrize("hidden", [2048, 5120])
def test_accuracy_token_counts(hidden, tokens, deterministic):
    check(make_case("outlier", (tokens,), hidden, seed=tokens, device="cuda"), deterministic)


@pytest.mark.bigmem
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", FAMILIES)
def test_residual_6144(family, weight_dtype, deterministic):
    case = make_case(family, (65536,), 6144, weight_dtype=weight_dtype, residual=True, seed=1, device="cuda")
    check(case, deterministic)


@pytest.mark.bigmem
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads,query", [(24, True), (4, False)])
def test_per_head_views(heads, query, family, deterministic):
    case = make_case(family, (65536, heads), 256, query_view=query, seed=2, device="cuda")
    if query:
        assert case.x.stride() == (12288, 512, 1)
    check(case, deterministic)


@pytest.mark.parametrize("hidden", [1, 1000, 8192, 8200, 20000, 65536])
def test_other_widths(hidden):
    tokens = max(1, min(4096, (1 << 26) // hidden))
    for deterministic in (True, False):
        check(make_case("normal", (tokens,), hidden, residual=True, seed=3, device="cuda"), deterministic)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    for deterministic in (True, False):
        check(make_case("outlier", (16384,), 4096, dtype=dtype, seed=4, device="cuda"), deterministic)


def check_sm_counts_and_modes(run, ref, names, n_mode, sms=(1, 66, 132, 264)):
    """run(det=True) -> outputs: the same bits as ref at every SM count, and the
    first n_mode outputs (all but dw) the same bits in deterministic=False."""
    for count in sms:
        with simulate_sm_count(count):
            out = run()
        for a, b, n in zip(ref, out, names):
            assert_bits_equal(a, b, f"{n} at {count} SMs")
    for a, b, n in zip(ref[:n_mode], run(False)[:n_mode], names):
        assert_bits_equal(a, b, f"{n}: both modes")


# --- determinism ---------------------------------------------------------------------------

SHAPES = [((65536,), 4096, {}), ((4096,), 6144, {"residual": True}), ((16384, 24), 256, {"query_view": True}),
          ((300,), 2048, {})]


@pytest.mark.bigmem
@pytest.mark.parametrize("lead,hidden,kw", SHAPES)
def test_repeat_and_sm_counts_bitwise(lead, hidden, kw):
    case = make_case("normal", lead, hidden, weight_dtype=torch.float32, seed=5, device="cuda", **kw)
    ref = run_both(case)
    for _ in range(3):
        for a, b in zip(ref, run_both(case)):
            assert_bits_equal(a, b, "repeat")
    for sms in (1, 16, 66, 114, 132, 170, 264):
        with simulate_sm_count(sms):
            out = run_both(case)
        for a, b, n in zip(ref, out, ("y", "rstd", "h", "dx", "dw")):
            assert_bits_equal(a, b, f"{n} at {sms} SMs")


@pytest.mark.bigmem
@pytest.mark.parametrize("lead,hidden,kw", SHAPES)
def test_modes_equal_and_fast_repeat_dx(lead, hidden, kw):
    case = make_case("offset", lead, hidden, seed=6, device="cuda", **kw)
    det = run_both(case, True)
    for _ in range(2):
        fast = run_both(case, False)
        for a, b, n in zip(det[:4], fast[:4], ("y", "rstd", "h", "dx")):
            assert_bits_equal(a, b, n)


@pytest.mark.parametrize("rule", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_residual_equals_the_norm_of_h(hidden, weight_dtype, rule, monkeypatch):
    # SPEC: rms_norm(x, w, residual=r) is rms_norm(h, w) bit for bit, at row counts on either
    # side of the forward's windows and of plan.RESIDUAL_HOLD_MIN_ROWS, with the residual's held
    # walks (plan.RESIDUAL_HOLD) off and on. 9f3b8e5..67030d0 held them one row a tile, which
    # split a row of H 5120's float32-weight entry over 8 warps where its two-row tile takes 4
    from trainnorm import plan
    monkeypatch.setattr(plan, "RESIDUAL_HOLD", rule)
    plan.clear_caches()
    try:
        case = make_case("outlier", (4096,), hidden, residual=True, weight_dtype=weight_dtype, seed=3,
                         device="cuda")
        edge = plan.RESIDUAL_HOLD_MIN_ROWS
        for n in (1, 300, 1025, edge - 1, edge, 4096):
            y, rstd, h = trainnorm.rms_norm_forward(case.x[:n], case.weight, EPS, residual=case.residual[:n])
            y_h, rstd_h, _ = trainnorm.rms_norm_forward(h, case.weight, EPS)
            assert_bits_equal(y, y_h, f"y at {n} rows, residual against h")
            assert_bits_equal(rstd, rstd_h, f"rstd at {n} rows, residual against h")
    finally:
        monkeypatch.undo()
        plan.clear_caches()


# 1000: a width off the table, whose chunked backward rounded a product that its one-chunk
# form fused until 2dedf9a (sm_90 instruction counts; compile-check --load-forms)
@pytest.mark.parametrize("hidden", [512, 1000, 1536, 2048, 4096, 6144])
def test_batch_invariance(hidden):
    big = make_case("normal", (16384,), hidden, residual=True, seed=7, device="cuda")
    out_big = run_both(big)
    for lo, hi in ((0, 1), (3, 17), (100, 4196), (0, 16384 - 1)):
        sub = type(big)(big.x[lo:hi], big.weight, big.dy[lo:hi], big.residual[lo:hi], big.dh[lo:hi])
        for a, b, n in zip(out_big[:4], run_both(sub)[:4], ("y", "rstd", "h", "dx")):
            assert_bits_equal(a[lo:hi], b, f"{n} rows {lo}:{hi}")


def _entries_with(field: str, what: str) -> list:
    """(hidden, kind) of the sm_90 table's 16-bit forward entries whose schedule sets `field`
    (a skipped case saying so where none does)."""
    from trainnorm.configs import table
    found = [(e["hidden"], e["kind"]) for e in table.load("sm_90")["forward"]
             if e["elt"] == 2 and e.get("schedule", {}).get(field)]
    return found or [pytest.param(0, "", marks=pytest.mark.skip(reason=f"no forward entry has {what}"))]


def _entry_case(hidden: int, kind: str, seed: int):
    """The table's 16-bit forward entry of (hidden, kind) and 8192 outlier rows with a residual for it."""
    from trainnorm.configs import table
    entry = next(e for e in table.load("sm_90")["forward"] if (e["hidden"], e["elt"], e["kind"]) == (hidden, 2, kind))
    case = make_case("outlier", (8192,), hidden, residual=True, seed=seed, device="cuda",
                     weight_dtype=torch.float32 if kind == "weight_fp32" else torch.bfloat16)
    return table.to_config("forward", entry), case


def _forward_under(cfg, hidden: int, kind: str, case, n: int | None = None):
    """The forward of the case's first n rows with `cfg` for (hidden, kind): the gated forward's
    outputs, else (y, rstd) without and (y, rstd, h) with the residual."""
    from trainnorm import configs
    x, r = case.x[:n], case.residual[:n]
    with configs.override(forward=lambda key, _: cfg if (key.hidden, key.kind) == (hidden, kind) else None):
        if kind == "gated":
            return trainnorm.rms_norm_gated_forward(x, r, case.weight)
        return (*trainnorm.rms_norm_forward(x, case.weight, EPS)[:2],
                *trainnorm.rms_norm_forward(x, case.weight, EPS, residual=r))


@pytest.mark.parametrize("hidden,kind", _entries_with("rows_block_m", "rows per tile by row count"))
def test_forward_rows_per_tile_same_bits(hidden, kind):
    # every row count a forward entry takes (FwdSchedule.rows_block_m) sums a row in one order:
    # each forced over the same 8192 outlier rows gives the entry's own tile's bits (y, rstd,
    # h; with a residual and with a gate where the entry's kind has one)
    cfg, case = _entry_case(hidden, kind, seed=21)

    def run(bm):
        return _forward_under(cfg.replace(block_m=bm, rows_block_m=()), hidden, kind, case)
    ref = run(cfg.tile.block_m)
    for _, bm in cfg.rows_block_m:
        for n, (a, b) in enumerate(zip(ref, run(bm))):
            assert_bits_equal(a, b, f"H {hidden} {kind} bm{bm} against bm{cfg.tile.block_m}, output {n}")


@pytest.mark.parametrize("hidden,kind", _entries_with("held_tile", "a held tile"))
def test_forward_held_tile_same_bits(hidden, kind):
    # an entry's held tile (FwdSchedule.held_tile, from plan.RESIDUAL_HOLD_MIN_ROWS rows, its own
    # rows and warps) sums a row as the entry's tile: over the same 8192 outlier rows it gives
    # the bits of the entry without it (y, rstd; with a residual y, rstd, h), and the rows
    # below the edge alone the bits they take in the held batch
    from trainnorm import plan
    cfg, case = _entry_case(hidden, kind, seed=22)
    edge = plan.RESIDUAL_HOLD_MIN_ROWS

    def run(c, n=8192):
        return _forward_under(c, hidden, kind, case, n)
    held = run(cfg)
    names = ("y", "rstd", "y res", "rstd res", "h")
    for a, b, n in zip(held, run(cfg.replace(held_tile=())), names):
        assert_bits_equal(a, b, f"H {hidden} {kind} {n}: held tile {cfg.held_tile} against the tile's forms")
    for a, b, n in zip(held, run(cfg, edge - 1), names):
        assert_bits_equal(a[:edge - 1], b, f"H {hidden} {kind} {n}: rows below the edge alone and in the held batch")


def test_cuda_graph_replay_bitwise():
    rows, hidden = 14928, 5120
    case = make_case("outlier", (rows,), hidden, weight_dtype=torch.float32, residual=True, seed=8, device="cuda")
    ref = run_both(case)
    ws = trainnorm.backward_workspace(rows, hidden, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
            dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh, workspace=ws)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y, rstd, h = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=case.residual)
        dx, dw = trainnorm.rms_norm_backward(case.dy, h, case.weight, rstd, dh=case.dh, workspace=ws)
    for _ in range(3):
        for t in (y, rstd, h, dx, dw):
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for a, b, n in zip(ref, (y, rstd, h, dx, dw), ("y", "rstd", "h", "dx", "dw")):
            assert_bits_equal(a, b, f"graph {n}")


def test_compile_bitwise_equal_to_eager():
    case = make_case("normal", (4096,), 4096, seed=9, device="cuda")

    def step(x, w, dy):
        y = trainnorm.rms_norm(x, w)
        return y, torch.autograd.grad(y, (x, w), dy)

    x = case.x.clone().requires_grad_()
    w = case.weight.clone().requires_grad_()
    eager = step(x, w, case.dy)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: trainnorm.rms_norm(x, w), fullgraph=True)
    y = compiled(x, w)
    grads = torch.autograd.grad(y, (x, w), case.dy)
    assert_bits_equal(eager[0], y, "y")
    assert_bits_equal(eager[1][0], grads[0], "dx")
    assert_bits_equal(eager[1][1], grads[1], "dw")


def test_second_device_if_present():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    case = make_case("normal", (4096,), 2048, seed=10, device="cuda:1")
    check(case, True)


# --- the gated variant at real sizes ---------------------------------------------------------

@pytest.mark.bigmem
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("lead,hidden", [((65536, 16), 128), ((16384,), 4096), ((65536,), 2048)])
def test_gated_real_sizes(lead, hidden, norm_before_gate):
    from helpers import check_gated
    c = make_case("outlier", lead, hidden, weight_dtype=torch.float32, residual=True, seed=11, device="cuda")
    x, z, w, dy = c.x, c.residual, c.weight, c.dy
    outs = {det: check_gated(x, z, w, dy, norm_before_gate, det, EPS) for det in (True, False)}
    for a, b, n in zip(outs[True][:4], outs[False][:4], ("y", "rstd", "dx", "dgate")):
        assert_bits_equal(a, b, n)
    again = trainnorm.rms_norm_gated_backward(dy, x, z, w, outs[True][1], norm_before_gate=norm_before_gate)
    for a, b in zip(outs[True][2:], again):
        assert_bits_equal(a, b, "repeat")


STACK = [((65536,), 4096, "fp32 stream"), ((16384,), 6144, "fp32 stream"), ((4096,), 5120, "offset"),
         ((65536,), 2048, "offset"), ((16384, 24), 256, "offset"), ((4096,), 4096, "fp32 y"),
         ((300,), 1536, "fp32 stream")]


@pytest.mark.bigmem
@pytest.mark.parametrize("lead,hidden,form", STACK)
def test_stack_forms_real_sizes(lead, hidden, form):
    # a float32 residual stream under bf16 x, the (1 + w) weight, a float32 y: against
    # FP64 at real sizes, dw in the budget, the same bits at every SM count and in both
    # modes (dx), and the descriptor stages fitted to a float32 stream (rows.descriptor_stages)
    from trainnorm import reference
    from helpers import DW_BUDGET, assert_close64
    case = make_case("outlier", lead, hidden, seed=hidden, device="cuda",
                     query_view=len(lead) == 2)
    r = 4 * torch.randn(case.x.shape, device="cuda") if form == "fp32 stream" else None
    dh = torch.randn(case.x.shape, device="cuda") if r is not None else None
    offset = 1.0 if form == "offset" else 0.0
    w = (0.1 * case.weight.float()).to(case.weight.dtype) if offset else case.weight
    out_dtype = torch.float32 if form == "fp32 y" else None
    dy = case.dy.to(out_dtype) if out_dtype else case.dy

    def run(det=True):
        y, rstd, h = trainnorm.rms_norm_forward(case.x, w, EPS, residual=r, weight_offset=offset, out_dtype=out_dtype)
        dx, dw = trainnorm.rms_norm_backward(dy, h, w, rstd, dh=dh, deterministic=det, weight_offset=offset)
        return y, rstd, h, dx, dw

    ref = run()
    y, rstd, h, dx, dw = ref
    y64, _, _ = reference.forward_fp64(case.x, w, EPS, r, weight_offset=offset)
    assert_close64(y, y64, "y")
    if r is not None:
        assert h.dtype == torch.float32
        assert_bits_equal(h, case.x.float() + r, "h = f32(x) + r")
    dx64, dw64 = reference.backward_fp64(dy, h, w, rstd, dh, weight_offset=offset)
    assert_close64(dx, dx64, "dx")
    assert reference.dw_err_over_tol(dw, dw64) <= DW_BUDGET
    check_sm_counts_and_modes(run, ref, ("y", "rstd", "h", "dx", "dw"), 4)


# the autograd path keys the backward on x's 16-bit dtype while dy and h may be float32
# (a float32 residual stream with y in float32): the form whose descriptor stages once
# asked for 296 KiB of shared memory at H 5120-6144
AUTOGRAD_STACK = [((16384,), 6144, torch.float32), ((4096,), 5120, torch.float32), ((16384,), 4096, None),
                  ((4096, 24), 256, torch.float32)]


@pytest.mark.bigmem
@pytest.mark.parametrize("lead,hidden,out_dtype", AUTOGRAD_STACK)
def test_stack_through_autograd_real_sizes(lead, hidden, out_dtype):
    from trainnorm import reference
    from helpers import DW_BUDGET, assert_close64
    case = make_case("outlier", lead, hidden, seed=hidden + 1, device="cuda", query_view=len(lead) == 2)
    r = 4 * torch.randn(case.x.shape, device="cuda")                       # the float32 stream
    dy = case.dy.to(out_dtype) if out_dtype else case.dy
    dh = torch.randn(case.x.shape, device="cuda")

    def run(det=True):
        x = case.x.detach().requires_grad_()
        res = r.clone().requires_grad_()
        w = case.weight.detach().clone().requires_grad_()
        y, h = trainnorm.rms_norm(x, w, EPS, residual=res, deterministic=det, out_dtype=out_dtype)
        torch.autograd.backward((y, h), (dy, dh))
        return y.detach(), h.detach(), x.grad, res.grad, w.grad

    ref = run()
    y, h, dx, dres, dw = ref
    assert y.dtype == (out_dtype or case.x.dtype) and h.dtype == torch.float32
    assert dx.dtype == case.x.dtype and dres.dtype == torch.float32
    assert_bits_equal(h, case.x.float() + r, "h = f32(x) + r")
    y64, _, _ = reference.forward_fp64(case.x, case.weight, EPS, r)
    assert_close64(y, y64, "y")
    _, rstd, _ = trainnorm.rms_norm_forward(case.x, case.weight, EPS, residual=r, out_dtype=out_dtype)
    dx64, dw64 = reference.backward_fp64(dy, h, case.weight, rstd, dh)
    assert_close64(dres, dx64, "the stream's gradient")
    assert_bits_equal(dx, dres.to(dx.dtype), "dx is the stream's gradient rounded")
    # dw before autograd rounds it to the weight's dtype: the op's float32 dw, the same call
    spec = "x:bf16" + (",y:fp32" if out_dtype else "")
    _, odw, _, _ = torch.ops.trainnorm.rms_norm_bwd(dy, h, case.weight, rstd, dh, None, spec, True, True, None)
    assert reference.dw_err_over_tol(odw, dw64) <= DW_BUDGET
    assert_bits_equal(odw.to(dw.dtype), dw, "dw through the op")
    check_sm_counts_and_modes(run, ref, ("y", "h", "dx", "dres", "dw"), 4, sms=(1, 132, 264))


@pytest.mark.bigmem
@pytest.mark.parametrize("heads,hidden", [(None, h) for h in BEYOND_H] + list(BEYOND_HEADS))
def test_widths_beyond_the_table(heads, hidden):
    # the bench's widths and head counts that configs/sm_90.json holds no entry for: their
    # configs come from the general rules; accuracy, both modes' dx and the SM-count bits
    lead = (16384,) if heads is None else (4096, heads)
    case = make_case("outlier", lead, hidden, seed=hidden, device="cuda")
    ref = check(case, True)
    check(case, False)
    check_sm_counts_and_modes(lambda det=True: run_both(case, det), ref, ("y", "rstd", "h", "dx", "dw"), 4,
                              sms=(1, 132, 264))
