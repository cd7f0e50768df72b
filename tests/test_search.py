"""Greedy and beam search against references that are obviously right: per-sentence full recomputation,
exhaustive enumeration, teacher-forced scores, the same search on split batches and without a cache."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from helpers import BOS, EOS, PAD, chunks_at, one_thread, src_batch, tiny_model  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from nmt.decoding import Hypothesis, SearchConfig, beam_search, greedy, length_limits

V = 20
PROPERTY = settings(max_examples=25, deadline=None)


class EncodeDecodeOnly(nn.Module):
    """A model offering only encode/decode/cfg: search must fall back to re-running the prefix."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner, self.cfg = model, model.cfg

    def encode(self, src_ids):
        return self.inner.encode(src_ids)

    def decode(self, tgt_in_ids, memory, src_ids):
        return self.inner.decode(tgt_in_ids, memory, src_ids)


class EosAverse(nn.Module):
    """The cached model with </s> made 50 nats less likely: every hypothesis runs to its length limit."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner, self.cfg = model, model.cfg

    def encode(self, src_ids):
        return self.inner.encode(src_ids)

    def start_cache(self, memory, src_ids):
        return self.inner.start_cache(memory, src_ids)

    def decode(self, tgt_in_ids, memory, src_ids, cache=None):
        logits = self.inner.decode(tgt_in_ids, memory, src_ids, cache=cache).clone()
        logits[..., EOS] -= 50.0
        return logits


@st.composite
def cases(draw, max_rows: int = 4):
    """(model, src_ids (B,S)): a random tiny float64 model (so near-ties cannot flip between two ways of
    computing the same logits) and a padded source batch."""
    model = tiny_model(seed=draw(st.integers(0, 2**16)), vocab=V, layers=draw(st.integers(1, 2)),
                       pre_norm=draw(st.booleans()), dtype=torch.float64)
    B = draw(st.integers(1, max_rows))
    lengths = draw(st.lists(st.integers(1, 6), min_size=B, max_size=B))
    return model, src_batch(torch.Generator().manual_seed(draw(st.integers(0, 2**16))), lengths, V)


searches = st.builds(SearchConfig, beam_size=st.integers(2, 4), alpha=st.sampled_from([0.0, 0.6, 1.0]),
                     max_len_a=st.sampled_from([0.0, 1.0, 3.0]), max_len_b=st.sampled_from([0.5, 1.0, 2.0]),
                     max_new_tokens=st.integers(1, 8))


def limits_of(src_ids: torch.Tensor, cfg: SearchConfig) -> list[int]:
    """The documented limit, computed independently: min(int(a + b * source length), max_new_tokens), >= 1."""
    lengths = src_ids.ne(PAD).sum(1).tolist()
    return [max(1, min(int(cfg.max_len_a + cfg.max_len_b * n), cfg.max_new_tokens)) for n in lengths]


def forced_logprob(model, src_row: torch.Tensor, tokens: list[int]) -> float:
    """Log-probability of `tokens` for source (1, S) by one teacher-forced forward pass."""
    tgt_in = torch.tensor([[BOS, *tokens[:-1]]])
    lp = torch.log_softmax(model(src_row, tgt_in)[0].float(), dim=-1)  # (T, V)
    return float(lp[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


def reference_greedy(model, src_row: torch.Tensor, limit: int) -> list[int]:
    """Greedy for one sentence by full recomputation: never <pad>/<s>; only </s> once at the limit."""
    tokens: list[int] = []
    while not tokens or tokens[-1] != EOS:
        logits = model(src_row, torch.tensor([[BOS, *tokens]]))[0, -1].float()
        logits[[PAD, BOS]] = -torch.inf
        tokens.append(EOS if len(tokens) + 1 >= limit else int(logits.argmax()))
    return tokens


def check_hypothesis(model, src_row: torch.Tensor, hyp: Hypothesis, limit: int, alpha: float) -> None:
    toks = hyp.tokens
    assert 1 <= len(toks) <= limit and toks[-1] == EOS and hyp.finished
    assert EOS not in toks[:-1] and PAD not in toks and BOS not in toks
    assert abs(hyp.logprob - forced_logprob(model, src_row, toks)) < 1e-4
    assert abs(hyp.score - hyp.logprob / ((5 + len(toks)) / 6) ** alpha) < 1e-5


@PROPERTY
@given(case=cases(), cfg=searches)
def test_greedy_is_beam_of_one_and_matches_full_recomputation(case, cfg):
    model, src_ids = case
    cfg = replace(cfg, beam_size=1)
    limits = limits_of(src_ids, cfg)
    assert length_limits(src_ids, PAD, cfg).tolist() == limits
    found = greedy(model, src_ids, cfg)
    assert beam_search(model, src_ids, cfg) == [[h] for h in found]
    generated = model.generate(src_ids, beam_size=1, max_new_tokens=cfg.max_new_tokens,
                               max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b)
    with torch.no_grad():
        for i, hyp in enumerate(found):
            row = src_ids[i : i + 1]
            assert hyp.tokens == reference_greedy(model, row, limits[i])
            assert generated[i, : len(hyp.tokens)].tolist() == hyp.tokens
            check_hypothesis(model, row, hyp, limits[i], cfg.alpha)


@PROPERTY
@given(case=cases(), cfg=searches)
def test_beam_hypotheses_are_sorted_scored_and_within_limits(case, cfg):
    """n-best lists: best first, distinct, ending in </s> within the limit, and each score is the model's
    own teacher-forced log-probability (which checks the beam's back-pointers and cache reordering)."""
    model, src_ids = case
    cfg = replace(cfg, nbest=cfg.beam_size)
    limits = limits_of(src_ids, cfg)
    found = beam_search(model, src_ids, cfg)
    assert len(found) == src_ids.shape[0]
    with torch.no_grad():
        for i, nbest in enumerate(found):
            assert 1 <= len(nbest) <= cfg.beam_size
            scores = [h.score for h in nbest]
            assert scores == sorted(scores, reverse=True)
            assert len({tuple(h.tokens) for h in nbest}) == len(nbest)
            for hyp in nbest:
                check_hypothesis(model, src_ids[i : i + 1], hyp, limits[i], cfg.alpha)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), alpha=st.sampled_from([0.0, 0.6]))
def test_wide_beam_finds_every_hypothesis(seed, alpha):
    """V=6 leaves 3 words (<unk> and two others) besides </s>; with at most 3 tokens there are 1+3+9=13
    hypotheses, and a beam of 13 must return every one, correctly scored and ranked."""
    model = tiny_model(seed=seed, vocab=6)
    src_ids = src_batch(torch.Generator().manual_seed(seed), [4, 2], 6)
    cfg = SearchConfig(beam_size=13, nbest=13, alpha=alpha, max_len_a=10, max_new_tokens=3)
    words = [1, 4, 5]
    every = {(*w, EOS) for n in range(3) for w in itertools.product(words, repeat=n)}
    found = beam_search(model, src_ids, cfg)
    with torch.no_grad():
        for i, nbest in enumerate(found):
            assert {tuple(h.tokens) for h in nbest} == every
            for hyp in nbest:
                check_hypothesis(model, src_ids[i : i + 1], hyp, 3, alpha)
            assert [h.score for h in nbest] == sorted((h.score for h in nbest), reverse=True)


@settings(max_examples=15, deadline=None)
@given(case=cases(), cfg=searches)
def test_hypotheses_stop_at_the_length_limit(case, cfg):
    """With </s> unlikely everywhere, every hypothesis is cut at exactly min(a + b * len, max_new_tokens)."""
    model, src_ids = case
    averse = EosAverse(model)
    limits = limits_of(src_ids, cfg)
    for i, hyp in enumerate(greedy(averse, src_ids, cfg)):
        assert len(hyp.tokens) == limits[i] and hyp.tokens[-1] == EOS
    for i, nbest in enumerate(beam_search(averse, src_ids, cfg)):
        assert all(len(h.tokens) == limits[i] and h.tokens[-1] == EOS for h in nbest)


def test_the_length_limit_never_passes_the_models_position_table():
    """A search allowing more tokens than the model has positions stops where its decoder input would overflow."""
    model = tiny_model()
    model.cfg = replace(model.cfg, max_positions=12)
    averse = EosAverse(model)
    src_ids = src_batch(torch.Generator().manual_seed(0), [5, 3], V)
    cfg = SearchConfig(beam_size=1, max_len_a=100, max_len_b=0, max_new_tokens=500)
    assert [len(h.tokens) for h in greedy(averse, src_ids, cfg)] == [11, 11]
    assert all(len(h.tokens) == 11 for nbest in beam_search(averse, src_ids, replace(cfg, beam_size=3)) for h in nbest)


@PROPERTY
@given(case=cases(max_rows=6), cfg=searches, data=st.data())
def test_search_on_split_batches_equals_search_on_the_whole(case, cfg, data):
    model, src_ids = case
    B = src_ids.shape[0]
    cuts = data.draw(st.lists(st.integers(1, max(B - 1, 1)), max_size=B), label="cut points")
    for search in (lambda s: [[h] for h in greedy(model, s, cfg)], lambda s: beam_search(model, s, cfg)):
        whole = search(src_ids)
        split = [nbest for part in chunks_at(B, cuts) for nbest in search(src_ids[part])]
        assert [[h.tokens for h in n] for n in split] == [[h.tokens for h in n] for n in whole]
        for got, want in zip(itertools.chain(*split), itertools.chain(*whole)):
            assert abs(got.score - want.score) < 1e-5


@PROPERTY
@given(case=cases(), cfg=searches)
def test_model_without_a_cache_gives_the_same_hypotheses(case, cfg):
    model, src_ids = case
    cfg = replace(cfg, nbest=cfg.beam_size)
    plain = EncodeDecodeOnly(model)
    assert not hasattr(plain, "start_cache")
    for search in (lambda m: [[h] for h in greedy(m, src_ids, cfg)], lambda m: beam_search(m, src_ids, cfg)):
        cached, uncached = search(model), search(plain)
        assert [[h.tokens for h in n] for n in uncached] == [[h.tokens for h in n] for n in cached]
        for got, want in zip(itertools.chain(*uncached), itertools.chain(*cached)):
            assert abs(got.logprob - want.logprob) < 1e-4


def test_generate_returns_the_best_hypotheses_as_eos_then_padding():
    model = tiny_model(seed=6, vocab=V)
    src_ids = src_batch(torch.Generator().manual_seed(2), [6, 2, 4, 1], V)
    out = model.generate(src_ids, beam_size=3, max_new_tokens=9)
    best = [n[0].tokens for n in beam_search(model, src_ids, SearchConfig(beam_size=3, max_new_tokens=9))]
    assert out.dtype == torch.long and out.shape == (4, max(len(b) for b in best)) and out.shape[1] <= 9
    for row, tokens in zip(out.tolist(), best):
        assert row == tokens + [PAD] * (out.shape[1] - len(tokens))
        assert row[len(tokens) - 1] == EOS


def test_search_encoded_stops_between_batches_when_asked():
    """Validation's decoding gives up between batches once a stop signal arrived (torchrun allows 30 s)."""
    from nmt.decoding import SearchConfig, search_encoded
    from tests.helpers import tiny_model

    model, asked = tiny_model(), []
    src = [[5, 6, 3], [7, 8, 9, 3], [5, 3], [6, 7, 8, 9, 10, 3]]

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2  # two batches decoded, then the signal

    found = search_encoded(model, src, SearchConfig(beam_size=2, max_len_a=0, max_len_b=4), batch_tokens=8, stop=stop)
    assert len(found) < len(src) and len(asked) == 3
    assert len(search_encoded(model, src, SearchConfig(beam_size=2, max_len_a=0, max_len_b=4), batch_tokens=8)) == 4


@pytest.mark.parametrize("beam", [1, 4])
def test_a_search_reads_the_device_once_a_step(beam):
    """Beam search and greedy read the device once per step (which rows go on), once for the length limit and at
    the end only: the finished hypotheses stay on the device until then."""
    from helpers import HostSyncs

    model = tiny_model(seed=3, vocab=30, layers=2)
    src_ids = src_batch(torch.Generator().manual_seed(3), [6, 2, 9, 4], 30)
    cfg = SearchConfig(beam_size=beam, max_new_tokens=7, nbest=min(beam, 2))
    with HostSyncs() as syncs:
        found = beam_search(model, src_ids, cfg)
    steps = max(len(h.tokens) for hyps in found for h in hyps)
    per_step = syncs.calls.count("tolist")
    assert len(found) == 4 and steps >= 2
    assert set(syncs.calls) <= {"__int__", "tolist"} and syncs.calls.count("__int__") == 1
    ends = 5 if beam > 1 else 3  # the finished hypotheses' parts (beam) or tokens, lengths, logprobs (greedy)
    assert per_step - ends <= steps


@pytest.mark.slow
def test_a_compiled_decoder_step_finds_what_eager_decoding_finds_with_few_graphs():
    """compile_decoder (what `compile: true` does to the model validation decodes with): the cached decoder step
    compiled whole (fullgraph, dynamic sizes) gives beam search's and greedy's eager hypotheses on batches of
    other sizes and lengths, with a bounded number of graphs (the first step, the later ones, one beam group)."""
    from torch._dynamo.utils import counters

    from nmt.decoding import compile_decoder

    model = tiny_model(seed=5, vocab=40, layers=2)
    gen = torch.Generator().manual_seed(5)
    batches = [src_batch(gen, [5, 3, 7, 4], 40), src_batch(gen, [9, 2, 6], 40), src_batch(gen, [4, 11], 40)]
    configs = [SearchConfig(beam_size=4, max_new_tokens=8), SearchConfig(beam_size=1, max_new_tokens=8)]

    def found(m):
        return [[h.tokens for h in hyps] for cfg in configs for b in batches for hyps in beam_search(m, b, cfg)]

    eager = found(model)
    torch._dynamo.reset()
    counters.clear()
    assert found(compile_decoder(model)) == eager
    assert 1 <= counters["stats"]["unique_graphs"] <= 8
