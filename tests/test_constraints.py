"""Glossaries (nmt.constraints): terms found in a text as whole words, leftmost then longest, whatever the
whitespace and NFKC; and the constrained beam search that writes each term of a sentence as a whole word, leaves a
sentence without terms as the plain search has it, and reads the device once a step. How `translate` and `nmt
translate --glossary` use them is tested with the translator (test_translate)."""

from __future__ import annotations

import re
import unicodedata

import pytest
import torch
from helpers import PAD, forced_logprob, one_thread, src_batch, tiny_model  # noqa: F401  (one_thread: module-wide)
from helpers import SEARCH_PROPERTY as PROPERTY
from helpers import SEARCH_VOCAB as V
from helpers import search_cases as cases
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.constraints import Glossary
from nmt.decoding import SearchConfig, beam_search
from nmt.errors import NmtError


def _targets_by_regex(pairs: list[tuple[str, str]], text: str) -> list[str]:
    """Glossary.targets_in's rule as one regular expression (what it was until issue 47, row 3): the terms as
    alternatives, longest first, whole words, whitespace runs alike, after NFKC."""
    target = {" ".join(unicodedata.normalize("NFKC", s).split()): t for s, t in pairs}
    alternatives = "|".join(r"\s+".join(map(re.escape, term.split())) for term in sorted(target, key=len, reverse=True))
    found = {target[" ".join(m.group(0).split())]: None
             for m in re.finditer(rf"(?<!\w)(?:{alternatives})(?!\w)", unicodedata.normalize("NFKC", text))}
    return list(found)


WORDS = st.text(alphabet="ab_1.+ \t\u00a0\ufb01", max_size=5)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(WORDS.filter(str.strip), WORDS.filter(str.strip)), min_size=1, max_size=6),
       st.text(alphabet="ab_1.+ \t\u00a0\ufb01", max_size=30))
def test_glossary_terms_match_as_whole_words_leftmost_longest(pairs, text):
    """Glossary.targets_in (a trie walked from each word start) finds what the rule says, on any text: whole words,
    case as given, any whitespace run for one, NFKC (ﬁ is fi, a no-break space a space), leftmost then longest."""
    try:
        glossary = Glossary.from_pairs(pairs)
    except NmtError:  # a source term given twice with two targets
        return
    assert glossary.targets_in(text) == _targets_by_regex(list(glossary.pairs), text)
    assert glossary.targets_in(text) == _targets_by_regex(list(glossary.pairs), text)  # remembered, the same


def holds(tokens: list[int], term: list[int]) -> bool:
    return any(tokens[i: i + len(term)] == term for i in range(len(tokens) - len(term) + 1))


@st.composite
def constrained_cases(draw):
    """(model, src_ids, terms): a random tiny model, a batch, and per sentence 0-3 terms of 1-3 word ids, each
    starting a word (an id of V // 2 or more: see JOINS), at least one sentence with terms."""
    model, src_ids = draw(cases())
    term = st.builds(lambda first, rest: [first, *rest], st.integers(V // 2, V - 1),
                     st.lists(st.integers(4, V - 1), max_size=2))
    terms = [draw(st.lists(term, max_size=3)) for _ in range(src_ids.shape[0])]
    if not any(terms):
        terms[0] = [draw(term)]
    return model, src_ids, terms


JOINS = torch.arange(V).lt(V // 2) & torch.arange(V).ge(4)  # (V,) words 4 .. V/2 - 1 continue the word before them


@PROPERTY
@given(case=constrained_cases(), beam=st.integers(1, 4), alpha=st.sampled_from([0.0, 0.6]))
def test_every_term_appears_and_sentences_without_terms_are_translated_as_without(case, beam, alpha):
    """Constrained beam search: every hypothesis that ends before its length limit holds every term of its sentence
    (several terms in one sentence too) as a whole word (the token after it does not continue it), and the best
    one holds them all (at the limit a hypothesis ends whatever it holds, and ranks after those that hold more);
    each is scored by the model's own log-probability. A sentence without terms in the same batch gets the plain
    search's hypotheses (beam 1: greedy's, which sums in float64)."""
    model, src_ids, terms = case
    cfg = SearchConfig(beam_size=beam, nbest=beam, alpha=alpha, max_len_a=14, max_len_b=0, max_new_tokens=14)
    plain = beam_search(model, src_ids, cfg)
    found = beam_search(model, src_ids, cfg, terms, JOINS)
    for i, (hyps, ts) in enumerate(zip(found, terms)):
        if not ts:
            assert [h.tokens for h in hyps] == [h.tokens for h in plain[i]]
            assert [h.score for h in hyps] == pytest.approx([h.score for h in plain[i]], abs=1e-5)
            continue
        assert 1 <= len(hyps) <= beam and all(holds(hyps[0].tokens, term) for term in ts), (hyps, ts)
        for hyp in hyps:
            if len(hyp.tokens) == 14:  # cut at the limit (where </s> is forced)
                continue
            src_row = src_ids[i: i + 1][:, : int(src_ids[i].ne(PAD).sum())]
            assert abs(hyp.logprob - forced_logprob(model, src_row, hyp.tokens)) < 1e-4
            for term in ts:  # as a whole word: what follows one of its places does not continue it
                ends = [j + len(term) for j in range(len(hyp.tokens)) if hyp.tokens[j: j + len(term)] == term]
                assert any(not JOINS[hyp.tokens[e]] for e in ends), (hyp.tokens, term)


def test_without_terms_a_search_is_the_plain_one():
    """terms of no sentence (or None) is the plain beam search, output for output."""
    model = tiny_model(seed=5, vocab=V)
    src_ids = src_batch(torch.Generator().manual_seed(5), [5, 3, 7], V)
    cfg = SearchConfig(beam_size=3, nbest=2)
    assert beam_search(model, src_ids, cfg, [[], [], []]) == beam_search(model, src_ids, cfg)


def test_a_constrained_search_reads_the_device_once_a_step():
    """The terms' state stays on the device: a constrained search reads it as often as a plain one, once more at the
    end (how many terms each finished hypothesis missed)."""
    from helpers import HostSyncs

    model = tiny_model(seed=3, vocab=30, layers=2)
    src_ids = src_batch(torch.Generator().manual_seed(3), [6, 2, 9, 4], 30)
    cfg = SearchConfig(beam_size=4, max_new_tokens=9, nbest=2)
    with HostSyncs() as syncs:
        found = beam_search(model, src_ids, cfg, [[[7, 8]], [], [[5], [11, 12]], []], torch.zeros(30, dtype=torch.bool))
    steps = max(len(h.tokens) for hyps in found for h in hyps)
    assert set(syncs.calls) <= {"__int__", "tolist"} and syncs.calls.count("__int__") == 1
    assert syncs.calls.count("tolist") - 6 <= steps
