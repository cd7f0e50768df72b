"""The Transformer's parts (batch first, padded tensors): masks from ids, sinusoidal positions, attention,
feed-forward and the encoder and decoder layers that nmt.model stacks. Plain PyTorch: the CPU fast paths of
nmt.kernels swap modules in from outside and appear in no signature here.
Shapes: B batch, S source, T target, D model, H heads, Dh head width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nmt.config import ModelConfig

if TYPE_CHECKING:  # annotations only: nmt.model builds on these layers
    from nmt.model import SelfKV


def key_attend(src_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, 1, 1, S) bool, True where attention to that key is allowed: the one place where padding becomes an
    attention mask. Always a mask, never a look at the ids from the host (that would stall a GPU each batch)."""
    return src_ids.ne(pad_id)[:, None, None, :]


def causal_attend(new: int, past: int, device: torch.device) -> torch.Tensor:
    """(new, past + new) bool, True where attention is allowed: every cached key, and new keys up to itself."""
    return torch.ones(new, past + new, dtype=torch.bool, device=device).tril(diagonal=past)


def sinusoids(length: int, dim: int, layout: str = "interleaved") -> torch.Tensor:
    """(length, dim) sinusoidal position table of Vaswani et al.: sin and cos interleaved (nmt's own layout),
    or as transformers' models lay it out: "halves" (Marian, Pegasus: the same frequencies, all sines then all
    cosines, computed in float64) or "m2m100" (M2M100, NLLB: frequencies 10000^(-i/(dim/2-1)), positions from 2)."""
    if layout == "halves":
        pos = torch.arange(length, dtype=torch.float64)[:, None]
        angle = pos / torch.pow(10000.0, torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (length, dim/2)
        return torch.cat([angle.sin(), angle.cos()], 1)[:, :dim].float()
    if layout == "m2m100":
        half = dim // 2
        freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
        angle = torch.arange(2, length + 2, dtype=torch.int64).float()[:, None] * freq[None]
        table = torch.cat([angle.sin(), angle.cos()], 1)
        return torch.cat([table, torch.zeros(length, dim % 2)], 1) if dim % 2 else table
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)
    return table


class Linear(nn.Linear):
    """nn.Linear, optionally with bias slots held at zero (`zero_bias`, True there).

    The layers call their projections as modules, never their weights directly, so a module that wraps one
    (a LoRA adapter, `nmt.adapters`, keeps it as its base layer and adds its low-rank term) takes part.
    """

    def __init__(self, d_in: int, d_out: int, zero_bias: torch.Tensor | None = None):
        super().__init__(d_in, d_out)
        self.register_buffer("zero_bias", zero_bias, persistent=False)

    def effective_bias(self) -> torch.Tensor:
        """The bias as the product uses it: zero in the `zero_bias` slots."""
        return self.bias if self.zero_bias is None else self.bias.masked_fill(self.zero_bias, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.effective_bias())


class Attention(nn.Module):
    """Multi-head attention through SDPA; fused QKV for self-attention, fused KV for cross-attention."""

    def __init__(self, cfg: ModelConfig, cross: bool):
        super().__init__()
        self.n_heads, self.dropout, self.cross = cfg.n_heads, cfg.dropout_at("attention"), cross
        d = cfg.d_model
        # The key bias adds the same score to every key of a query: softmax cancels it, its gradient is 0
        # up to rounding, and Adam would turn that rounding noise into +-lr updates (so runs split over
        # processes would drift apart). It is masked to stay exactly zero.
        key = torch.zeros((2 if cross else 3) * d, dtype=torch.bool)
        key[(0 if cross else d): (d if cross else 2 * d)] = True
        if cross:
            self.q = Linear(d, d)
            self.kv = Linear(d, 2 * d, zero_bias=key)
        else:
            self.qkv = Linear(d, 3 * d, zero_bias=key)
        self.out = Linear(d, d)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        return x.view(B, L, self.n_heads, D // self.n_heads).transpose(1, 2)  # (B, H, L, Dh)

    def project_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of the encoder output (B, S, D): computed once per sentence."""
        k, v = self.kv(memory).chunk(2, dim=-1)
        return self.heads(k), self.heads(v)

    def forward(self, x: torch.Tensor, attend: torch.Tensor | None = None, causal: bool = False,
                kv: SelfKV | tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (B, L, D) -> (B, L, D).

        Self-attention appends its new keys and values to `kv` (a `SelfKV`, the cache of earlier steps) when
        given; cross-attention uses `kv`, the memory's (K, V) (B', H, S, Dh) each, as is.
        """
        if self.cross:
            q, (k, v) = self.heads(self.q(x)), kv
        else:
            q, k, v = map(self.heads, self.qkv(x).chunk(3, dim=-1))
            if kv is not None:
                k, v = kv.extend(k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        B, H, L, Dh = y.shape
        return self.out(y.transpose(1, 2).reshape(B, L, H * Dh))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up, self.down = Linear(cfg.d_model, cfg.d_ff), Linear(cfg.d_ff, cfg.d_model)
        self.act = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}[cfg.activation]()
        self.drop = nn.Dropout(cfg.dropout_at("activation"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(self.act(self.up(x))))


class Residual(nn.Module):
    """The residual around a sublayer: pre-norm x + f(LN(x)), or post-norm LN(x + f(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm, self.drop, self.pre_norm = nn.LayerNorm(cfg.d_model), nn.Dropout(cfg.dropout), cfg.pre_norm

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        """What the sublayer sees: the normed x (pre-norm) or x itself."""
        return self.norm(x) if self.pre_norm else x

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x plus the sublayer's output y (dropped out), normed after (post-norm)."""
        x = x + self.drop(y)
        return x if self.pre_norm else self.norm(x)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn, self.ff = Attention(cfg, cross=False), FeedForward(cfg)
        self.sub_attn, self.sub_ff = Residual(cfg), Residual(cfg)

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """x (B, S, D), attend (B, 1, 1, S) -> (B, S, D)."""
        x = self.sub_attn.add(x, self.attn(self.sub_attn.inner(x), attend=attend))
        return self.sub_ff.add(x, self.ff(self.sub_ff.inner(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(cfg, cross=False), Attention(cfg, cross=True)
        self.ff = FeedForward(cfg)
        self.sub_self, self.sub_cross, self.sub_ff = Residual(cfg), Residual(cfg), Residual(cfg)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | tuple, attend: torch.Tensor,
                self_kv: SelfKV | None = None, group: int = 1) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D). memory: the encoder output (B, S, D), or its cross-attention (K, V) from a
        cache; attend (B, 1, 1, S) its padding. `self_kv`: the cache of earlier steps (x holds only the new
        positions then). With `group` > 1, memory and `attend` hold one sentence per `group` consecutive rows of x
        (beams sharing a source), B / group of them.

        Projecting the memory here, inside forward, matters under FSDP: a wrapped layer's weights are
        gathered only while its forward runs.
        """
        cross_kv = self.cross_kv(memory) if isinstance(memory, torch.Tensor) else memory
        # causality is a property of the decoder: full-prefix runs use is_causal; a cached call with several new
        # positions needs a mask aligned to the end (is_causal aligns to the start). Right padding needs no
        # target mask: real positions only ever look left, at real tokens.
        first = self_kv is None or self_kv.k is None  # nothing cached yet: a plain causal run over x
        new = x.shape[1]
        self_attend = None if first or new == 1 else causal_attend(new, self_kv.length, x.device)
        h = self.self_attn(self.sub_self.inner(x), attend=self_attend, causal=first, kv=self_kv)
        x = self.sub_self.add(x, h)
        x = self.sub_cross.add(x, self.attend_memory(self.sub_cross.inner(x), cross_kv, attend, group))
        return self.sub_ff.add(x, self.ff(self.sub_ff.inner(x)))

    def attend_memory(self, h: torch.Tensor, cross_kv: tuple, attend: torch.Tensor, group: int) -> torch.Tensor:
        """Cross-attention; a sentence's `group` rows (B, T, D) are attended as one row of group * T queries."""
        if group == 1:
            return self.cross_attn(h, attend=attend, kv=cross_kv)
        B, T, D = h.shape
        return self.cross_attn(h.reshape(B // group, group * T, D), attend=attend, kv=cross_kv).view(B, T, D)

    def cross_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention (K, V) of the encoder output (B, S, D) for this layer (a cache's start)."""
        return self.cross_attn.project_kv(memory)
