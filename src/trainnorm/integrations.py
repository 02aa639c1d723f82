"""Hugging Face transformers integration: swap a model's RMSNorm modules for trainnorm's.

``patch_transformers(model)`` replaces, in place, the RMSNorm modules of
Llama-, Qwen2-, Qwen3- and Qwen3-Next-style models (and any other module whose
class name contains ``RMSNorm`` and whose behaviour is recognised).
``patch_transformers_classes(...)`` replaces the classes themselves, before a
model is built (``from_pretrained`` then builds trainnorm's modules).
transformers itself is never imported here: modules are matched by class name
and then classified by a numerical probe of their own forward, so the swap
never changes the math silently.
"""
from __future__ import annotations

import inspect
import sys
import types
import warnings

import torch
from torch import nn

from . import reference
from .functional import _check_flag, rms_norm, rms_norm_gated
from .modules import RMSNorm, RMSNormGated

__all__ = ["patch_transformers", "plan_transformers", "patch_transformers_classes", "unpatch_transformers_classes",
           "OffsetRMSNorm", "OffsetRMSNormGated"]

# Kinds of norm the probe recognises: (gated, norm_before_gate, weight offset)
_KINDS = {
    "rmsnorm": (False, True, 0.0),             # rms_norm(x) * w                   (Llama, Qwen2, Qwen3)
    "rmsnorm_offset": (False, True, 1.0),      # rms_norm(x) * (1 + w)             (Qwen3-Next, Gemma)
    "gated": (True, True, 0.0),                # rms_norm(x) * w * silu(gate)      (Qwen3-Next's gated norm)
    "gated_offset": (True, True, 1.0),         # rms_norm(x) * (1 + w) * silu(gate)
    "gated_after": (True, False, 0.0),         # rms_norm(x * silu(gate)) * w
    "gated_after_offset": (True, False, 1.0),  # rms_norm(x * silu(gate)) * (1 + w)
}

_PROBE_ROWS = 8
_PROBE_RTOL = 1e-4


def _weight_for(weight, x):
    """The weight as the kernels take it: in x's dtype or float32 (a 16-bit
    checkpoint weight under float32 activations is widened, as the models do)."""
    return weight if weight.dtype in (x.dtype, torch.float32) else weight.float()


class OffsetRMSNorm(nn.Module):
    """RMSNorm with ``(1 + weight)`` scaling: ``rms_norm(x) * (1 + weight)``.

    Holds the original ``weight`` parameter (zero-centred, as stored in the
    checkpoint) and calls :func:`trainnorm.rms_norm` with it and
    ``weight_offset=offset``: the kernels add the offset in float32 as they read
    the weight, so there is no extra op and dw is that of ``weight``.
    """

    def __init__(self, weight: nn.Parameter, eps, *, offset: float = 1.0, deterministic: bool = True):
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.offset = offset
        self.deterministic = deterministic
        self.normalized_shape = tuple(weight.shape)

    def forward(self, x):
        return rms_norm(x, _weight_for(self.weight, x), self.eps, deterministic=self.deterministic,
                        weight_offset=self.offset)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, offset={self.offset}, deterministic={self.deterministic}"


class OffsetRMSNormGated(OffsetRMSNorm):
    """Gated form of :class:`OffsetRMSNorm`: ``forward(x, gate)`` with
    ``(1 + weight)`` scaling, through :func:`trainnorm.rms_norm_gated`."""

    def __init__(self, weight: nn.Parameter, eps, *, offset: float = 1.0, norm_before_gate: bool = True,
                 deterministic: bool = True):
        super().__init__(weight, eps, offset=offset, deterministic=deterministic)
        self.norm_before_gate = norm_before_gate

    def forward(self, x, gate):
        return rms_norm_gated(x, gate, _weight_for(self.weight, x), self.eps, norm_before_gate=self.norm_before_gate,
                              deterministic=self.deterministic, weight_offset=self.offset)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", norm_before_gate={self.norm_before_gate}"


# --- matching and probing ------------------------------------------------------------------

def _is_candidate(module: nn.Module) -> bool:
    cls = type(module)
    if cls.__module__.startswith("trainnorm"):
        return False
    return "rmsnorm" in cls.__name__.lower()


def _eps_of(module: nn.Module):
    for name in ("variance_epsilon", "eps"):
        if hasattr(module, name):
            return True, getattr(module, name)
    return False, None


def _forward_arity(module: nn.Module):
    """(required positional inputs, total positional inputs) of module.forward, or None."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    required = [p for p in positional if p.default is p.empty]
    return len(required), len(positional)


def _reference(x, gate, w, eps, kind):
    """float64 value of the recognised kind (``reference.forward_fp64`` with weight w + offset)."""
    gated, before, offset = _KINDS[kind]
    y, _, _ = reference.forward_fp64(x, w.double() + offset, eps, gate=gate if gated else None,
                                     norm_before_gate=before)
    return y


def _classify(module: nn.Module):
    """The kind of `module` (a key of _KINDS), or (None, reason)."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None, "no 1-D `weight` parameter"
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None, f"weight dtype {weight.dtype} is not supported"
    found, eps = _eps_of(module)
    if not found:
        return None, "no `variance_epsilon` or `eps` attribute"
    if eps is not None and not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0):
        return None, f"eps {eps!r} is not a positive number"
    arity = _forward_arity(module)
    if arity is None:
        return None, "forward signature not understood"
    required, total = arity
    if required == 1 and total == 1:
        gated = False
    elif required == 2 and total == 2:
        gated = True
    else:
        return None, f"forward takes {required} required of {total} positional inputs (expected (x) or (x, gate))"

    hidden = weight.shape[0]
    device = weight.device if weight.device.type != "meta" else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(_PROBE_ROWS, hidden, generator=gen).to(device)
    g = torch.randn(_PROBE_ROWS, hidden, generator=gen).to(device)
    w = (torch.rand(hidden, generator=gen) * 2 - 1).to(device)   # values where w and 1 + w differ clearly
    probe_eps = float(torch.finfo(torch.float32).eps) if eps is None else float(eps)
    try:
        with torch.no_grad():
            out = torch.func.functional_call(module, {"weight": w}, (x, g) if gated else (x,))
    except Exception as exc:  # noqa: BLE001 - any failure means: leave it alone
        return None, f"probe forward raised {type(exc).__name__}: {exc}"
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None, "probe forward did not return a tensor of the input's shape"
    out = out.detach().double().cpu()
    for kind, (k_gated, _, _) in _KINDS.items():
        if k_gated != gated:
            continue
        ref = _reference(x.cpu(), g.cpu(), w.cpu(), probe_eps, kind)
        if torch.allclose(out, ref, rtol=_PROBE_RTOL, atol=_PROBE_RTOL * float(ref.abs().max())):
            return kind, None
    return None, "output matches none of rms_norm(x)*w, rms_norm(x)*(1+w) (or their gated forms)"


def _replacement(module: nn.Module, kind: str, deterministic: bool) -> nn.Module:
    gated, before, offset = _KINDS[kind]
    _, eps = _eps_of(module)
    weight = module.weight
    if offset:
        if gated:
            new = OffsetRMSNormGated(weight, eps, offset=offset, norm_before_gate=before, deterministic=deterministic)
        else:
            new = OffsetRMSNorm(weight, eps, offset=offset, deterministic=deterministic)
    else:
        if gated:
            new = RMSNormGated(weight.shape[0], eps, norm_before_gate=before, device="meta", dtype=weight.dtype,
                               deterministic=deterministic)
        else:
            new = RMSNorm(weight.shape[0], eps, device="meta", dtype=weight.dtype, deterministic=deterministic)
        new.weight = weight                     # the same Parameter: optimizers and tied references keep working
    new.train(module.training)
    return new


def plan_transformers(model: nn.Module) -> dict[str, str]:
    """What :func:`patch_transformers` would do, without changing anything.

    Returns ``{qualified module name: kind}`` for every candidate module (class
    name containing ``RMSNorm``), where kind is one of ``"rmsnorm"``,
    ``"rmsnorm_offset"``, ``"gated"``, ``"gated_offset"``, ``"gated_after"``,
    ``"gated_after_offset"``, or ``"skip: <reason>"`` for a module that would be
    left untouched.
    """
    plan: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or not _is_candidate(module):
            continue
        if id(module) in seen:                  # a shared module: classify once
            plan[name] = seen[id(module)]
            continue
        kind, reason = _classify(module)
        plan[name] = seen[id(module)] = kind if kind is not None else f"skip: {reason}"
    return plan


def patch_transformers(model: nn.Module, *, deterministic: bool = True) -> int:
    """Replace, in place, the RMSNorm modules of a transformers model with trainnorm's.

    Each module whose class name contains ``RMSNorm`` (``LlamaRMSNorm``,
    ``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``Qwen3NextRMSNorm``,
    ``Qwen3NextRMSNormGated``, ``GemmaRMSNorm``, ...) is classified by running
    its own forward on a small random float32 input with a probe weight, and
    comparing the output with each form trainnorm computes:

    * ``rms_norm(x) * w`` (Llama, Qwen2, Qwen3) -> :class:`trainnorm.RMSNorm`;
    * ``rms_norm(x) * w * silu(gate)`` (Qwen3-Next's gated norm) ->
      :class:`trainnorm.RMSNormGated` (``rms_norm(x * silu(gate)) * w`` with
      ``norm_before_gate=False``);
    * ``rms_norm(x) * (1 + w)`` (Qwen3-Next's ``Qwen3NextRMSNorm``, Gemma) ->
      :class:`OffsetRMSNorm`, which keeps the zero-centred weight and calls
      :func:`trainnorm.rms_norm` with ``1 + w`` in float32 (and its gated form
      :class:`OffsetRMSNormGated`).

    A candidate that matches none of these (or whose forward does not take
    ``(x)`` or ``(x, gate)``, or has no ``variance_epsilon`` / ``eps``) is left
    untouched and named in a ``UserWarning``; see :func:`plan_transformers`.

    The replacement holds the very same ``weight`` Parameter (same dtype,
    device, storage; optimizers built before the patch keep working), the same
    eps and training flag, and is called the way the parent calls the original
    (``norm(x)`` or ``norm(x, gate)``, positionally). state_dict keys do not
    change. Hooks registered on the original modules are not carried over.

    Numerics: HF's Llama-style norm computes ``x * rstd`` in float32, rounds it
    to the input dtype, then multiplies by the weight in the weight's dtype
    (two roundings; with a float32 weight and bf16 input its output is float32).
    Qwen3-Next / Gemma norms compute ``x * rstd * (1 + w)`` in float32 and
    round once; Qwen3-Next's gated norm rounds after the normalisation and
    after the weight, then multiplies by ``silu(gate)`` in float32. trainnorm
    evaluates each form in higher precision and rounds once to the input dtype,
    so the results agree to about one rounding of the input dtype (exactly the
    same function, not the same bits), and the output dtype is always the input
    dtype. trainnorm accepts a weight in the input dtype or float32: a bf16
    model fed float32 activations raises a TypeError after the patch.

    Returns the number of modules swapped (a module shared by several parents
    counts once).
    """
    deterministic = _check_flag("deterministic", deterministic)
    plan = plan_transformers(model)
    replaced: dict[int, tuple[nn.Module, nn.Module]] = {}   # id(original) -> (original, replacement)
    skipped = []
    for name, kind in plan.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, attr)
        if kind.startswith("skip"):
            skipped.append(f"{name} ({type(module).__name__}): {kind[6:]}")
            continue
        if id(module) not in replaced:
            replaced[id(module)] = (module, _replacement(module, kind, deterministic))
        setattr(parent, attr, replaced[id(module)][1])
    if skipped:
        warnings.warn("trainnorm.patch_transformers left these modules untouched: " + "; ".join(skipped),
                      UserWarning, stacklevel=2)
    return len(replaced)


# --- patching classes, before a model is built ----------------------------------------------

_PROBE_HIDDEN = 32


def _namespaces(targets) -> list[types.ModuleType]:
    out = []
    for t in targets:
        if isinstance(t, types.ModuleType):
            mod = t
        elif isinstance(t, type):
            mod = sys.modules.get(t.__module__)
            if mod is None:
                raise ValueError(f"targets: the module {t.__module__!r} of {t.__qualname__} is not imported")
        else:
            raise TypeError("targets must be Python modules (e.g. transformers.models.llama.modeling_llama) or "
                            f"classes defined in them (e.g. LlamaForCausalLM), got {type(t).__name__}")
        if mod not in out:
            out.append(mod)
    return out


def _norm_classes(mod: types.ModuleType):
    """(attribute name, class) of the module's RMSNorm classes, patched ones included."""
    for name, value in sorted(vars(mod).items()):
        if (isinstance(value, type) and issubclass(value, nn.Module) and "rmsnorm" in name.lower()
                and (not value.__module__.startswith("trainnorm") or hasattr(value, "_trainnorm_original"))):
            yield name, value


def _classify_class(cls: type):
    """(kind, None) or (None, reason), from an instance built with the class's own constructor."""
    try:
        with torch.device("cpu"):
            probe = cls(_PROBE_HIDDEN)
    except Exception as exc:  # noqa: BLE001 - a constructor that wants more than (hidden_size): leave it alone
        return None, f"{cls.__name__}({_PROBE_HIDDEN}) raised {type(exc).__name__}: {exc}"
    return _classify(probe)


def _patched_class(original: type, kind: str, deterministic: bool, base: type) -> type:
    """A subclass of trainnorm's module `base`, named like `original` and built
    with its constructor: the original is built (its own parameter
    initialisation, dtype and device), then turned into trainnorm's module
    holding the same weight Parameter and eps, as patch_transformers does."""

    def __init__(self, *args, **kwargs):
        built = _replacement(original(*args, **kwargs), kind, deterministic)
        # this object takes over the state of the module just built, an instance of `base`
        self.__dict__.update(built.__dict__)

    return type(original.__name__, (base,), {
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": original.__qualname__,
        "__doc__": f"trainnorm's {base.__name__} in place of {original.__module__}.{original.__qualname__} "
                   f"(built with its constructor; kind {kind!r}).",
        "_trainnorm_original": original,
        "_trainnorm_kind": kind,
    })


def patch_transformers_classes(*targets, deterministic: bool = True) -> dict[str, str]:
    """Replace the RMSNorm classes of transformers models with trainnorm's, before
    the models are built, so that ``from_pretrained`` (or any construction)
    builds trainnorm's modules directly.

    ``targets``: modeling modules (``transformers.models.llama.modeling_llama``)
    or classes defined in them (``LlamaForCausalLM``: its module is patched).
    Each class in such a module whose name contains ``RMSNorm`` is built once
    with its own constructor at a probe width of 32, and classified as
    :func:`patch_transformers` classifies modules; a recognised class is
    replaced, in that module's namespace, by a subclass of trainnorm's
    replacement (``trainnorm.RMSNorm``, ``RMSNormGated``, ``OffsetRMSNorm``,
    ``OffsetRMSNormGated``) that keeps the original's name and constructor:
    each instance builds the original (its parameter initialisation, dtype
    and device) and takes its weight Parameter and eps. The model code looks
    the class up in that namespace when it builds a layer, so models built
    afterwards hold trainnorm's modules, with the same state_dict keys.
    Models built before are unchanged (use :func:`patch_transformers` on
    them). Unrecognised classes are left alone and named in a UserWarning.
    Instances pickle by class name, so pickle a patched model's state_dict,
    not the model.

    Returns ``{"module.ClassName": kind}`` for every candidate, with
    ``"skip: <reason>"`` for those left alone (``"patched: <kind>"`` for a
    class patched before). Undo with :func:`unpatch_transformers_classes`.
    """
    deterministic = _check_flag("deterministic", deterministic)
    result: dict[str, str] = {}
    skipped = []
    for mod in _namespaces(targets):
        for name, cls in _norm_classes(mod):
            key = f"{mod.__name__}.{name}"
            if hasattr(cls, "_trainnorm_original"):
                result[key] = f"patched: {cls._trainnorm_kind}"
                continue
            kind, reason = _classify_class(cls)
            if kind is None:
                result[key] = f"skip: {reason}"
                skipped.append(f"{key}: {reason}")
                continue
            with torch.device("cpu"):
                base = type(_replacement(cls(_PROBE_HIDDEN), kind, deterministic))
            setattr(mod, name, _patched_class(cls, kind, deterministic, base))
            result[key] = kind
    if skipped:
        warnings.warn("trainnorm.patch_transformers_classes left these classes untouched: " + "; ".join(skipped),
                      UserWarning, stacklevel=2)
    return result


def unpatch_transformers_classes(*targets) -> int:
    """Put back the classes that :func:`patch_transformers_classes` replaced in
    the targets' modules; returns how many. Modules already built keep their class."""
    n = 0
    for mod in _namespaces(targets):
        for name, cls in list(_norm_classes(mod)):
            original = getattr(cls, "_trainnorm_original", None)
            if original is not None:
                setattr(mod, name, original)
                n += 1
    return n
