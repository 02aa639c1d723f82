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
