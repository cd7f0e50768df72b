"""Training end to end in-process on a tiny model: metrics, checkpoints, resume, best model, translation; and the
run's mixed precision: the launcher's when it chose one; under a time budget bf16 where the device multiplies it in
hardware; fp32 otherwise (the plan and `nmt check` time steps in the precision training will use)."""

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)
from safetensors.torch import load_file

from nmt import Translator, train
from nmt.checkpoint import list_checkpoints
from nmt.compat import reset_accelerate_state
from nmt.errors import NmtError
from nmt.tools.check import preflight
from nmt.training import loop, run
from nmt.training.loop import OneDevice, inverse_sqrt, linear_decay, run_precision
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_train_writes_everything_and_translates(tiny_cfg):
    result = train(tiny_cfg)
    run = Path(tiny_cfg.output_dir)
    assert result.steps == 12
    assert sorted(p.name for p in result.model_dir.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "training.json"]
    assert [p.name for p in list_checkpoints(run)] == ["step_6", "step_12"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows, valid_rows = [r for r in rows if "loss" in r], [r for r in rows if "bleu" in r]
    assert [r["step"] for r in train_rows] == [3, 6, 9, 12]
    assert [r["step"] for r in valid_rows] == [6, 12]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]  # it learns
    assert (run / "config.yaml").is_file()
    out = Translator.from_pretrained(result.model_dir).translate(["The dog sleeps.", "I am young."], beam_size=2)
    assert len(out) == 2 and all(isinstance(s, str) for s in out)
    summary = json.loads((result.model_dir / "training.json").read_text())
    assert summary["step"] in (6, 12) and "bleu" in summary["metrics"]


def test_under_a_time_budget_validations_during_warmup_score_the_loss_only(tiny_cfg, monkeypatch):
    """Cheap validations early: no decoding while the learning rate warms up (step <= warmup_steps)."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # fp32 on any CPU: the precision is not under test
    tiny_cfg.max_minutes, tiny_cfg.eval_every, tiny_cfg.save_every = 30.0, 3, 3  # warmup_steps 10, max_steps 12
    train(tiny_cfg)
    rows = [json.loads(line) for line in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in rows if "valid_nll" in r]
    assert [(r["step"], "bleu" in r) for r in valid] == [(3, False), (6, False), (9, False), (12, True)]


def test_resume_continues_at_the_saved_step(tiny_cfg):
    tiny_cfg.max_steps = 6
    train(tiny_cfg)
    reset_accelerate_state()
    tiny_cfg.max_steps, tiny_cfg.resume = 12, "latest"
    result = train(tiny_cfg)
    rows = [json.loads(line) for line in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [3, 6, 9, 12]  # no step trained twice
    assert result.steps == 12


def test_resume_without_checkpoint_is_a_clear_error(tiny_cfg):
    tiny_cfg.resume = "latest"
    with pytest.raises(NmtError, match="no checkpoint"):
        train(tiny_cfg)


@pytest.mark.parametrize("bpe_dropout, multilingual", [(None, False), (0.1, False), (0.1, True)],
                         ids=["plain", "bpe-dropout", "two-pairs-temperature-5"])
def test_resumed_run_equals_uninterrupted_run(corpus_dir, tmp_path, bpe_dropout, multilingual):
    from functools import partial

    from nmt.config import TokenizerConfig
    from tests.conftest import multilingual_config, tiny_config

    tok = TokenizerConfig(vocab_size=300, dropout=bpe_dropout)  # BPE-dropout: the same noisy segmentation too
    # max_tokens 2000: 8 (9 with BPE-dropout) steps an epoch, so the resumed half crosses into epoch 1; two pairs
    # (en->xx and xx->en weighted 1 and 0.5, tagged, mixed at temperature 5: each corpus a sample drawn anew each
    # epoch) have about 1.5 times the pairs and twice the tokens a step
    make = partial(multilingual_config, temperature=5.0, reverse_weight=0.5) if multilingual else tiny_config
    common = dict(max_steps=12, save_every=6, eval_every=100, tokenizer=tok, max_tokens=4000 if multilingual else 2000)
    whole = make(corpus_dir, tmp_path / "a", **common)
    train(whole)
    reset_accelerate_state()
    split = make(corpus_dir, tmp_path / "b", **common | {"max_steps": 6})
    train(split)
    reset_accelerate_state()
    split.max_steps, split.resume = 12, "latest"
    train(split)
    a = load_file(Path(whole.output_dir) / "checkpoints" / "step_12" / "model.safetensors")
    b = load_file(Path(split.output_dir) / "checkpoints" / "step_12" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise: same data order, same RNG, same updates


class SeedStyleModel(torch.nn.Module):
    """A user's own model in the DataParallel question's spirit, rewritten to take ids only and derive its masks."""

    def __init__(self, vocab: int, d: int = 32):
        super().__init__()
        self.pad_id, self.bos_id, self.eos_id = 0, 2, 3
        self.embed = torch.nn.Embedding(vocab, d)
        self.transformer = torch.nn.Transformer(d, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.out = torch.nn.Linear(d, vocab)

    def forward(self, src_ids, tgt_in_ids):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt_in_ids.shape[1], device=src_ids.device)
        h = self.transformer(self.embed(src_ids), self.embed(tgt_in_ids), tgt_mask=causal, tgt_is_causal=True,
                             src_key_padding_mask=src_ids.eq(self.pad_id),
                             memory_key_padding_mask=src_ids.eq(self.pad_id))
        return self.out(h)


def test_bring_your_own_model(tiny_cfg):
    tiny_cfg.max_steps = 4
    result = train(tiny_cfg, model=SeedStyleModel(vocab=300))
    assert (result.model_dir / "model.safetensors").is_file()
    assert result.steps == 4


class MaskTakingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, src, tgt, tgt_mask, src_pad_mask):
        return src


def test_model_breaking_the_contract_is_named(tiny_cfg):
    with pytest.raises(NmtError, match=r"MaskTakingModel.forward must take exactly \(src_ids, tgt_in_ids\)"):
        train(tiny_cfg, model=MaskTakingModel())
    with pytest.raises(NmtError, match="predicts 17 classes but the target vocabulary has 300"):
        train(tiny_cfg, model=SeedStyleModel(vocab=17))


def test_inverse_sqrt_schedule():
    f = inverse_sqrt(4)
    assert [round(f(s), 3) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, round((4 / 5) ** 0.5, 3), round((4 / 6) ** 0.5, 3)]


def test_linear_decay_schedule():
    f = linear_decay(2, 6)
    assert [round(f(s), 3) for s in range(8)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert linear_decay(10, 4)(3) > 0  # a warmup longer than the run still trains before the end
    assert [linear_decay(1, 1)(s) for s in range(2)] == [1.0, 0.0]  # a one-step run


def test_a_linear_schedule_ends_training_where_its_lr_reaches_zero(tiny_cfg):
    """optim.decay_steps bounds the run (lr 0 after it); left null it is the run's own length."""
    tiny_cfg.optim.schedule, tiny_cfg.optim.decay_steps, tiny_cfg.max_steps = "linear", 5, 100
    tiny_cfg.optim.warmup_steps, tiny_cfg.log_every = 2, 1
    assert train(tiny_cfg).steps == 5
    rows = [json.loads(x) for x in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert lrs and lrs[-1] < max(lrs)


def test_a_linear_schedule_under_a_time_budget_ends_at_the_planned_steps(tiny_cfg, capsys):
    """optim.schedule linear with max_minutes and the rest planned: the plan times steps, fills decay_steps, and
    the run ends there (or at the time limit, if it comes first)."""
    from nmt.config import OptimConfig

    tiny_cfg.optim = OptimConfig(schedule="linear")
    tiny_cfg.max_steps, tiny_cfg.max_minutes, tiny_cfg.save_every = None, 0.05, None
    result = train(tiny_cfg)
    plan = json.loads((Path(tiny_cfg.output_dir) / "plan.json").read_text())
    assert "optim.decay_steps" in capsys.readouterr().out and 1 <= result.steps <= plan["chosen"]["optim.decay_steps"]


def test_coming_from_dataparallel_doc_model_trains(tiny_cfg):
    doc = (Path(__file__).parent.parent / "docs" / "coming-from-dataparallel.md").read_text()
    model_code = doc.split("```python\n")[2].split("```")[0]  # the rewritten seed model
    scope: dict = {}
    exec(model_code, scope)
    model = scope["SeedTransformer"](300, 300, dim_model=32, num_heads=2, num_encoder_layers=1,
                                     num_decoder_layers=1, dropout_p=0.0)
    tiny_cfg.max_steps = 3
    result = train(tiny_cfg, model=model)
    summary = json.loads((result.model_dir / "training.json").read_text())
    assert "bleu" in summary["metrics"]  # encode/decode present: validation decoded with beam search
    dp = torch.nn.DataParallel(model.eval())
    src, tgt = torch.tensor([[5, 6, 3, 0], [7, 8, 9, 3]]), torch.tensor([[2, 5, 0], [2, 7, 8]])
    assert torch.allclose(dp(src, tgt), model(src, tgt), atol=1e-6)


def test_early_stopping_with_patience(tiny_cfg):
    tiny_cfg.max_steps, tiny_cfg.eval_every, tiny_cfg.patience = 60, 2, 1
    tiny_cfg.optim.lr = 0.0  # nothing changes, so the second validation cannot improve on the first
    result = train(tiny_cfg)
    assert result.steps == 4  # validations at 2 (best) and 4 (no better): patience 1 is used up


def test_checkpoint_average_is_kept_when_not_worse(tiny_cfg):
    tiny_cfg.max_steps, tiny_cfg.save_every, tiny_cfg.eval_every = 9, 3, 3
    tiny_cfg.keep_last, tiny_cfg.average_last = 3, 3
    tiny_cfg.optim.lr = 0.0  # identical checkpoints: the average validates exactly as well, so it is kept
    result = train(tiny_cfg)
    summary = json.loads((result.model_dir / "training.json").read_text())
    assert summary["metrics"]["averaged"] == "step_3, step_6, step_9"


def test_sizes_left_to_the_corpus_are_chosen_recorded_and_kept_on_resume(corpus_dir, tmp_path, capsys, monkeypatch):
    from nmt.config import ModelConfig, TokenizerConfig, read_yaml
    from nmt.tools.info import describe
    from tests.conftest import tiny_config

    cfg = tiny_config(corpus_dir, tmp_path, tokenizer=TokenizerConfig(), model=ModelConfig(), max_steps=4,
                      save_every=4, eval_every=4)
    result = train(cfg)
    out = capsys.readouterr().out
    assert "  tokenizer.vocab_size 1,000: for 600 training pairs" in out and "  model.size tiny: d_model 32" in out
    run = read_yaml(Path(cfg.output_dir) / "config.yaml")  # 600 pairs: 1,000 subwords and the tiny model
    assert run["tokenizer"]["vocab_size"] == 1000 and run["model"]["size"] == "tiny" and run["model"]["d_model"] == 32
    info = describe(result.model_dir)
    assert info["architecture"]["d_model"] == 32 and info["architecture"]["size"] == "tiny"
    assert info["vocab"]["src"] <= 1000
    reset_accelerate_state()
    monkeypatch.setattr("nmt.plan.SIZES", ((None, 500, "small"),))  # the rule changed since
    cfg.max_steps, cfg.resume = 6, "latest"
    assert train(cfg).steps == 6  # the checkpoint's model and tokenizer again, not the new rule's
    assert read_yaml(Path(cfg.output_dir) / "config.yaml") == run | {"max_steps": 6, "resume": "latest"}


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


def test_progress_line_and_one_line_validation(tiny_cfg, capsys, caplog, monkeypatch):
    """On a terminal the main process keeps one live line (steps done/total, elapsed<ETA, epoch, loss, lr, target
    tokens/s); each validation prints one compact line; checkpoints of the tied embeddings print no warning."""
    import re

    monkeypatch.setattr("nmt.training.loop.stderr_is_terminal", lambda: True)
    tiny_cfg.max_steps, tiny_cfg.eval_every, tiny_cfg.save_every = 4, 2, 2
    with caplog.at_level("WARNING"):
        train(tiny_cfg)
    assert not [r for r in caplog.records if "shared tensor" in r.getMessage()]
    assert not logging.getLogger("accelerate.utils.other").filters  # muted only while saving, then restored
    err = capsys.readouterr().err
    bar = [s for s in re.split(r"[\r\n]", err) if s.startswith("train:")][-1]  # the line as it was left
    m = re.search(r"\| (\d+)/(\d+) \[[\d:]+<([\d:]+),\s+[\d.]+(?:step/s|s/step), epoch=(\d+), loss=([\d.]+), "
                  r"lr=([\d.e+-]+), tok/s=(\d+), mem=[\d.]+G\]$", bar)
    assert m, bar
    assert (m[1], m[2], m[3]) == ("4", "4", "00:00") and float(m[5]) > 0 and float(m[6]) > 0 and int(m[7]) > 0
    valid = [line for line in err.splitlines() if line.startswith("valid @")]
    assert [line.split(":")[0] for line in valid] == ["valid @ step 2", "valid @ step 4"]
    for line in valid:
        assert re.fullmatch(r"valid @ step \d: valid_nll [\d.]+ valid_ppl [\d.]+ bleu [\d.]+ chrf [\d.]+( \(best\))?", line)


def test_progress_off_a_terminal_is_plain_lines_every_log_every(tiny_cfg, capsys, monkeypatch):
    """stderr is not a terminal (captured here, as under SLURM or nohup): one plain line every log_every steps,
    no carriage returns or bar redraws; each with the process's peak memory, as metrics.jsonl's rows have it.
    The CUDA allocator is set to grow its segments unless the user's PYTORCH_ALLOC_CONF says otherwise."""
    import json
    import re

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    tiny_cfg.max_steps, tiny_cfg.log_every = 6, 2
    train(tiny_cfg)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("train:")]
    assert [line.split()[2] for line in lines] == ["2/6", "4/6", "6/6"]
    assert re.fullmatch(r"train: step 6/6 \(100%\) \[[\d:]+<00:00\] epoch=\d+ loss=[\d.]+ lr=[\d.e+-]+ tok/s=\d+ "
                        r"mem=[\d.]+G", lines[-1]), lines[-1]
    rows = [json.loads(line) for line in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    peaks = [row["peak_memory_gib"] for row in rows if "loss" in row]
    assert len(peaks) == 3 and 0 < peaks[0] <= peaks[1] <= peaks[2]  # a peak: it never falls
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    from nmt.training.run import expandable_segments

    expandable_segments()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "backend:cudaMallocAsync"  # the user's setting wins


def test_progress_total_comes_from_the_time_budget(tiny_cfg, capsys):
    """max_minutes ends the run long before max_steps: the progress total is what the budget allows, not
    max_steps, and the last line reaches it."""
    tiny_cfg.max_steps, tiny_cfg.max_minutes, tiny_cfg.log_every = 100_000, 0.05, 1
    result = train(tiny_cfg)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train:")]
    done, total = map(int, lines[-1].split()[2].split("/"))
    assert done == result.steps <= total < 100_000  # the total follows the re-timed plan's estimate
    assert all(int(line.split()[2].split("/")[1]) < 100_000 for line in lines[1:])


def test_budget_total_projects_the_steps_left_in_the_budget():
    from nmt.training.loop import budget_total

    assert budget_total(100_000, 0, 0, 0.0, 25) == 100_000  # no step done: no rate yet
    assert budget_total(100_000, 10, 10, 60.0, None) == 100_000  # no budget
    assert budget_total(100_000, 10, 10, 60.0, 25) == 10 + 24 * 60 * 10 // 60  # 10 steps a minute, 24 minutes left
    assert budget_total(200, 10, 10, 60.0, 25) == 200  # max_steps comes first
    assert budget_total(100_000, 30, 10, 60.0, 1) == 30  # resumed at step 20, the budget spent


def test_trackers_get_the_config_and_the_metrics_file_rows(tiny_cfg):
    """log_with goes through Accelerate's trackers: init with the flattened config, every metrics.jsonl row
    logged at its step, finished at the end (a GeneralTracker object stands in for tensorboard/wandb/...)."""
    import json

    from accelerate.tracking import GeneralTracker

    class Recorder(GeneralTracker):
        name, requires_logging_directory = "recorder", False

        def __init__(self):
            super().__init__()
            self.config, self.rows, self.finished = None, [], False

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            self.config = values

        def log(self, values, step=None, **kwargs):
            self.rows.append({"step": step, **values})

        def finish(self):
            self.finished = True

    recorder = Recorder()
    tiny_cfg.max_steps, tiny_cfg.log_every, tiny_cfg.eval_every = 4, 2, 4
    tiny_cfg.log_with = [recorder]
    train(tiny_cfg)
    assert recorder.config["max_steps"] == 4 and recorder.config["model.d_model"] == tiny_cfg.model.d_model
    rows = [json.loads(line) for line in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in recorder.rows] and [2, 4] == sorted({r["step"] for r in rows})
    assert all(r.items() <= t.items() for r, t in zip(rows, recorder.rows) if "loss" in r)
    assert recorder.finished


@pytest.mark.parametrize("name, needle", [("tensorbored", "unknown tracker 'tensorbored'"),
                                          ("aim", "tracker 'aim' is not installed; pip install aim")])
def test_tracker_that_cannot_log_is_named_before_training(tiny_cfg, name, needle):
    import importlib.util

    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    tiny_cfg.log_with = [name]
    with pytest.raises(NmtError, match=needle):
        train(tiny_cfg)
    assert not (Path(tiny_cfg.output_dir) / "metrics.jsonl").exists()


def test_nmt_check_times_the_training_step(tiny_cfg, monkeypatch):
    """The probe of `nmt check` and training call one `train_step`, with the same objective and optimizer."""
    from nmt.model import Seq2SeqLoss
    from nmt.tools.check import preflight
    from nmt.training import loop

    calls, real = [], loop.train_step

    def spy(accelerator, objective, optim, window, stop=False):
        base = accelerator.unwrap_model(objective) if hasattr(accelerator, "unwrap_model") else objective
        calls.append((type(accelerator).__name__, type(base), optim.optimizer.defaults, optim.clip_norm))
        return real(accelerator, objective, optim, window, stop)

    monkeypatch.setattr(loop, "train_step", spy)
    tiny_cfg.max_steps = 1
    preflight(tiny_cfg, probe_steps=1)
    train(tiny_cfg)
    assert [c[0] for c in calls] == ["OneDevice", "OneDevice", "Accelerator"]  # warm-up, timed, trained
    kinds = {c[1] for c in calls}  # one objective class (on a CPU: nmt.kernels' fused loss)
    assert len(kinds) == 1 and issubclass(kinds.pop(), Seq2SeqLoss)
    probe, trained = calls[1], calls[2]
    assert probe[2] == trained[2] and probe[3] == trained[3]  # the same AdamW settings (fused where available)


def test_the_plans_timing_leaves_out_the_steps_that_compiled(monkeypatch):
    """Under compile, a probe step during which torch.compile compiled a graph (the first shape; the dynamic one at
    the second) is a warm-up, not a timed step: the plan never prices a step by its compilation."""
    from helpers import src_batch, tgt_in_batch, tiny_model

    from nmt.config import TrainConfig
    from nmt.training import loop, timing

    gen = torch.Generator().manual_seed(0)
    windows = []
    for lengths in ([5, 3], [7, 2, 4], [3], [6, 6], [4], [2, 5]):
        tgt = tgt_in_batch(gen, lengths, 30)
        windows.append([{"src_ids": src_batch(gen, lengths, 30), "tgt_in_ids": tgt,
                         "labels": torch.cat([tgt[:, 1:], torch.zeros_like(tgt[:, :1])], 1)}])
    graphs, real = [0], loop.train_step

    def compiling(accelerator, objective, optim, window, stop=False):  # steps 0 and 2 compile a graph
        graphs[0] += window is windows[0] or window is windows[2]
        return real(accelerator, objective, optim, window, stop)

    monkeypatch.setattr(loop, "train_step", compiling)
    monkeypatch.setattr(timing, "graphs_compiled", lambda: graphs[0])
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: None)  # what compiles is faked above
    cfg = TrainConfig(compile=True)
    timed = timing.time_steps(tiny_model(vocab=30).train(), cfg, iter(windows), 3, torch.device("cpu"))
    position = {id(w): i for i, w in enumerate(windows)}
    assert [position[id(w)] for _, w in timed] == [1, 3, 4]
    cfg.compile = False  # without compile only the first step warms up
    timed = timing.time_steps(tiny_model(vocab=30).train(), cfg, iter(windows), 3, torch.device("cpu"))
    assert [position[id(w)] for _, w in timed] == [1, 2, 3]


def test_a_probe_that_runs_out_of_memory_answers_that_the_batch_does_not_fit(tiny_cfg, monkeypatch):
    """The plan's speed probe answers None for a batch whose step runs out of memory (the plan then backs off to
    a smaller one, test_plan), and `nmt check` names the batch and the fix."""
    from nmt.data import prepare
    from nmt.plan import RUNGS
    from nmt.tools.check import preflight
    from nmt.training import loop, timing

    real = loop.train_step

    def out_of_memory(accelerator, objective, optim, window, stop=False):
        return dataclasses.replace(real(accelerator, objective, optim, window, stop), out_of_memory=1)

    monkeypatch.setattr(loop, "train_step", out_of_memory)
    corpus = prepare(tiny_cfg.data, tiny_cfg.tokenizer)
    assert timing.speed_probe(tiny_cfg, corpus, "cpu", "no")(RUNGS[0], 1024) is None
    with pytest.raises(NmtError, match="ran out of memory on cpu at [0-9,]+ padded tokens a micro-batch; lower "
                                       "max_tokens, and raise accum_steps"):
        preflight(tiny_cfg, probe_steps=1, device="cpu")


def plan_lines(out: str) -> dict[str, str]:
    """The printed plan's and re-timing's values by key (a later value of a key replaces the earlier one)."""
    from nmt.plan import KEYS

    values = {}
    for line in out.splitlines():
        key, _, rest = line.strip().partition(" ")
        if line.startswith("  ") and key in KEYS:
            values[key] = rest.split(":", 1)[0]
        if line.startswith("nmt: re-timed at step") and "; " in line:
            for item in line.split("; ", 1)[1].split(", "):
                key, _, value = item.partition(" ")
                values[key] = value
    return values


def trained_values(run: Path, keys) -> dict[str, str]:
    """The values the run's last step trained with (its model directory's config: the resolved config with what
    the plan re-timed since, nmt.plan.settings)."""
    from nmt.config import TrainConfig, from_dict
    from nmt.plan import get, show

    cfg = from_dict(TrainConfig, json.loads((run / "model" / "training.json").read_text())["config"])
    return {key: show(get(cfg, key)) for key in keys}


def test_a_time_budget_plans_the_null_fields_saves_the_plan_and_resume_reuses_it(corpus_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    """max_minutes with lr, warmup, cadence and model left null: a few real steps are timed, the plan fills them
    (explicit max_tokens and eval_every win), is printed and saved, re-timed on the run's own steps; a resume
    reads plan.json back and times nothing."""
    from nmt.config import ModelConfig, OptimConfig, read_yaml
    from tests.conftest import tiny_config

    cfg = tiny_config(corpus_dir, tmp_path, model=ModelConfig(), optim=OptimConfig(), max_steps=12,
                      max_minutes=10, eval_every=4, save_every=None, log_every=1000)
    train(cfg)  # 12 steps: the plan is re-timed after the 6th (the first warms up)
    out = capsys.readouterr()
    printed = plan_lines(out.out + out.err)
    assert {"save_every", "optim.lr", "optim.warmup_steps", "model.size"} <= set(printed)
    from nmt.training.loop import launched_precision, native_bf16

    bf16 = native_bf16("cpu") and launched_precision() is None
    assert ("\n  precision bf16: for the time budget" in out.out) == bf16  # printed with the plan, with its reason
    assert "max_tokens" not in printed and "eval_every" not in printed  # given: kept, and not printed
    run = Path(cfg.output_dir)
    assert printed == trained_values(run, printed)  # every value printed is the value trained with
    plan = json.loads((run / "plan.json").read_text())
    saved = read_yaml(run / "config.yaml")
    assert saved["max_tokens"] == 400 and saved["eval_every"] == 4
    assert plan["seconds_per_token"] > 0 and plan["retimed"]["at_step"] == 6  # re-timed on its own steps
    assert plan["retimed"]["seconds_per_step"] > 0
    reset_accelerate_state()
    import nmt.training.timing as timing

    def no_timing(*args, **kwargs):
        raise AssertionError("a resume timed steps again instead of reading plan.json")

    monkeypatch.setattr(timing, "speed_probe", no_timing)
    cfg.resume, cfg.max_steps = "latest", 14
    train(cfg)  # the same run: the checkpoint's config matches the saved plan's choices
    again = json.loads((run / "plan.json").read_text())
    assert again["chosen"] == plan["chosen"] and again["retimed"] == plan["retimed"]


@pytest.mark.slow  # a real time budget spent to its end
def test_a_budget_alone_trains_until_it_is_spent_and_says_what_the_user_has(corpus_dir, tmp_path, capsys):
    """The README's own-corpus command, a small budget: no epoch limit cuts it short (>= 90% of the minutes
    used), and the end names the minutes, why it stopped, the validation and test scores and the commands."""
    from nmt.cli import main

    d, run = corpus_dir, tmp_path / "run"
    assert main(["train", "--data.train", f"{d}/train", "--data.valid", f"{d}/valid", "--data.test", f"{d}/test",
                 "--data.src_lang", "en", "--data.tgt_lang", "xx", "--max_minutes", "0.25", "--output_dir", str(run),
                 "--data.cache_dir", str(tmp_path / "cache")]) == 0
    captured = capsys.readouterr()
    out = captured.out
    printed = plan_lines(out + captured.err)
    assert {"max_epochs", "model.size", "optim.lr", "max_tokens", "eval_every"} <= set(printed)
    assert printed == trained_values(run, printed)  # every value printed is the value trained with
    head = next(line for line in out.splitlines() if line.startswith("nmt: trained "))
    used, budget = (float(x) for x in head.split(" in ")[1].split(" minutes")[0].split(" of "))
    assert budget == 0.25 and used >= 0.9 * budget, head
    assert head.endswith("stopped: the time budget is spent")
    assert "  best validation: bleu " in out and f"  model: {run / 'model'}" in out
    assert "  test (beam 4, 40 pairs): BLEU " in out
    assert f"nmt translate {run / 'model'} --input FILE --output FILE" in out
    assert f"nmt evaluate {run / 'model'} --src {d}/test.en --ref {d}/test.xx" in out


def test_a_limit_set_in_the_config_is_named_when_it_ends_the_run(tiny_cfg, capsys):
    from nmt.cli import main
    from nmt.config import save_yaml

    tiny_cfg.max_steps, tiny_cfg.max_epochs, tiny_cfg.max_minutes = None, 1, 10
    save_yaml(tiny_cfg, Path(tiny_cfg.output_dir).parent / "c.yaml")
    assert main(["train", "--config", str(Path(tiny_cfg.output_dir).parent / "c.yaml")]) == 0
    head = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nmt: trained "))
    assert " of 10 minutes; stopped: max_epochs 1, set in the config" in head and "(1.0 epochs)" in head


def test_the_quickstart_config_prints_only_what_it_leaves_open_and_trains_with_it(corpus_dir, tmp_path, capsys):
    """configs/default.yaml as `bash run.sh` trains it (on a small corpus, a few steps): the plan names only the
    values it chose, and those are the values trained with."""
    from nmt.cli import main

    d, run = corpus_dir, tmp_path / "run"
    root = Path(__file__).resolve().parents[1]
    assert main(["train", "--config", str(root / "configs" / "default.yaml"), "--data.train", f"{d}/train",
                 "--data.valid", f"{d}/valid", "--data.test", f"{d}/test", "--max_steps", "4", "--eval_every", "4",
                 "--save_every", "4", "--output_dir", str(run), "--data.cache_dir", str(tmp_path / "cache")]) == 0
    printed = plan_lines(capsys.readouterr().out)
    assert set(printed) == {"average_last", "keep_last"}  # lr, warmup and cadence are the YAML's: not printed
    assert printed == trained_values(run, printed)


def test_a_run_refused_before_it_starts_leaves_its_output_dir_unused(tiny_cfg):
    """The plan is saved only once the run starts: a model breaking the contract leaves nothing to refuse the
    next try for."""
    with pytest.raises(NmtError, match="must take exactly"):
        train(tiny_cfg, model=MaskTakingModel())
    out = Path(tiny_cfg.output_dir)
    assert not out.exists() or not any(out.iterdir())


def test_an_optimizer_step_reads_the_device_once_whatever_its_micro_batches():
    """train_step over 3 micro-batches of the plain objective (a GPU's): the micro-batches read nothing (token
    counts and loss sums stay tensors), and the step's figures are read once, with the gradient norm."""
    from helpers import HostSyncs, src_batch, tgt_in_batch, tiny_model

    from nmt.config import TrainConfig
    from nmt.model import Seq2SeqLoss
    from nmt.training.loop import OneDevice, make_optim, train_step

    gen = torch.Generator().manual_seed(0)
    model = tiny_model(vocab=30, layers=1, dropout=0.1).train()
    objective = Seq2SeqLoss(model, 0.1)
    cfg = TrainConfig()
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
    optim = make_optim(objective, cfg)
    window = []
    for lengths in ([5, 3], [7, 2, 4], [3]):
        tgt = tgt_in_batch(gen, lengths, 30)
        window.append({"src_ids": src_batch(gen, lengths, 30), "tgt_in_ids": tgt,
                       "labels": torch.cat([tgt[:, 1:], torch.zeros_like(tgt[:, :1])], 1)})
    with HostSyncs() as syncs:
        stats = train_step(OneDevice(torch.device("cpu"), accum_steps=3), objective, optim, window)
    assert syncs.calls == ["tolist"]
    assert stats.finite and stats.tokens == sum(int(b["labels"].ne(0).sum()) for b in window)


def test_an_optimizer_step_off_the_host_reads_once_copies_nothing_from_it_and_mixes_no_devices():
    """The same step as a GPU runs it (the objective as training builds it, AdamW unfused where the device has no
    fused kernel), on `meta`:
    shapes without values, so a read of a value, a copy from host memory (which makes a GPU's host wait) or a
    tensor of another device shows itself (`helpers.OffHost`). The one read is the step's figures."""
    from helpers import OffHost, src_batch, tgt_in_batch, tiny_model

    from nmt.config import TrainConfig
    from nmt.kernels import FusedSeq2SeqLoss
    from nmt.training.loop import OneDevice, make_objective, make_optim, train_step

    gen, meta = torch.Generator().manual_seed(0), torch.device("meta")
    cfg = TrainConfig()
    objective = make_objective(tiny_model(vocab=30, dropout=0.1).train().to(meta), cfg, meta)
    assert type(objective) is FusedSeq2SeqLoss
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
    optim = make_optim(objective, cfg)
    window = []
    for lengths in ([5, 3], [7, 2, 4]):
        tgt = tgt_in_batch(gen, lengths, 30)
        batch = {"src_ids": src_batch(gen, lengths, 30), "tgt_in_ids": tgt,
                 "labels": torch.cat([tgt[:, 1:], torch.zeros_like(tgt[:, :1])], 1)}
        window.append({k: v.to(meta) for k, v in batch.items()})
    for stop in (False, True):
        with OffHost() as off:
            train_step(OneDevice(meta, accum_steps=2), objective, optim, window, stop=stop)
        assert (off.reads, off.copies, off.mixes) == (["tolist"], [], [])


# --- the run's mixed precision -----------------------------------------------------------------------------------


@pytest.fixture
def precision_cfg(corpus_dir, tmp_path):
    return tiny_config(corpus_dir, tmp_path)


@pytest.fixture
def unlaunched(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("minutes", [None, 25.0])
def test_bf16_only_for_a_time_budget_on_hardware_that_has_it(precision_cfg, unlaunched, monkeypatch, native, minutes):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: native)
    expected = "bf16" if native and minutes else "no"
    precision, why = run_precision(dataclasses.replace(precision_cfg, max_minutes=minutes), "cpu")
    assert precision == expected and (why is not None) == (expected == "bf16")  # the plan prints why it chose bf16


@pytest.mark.parametrize("bf16_units", [True, False])
@pytest.mark.parametrize("minutes", [None, 25.0])
def test_a_gpu_trains_in_bf16_where_it_has_the_units_else_fp16(precision_cfg, unlaunched, monkeypatch, bf16_units,
                                                                minutes):
    """Issue 46, part 1: on a GPU nmt trains mixed, budget or not: bf16 with bf16 units, fp16 (scaled) without;
    bf16 that torch only emulates (V100, T4) does not count. The device's answers are faked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_units or
                        including_emulation)
    assert loop.native_bf16("cuda") == bf16_units
    precision, why = run_precision(dataclasses.replace(precision_cfg, max_minutes=minutes), "cuda")
    assert precision == ("bf16" if bf16_units else "fp16") and ("bf16 units" in why)


@pytest.mark.parametrize("launched", ["no", "FP16", "bf16"])
def test_the_launchers_choice_wins(precision_cfg, monkeypatch, launched):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    assert run_precision(dataclasses.replace(precision_cfg, max_minutes=25.0), "cpu") == (launched.lower(), None)


def test_the_accelerator_trains_in_the_chosen_precision(precision_cfg, unlaunched, monkeypatch, capsys):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    reset_accelerate_state()
    try:
        timed = dataclasses.replace(precision_cfg, max_minutes=25.0)
        assert run.make_accelerator(timed, run_precision(timed, "cpu")[0]).mixed_precision == "bf16"
        reset_accelerate_state()
        assert run.make_accelerator(precision_cfg, run_precision(precision_cfg, "cpu")[0]).mixed_precision == "no"
    finally:
        reset_accelerate_state()


def test_validation_decodes_in_the_training_precision(precision_cfg, monkeypatch):
    """Issue 46, part 1: a run in bf16 decodes its validation under the same autocast (it decoded in fp32)."""
    import nmt.training.evaluation as evaluation

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    search, seen = evaluation.search_encoded, []
    monkeypatch.setattr(evaluation, "search_encoded", lambda *a, **kw: seen.append(
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None) or search(*a, **kw))
    reset_accelerate_state()
    try:
        train(dataclasses.replace(precision_cfg, max_steps=4, eval_every=2))
    finally:
        reset_accelerate_state()
    assert seen and set(seen) == {torch.bfloat16}, seen


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("no", None)])
def test_one_device_steps_run_the_forward_under_autocast(precision, dtype):
    seen = []
    one = OneDevice(torch.device("cpu"), mixed_precision=precision)
    with one.accumulate(None):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        x = torch.ones(2, 2) @ torch.ones(2, 2)
    assert seen == [dtype] and x.dtype == (dtype or torch.float32)
    assert not torch.is_autocast_enabled("cpu")  # only inside the micro-batch


def test_check_probes_in_the_precision_training_will_use(precision_cfg, unlaunched, monkeypatch):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    seen = []
    real = loop.train_step

    def spy(accelerator, *args, **kwargs):
        seen.append(accelerator.mixed_precision)
        return real(accelerator, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", spy)
    report = preflight(dataclasses.replace(precision_cfg, max_minutes=5.0), probe_steps=1, device="cpu")
    assert report.precision == "bf16" and set(seen) == {"bf16"}
    assert " s/step on cpu in bf16 " in next(line for line in report.lines() if line.startswith("time"))
