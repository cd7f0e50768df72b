"""The decoding chapter (nmt.decoding): greedy, beam search and sampling on any model with encode/decode, their
properties (batching, padding and splitting change nothing; length limits hold; a step reads the device once),
ensembles of models decoded as one, and forced scoring of given translations."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from helpers import (  # noqa: F401
    BOS,
    EOS,
    PAD,
    chunks_at,
    forced_logprob,
    model_dir,  # noqa: F401
    one_thread,
    src_batch,
    tiny_model,
)
from helpers import SEARCH_PROPERTY as PROPERTY
from helpers import SEARCH_VOCAB as V
from helpers import search_cases as cases
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import nmt.decoding
from nmt import Translator
from nmt.cli import main
from nmt.decoding import (
    Ensemble,
    Hypothesis,
    SamplingConfig,
    SearchConfig,
    beam_search,
    greedy,
    length_limits,
    score_encoded,
    search,
)
from nmt.errors import NmtError

# --- search: greedy and beam ---------------------------------------------------------------------------------------


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

    def forward(self, src_ids, tgt_in_ids):
        logits = self.inner(src_ids, tgt_in_ids).clone()
        logits[..., EOS] -= 50.0
        return logits


searches = st.builds(SearchConfig, beam_size=st.integers(2, 4), alpha=st.sampled_from([0.0, 0.6, 1.0]),
                     max_len_a=st.sampled_from([0.0, 1.0, 3.0]), max_len_b=st.sampled_from([0.5, 1.0, 2.0]),
                     max_new_tokens=st.integers(1, 8))


def limits_of(src_ids: torch.Tensor, cfg: SearchConfig) -> list[int]:
    """The documented limit, computed independently: min(int(a + b * source length), max_new_tokens), >= 1."""
    lengths = src_ids.ne(PAD).sum(1).tolist()
    return [max(1, min(int(cfg.max_len_a + cfg.max_len_b * n), cfg.max_new_tokens)) for n in lengths]


def reference_greedy(model, src_row: torch.Tensor, limit: int, no_repeat: int = 0) -> list[int]:
    """Greedy for one sentence by full recomputation: never <pad>/<s>; only </s> once at the limit; with
    `no_repeat` n, never a token that ends an n-gram the translation holds already."""
    tokens: list[int] = []
    while not tokens or tokens[-1] != EOS:
        logits = model(src_row, torch.tensor([[BOS, *tokens]]))[0, -1].float()
        logits[[PAD, BOS]] = -torch.inf
        if no_repeat:
            tail = tokens[len(tokens) - no_repeat + 1:] if no_repeat > 1 else []
            for j in range(len(tokens) - no_repeat + 1):
                if tokens[j: j + no_repeat - 1] == tail:
                    logits[tokens[j + no_repeat - 1]] = -torch.inf
        tokens.append(EOS if len(tokens) + 1 >= limit else int(logits.argmax()))
    return tokens


def check_hypothesis(model, src_row: torch.Tensor, hyp: Hypothesis, limit: int, alpha: float) -> None:
    toks = hyp.tokens
    assert 1 <= len(toks) <= limit and toks[-1] == EOS and hyp.finished
    assert EOS not in toks[:-1] and PAD not in toks and BOS not in toks
    # a </s> forced at the limit counts 0, as in transformers (ForcedEOSTokenLogitsProcessor): what the model chose
    chosen = toks if len(toks) < limit else toks[:-1]
    assert abs(hyp.logprob - (forced_logprob(model, src_row, chosen) if chosen else 0.0)) < 1e-4
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


def repeats(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


@PROPERTY
@given(case=cases(), cfg=searches, n=st.integers(1, 3))
def test_no_repeat_ngram_size_keeps_every_n_gram_to_once(case, cfg, n):
    """no_repeat_ngram_size n on a model made to run to its length limit, where loops come: no hypothesis of
    beam search holds an n-gram twice, and greedy picks at each step the best token that repeats none, as
    recomputed from scratch."""
    model, src_ids = case
    model, cfg = EosAverse(model), replace(cfg, no_repeat_ngram_size=n, nbest=cfg.beam_size)
    limits = limits_of(src_ids, cfg)
    for nbest in beam_search(model, src_ids, cfg):
        assert not any(repeats(h.tokens, n) for h in nbest)
    with torch.no_grad():
        for i, hyp in enumerate(greedy(model, src_ids, replace(cfg, beam_size=1, nbest=1))):
            assert hyp.tokens == reference_greedy(model, src_ids[i: i + 1], limits[i], no_repeat=n)


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
    for run_search in (lambda s: [[h] for h in greedy(model, s, cfg)], lambda s: beam_search(model, s, cfg)):
        whole = run_search(src_ids)
        split = [nbest for part in chunks_at(B, cuts) for nbest in run_search(src_ids[part])]
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
    for run_search in (lambda m: [[h] for h in greedy(m, src_ids, cfg)], lambda m: beam_search(m, src_ids, cfg)):
        cached, uncached = run_search(model), run_search(plain)
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
def test_a_search_reads_the_device_once_a_step_and_copies_nothing_from_the_host(beam):
    """Beam search and greedy, run as a GPU runs them (on `meta`: shapes without values, `helpers.OffHost`), read
    the device once for the length limit, once per step (which rows go on) and at the end only (the finished
    hypotheses stay on the device until then); they copy nothing from host memory and mix no devices."""
    from helpers import OffHost

    meta = torch.device("meta")
    model = tiny_model(seed=3, vocab=30, layers=2).to(meta)
    src_ids = src_batch(torch.Generator().manual_seed(3), [6, 2, 9, 4], 30).to(meta)
    with OffHost(value=5) as off, torch.inference_mode():  # the length limit read as 5: five steps, every row going
        beam_search(model, src_ids, SearchConfig(beam_size=beam, max_new_tokens=7, nbest=min(beam, 2)))
    ends = 5 if beam > 1 else 3  # the finished hypotheses' parts (beam) or tokens, lengths, logprobs (greedy)
    assert off.reads == ["__int__"] + ["tolist"] * (5 + ends)
    assert (off.copies, off.mixes) == ([], [])


@pytest.mark.slow
def test_a_compiled_decoder_step_finds_what_eager_decoding_finds_under_the_recompile_limit():
    """compile_decoder (what `compile: true` does to the model validation decodes with): the cached decoder step
    compiled whole (fullgraph, dynamic sizes) gives beam search's and greedy's eager hypotheses over batches of
    16, 12, 1, 2, 7 and 1 sentences of other lengths, compiling few enough graphs that fullgraph's recompile limit
    (a hard failure) is never reached."""
    from helpers import in_fresh_interpreter

    in_fresh_interpreter("test_decoding", "compiled_decoder_case")


def compiled_decoder_case() -> None:
    """The body of the test above, run in a fresh interpreter."""
    from torch._dynamo.utils import counters

    from nmt.decoding import compile_decoder

    model = tiny_model(seed=5, vocab=40, layers=2)
    gen = torch.Generator().manual_seed(5)
    sizes = [16, 12, 1, 2, 7, 1]
    batches = [src_batch(gen, torch.randint(2, 12, (n,), generator=gen).tolist(), 40) for n in sizes]
    configs = [SearchConfig(beam_size=4, max_new_tokens=8), SearchConfig(beam_size=1, max_new_tokens=8),
               SearchConfig(beam_size=3, max_new_tokens=8)]

    def found(m):
        return [[h.tokens for h in hyps] for cfg in configs for b in batches for hyps in beam_search(m, b, cfg)]

    eager = found(model)
    torch._dynamo.reset()
    counters.clear()
    assert found(compile_decoder(model)) == eager
    graphs = counters["stats"]["unique_graphs"]
    print(f"{graphs} graphs for {len(configs)} searches over batches of {sizes}")
    assert 1 <= graphs < torch._dynamo.config.recompile_limit


# --- sampling ------------------------------------------------------------------------------------------------------

SAMPLING_PROPERTY = settings(max_examples=15, deadline=None)
SEARCH = SearchConfig(beam_size=1, max_len_a=2, max_len_b=1.5, max_new_tokens=12)


@st.composite
def sampling_cases(draw):
    model = tiny_model(seed=draw(st.integers(0, 2**16)), vocab=V, layers=draw(st.integers(1, 2)))
    lengths = draw(st.lists(st.integers(1, 7), min_size=1, max_size=5))
    return model, src_batch(torch.Generator().manual_seed(draw(st.integers(0, 2**16))), lengths, V)


def same(a, b) -> bool:
    return [h.tokens for h in a] == [h.tokens for h in b] and all(
        abs(x.logprob - y.logprob) < 1e-6 for x, y in zip(a, b))


@SAMPLING_PROPERTY
@given(case=sampling_cases(), temperature=st.sampled_from([0.0, 1e-7]), seed=st.integers(0, 100))
def test_temperature_towards_zero_is_greedy(case, temperature, seed):
    model, src_ids = case
    drawn = greedy(model, src_ids, SEARCH, SamplingConfig(temperature=temperature, seed=seed))
    assert same(drawn, greedy(model, src_ids, SEARCH))


@SAMPLING_PROPERTY
@given(case=sampling_cases(), temperature=st.sampled_from([0.5, 1.0, 3.0]), seed=st.integers(0, 100))
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


@SAMPLING_PROPERTY
@given(case=sampling_cases(), topk=st.sampled_from([0, 2, 3, 5]), topp=st.sampled_from([1.0, 0.9, 0.5, 0.2]),
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
    assert len(translator.translations(texts, nbest=2, sampling=SamplingConfig(seed=1), max_new_tokens=10)[0].nbest) == 2
    assert len(translator.translations(texts, beam_size=1, nbest=6, sampling=SamplingConfig(),
                                       max_new_tokens=10)[0].nbest) == 6
    for bad in (dict(topk=-1), dict(topp=0.0), dict(topp=1.5), dict(temperature=-1.0)):
        with pytest.raises(NmtError, match="sampling"):
            SamplingConfig(**bad)


def test_chunks_of_a_stream_draw_from_their_own_seeds(monkeypatch):
    """translate_stream: chunk k starts at line n and samples from seed + n - 1, so no two chunks share random
    streams (a back-translated corpus would repeat its noise every chunk); the first chunk is translate()'s."""
    from nmt.translate import Translation
    from nmt.translate import Translator as T

    def translations(self, texts, *args, **kw):
        seen.append(kw["sampling"].seed)
        return [Translation(t, 0.0, 0.0) for t in texts]

    seen = []
    monkeypatch.setattr(T, "translations", translations)
    translator = T.__new__(T)
    lines = [f"line {i}" for i in range(7)]
    out = list(translator.translate_stream(lines, chunk_size=3, sampling=SamplingConfig(topk=5, seed=10)))
    assert out == lines and seen == [10, 13, 16]
    seen.clear()
    list(translator.translate_stream(lines, chunk_size=3, sampling=SamplingConfig(topk=5, seed=None)))
    assert seen == [None, None, None]  # torch's global generator: nothing to offset


# --- ensembles -----------------------------------------------------------------------------------------------------

def hyps(model, src_ids, cfg, sampling=None):
    return [[(h.tokens, round(h.logprob, 4)) for h in n] for n in search(model, src_ids, cfg, sampling)]


@pytest.mark.parametrize("beam,sampling", [(1, None), (4, None), (1, SamplingConfig(topk=5, seed=3))])
def test_an_ensemble_of_a_model_with_itself_is_the_model(beam, sampling):
    model = tiny_model(seed=5, vocab=V, layers=2)
    src_ids = src_batch(torch.Generator().manual_seed(4), [7, 3, 5, 1], V)
    cfg = SearchConfig(beam_size=beam, nbest=beam, max_new_tokens=10)
    assert hyps(Ensemble([model, model]), src_ids, cfg, sampling) == hyps(model, src_ids, cfg, sampling)
    other = tiny_model(seed=6, vocab=V, layers=2)
    assert hyps(Ensemble([model, other]), src_ids, cfg, sampling) != hyps(model, src_ids, cfg, sampling)


def test_ensemble_steps_are_the_renormalised_mean_of_the_models():
    a, b = tiny_model(seed=1, vocab=V), tiny_model(seed=2, vocab=V)
    src, tgt = [[5, 6, 7, EOS]], [[8, 9, 10]]
    ensemble = score_encoded(Ensemble([a, b]), src, tgt, 100)[0].token_logprobs
    with torch.no_grad():
        lps = [torch.log_softmax(m(torch.tensor(src), torch.tensor([[2, 8, 9, 10]])), -1)[0] for m in (a, b)]
    want = torch.log_softmax((lps[0] + lps[1]) / 2, -1)[torch.arange(4), torch.tensor([8, 9, 10, EOS])]
    assert ensemble == pytest.approx(want.tolist(), abs=1e-5)


def test_translator_ensembles_directories_and_refuses_other_tokenizers(tmp_path, capsys):
    a, b = model_dir(tmp_path / "a", seed=1), model_dir(tmp_path / "b", seed=2)
    texts = ["the dog sleeps", "a small cat"]
    alone = Translator.from_pretrained(a).translate(texts, max_new_tokens=8)
    assert Translator.from_pretrained([a, a]).translate(texts, max_new_tokens=8) == alone
    assert isinstance(Translator.from_pretrained([a, b]).model, Ensemble)
    (tmp_path / "in.en").write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["translate", str(a), str(a), "--input", str(tmp_path / "in.en"), "--beam", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == Translator.from_pretrained(a).translate(texts, beam_size=2)
    other = model_dir(tmp_path / "c", seed=1, mirrored=True)  # another tokenizer of the same size
    assert Translator.from_pretrained(other).model.cfg == Translator.from_pretrained(a).model.cfg
    with pytest.raises(NmtError, match="tokenizer differs"):
        Translator.from_pretrained([a, other])
    assert main(["translate", str(a), str(other), "--input", str(tmp_path / "in.en")]) == 2
    assert "tokenizer differs" in capsys.readouterr().err
    with pytest.raises(NmtError, match="share one vocabulary"):
        Ensemble([tiny_model(vocab=V), tiny_model(vocab=V + 1)])


# --- forced scoring ------------------------------------------------------------------------------------------------

def alone(model, src: list[int], tgt: list[int]) -> list[float]:
    """Each reference token's log-probability, one unpadded pair through the model's forward."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([src]), torch.tensor([[BOS, *tgt]])).float(), -1)[0]  # (T, V)
    return lp[torch.arange(len(tgt) + 1), torch.tensor([*tgt, EOS])].tolist()


def test_scores_are_the_log_softmax_at_the_reference_tokens():
    model = tiny_model(seed=4, vocab=V, layers=2)
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(4, V, (n,), generator=g).tolist() + [EOS] for n in (5, 1, 8, 3, 5, 2)]
    tgt = [torch.randint(4, V, (n,), generator=g).tolist() for n in (2, 7, 0, 4, 4, 9)]
    scores = score_encoded(model, src, tgt, batch_tokens=20)  # several length-sorted, padded batches
    for s, t, got in zip(src, tgt, scores):
        want = alone(model, s, t)
        assert len(got.token_logprobs) == len(t) + 1  # </s> included
        assert got.token_logprobs == pytest.approx(want, abs=1e-5)
        assert got.total == pytest.approx(sum(want), abs=1e-4) and got.mean == pytest.approx(sum(want) / len(want))


def test_beam_best_outscores_every_hypothesis_it_kept():
    """Scored independently, each kept hypothesis' log-probability is the beam's (a </s> forced at the limit of 10
    tokens counting 0), and the best one's length-normalised score is the highest."""
    model = tiny_model(seed=9, vocab=V)
    src_ids = src_batch(torch.Generator().manual_seed(3), [6, 4, 2], V)
    cfg = SearchConfig(beam_size=4, nbest=4, alpha=0.6, max_new_tokens=10)
    for i, nbest in enumerate(beam_search(model, src_ids, cfg)):
        src = [t for t in src_ids[i].tolist() if t]
        scores = score_encoded(model, [src] * len(nbest), [h.tokens[:-1] for h in nbest], batch_tokens=1000)
        totals = [s.total - s.token_logprobs[-1] * (len(h.tokens) == 10) for s, h in zip(scores, nbest)]
        assert totals == pytest.approx([h.logprob for h in nbest], abs=1e-4)
        normalised = [t / ((5 + len(h.tokens)) / 6) ** cfg.alpha for t, h in zip(totals, nbest)]
        assert normalised[0] == max(normalised) and len(nbest) > 1


def test_nmt_score_prints_sum_mean_and_tokens(tmp_path, capsys):
    directory = model_dir(tmp_path / "m")
    (tmp_path / "a.en").write_text("the dog sleeps\na cat\n", encoding="utf-8")
    (tmp_path / "a.xx").write_text("le chien\nun chat miaou\n", encoding="utf-8")
    assert main(["score", str(directory), "--src", str(tmp_path / "a.en"), "--tgt", str(tmp_path / "a.xx"),
                 "--per-token"]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = Translator.from_pretrained(directory).score(["the dog sleeps", "a cat"], ["le chien", "un chat miaou"])
    assert len(lines) == 2
    for line, s in zip(lines, want):
        total, mean, tokens = line.split("\t")
        assert float(total) == pytest.approx(s.total, abs=1e-4) and float(mean) == pytest.approx(s.mean, abs=1e-4)
        assert [float(x) for x in tokens.split()] == pytest.approx(s.token_logprobs, abs=1e-4)
    (tmp_path / "b.xx").write_text("one line\n", encoding="utf-8")
    assert main(["score", str(directory), "--src", str(tmp_path / "a.en"), "--tgt", str(tmp_path / "b.xx")]) == 2
    assert "has 2 lines but" in capsys.readouterr().err
    with pytest.raises(NmtError, match="targets"):
        Translator.from_pretrained(directory).score(["a"], [])
