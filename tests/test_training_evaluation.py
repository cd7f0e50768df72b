"""Validation and the kept model (nmt.training.evaluation): validation builds no autograd graph, the loss only while
a time budget's warmup runs, the checkpoint average kept when it is not worse, the tuned length penalty (validation
decoded, the best alpha kept, the default among equals)."""

import json
from pathlib import Path

import pytest
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)

from nmt import Translator, train

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_validation_builds_no_autograd_graph(tiny_cfg, monkeypatch):
    """Every pass of the model in eval mode (validation's loss and its decoding) runs with autograd off: a graph
    kept per validation batch costs memory and time and changes no score (found in review: a helper slipped between
    `@torch.no_grad()` and `validate`)."""
    import torch

    from nmt.model import Seq2SeqTransformer

    passes, real = [], Seq2SeqTransformer.decode_hidden

    def recorded(model, *args, **kwargs):
        passes.append((model.training, torch.is_grad_enabled()))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(Seq2SeqTransformer, "decode_hidden", recorded)
    tiny_cfg.max_steps, tiny_cfg.eval_every, tiny_cfg.save_every = 4, 2, 100
    train(tiny_cfg)
    validating = [grad for training, grad in passes if not training]
    assert validating and not any(validating), passes  # validated, never with autograd on
    assert any(grad for training, grad in passes if training)  # training's passes keep theirs


def test_under_a_time_budget_validations_during_warmup_score_the_loss_only(tiny_cfg, monkeypatch):
    """Cheap validations early: no decoding while the learning rate warms up (step <= warmup_steps)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # fp32 on any CPU: the precision is not under test
    tiny_cfg.max_minutes, tiny_cfg.eval_every, tiny_cfg.save_every = 30.0, 3, 3  # warmup_steps 10, max_steps 12
    train(tiny_cfg)
    rows = [json.loads(line) for line in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in rows if "valid_nll" in r]
    assert [(r["step"], "bleu" in r) for r in valid] == [(3, False), (6, False), (9, False), (12, True)]


def test_checkpoint_average_is_kept_when_not_worse(tiny_cfg):
    tiny_cfg.max_steps, tiny_cfg.save_every, tiny_cfg.eval_every = 9, 3, 3
    tiny_cfg.keep_last, tiny_cfg.average_last = 3, 3
    tiny_cfg.optim.lr = 0.0  # identical checkpoints: the average validates exactly as well, so it is kept
    result = train(tiny_cfg)
    summary = json.loads((result.model_dir / "training.json").read_text())
    assert summary["metrics"]["averaged"] == "step_3, step_6, step_9"


def test_tune_alpha_decodes_validation_only_and_the_model_keeps_the_best(tiny_cfg, monkeypatch, capsys):
    import importlib

    from nmt.cli import main
    from nmt.tools.info import describe, lines

    train_module = importlib.import_module("nmt.training.evaluation")  # validation decodes through nmt.decoding
    decoded = []
    real = train_module.search_encoded

    def spy(model, src_ids, search, *args, **kwargs):
        decoded.append((search.alpha, search.beam_size, list(src_ids)))
        return real(model, src_ids, search, *args, **kwargs)

    monkeypatch.setattr(train_module, "search_encoded", spy)
    tiny_cfg.eval_beam, tiny_cfg.tune_alpha = 2, [0.0, 2.0]
    result = train(tiny_cfg)
    tuning = decoded[-3:]  # after the validations: one decode per alpha, the default 0.6 included
    assert [(a, k) for a, k, _ in tuning] == [(0.0, 2), (0.6, 2), (2.0, 2)]
    from nmt.data import prepare
    corpus = prepare(tiny_cfg.data, tiny_cfg.tokenizer)
    assert all(ids == corpus.splits["valid"]["src_ids"][:16] for _, _, ids in tuning)  # never the test set
    search = json.loads((result.model_dir / "search.json").read_text())
    bleu = {float(a): b for a, b in search["bleu"].items()}
    assert search["alpha"] == train_module.best_alpha(bleu, 0.6) == result.best["alpha"]
    last = json.loads((Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tuned_alpha"] == search["alpha"] and last["default_alpha_bleu"] == bleu[0.6]
    assert Translator.from_pretrained(result.model_dir).search_defaults == {"alpha": search["alpha"]}
    assert any(line.startswith("search        alpha") for line in lines(describe(result.model_dir)))

    (result.model_dir / "search.json").write_text(json.dumps({"alpha": 1.7}))
    used = []
    monkeypatch.setattr("nmt.engines.search_encoded",
                        lambda model, ids, search, *a, **k: used.append(search.alpha) or real(model, ids, search, *a, **k))
    src = Path(tiny_cfg.output_dir) / "in.txt"
    src.write_text("The dog sleeps.\n")
    capsys.readouterr()
    assert main(["translate", str(result.model_dir), "--input", str(src), "--beam", "2"]) == 0
    assert main(["translate", str(result.model_dir), "--input", str(src), "--beam", "2", "--alpha", "0.2"]) == 0
    assert used == [1.7, 0.2]  # the model's own default, and an explicit --alpha over it


def test_best_alpha_prefers_the_default_among_equals():
    from nmt.training.evaluation import best_alpha

    assert best_alpha({0.6: 30.0, 1.0: 31.0, 1.4: 29.0}, 0.6) == 1.0
    assert best_alpha({0.0: 31.0, 0.6: 31.0, 1.0: 31.0}, 0.6) == 0.6
    assert best_alpha({0.2: 31.0, 0.6: 30.0, 1.0: 31.0, 1.2: 31.0}, 0.6) == 0.2  # equally near: the smaller
    assert best_alpha({0.6: 30.0, 0.8: 31.0, 1.0: 31.0}, 0.6) == 0.8
