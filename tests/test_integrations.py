"""trainnorm.integrations: swapping the RMSNorm modules of Hugging Face transformers models.

Tiny models are built from configs with random weights (no downloads) and run
in float32 on the CPU reference path (TRITON_INTERPRET=0, so they stay fast),
before and after the patch.
"""
import subprocess
import sys

import pytest
import torch
from torch import nn

import trainnorm
from trainnorm.integrations import OffsetRMSNorm, OffsetRMSNormGated, patch_transformers, plan_transformers

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128)

# (config class, model class, extra config, expected {kind: count}); 2 layers each
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {"rmsnorm": 5}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, {"rmsnorm": 5}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), {"rmsnorm": 9}),   # + q_norm, k_norm
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"]),
                   {"gated": 1, "rmsnorm_offset": 7}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16), {"rmsnorm_offset": 5}),
}

REPLACEMENT = {"rmsnorm": trainnorm.RMSNorm, "gated": trainnorm.RMSNormGated,
               "rmsnorm_offset": OffsetRMSNorm, "gated_offset": OffsetRMSNormGated}


@pytest.fixture
def reference_path(monkeypatch):
    # CPU tensors take trainnorm's float64 reference path, not Triton's interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def hf():
    return pytest.importorskip("transformers")


def _build(hf, key, dtype=torch.float32):
    cfg_name, model_name, extra, expected = MODELS[key]
    if not hasattr(hf, cfg_name) or not hasattr(hf, model_name):
        pytest.skip(f"transformers {hf.__version__} has no {model_name}")
    torch.manual_seed(0)
    config = getattr(hf, cfg_name)(**COMMON, **extra)
    config._attn_implementation = "eager"
    model = getattr(hf, model_name)(config).to(dtype).eval()
    # random norm weights (HF initialises them to ones or zeros), around the value each form expects
    with torch.no_grad():
        for name, kind in plan_transformers(model).items():
            w = model.get_submodule(name).weight
            w.uniform_(-0.5, 0.5)
            if "offset" not in kind:
                w.add_(1.0)
    return model, expected


def _hf_norms(model):
    return {n: m for n, m in model.named_modules()
            if type(m).__module__.startswith("transformers") and "rmsnorm" in type(m).__name__.lower()}


def _step(model, input_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().clone(), grads


@pytest.mark.parametrize("key", list(MODELS))
def test_patch_matches_hf(hf, reference_path, key):
    """Count and kinds of swapped modules, no HF RMSNorm left, same Parameters and
    state_dict keys, eps kept, and float32 logits and gradients as before."""
    model, expected = _build(hf, key)
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    norms = _hf_norms(model)
    assert len(norms) == sum(expected.values())
    plan = plan_transformers(model)
    assert sorted(plan) == sorted(norms)
    assert {k: list(plan.values()).count(k) for k in set(plan.values())} == expected
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    eps = {n: getattr(m, "variance_epsilon", getattr(m, "eps", None)) for n, m in norms.items()}
    logits0, grads0 = _step(model, input_ids)

    assert patch_transformers(model) == sum(expected.values())

    assert not _hf_norms(model), "HF RMSNorm modules left"
    for name, kind in plan.items():
        new = model.get_submodule(name)
        assert type(new) is REPLACEMENT[kind], name
        assert new.eps == eps[name] and new.deterministic is True
        assert new.weight is params[f"{name}.weight"], f"{name}: not the same Parameter"
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is params[n] for n in params)
    assert list(model.state_dict()) == keys

    logits1, grads1 = _step(model, input_ids)
    torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5)
    assert grads1.keys() == grads0.keys()
    for name in plan:   # the norm weights' gradients
        n = f"{name}.weight"
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    for n in grads0:    # and every other gradient
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")

    assert patch_transformers(model) == 0   # nothing left to swap


@pytest.mark.parametrize("key", ["llama", "qwen3_next"])
def test_bf16_model_agrees_to_one_rounding(hf, reference_path, key):
    """A bf16 model: the weights stay bf16 and each swapped norm's output is
    within two bf16 roundings (HF rounds twice, trainnorm once) of HF's."""
    model, _ = _build(hf, key, torch.bfloat16)
    originals = dict(_hf_norms(model))
    assert patch_transformers(model, deterministic=False) == len(originals)
    gen = torch.Generator().manual_seed(2)
    for name, old in originals.items():
        new = model.get_submodule(name)
        assert new.weight.dtype == torch.bfloat16 and new.deterministic is False
        x = torch.randn(3, 5, old.weight.shape[0], generator=gen).to(torch.bfloat16)
        args = (x, torch.randn(x.shape, generator=gen).to(torch.bfloat16)) if isinstance(
            new, (trainnorm.RMSNormGated, OffsetRMSNormGated)) else (x,)
        with torch.no_grad():
            ref, out = old(*args), new(*args)
        assert out.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=1e-6, msg=lambda m: f"{name}: {m}")


# --- matching by behaviour, no transformers needed -------------------------------------------

class PlainRMSNorm(nn.Module):
    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h) + 0.5)
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        v = hidden_states.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states.float() * torch.rsqrt(v + self.variance_epsilon)).to(hidden_states.dtype)


class OddRMSNorm(PlainRMSNorm):
    """Named like a norm, but does something else: must be left alone."""

    def forward(self, hidden_states):
        return hidden_states * self.weight


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = PlainRMSNorm(32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), self.shared) for _ in range(2)])
        self.odd = OddRMSNorm(32)
        self.final = PlainRMSNorm(32, eps=1e-6)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.final(self.odd(x))


def test_behaviour_match_shared_and_unknown(reference_path):
    """A shared norm is swapped once (both places hold the one replacement), an
    unrecognised one is left untouched with a warning naming it."""
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 32)
    ref = net(x).detach()
    assert plan_transformers(net)["odd"].startswith("skip:")
    with pytest.warns(UserWarning, match=r"odd \(OddRMSNorm\)"):
        assert patch_transformers(net) == 2
    assert type(net.odd) is OddRMSNorm
    assert isinstance(net.final, trainnorm.RMSNorm) and net.final.eps == 1e-6
    assert net.blocks[0][1] is net.blocks[1][1] is net.shared and isinstance(net.shared, trainnorm.RMSNorm)
    torch.testing.assert_close(net(x), ref, rtol=1e-5, atol=1e-6)


def test_import_does_not_import_transformers():
    code = ("import sys, trainnorm, trainnorm.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- patching classes before a model is built (from_pretrained) ------------------------------

from trainnorm.integrations import patch_transformers_classes, unpatch_transformers_classes  # noqa: E402


@pytest.fixture
def patch_classes():
    """patch_transformers_classes, undone at the end of the test."""
    targets = []

    def patch(*t, **kw):
        targets.extend(t)
        return patch_transformers_classes(*t, **kw)
    yield patch
    unpatch_transformers_classes(*targets)


def _config(hf, key):
    cfg_name, model_name, extra, expected = MODELS[key]
    if not hasattr(hf, cfg_name) or not hasattr(hf, model_name):
        pytest.skip(f"transformers {hf.__version__} has no {model_name}")
    config = getattr(hf, cfg_name)(**COMMON, **extra)
    config._attn_implementation = "eager"
    return config, getattr(hf, model_name), expected


def _kinds_of(model):
    found = {}
    for m in model.modules():
        kind = getattr(type(m), "_trainnorm_kind", None)
        if kind is not None:
            found[kind] = found.get(kind, 0) + 1
    return found


def _reference_model(model_cls, config):
    """An unpatched model whose norms hold random weights around their identity value."""
    torch.manual_seed(0)
    ref = model_cls(config).eval()
    with torch.no_grad():
        for name, kind in plan_transformers(ref).items():
            ref.get_submodule(name).weight.uniform_(-0.5, 0.5).add_(0.0 if "offset" in kind else 1.0)
    return ref


@pytest.mark.parametrize("key", list(MODELS))
def test_patch_classes_builds_trainnorm_modules(hf, reference_path, patch_classes, key):
    """Models built after patching their classes hold trainnorm's modules (the kinds and
    counts patch_transformers finds), take an unpatched model's state_dict strictly, and
    give its logits and gradients; HF's own weight initialisation still reaches them."""
    config, model_cls, expected = _config(hf, key)
    ref = _reference_model(model_cls, config)

    result = patch_classes(model_cls)
    assert sorted(result.values()) == sorted(expected), result    # one class per kind in these models
    assert all(k.startswith(model_cls.__module__ + ".") for k in result)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    assert not _hf_norms(model), "HF RMSNorm modules left"
    assert _kinds_of(model) == expected
    for name, kind in plan_transformers(ref).items():
        new, old = model.get_submodule(name), ref.get_submodule(name)
        assert isinstance(new, REPLACEMENT[kind]) and type(new).__name__ == type(old).__name__
        # HF initialises norms by class name: ones, or zeros for (1 + w) norms
        assert torch.equal(new.weight, torch.full_like(new.weight, 0.0 if "offset" in kind else 1.0)), name
        assert new.eps == getattr(old, "variance_epsilon", getattr(old, "eps", None))
    assert list(model.state_dict()) == list(ref.state_dict())
    model.load_state_dict(ref.state_dict(), strict=True)

    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    logits0, grads0 = _step(ref, input_ids)
    logits1, grads1 = _step(model, input_ids)
    torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5)
    assert grads1.keys() == grads0.keys()
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("key", ["llama", "qwen3_next"])
def test_patch_classes_then_from_pretrained(hf, reference_path, patch_classes, tmp_path, key):
    config, model_cls, expected = _config(hf, key)
    ref = _reference_model(model_cls, config)
    ref.save_pretrained(tmp_path)
    patch_classes(model_cls)
    model = model_cls.from_pretrained(tmp_path).eval()
    assert not _hf_norms(model) and _kinds_of(model) == expected
    theirs = ref.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, theirs[k]), k
    input_ids = torch.randint(0, COMMON["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, ref(input_ids=input_ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_patch_classes_undo_and_repeat(hf, reference_path, patch_classes):
    import copy

    from transformers.models.llama import modeling_llama
    config, model_cls, _ = _config(hf, "llama")
    original = modeling_llama.LlamaRMSNorm
    first = patch_classes(modeling_llama, deterministic=False)
    assert first == {"transformers.models.llama.modeling_llama.LlamaRMSNorm": "rmsnorm"}
    assert patch_classes(model_cls) == {"transformers.models.llama.modeling_llama.LlamaRMSNorm": "patched: rmsnorm"}
    model = model_cls(config)
    norm = model.model.norm
    assert type(norm) is modeling_llama.LlamaRMSNorm and isinstance(norm, torch.nn.RMSNorm)
    assert norm.deterministic is False
    twin = copy.deepcopy(model)          # a copy builds nothing: the class is only looked up
    assert type(twin.model.norm) is type(norm) and twin.model.norm.weight is not norm.weight
    assert unpatch_transformers_classes(modeling_llama) == 1
    assert modeling_llama.LlamaRMSNorm is original
    assert type(model_cls(config).model.norm) is original
    assert type(model.model.norm).__module__ == "trainnorm.integrations"   # built while patched: kept
    with pytest.raises(TypeError, match="targets must be Python modules"):
        patch_transformers_classes("llama")


# the class patch without transformers: a modeling module of its own, whose model looks its
# norm classes up in the module's namespace when it is built, as transformers' models do
TOY_MODELING = '''
import torch
from torch import nn


class ToyRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype)


class ToyWideRMSNorm(nn.Module):
    """A constructor that needs more than the width: left alone."""

    def __init__(self, hidden_size, groups, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return x * self.weight


class ToyModel(nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.up = nn.Linear(h, h)
        self.norm = ToyRMSNorm(h, eps=1e-5)
        self.final = ToyRMSNorm(h)
        self.wide = ToyWideRMSNorm(h, 2)

    def forward(self, x):
        return self.wide(self.final(self.norm(self.up(x))))
'''


@pytest.fixture
def toy_modeling():
    import types
    mod = types.ModuleType("toy_modeling")
    exec(compile(TOY_MODELING, "toy_modeling.py", "exec"), mod.__dict__)
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_patch_classes_without_transformers(reference_path, toy_modeling):
    torch.manual_seed(0)
    ref = toy_modeling.ToyModel()
    with torch.no_grad():
        ref.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 32)
    with pytest.warns(UserWarning, match=r"toy_modeling\.ToyWideRMSNorm: ToyWideRMSNorm\(32\) raised TypeError"):
        result = patch_transformers_classes(toy_modeling.ToyModel)   # a class: its module is patched
    assert result == {"toy_modeling.ToyRMSNorm": "rmsnorm", "toy_modeling.ToyWideRMSNorm": result[
        "toy_modeling.ToyWideRMSNorm"]} and result["toy_modeling.ToyWideRMSNorm"].startswith("skip:")
    try:
        model = toy_modeling.ToyModel()
        assert isinstance(model.norm, trainnorm.RMSNorm) and isinstance(model.final, trainnorm.RMSNorm)
        assert type(model.norm).__name__ == "ToyRMSNorm" and type(model.wide).__name__ == "ToyWideRMSNorm"
        assert model.norm.eps == 1e-5 and model.final.eps == 1e-6
        assert isinstance(model.norm.weight, nn.Parameter) and "weight" in dict(model.norm.named_parameters())
        model.load_state_dict(ref.state_dict(), strict=True)
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)
    finally:
        assert unpatch_transformers_classes(toy_modeling) == 1
    assert type(toy_modeling.ToyModel().norm) is toy_modeling.ToyRMSNorm


def test_offset_norm_widens_a_16bit_weight_under_float32_activations():
    # a bf16 checkpoint weight beside float32 activations (the models compute the norm in
    # float32): the weight is widened, as the models do, and (1 + w) is taken in the kernels
    from trainnorm import reference
    w = torch.nn.Parameter((0.1 * torch.randn(32)).to(torch.bfloat16))
    x = torch.randn(5, 32)
    y = OffsetRMSNorm(w, 1e-6)(x)
    y64, _, _ = reference.forward_fp64(x, w.float(), 1e-6, weight_offset=1.0)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        trainnorm.rms_norm(x, w, 1e-6, weight_offset=1.0)      # the public function does not widen
