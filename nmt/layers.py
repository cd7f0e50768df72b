"""The Transformer's parts (batch first): masks from ids, sinusoidal positions, packing of real tokens,
attention, feed-forward and the encoder and decoder layers that nmt.model stacks.
Shapes: B batch, S source, T target, D model, H heads, Dh head width, N real (unpadded) tokens.
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


def key_attend(src_ids: torch.Tensor, pad_id: int) -> torch.Tensor | None:
    """(B, 1, 1, S) bool, True where attention to that key is allowed; None when nothing is padding.

    The one place where padding becomes an attention mask.
    """
    src_is_pad = src_ids.eq(pad_id)  # (B, S)
    if not torch.compiler.is_compiling() and not bool(src_is_pad.any()):
        return None  # no mask lets SDPA use its fastest kernel (a compiled graph keeps the mask: no break)
    return ~src_is_pad[:, None, None, :]


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


class Packing:
    """The real (non-pad) positions of a right-padded (B, L) id batch, N of them.

    Position-wise work (norms, projections, feed-forward, dropout, the output projection) runs on the N real
    tokens only, packed as (N, ...); attention unpacks to (B, L, ...), zeros at padding. Padding costs no
    matmul then, which on a CPU is nearly all the time. Without padding both are views.
    """

    def __init__(self, ids: torch.Tensor, pad_id: int, first_real: bool = False):
        self.B, self.L = ids.shape
        self.real = ids.ne(pad_id)  # (B, L)
        if first_real:  # a decoder start that is the pad id (Marian's) is a real position
            self.real[:, :1] = True
        real = self.real.flatten()  # (B*L,)
        # compiled graphs keep the padding: a data-dependent N would break them
        unpacked = torch.compiler.is_compiling() or bool(real.all())
        self.index = None if unpacked else real.nonzero().squeeze(1)  # (N,) rows of the flattened batch

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (N, ...)."""
        x = x.flatten(0, 1)
        return x if self.index is None else x.index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (B, L, ...), zeros at padding."""
        if self.index is not None:
            x = x.new_zeros(self.B * self.L, *x.shape[1:]).index_copy(0, self.index, x)
        return x.unflatten(0, (self.B, self.L))


class Linear(nn.Linear):
    """nn.Linear, optionally with bias slots held at zero (`zero_bias`, True there); through a packed oneDNN weight
    where `nmt.kernels.use_cpu_kernels` gives it a `packed_linear` (CPU inference), else `F.linear`.

    The layers call their projections as modules, never their weights directly, so a module that wraps one
    (a LoRA adapter, `nmt.adapters`, keeps it as its base layer and adds its low-rank term) takes part.
    """

    packed_linear = None  # a nmt.kernels.PackedLinear once a model opts in (use_cpu_kernels)

    def __init__(self, d_in: int, d_out: int, zero_bias: torch.Tensor | None = None):
        super().__init__(d_in, d_out)
        self.register_buffer("zero_bias", zero_bias, persistent=False)

    def effective_bias(self) -> torch.Tensor:
        """The bias as the product uses it: zero in the `zero_bias` slots."""
        return self.bias if self.zero_bias is None else self.bias.masked_fill(self.zero_bias, 0.0)

    def forward(self, x: torch.Tensor, relu: bool = False) -> torch.Tensor:
        bias = self.effective_bias()
        if self.packed_linear is not None:
            return self.packed_linear(x, self.weight, bias, relu)
        y = F.linear(x, self.weight, bias)
        return F.relu(y) if relu else y


class Attention(nn.Module):
    """Multi-head attention through SDPA; fused QKV for self-attention, fused KV for cross-attention."""

    def __init__(self, cfg: ModelConfig, cross: bool):
        super().__init__()
        self.n_heads, self.dropout, self.cross = cfg.n_heads, cfg.dropout, cross
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

    def project_kv(self, memory: torch.Tensor, packing: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of the encoder output (B, S, D), or (N, D) packed by `packing`:
        computed once per sentence."""
        kv = self.kv(memory)
        k, v = (kv if packing is None else packing.unpack(kv)).chunk(2, dim=-1)
        return self.heads(k), self.heads(v)

    def forward(self, x: torch.Tensor, attend: torch.Tensor | None = None, causal: bool = False,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                packing: Packing | None = None) -> tuple[torch.Tensor, tuple]:
        """x (B, L, D), or (N, D) packed by `packing` -> the same shape, plus the (K, V) used, (B, H, L_kv, Dh) each.

        Self-attention appends to `kv` (the cache of earlier steps); cross-attention uses `kv` as is.
        """
        unpack = (lambda t: t) if packing is None else packing.unpack
        if self.cross:
            q, (k, v) = self.heads(unpack(self.q(x))), kv
        else:
            qkv = self.qkv(x)
            q, k, v = map(self.heads, unpack(qkv).chunk(3, dim=-1))
            if kv is not None:
                k, v = kv.extend(k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0)
        B, H, L, Dh = y.shape
        y = y.transpose(1, 2).reshape(B, L, H * Dh)
        return self.out(y if packing is None else packing.pack(y)), (k, v)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up, self.down = Linear(cfg.d_model, cfg.d_ff), Linear(cfg.d_ff, cfg.d_model)
        self.act = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}[cfg.activation]()
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.act, nn.ReLU) and type(self.up) is Linear:  # fused where packed (not under an adapter)
            h = self.up(x, relu=True)
        else:
            h = self.act(self.up(x))
        return self.down(self.drop(h))


class Sublayer(nn.Module):
    """Residual wrapper: pre-norm x + f(LN(x)) or post-norm LN(x + f(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm, self.drop, self.pre_norm = nn.LayerNorm(cfg.d_model), nn.Dropout(cfg.dropout), cfg.pre_norm

    def forward(self, x: torch.Tensor, fn) -> tuple[torch.Tensor, object]:
        y = fn(self.norm(x) if self.pre_norm else x)
        y, extra = y if isinstance(y, tuple) else (y, None)
        x = x + self.drop(y)
        return (x if self.pre_norm else self.norm(x)), extra


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn, self.ff = Attention(cfg, cross=False), FeedForward(cfg)
        self.sub_attn, self.sub_ff = Sublayer(cfg), Sublayer(cfg)

    def forward(self, x: torch.Tensor, attend: torch.Tensor | None, packing: Packing | None = None) -> torch.Tensor:
        """x (B, S, D), or (N, D) packed by `packing` -> the same shape."""
        x, _ = self.sub_attn(x, lambda h: self.attn(h, attend=attend, packing=packing))
        x, _ = self.sub_ff(x, self.ff)
        return x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.cross_attn = Attention(cfg, cross=False), Attention(cfg, cross=True)
        self.ff = FeedForward(cfg)
        self.sub_self, self.sub_cross, self.sub_ff = Sublayer(cfg), Sublayer(cfg), Sublayer(cfg)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | tuple, attend: torch.Tensor | None,
                self_kv: SelfKV | None = None, packing: Packing | None = None,
                memory_packing: Packing | None = None, group: int = 1) -> tuple[torch.Tensor, tuple]:
        """x (B, T, D), or (N, D) packed by `packing`; memory: the encoder output (B, S, D) (or packed by
        `memory_packing`), or its cross-attention (K, V) from a cache. With `group` > 1, memory and `attend`
        hold one sentence per `group` consecutive rows of x (beams sharing a source), B / group of them.

        Projecting the memory here, inside forward, matters under FSDP: a wrapped layer's weights are
        gathered only while its forward runs.
        """
        cross_kv = self.cross_kv(memory, memory_packing) if isinstance(memory, torch.Tensor) else memory
        # causality is a property of the decoder: full-prefix runs use is_causal; a cached call with
        # several new positions needs a mask aligned to the end (is_causal aligns to the start). Right
        # padding needs no target mask: real positions only ever look left, at real tokens.
        past, new = (0 if self_kv is None else self_kv.length), (x.shape[1] if packing is None else packing.L)
        causal = past == 0 and new > 1
        self_attend = causal_attend(new, past, x.device) if past and new > 1 else None
        x, new_kv = self.sub_self(x, lambda h: self.self_attn(h, attend=self_attend, causal=causal, kv=self_kv,
                                                              packing=packing))
        x, _ = self.sub_cross(x, lambda h: self.attend_memory(h, cross_kv, attend, packing, group))
        x, _ = self.sub_ff(x, self.ff)
        return x, new_kv

    def attend_memory(self, h: torch.Tensor, cross_kv: tuple, attend: torch.Tensor | None, packing: Packing | None,
                      group: int) -> torch.Tensor:
        """Cross-attention; a sentence's `group` rows (B, T, D) are attended as one row of group * T queries."""
        if group == 1:
            return self.cross_attn(h, attend=attend, kv=cross_kv, packing=packing)[0]
        B, T, D = h.shape
        y, _ = self.cross_attn(h.reshape(B // group, group * T, D), attend=attend, kv=cross_kv)
        return y.view(B, T, D)

    def cross_kv(self, memory: torch.Tensor, packing: Packing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention (K, V) of the encoder output (B, S, D), or (N, D) packed by `packing`, for this
        layer (a cache's start)."""
        return self.cross_attn.project_kv(memory, packing)
