"""Sampling: temperature 0 and top-k 1 are greedy search, a seed reproduces, and every drawn token lies in
the top-k / top-p set of the distribution it was drawn from."""

from __future__ import annotations

import pytest
import torch
from helpers import model_dir, one_thread, src_batch, tiny_model  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

import nmt.decoding
from nmt import Translator
from nmt.decoding import SamplingConfig, SearchConfig, greedy, search
from nmt.errors import NmtError

V = 20
PROPERTY = settings(max_examples=15, deadline=None)
SEARCH = SearchConfig(beam_size=1, max_len_a=2, max_len_b=1.5, max_new_tokens=12)


@st.composite
def cases(draw):
    model = tiny_model(seed=draw(st.integers(0, 2**16)), vocab=V, layers=draw(st.integers(1, 2)))
    lengths = draw(st.lists(st.integers(1, 7), min_size=1, max_size=5))
    return model, src_batch(torch.Generator().manual_seed(draw(st.integers(0, 2**16))), lengths, V)


def same(a, b) -> bool:
    return [h.tokens for h in a] == [h.tokens for h in b] and all(
        abs(x.logprob - y.logprob) < 1e-6 for x, y in zip(a, b))


@PROPERTY
@given(case=cases(), temperature=st.sampled_from([0.0, 1e-7]), seed=st.integers(0, 100))
def test_temperature_towards_zero_is_greedy(case, temperature, seed):
    model, src_ids = case
    drawn = greedy(model, src_ids, SEARCH, SamplingConfig(temperature=temperature, seed=seed))
    assert same(drawn, greedy(model, src_ids, SEARCH))


@PROPERTY
@given(case=cases(), temperature=st.sampled_from([0.5, 1.0, 3.0]), seed=st.integers(0, 100))
def test_top_k_of_one_is_greedy(case, temperature, seed):
    model, src_ids = case
    drawn = greedy(model, src_ids, SEARCH, SamplingConfig(topk=1, temperature=temperature, seed=seed))
    assert same(drawn, greedy(model, src_ids, SEARCH))


def test_a_seed_gives_the_same_samples_and_another_seed_others():
    model = tiny_model(seed=3, vocab=V)
    src_ids = src_batch(torch.Generator().manual_seed(0), [5, 3, 6, 2, 7, 4], V)
    cfg = SearchConfig(beam_size=3, nbest=3, max_new_tokens=12)
    draw = lambda seed: [[h.tokens for h in n]
                         for n in search(model, src_ids, cfg, SamplingConfig(temperature=2.0, seed=seed))]
    assert draw(5) == draw(5)
    assert draw(5) != draw(6)
    assert draw(5) != [[h.tokens for h in n] for n in search(model, src_ids, cfg)]  # not the beam's answer


@PROPERTY
@given(case=cases(), topk=st.sampled_from([0, 2, 3, 5]), topp=st.sampled_from([1.0, 0.9, 0.5, 0.2]),
       temperature=st.sampled_from([0.7, 1.0, 3.0]), seed=st.integers(0, 100))
def test_drawn_tokens_lie_in_the_top_k_and_top_p_sets(case, topk, topp, temperature, seed):
    """Each draw is checked against the very distribution the loop drew it from: fewer than k tokens are
    more likely, and the tokens more likely than it hold less than p of the probability."""
    model, src_ids = case
    draws = []
    real = nmt.decoding.choose

    def spy(lp, cfg, generator):
        chosen = real(lp, cfg, generator)
        draws.append((lp.clone(), chosen))
        return chosen

    nmt.decoding.choose = spy
    try:
        greedy(model, src_ids, SEARCH, SamplingConfig(topk=topk, topp=topp, temperature=temperature, seed=seed))
    finally:
        nmt.decoding.choose = real
    for lp, chosen in draws:
        mine = lp.gather(1, chosen[:, None])  # (N, 1)
        above = lp > mine  # (N, V) tokens more likely than the drawn one
        assert bool(mine.isfinite().all())
        if topk:
            assert bool((above.sum(1) < topk).all())
        assert bool(((lp.exp() * above).sum(1) < topp + 1e-6).all())


def test_sampling_really_draws_outside_the_argmax():
    """The property above would hold for greedy search too: this shows the draws spread (so it can fail)."""
    model = tiny_model(seed=1, vocab=V)
    src_ids = src_batch(torch.Generator().manual_seed(1), [6] * 8, V)
    best = greedy(model, src_ids, SEARCH)
    drawn = greedy(model, src_ids, SEARCH, SamplingConfig(topk=5, temperature=2.0))
    assert sum(a.tokens != b.tokens for a, b in zip(best, drawn)) >= 4


def test_translator_samples_reproducibly_and_checks_its_options(tmp_path):
    translator = Translator.from_pretrained(model_dir(tmp_path / "m"))
    texts = ["the small dog sleeps", "a cat", "the bird sings a song"]
    sampled = translator.translate(texts, sampling=SamplingConfig(topp=0.9, seed=1), max_new_tokens=10)
    assert sampled == translator.translate(texts, sampling=SamplingConfig(topp=0.9, seed=1), max_new_tokens=10)
    assert len(translator.translate(texts, nbest=2, sampling=SamplingConfig(seed=1), max_new_tokens=10)[0]) == 2
    assert len(translator.translate(texts, beam_size=1, nbest=6, sampling=SamplingConfig(), max_new_tokens=10)[0]) == 6
    for bad in (dict(topk=-1), dict(topp=0.0), dict(topp=1.5), dict(temperature=-1.0)):
        with pytest.raises(NmtError, match="sampling"):
            SamplingConfig(**bad)


def test_chunks_of_a_stream_draw_from_their_own_seeds(monkeypatch):
    """translate_stream: chunk k starts at line n and samples from seed + n - 1, so no two chunks share random
    streams (a back-translated corpus would repeat its noise every chunk); the first chunk is translate()'s."""
    from nmt.translate import Translator as T

    seen = []
    monkeypatch.setattr(T, "translate", lambda self, texts, **kw: seen.append(kw["sampling"].seed) or list(texts))
    translator = T.__new__(T)
    lines = [f"line {i}" for i in range(7)]
    out = list(translator.translate_stream(lines, chunk_size=3, sampling=SamplingConfig(topk=5, seed=10)))
    assert out == lines and seen == [10, 13, 16]
    seen.clear()
    list(translator.translate_stream(lines, chunk_size=3, sampling=SamplingConfig(topk=5, seed=None)))
    assert seen == [None, None, None]  # torch's global generator: nothing to offset
