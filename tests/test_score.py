"""Forced decoding: `nmt score` / `Translator.score` give the model's own log-softmax at the reference tokens,
and beam search's best hypothesis outscores every other one it kept."""

from __future__ import annotations

import pytest
import torch
from helpers import BOS, EOS, model_dir, one_thread, src_batch, tiny_model  # noqa: F401

from nmt import Translator
from nmt.cli import main
from nmt.decoding import SearchConfig, beam_search, score_encoded
from nmt.errors import NmtError

V = 20


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
    """Scored independently, each kept hypothesis' log-probability is the beam's, and the best one's
    length-normalised score is the highest."""
    model = tiny_model(seed=9, vocab=V)
    src_ids = src_batch(torch.Generator().manual_seed(3), [6, 4, 2], V)
    cfg = SearchConfig(beam_size=4, nbest=4, alpha=0.6, max_new_tokens=10)
    for i, nbest in enumerate(beam_search(model, src_ids, cfg)):
        src = [t for t in src_ids[i].tolist() if t]
        scores = score_encoded(model, [src] * len(nbest), [h.tokens[:-1] for h in nbest], batch_tokens=1000)
        assert [s.total for s in scores] == pytest.approx([h.logprob for h in nbest], abs=1e-4)
        normalised = [s.total / ((5 + len(h.tokens)) / 6) ** cfg.alpha for s, h in zip(scores, nbest)]
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
