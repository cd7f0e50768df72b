"""The timing probe and the config resolved with it (nmt.training.timing), as `nmt train` and `nmt check` meet
them: a time budget plans the fields left open and prints them with their reasons, the values printed are the values
trained with, the compiling steps are left out of the timing, a probe out of memory says the batch does not fit,
sizes left to the corpus are chosen once and kept on resume."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)

from nmt import train
from nmt.compat import reset_accelerate_state
from nmt.errors import NmtError
from nmt.tools.check import preflight
from nmt.training import loop
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_sizes_left_to_the_corpus_are_chosen_recorded_and_kept_on_resume(corpus_dir, tmp_path, capsys, monkeypatch):
    from nmt.config import ModelConfig, TokenizerConfig, read_yaml
    from nmt.tools.info import describe

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


def test_nmt_check_times_the_training_step(tiny_cfg, monkeypatch):
    """The probe of `nmt check` and training call one `train_step`, with the same objective and optimizer."""
    from nmt.model import Seq2SeqLoss
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
    from nmt.training import timing

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
