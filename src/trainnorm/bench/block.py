"""A Qwen3-style decoder block, for timing trainnorm's norms inside a model compiled whole.

The block (pre-norm, batch-first ``[B, T, hidden]``):

    a = input_norm(x)
    q = q_norm(q_proj(a).view(B, T, heads, head_dim))        per-head RMSNorm over head_dim
    k = k_norm(k_proj(a).view(B, T, kv_heads, head_dim))
    v = v_proj(a).view(B, T, kv_heads, head_dim)
    q, k = rope(q), rope(k)                                   rotary embedding (rotate-half form)
    o = o_proj(causal SDPA(q, k, v) with grouped-query attention)
    h = x + o;  m = post_norm(h)                              (trainnorm: m, h = post_norm(o, residual=x))
    out = h + down_proj(silu(gate_proj(m)) * up_proj(m))

``norm="torch"`` builds it with torch.nn.RMSNorm, ``norm="trainnorm"`` with
trainnorm.RMSNorm (its post-attention norm takes the residual add fused).
Both have the same parameter names, so one state_dict loads into either.
``QWEN3_8B`` is the real size: hidden 4096, 32 query and 8 key/value heads of
128, MLP 12288, eps 1e-6, rope theta 1e6 (Qwen3-8B's configuration).

The bench adapters (``BlockImpl``) time the block's training forward and
the forward with its backward, compiled whole (``torch.compile``, fullgraph)
or eager; gradients are taken with torch.autograd.grad with respect to the
input and every parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

import trainnorm

from .impls import Impl, row_generator
from .shapes import Row

NORMS = ("torch", "trainnorm")


@dataclass(frozen=True)
class BlockConfig:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    eps: float = 1e-6
    rope_theta: float = 1e6

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"BlockConfig.{f.name} must be a number, got {v!r}")
            if f.name in ("eps", "rope_theta"):
                if not (math.isfinite(v) and v > 0):
                    raise ValueError(f"BlockConfig.{f.name} must be finite and > 0, got {v!r}")
            elif not isinstance(v, int) or v < 1:
                raise ValueError(f"BlockConfig.{f.name} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"BlockConfig.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"BlockConfig.head_dim must be even (rotary halves), got {self.head_dim}")


QWEN3_8B = BlockConfig()


def _norm(kind: str, width: int, eps: float, deterministic: bool, device, dtype) -> nn.Module:
    if kind == "torch":
        return nn.RMSNorm(width, eps=eps, device=device, dtype=dtype)
    return trainnorm.RMSNorm(width, eps=eps, deterministic=deterministic, device=device, dtype=dtype)


class DecoderBlock(nn.Module):
    """One pre-norm decoder layer of a Qwen3-style model; ``forward(x, cos, sin)``."""

    def __init__(self, cfg: BlockConfig = QWEN3_8B, norm: str = "torch", *, deterministic: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        self.cfg = cfg
        self.norm = norm

        def lin(n_in, n_out):
            return nn.Linear(n_in, n_out, bias=False, device=device, dtype=dtype)

        def rms(width):
            return _norm(norm, width, cfg.eps, deterministic, device, dtype)

        self.input_norm = rms(cfg.hidden)
        self.q_proj = lin(cfg.hidden, cfg.heads * cfg.head_dim)
        self.k_proj = lin(cfg.hidden, cfg.kv_heads * cfg.head_dim)
        self.v_proj = lin(cfg.hidden, cfg.kv_heads * cfg.head_dim)
        self.q_norm = rms(cfg.head_dim)
        self.k_norm = rms(cfg.head_dim)
        self.o_proj = lin(cfg.heads * cfg.head_dim, cfg.hidden)
        self.post_norm = rms(cfg.hidden)
        self.gate_proj = lin(cfg.hidden, cfg.intermediate)
        self.up_proj = lin(cfg.hidden, cfg.intermediate)
        self.down_proj = lin(cfg.intermediate, cfg.hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        a = self.input_norm(x)
        q = self.q_norm(self.q_proj(a).view(b, t, cfg.heads, cfg.head_dim))
        k = self.k_norm(self.k_proj(a).view(b, t, cfg.kv_heads, cfg.head_dim))
        v = self.v_proj(a).view(b, t, cfg.kv_heads, cfg.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=cfg.heads != cfg.kv_heads)
        o = self.o_proj(o.transpose(1, 2).reshape(b, t, cfg.heads * cfg.head_dim))
        if self.norm == "trainnorm":
            m, h = self.post_norm(o, residual=x)
        else:
            h = x + o
            m = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


def rope_tables(tokens: int, cfg: BlockConfig, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of positions 0..tokens-1, each [tokens, 1, head_dim], computed in float32
    and cast to dtype (what a model computes once per forward and hands to every layer)."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(tokens, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding in its rotate-half form; x is [B, T, heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def build_block(cfg: BlockConfig, norm: str, state: dict | None = None, seed: int = 0, *,
                deterministic: bool = True, device=None, dtype=None) -> DecoderBlock:
    """A block with the parameters of `state` (a state_dict of either norm kind), or, without
    one, seeded ones: projections N(0, 0.02^2), norm weights 1 + 0.1 N(0, 1)."""
    block = DecoderBlock(cfg, norm, deterministic=deterministic, device="meta", dtype=dtype)
    block = block.to_empty(device=device if device is not None else "cpu")
    if state is not None:
        block.load_state_dict(state)
        return block
    with torch.no_grad():
        for i, (name, p) in enumerate(block.named_parameters()):
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
            vals = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.copy_(1.0 + 0.1 * vals if name.endswith("norm.weight") else 0.02 * vals)
    return block


# --- bench rows --------------------------------------------------------------------------------

@dataclass
class BlockData:
    """A block row's inputs, shared (read-only) by every implementation."""

    row: Row
    cfg: BlockConfig
    x: torch.Tensor                  # [1, T, hidden]
    dy: torch.Tensor                 # gradient of the block's output
    cos: torch.Tensor
    sin: torch.Tensor
    state: dict                      # the block's parameters, loaded into every implementation's copy


def make_block_data(row: Row, device, seed: int = 0, cfg: BlockConfig = QWEN3_8B,
                    dtype: torch.dtype = torch.bfloat16) -> BlockData:
    """Standard-normal input and output gradient, and one set of weights per row."""
    if not row.block:
        raise ValueError(f"row {row.id!r} is not a block row")
    if row.hidden != cfg.hidden:
        raise ValueError(f"row {row.id!r} has hidden {row.hidden}, the block config {cfg.hidden}")
    gen = row_generator(row, device, seed)
    x = torch.randn(row.shape, generator=gen, device=device, dtype=dtype)
    dy = torch.randn(row.shape, generator=gen, device=device, dtype=dtype)
    cos, sin = rope_tables(row.tokens, cfg, device=device, dtype=dtype)
    state = build_block(cfg, "torch", seed=seed, device=device, dtype=dtype).state_dict()
    return BlockData(row, cfg, x, dy, cos, sin, state)


class BlockImpl(Impl):
    """The decoder block with one kind of norm, compiled whole or eager.

    - fwd: the training forward (autograd records what the backward needs);
    - step: the forward, then torch.autograd.grad of its output with respect to
      the input and every parameter.
    The backward is not timed alone: Inductor compiles it with donated buffers
    (it overwrites the forward's saved tensors), so it runs once per forward and
    a retained graph cannot replay it. ``backend`` is torch.compile's (Inductor
    by default). No dw check: the norms' dw are checked on their own rows."""

    NAMES = {("trainnorm", True, True): "trainnorm", ("trainnorm", True, False): "trainnorm-fast",
             ("torch", True, True): "torch-compile", ("trainnorm", False, True): "trainnorm-eager",
             ("torch", False, True): "eager"}
    checks_dw = False

    def __init__(self, norm: str, compiled: bool, deterministic: bool = True, backend: str = "inductor"):
        super().__init__()
        key = (norm, compiled, deterministic)
        if key not in self.NAMES:
            raise ValueError(f"no block implementation for norm={norm!r}, compiled={compiled}, "
                             f"deterministic={deterministic}")
        self.norm, self.compiled, self.deterministic, self.backend = norm, compiled, deterministic, backend
        self.name = self.NAMES[key]
        how = f"torch.compile(fullgraph=True, dynamic=False, backend={backend!r})" if compiled else "eager"
        norms = ("trainnorm.RMSNorm" + ("" if deterministic else "(deterministic=False)")
                 if norm == "trainnorm" else "torch.nn.RMSNorm")
        self.description = f"Qwen3-style decoder block with {norms}, {how}"
        self.mod = self.fn = self.x = None

    def version(self):
        return trainnorm.__version__ if self.norm == "trainnorm" else torch.__version__

    def skip_reason(self, row):
        return None if row.block else "not a block row"

    def begin_row(self, d: BlockData):
        mod = build_block(d.cfg, self.norm, d.state, deterministic=self.deterministic, device=d.x.device,
                          dtype=d.x.dtype)
        self.mod = mod
        self.fn = (torch.compile(mod, fullgraph=True, dynamic=False, backend=self.backend,
                                 **_compile_options(self.backend)) if self.compiled else mod)
        self.x = d.x.detach().requires_grad_(True)

    def end_row(self):
        self.mod = self.fn = self.x = None

    def forward(self, d: BlockData):
        return self.fn(self.x, d.cos, d.sin)

    def grads(self, d: BlockData, out):
        """(dx, *parameter gradients) of the output at d.dy."""
        return torch.autograd.grad(out, (self.x, *self.mod.parameters()), d.dy)

    def op_skip_reason(self, op):
        if op == "bwd":
            return "the block's backward is timed with its forward (step): compiled, it runs once per forward"
        return None

    def prepare(self, d, op):
        if op == "fwd":
            return lambda: self.forward(d)
        if op == "step":
            return lambda: self.grads(d, self.forward(d))
        raise ValueError(f"the block times fwd and step, not {op!r}")


def _compile_options(backend: str) -> dict:
    """Inductor's defaults for the block, whatever the norm rows set before in this process
    (their torch.compile peer turns emulate_precision_casts on, a global setting)."""
    import torch._inductor.config as inductor_config
    if backend != "inductor" or not hasattr(inductor_config, "emulate_precision_casts"):
        return {}
    return {"options": {"emulate_precision_casts": False}}


def make_block_impls(backend: str = "inductor") -> list[BlockImpl]:
    """The block's implementations, in the report's order."""
    return [BlockImpl("trainnorm", True, backend=backend), BlockImpl("trainnorm", True, False, backend=backend),
            BlockImpl("torch", True, backend=backend), BlockImpl("trainnorm", False), BlockImpl("torch", False)]
