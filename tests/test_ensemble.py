"""Ensembles: a model ensembled with itself decodes and scores exactly as it does alone (greedy, beam,
sampling); two different models give something else; models with different tokenizers are refused."""

from __future__ import annotations

import pytest
import torch
from helpers import EOS, model_dir, one_thread, src_batch, tiny_model  # noqa: F401

from nmt import Translator
from nmt.cli import main
from nmt.decoding import Ensemble, SamplingConfig, SearchConfig, score_encoded, search
from nmt.errors import NmtError

V = 20


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
