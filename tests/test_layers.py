"""nmt.layers: the blocks the model is built of, met through the model as a user builds it (tests/test_model.py
holds the encoder-decoder's own properties): the position table in each layout, what each variant flag changes,
where each dropout falls, masked attention scores in bf16."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ATOL, one_thread, src_batch, tgt_in_batch, tiny_model  # noqa: F401

from nmt.config import ModelConfig
from nmt.layers import sinusoids

V = 24


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=ATOL, rtol=0)


def test_the_position_table_is_vaswanis_in_each_layout():
    """nmt's own: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...); "halves" (Marian): the same
    frequencies, all sines then all cosines; "m2m100": frequencies 10000^(-i/(d/2-1)), positions from 2."""
    length, dim = 50, 16
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    angle = pos / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (length, dim/2)
    table = sinusoids(length, dim)
    assert table.shape == (length, dim) and table.dtype == torch.float32
    assert torch.allclose(table[:, 0::2].double(), angle.sin(), atol=1e-5)
    assert torch.allclose(table[:, 1::2].double(), angle.cos(), atol=1e-5)
    assert torch.allclose(sinusoids(length, dim, "halves").double(), torch.cat([angle.sin(), angle.cos()], 1),
                          atol=1e-6)
    half = dim // 2
    m2m = (pos + 2) * torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    assert torch.allclose(sinusoids(length, dim, "m2m100").double(), torch.cat([m2m.sin(), m2m.cos()], 1), atol=1e-4)
    assert sinusoids(length, dim + 1, "m2m100")[:, -1].eq(0).all()  # an odd width: a zero column last


def test_variant_flags_change_the_computation():
    gen = torch.Generator().manual_seed(0)
    src_ids, tgt_in_ids = src_batch(gen, [5, 3], V), tgt_in_batch(gen, [4, 6], V)
    base = tiny_model(seed=2, vocab=V)
    with torch.no_grad():
        reference = base(src_ids, tgt_in_ids)
        gelu = tiny_model(seed=3, vocab=V, activation="gelu")
        gelu.load_state_dict(base.state_dict())
        assert not close(gelu(src_ids, tgt_in_ids), reference)
        post = tiny_model(seed=3, vocab=V, pre_norm=False)
        missing, unexpected = post.load_state_dict(base.state_dict(), strict=False)
        assert not missing and set(unexpected) == {f"{m}_norm.{p}" for m in ("enc", "dec") for p in ("weight", "bias")}
        assert not close(post(src_ids, tgt_in_ids), reference)
    separate = tiny_model(seed=2, vocab=V, share=False)
    assert base.src_embed is base.tgt_embed and separate.src_embed is not separate.tgt_embed
    assert separate.num_parameters() - base.num_parameters() == V * base.cfg.d_model


@pytest.mark.parametrize("settings, drops", [
    ({}, False),
    (dict(dropout=0.5, attention_dropout=0.0, activation_dropout=0.0), True),  # Marian's: embeddings, residuals
    (dict(attention_dropout=0.5), True),
    (dict(activation_dropout=0.5), True),
])
def test_dropout_falls_where_its_settings_say(settings, drops):
    """`dropout` on the embeddings and residual branches, attention_dropout on the attention weights,
    activation_dropout on the feed-forward activation: each alone makes two training forwards differ, and with
    all three at 0 they are the same. Left null, the last two take `dropout`'s value (as nmt always trained)."""
    gen = torch.Generator().manual_seed(0)
    src_ids, tgt_in_ids = src_batch(gen, [5, 3], V), tgt_in_batch(gen, [4, 6], V)
    model = tiny_model(seed=4, vocab=V, **settings).train()
    assert close(model(src_ids, tgt_in_ids), model(src_ids, tgt_in_ids)) != drops
    cfg = ModelConfig.preset("tiny", dropout=0.3)
    assert (cfg.dropout_at("attention"), cfg.dropout_at("activation")) == (0.3, 0.3)


def test_masked_scores_are_finite_in_bf16():
    """Heavy padding (rows of 1-3 real tokens in 48 columns) under bf16 autocast: no inf/NaN, and the
    logits stay near float32's (bf16 keeps ~3 significant digits; a leaking mask would be off by O(1))."""
    model = tiny_model(seed=5, vocab=V, layers=2)
    gen = torch.Generator().manual_seed(1)
    src_ids = src_batch(gen, [1, 2, 3, 48], V, width=48)
    tgt_in_ids = tgt_in_batch(gen, [1, 3, 40, 2], V, width=40)
    with torch.no_grad():
        full = model(src_ids, tgt_in_ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(src_ids, tgt_in_ids)
            memory = model.encode(src_ids)
    assert low.dtype == torch.bfloat16  # (memory ends in a LayerNorm, which autocast keeps in float32)
    assert torch.isfinite(low).all() and torch.isfinite(memory).all()
    assert (low.float() - full).abs().max() < 0.25
