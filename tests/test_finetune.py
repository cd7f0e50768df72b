"""Fine-tuning a model directory on another corpus (`init_from`): its tokenizer and architecture are kept,
mismatches are named, the starting model is validated before step 1 and never beaten by a worse one, and `nmt
check` reports how the old tokenizer fits the new data."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nmt import train
from nmt.config import FinetuneConfig, ModelConfig, OptimConfig, TokenizerConfig
from nmt.errors import NmtError
from nmt.loading import open_model
from nmt.plan import LORA_LR
from nmt.synthetic import generate_pairs
from nmt.tools.check import preflight
from tests.conftest import tiny_config, write_pairs
from tests.helpers import sum_error

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def domains(tmp_path_factory) -> Path:
    """Two domains of the synthetic language, short sentences (quick to learn): statements (a/), questions (b/)."""
    d = tmp_path_factory.mktemp("domains")
    pairs = generate_pairs(20000, seed=11)
    for name, keep in (("a", lambda p: not p[0].endswith("?") and len(p[0].split()) <= 6),
                       ("b", lambda p: p[0].endswith("?") and len(p[0].split()) <= 7)):
        chosen = [p for p in pairs if keep(p)][:2500]
        (d / name).mkdir()
        write_pairs(d / name / "train", chosen[:-60])
        write_pairs(d / name / "valid", chosen[-60:-30])
        write_pairs(d / name / "test", chosen[-30:])
    return d


def domain_config(domains: Path, name: str, out: Path, **overrides):
    cfg = tiny_config(domains / name, out, **overrides)
    cfg.data.cache_dir = str(domains / "cache")
    return cfg


def train_statements(domains: Path, out: Path, steps: int) -> Path:
    """A tiny model trained on the statements only; its model directory."""
    from nmt.compat import reset_accelerate_state

    reset_accelerate_state()
    cfg = domain_config(domains, "a", out, max_steps=steps, eval_every=steps, save_every=steps, max_tokens=800,
                        model=ModelConfig.preset("tiny", d_model=64, d_ff=128), tokenizer=TokenizerConfig(vocab_size=400),
                        optim=OptimConfig(lr=5e-3, warmup_steps=20))
    model_dir = train(cfg).model_dir
    reset_accelerate_state()
    return model_dir


@pytest.fixture(scope="module")
def trained_statements(domains, tmp_path_factory) -> Path:
    """A model directory trained 250 steps on the statements (~20 s: BLEU ~14 on them, a few on the questions)."""
    return train_statements(domains, tmp_path_factory.mktemp("a250"), 250)


@pytest.fixture(scope="module")
def statements_model(domains, tmp_path_factory) -> Path:
    """A model directory trained a few steps on the statements (what the checks need, not a good model)."""
    return train_statements(domains, tmp_path_factory.mktemp("a"), 4)


def bleu_by_step(out: str) -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["bleu"] for r in rows if "bleu" in r}


@pytest.mark.slow
def test_fine_tuning_on_a_new_domain_raises_its_bleu_from_the_start_and_keeps_the_tokenizer(domains, trained_statements,
                                                                                              tmp_path, capsys):
    statements_model = trained_statements
    capsys.readouterr()
    cfg = domain_config(domains, "b", tmp_path, init_from=str(statements_model), max_steps=80, eval_every=20,
                        save_every=80, max_tokens=800, optim=OptimConfig(lr=5e-3, warmup_steps=5),
                        model=ModelConfig(), tokenizer=TokenizerConfig(), eval_max_sentences=30)
    result = train(cfg)
    bleu, printed = bleu_by_step(cfg.output_dir), capsys.readouterr()
    assert bleu[80] > bleu[0] + 8 and bleu[80] > bleu[40], bleu  # the questions are learnt (measured 1.5 -> 12.9)
    # the start validated before step 1, printed, and the summary's start -> best
    assert f"nmt: start: BLEU {bleu[0]:.2f} on the validation set (30 pairs" in printed.err
    assert result.best["step"] > 0 and result.best["bleu"] > bleu[0]
    assert f"start -> best: BLEU {bleu[0]:.2f} -> {result.best['bleu']:.2f} (step {result.best['step']})" in \
        result.summary()
    assert "optim.lr 0.005: given, kept over the fine-tuning rule's" in printed.out  # the flag won, and says so
    assert "model.dropout 0: as the model was trained (its training.json)" in printed.out  # tiny's dropout 0
    assert (result.model_dir / "tokenizer.json").read_bytes() == (statements_model / "tokenizer.json").read_bytes()
    assert open_model(result.model_dir).model.cfg == open_model(
        statements_model).model.cfg  # the architecture of the model fine-tuned
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert next(r["lr"] for r in rows if "lr" in r) < cfg.optim.lr  # a fresh schedule: warming up again


@pytest.mark.slow
def test_a_run_that_only_gets_worse_ends_with_the_start_model_and_says_so(domains, trained_statements, tmp_path):
    cfg = domain_config(domains, "b", tmp_path, init_from=str(trained_statements), max_steps=6, eval_every=3,
                        save_every=3, max_tokens=800, optim=OptimConfig(lr=1.0, warmup_steps=1),  # a ruinous lr
                        model=ModelConfig(), tokenizer=TokenizerConfig(), eval_max_sentences=30)
    result = train(cfg)
    bleu = bleu_by_step(cfg.output_dir)
    assert bleu[0] > 1 and max(bleu[3], bleu[6]) < bleu[0], bleu
    assert result.best["step"] == 0 and result.best["bleu"] == bleu[0]
    assert "(no step beat the start: the model written is the starting model)" in result.summary()
    start, final = (load_file(str(d / "model.safetensors")) for d in (trained_statements, result.model_dir))
    assert start.keys() == final.keys() and all(torch.equal(start[k], final[k]) for k in start)


def test_a_resumed_fine_tuning_keeps_its_start_and_does_not_validate_it_again(domains, statements_model, tmp_path,
                                                                               capsys, fresh_accelerate_state):
    cfg = domain_config(domains, "b", tmp_path, init_from=str(statements_model), max_steps=4, eval_every=2,
                        save_every=2, model=ModelConfig(), tokenizer=TokenizerConfig())
    first = train(cfg)
    assert capsys.readouterr().err.count("nmt: start: BLEU") == 1 and "bleu" in first.start
    fresh_accelerate_state()
    cfg.max_steps, cfg.resume = 6, "latest"
    second = train(cfg)
    assert "nmt: start:" not in capsys.readouterr().err and second.steps == 6
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "bleu" in r] == [0, 2, 4, 6]  # step 0 once
    assert second.start == first.start and "start -> best: BLEU" in second.summary()


def run_training(cfg) -> None:  # top level: launched processes import it by name
    train(cfg)


@pytest.mark.multiprocess
def test_two_processes_validate_the_start_as_one_does(domains, statements_model, tmp_path, fresh_accelerate_state):
    from nmt.launch import launch

    runs = {n: domain_config(domains, "b", tmp_path / str(n), init_from=str(statements_model), max_steps=2,
                             eval_every=2, save_every=2, model=ModelConfig(dropout=0.0), tokenizer=TokenizerConfig())
            for n in (1, 2)}
    run_training(runs[1])
    fresh_accelerate_state()
    launch(run_training, (runs[2],), num_processes=2)
    starts = []
    for cfg in runs.values():
        rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
        starts.append([r for r in rows if r["step"] == 0])
        info = json.loads((Path(cfg.output_dir) / "checkpoints" / "step_2" / "nmt_checkpoint.json").read_text())
        assert {**info["state"]["start"], "step": 0} == starts[-1][0]  # in the run's JSON state, for a resume
    (one,), (two,) = starts  # one step-0 validation each, its scores the same on 1 and 2 processes
    assert (one["bleu"], one["chrf"]) == (two["bleu"], two["chrf"]) and one["chrf"] > 0
    # a mean of positive token losses summed in another order: at most a token a character, and an end each
    tokens = sum(len(line) + 1 for line in Path(runs[1].data.valid + ".xx").read_text(encoding="utf-8").splitlines())
    assert one["valid_nll"] == pytest.approx(two["valid_nll"], rel=sum_error(tokens))


def test_mismatches_with_the_model_directory_are_named(domains, statements_model, tmp_path):
    cases = {"data.tgt_lang": ({"data": "tgt_lang", "value": "de"}, r"translates en->xx, this config en->de"),
             "tokenizer.joint": ({"tokenizer": TokenizerConfig(joint=False)}, r"set tokenizer.joint: true"),
             "model.d_model": ({"model": ModelConfig(d_model=128)}, r"model.d_model is 64 there, 128 in this config"),
             "tokenizer.vocab_size": ({"tokenizer": TokenizerConfig(vocab_size=900)}, r"vocab_size 900 is not the model's")}
    for key, (change, message) in cases.items():
        cfg = domain_config(domains, "b", tmp_path / key, init_from=str(statements_model), model=ModelConfig(),
                            tokenizer=TokenizerConfig())
        if "data" in change:  # the questions again, as if German: b/*.xx copied to *.de
            for split in ("train", "valid", "test"):
                shutil.copyfile(domains / "b" / f"{split}.xx", domains / "b" / f"{split}.de")
            setattr(cfg.data, change["data"], change["value"])
        else:
            cfg = dataclasses.replace(cfg, **change)
        with pytest.raises(NmtError, match=message):
            train(cfg)
    cfg = domain_config(domains, "b", tmp_path / "nodir", init_from=str(tmp_path / "missing"))
    with pytest.raises(NmtError, match=r"config key .init_from.: .*missing does not exist; give a model directory"):
        train(cfg)
    damaged = shutil.copytree(statements_model, tmp_path / "damaged")  # its training.json cut short
    (damaged / "training.json").write_text((damaged / "training.json").read_text()[:40])
    cfg = domain_config(domains, "b", tmp_path / "fromdamaged", init_from=str(damaged))
    with pytest.raises(NmtError, match=r"damaged/training.json: not valid JSON"):
        train(cfg)


def test_a_pretrained_model_with_another_tokenizer_is_refused(domains, statements_model, tmp_path):
    cfg = domain_config(domains, "b", tmp_path, model=ModelConfig(), tokenizer=TokenizerConfig(vocab_size=400))
    model = open_model(statements_model).model
    with pytest.raises(NmtError, match=r"another tokenizer.*init_from="):
        train(cfg, model=model)  # before: a new tokenizer of the same size, ids silently meaning other subwords


def test_the_plan_fine_tunes_at_the_rate_the_model_was_trained_with(domains, statements_model, tmp_path):
    """nmt check (the plan training follows): a model nmt trained is fine-tuned at its own training.json's peak lr
    (5e-3 here), said so; its LoRA adapters at LORA_LR."""
    cfg = domain_config(domains, "b", tmp_path, init_from=str(statements_model), model=ModelConfig(),
                        tokenizer=TokenizerConfig(), optim=OptimConfig(), eval_every=None, max_steps=100)
    plan = preflight(cfg, probe_steps=0).plan
    assert "  optim.lr 0.005: the peak rate the model was trained with (its training.json): fine-tuning a model nmt " \
           "trained, it validated best of 3e-5 to 1.3e-3 (docs/configuration.md)" in plan
    assert any(line.startswith("  optim.warmup_steps 12: 12% of ~100 steps, as from scratch") for line in plan), plan
    lora = dataclasses.replace(cfg, finetune=FinetuneConfig(lora_r=4))
    assert any(line.startswith(f"  optim.lr {LORA_LR:g}: LoRA (rank 4)") for line in preflight(lora, probe_steps=0).plan)


def test_check_reports_the_old_tokenizer_on_the_new_corpus(domains, statements_model, tmp_path):
    cfg = domain_config(domains, "b", tmp_path, init_from=str(statements_model), model=ModelConfig(),
                        tokenizer=TokenizerConfig())
    report = preflight(cfg, probe_steps=0)
    line = next(x for x in report.lines() if x.startswith("init_from"))
    assert "subwords/word" in line and "on its own training data" in line and "<unk>" in line, line
    own = json.loads((statements_model / "training.json").read_text())["segmentation"]
    assert report.fit["old"] == own and report.fit["new"]["src"]["subwords_per_word"] > 1.0
    assert report.n_params == sum(p.numel() for p in open_model(statements_model).model.parameters())
