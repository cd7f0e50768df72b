"""`nmt check` / `nmt train --dry-run`: the numbers of a pre-flight check, and the problems it names."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)

from nmt.batching import TokenBatchSampler
from nmt.cli import main
from nmt.config import DataConfig, ModelConfig
from nmt.data import prepare
from nmt.encoding import pair_lengths
from nmt.errors import NmtError
from nmt.model import Seq2SeqTransformer, label_smoothed_nll
from nmt.synthetic import generate_pairs
from nmt.tools.check import activation_bytes, attention_kernel, launch_processes, memory_fixes, preflight
from tests.conftest import tiny_config, write_pairs

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def cfg(corpus_dir, tmp_path_factory):
    return tiny_config(corpus_dir, tmp_path_factory.mktemp("check"))


@pytest.fixture(scope="module")
def report(cfg):
    return preflight(cfg, num_processes=1, probe_steps=2, device="cpu")


def test_counts_lengths_and_vocabulary(cfg, report):
    corpus = prepare(cfg.data, cfg.tokenizer)  # the same cache: an independent look at what was checked
    assert report.pairs == {"train": 600 - sum(report.dropped.values()), "valid": 40, "test": 40}
    assert report.read == 600
    src = np.array([len(x) for x in corpus.splits["train"]["src_ids"]])
    tgt = np.array([len(x) + 1 for x in corpus.splits["train"]["tgt_ids"]])
    for p, lengths in ((report.src_len, src), (report.tgt_len, tgt)):
        assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"] == lengths.max()
        assert p["p50"] == int(np.percentile(lengths, 50, method="higher"))
    assert report.tokens_per_epoch == {"src": src.sum(), "tgt": tgt.sum()}
    assert report.joint_vocab and report.src_vocab_size == report.tgt_vocab_size == corpus.tokenizer.src_vocab_size
    assert report.unk_rate == {"src": 0.0, "tgt": 0.0}
    assert 0 <= report.padding_share < 0.5


@pytest.mark.parametrize("world, accum", [(1, 1), (2, 1), (2, 3)])
def test_steps_per_epoch_are_the_training_samplers(cfg, world, accum):
    cfg = dataclasses.replace(cfg, accum_steps=accum, max_steps=None, max_epochs=2)
    r = preflight(cfg, num_processes=world, probe_steps=0)
    train = prepare(cfg.data, cfg.tokenizer).splits["train"]
    plan = TokenBatchSampler(train["cost"], cfg.max_tokens, 0, world, accum, cfg.seed, pair_lengths(train)[0]).plan(0)
    assert r.steps_per_epoch == len(plan) and r.micro_batches_per_epoch == len(plan) * accum
    assert r.total_steps == 2 * len(plan)
    assert r.seconds_per_step is None  # no probe asked for


def test_bpe_dropout_is_planned_as_training_plans_its_first_epoch(cfg):
    from nmt.batching import bpe_dropout

    noisy = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, dropout=0.3), max_steps=None,
                                max_epochs=1)
    r = preflight(noisy, num_processes=1, probe_steps=1, device="cpu")
    plain = preflight(dataclasses.replace(noisy, tokenizer=cfg.tokenizer), num_processes=1, probe_steps=0)
    corpus = prepare(noisy.data, noisy.tokenizer)
    train = corpus.splits["train"]
    sampler = TokenBatchSampler(train["cost"], noisy.max_tokens, 0, 1, 1, noisy.seed, pair_lengths(train)[0],
                                epoch_lengths=bpe_dropout(noisy, corpus).lengths)  # as nmt.train builds it
    assert r.steps_per_epoch == sampler.steps_per_epoch(0) > plain.steps_per_epoch  # noisier pieces: more tokens
    assert r.tokens_per_epoch["src"] > plain.tokens_per_epoch["src"] and r.src_len["p50"] >= plain.src_len["p50"]
    assert "BPE-dropout p=0.3" in next(line for line in r.lines() if line.startswith("epoch"))
    assert r.seconds_per_step > 0


def test_more_processes_fewer_steps(cfg, report):
    assert preflight(cfg, num_processes=2, probe_steps=0).steps_per_epoch < report.steps_per_epoch


def test_probe_times_real_steps(report):
    assert report.probe_steps == 2 and report.probe_device == "cpu"
    assert 0 < report.seconds_per_step < 60
    assert report.seconds_per_epoch == pytest.approx(report.seconds_per_step * report.steps_per_epoch)


@pytest.mark.parametrize("max_minutes", [None, 5.0])
def test_a_linear_schedule_is_probed_with_or_without_a_time_budget(cfg, max_minutes):
    linear = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule="linear"), max_minutes=max_minutes)
    assert preflight(linear, num_processes=1, probe_steps=1, device="cpu").probe_steps == 1


def test_time_line_says_how_far_max_minutes_gets(report):
    """With a wall-clock budget the time line adds the steps and epochs it allows at the probed speed."""
    timed = dataclasses.replace(report, seconds_per_step=2.0, steps_per_epoch=50, total_steps=100_000,
                                cfg=dataclasses.replace(report.cfg, max_minutes=25))
    line = next(x for x in timed.lines() if x.startswith("time"))
    assert line.endswith("; max_minutes 25 allows ~750 steps (15.0 epochs)"), line
    assert "max_minutes" not in next(x for x in report.lines() if x.startswith("time"))


def test_parameters_and_memory(cfg, report):
    model = Seq2SeqTransformer(report.cfg.model)  # the resolved config's model, as training builds it
    assert report.n_params == model.num_parameters()
    assert report.memory["states"] == 16 * report.n_params
    assert report.memory["total"] == report.memory["states"] + report.memory["activations"] > 0
    line = next(x for x in report.lines() if x.startswith("model"))
    assert f"(fp32, {report.attention} attention)" in line and "on cpu" in line


def saved_activation_bytes(model: Seq2SeqTransformer, rows: int, length: int) -> int:
    """Bytes autograd saves for backward in one training forward (parameters not counted)."""
    params = {p.data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.layout == torch.strided and t.data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.cfg.tgt_vocab_size, (rows, length), generator=gen)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        label_smoothed_nll(model.train()(ids, ids), ids, 0, 0.1)
    return sum(storages.values())


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("kernel", ["math", "fused"])
@pytest.mark.parametrize("length", [10, 40])
def test_activation_formula_matches_what_autograd_saves(length, kernel, precision):
    """The estimate for the precision and the attention kernel in use: the fused kernels (a GPU's; a CPU's flash
    kernel, which takes no dropout) keep no H x L rows; under autocast the layers keep 16-bit tensors. A CPU's
    estimate counts the rows: its training step may take the math kernel whatever the dropout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = ModelConfig.preset("tiny", src_vocab_size=300, tgt_vocab_size=300, dropout=0.1, n_encoder_layers=2,
                           attention_dropout=0.1 if kernel == "math" else 0.0)
    assert attention_kernel(m, "cpu") == "math" and attention_kernel(m, "cuda") == "fused"
    torch.manual_seed(0)
    backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), sdpa_kernel([backend]):
        measured = saved_activation_bytes(Seq2SeqTransformer(m), 400 // length, length)
    # the plain loss's peak (3 V a position) also counts the logits and their gradient, which autograd does not save
    estimate = activation_bytes(m, 400, length, precision, kernel) - 4 * 400 * 2 * m.tgt_vocab_size
    assert estimate == pytest.approx(measured, rel=0.2)
    no_dropout = saved_activation_bytes(Seq2SeqTransformer(dataclasses.replace(m, dropout=0.0)), 400 // length, length)
    assert activation_bytes(m, 400, length, kernel="math") > no_dropout  # an upper bound without dropout


def test_checkpointed_layers_are_estimated_from_their_inputs():
    m = ModelConfig.preset("tiny", src_vocab_size=300, tgt_vocab_size=300, dropout=0.1, checkpoint_activations=True)
    torch.manual_seed(0)
    saved = saved_activation_bytes(Seq2SeqTransformer(m), 20, 20)  # the forward keeps each layer's input
    checkpointed = activation_bytes(m, 400, 20, checkpointed=True) - 4 * 400 * 2 * m.tgt_vocab_size
    assert saved < checkpointed < activation_bytes(m, 400, 20) - 4 * 400 * 2 * m.tgt_vocab_size


def test_a_gpu_too_small_for_the_estimate_gets_the_fixes_named(cfg, capsys):
    """`nmt check --gpu-memory GIB`: the estimate is made for a GPU (its precision, its fused attention kernel) and,
    where it does not fit, the problem names each fix with its own estimate: the max_tokens (and accum_steps) that
    fit, checkpointing, FSDP over the GPUs; LoRA when fine-tuning."""
    report = preflight(cfg, num_processes=1, probe_steps=0, device="cpu", gpu_memory=2**40)  # a GPU's estimate
    assert report.attention == "fused"
    total = report.memory["total"]
    assert memory_fixes(report, 2 * total) is None
    problem = memory_fixes(report, total)
    fit = int((0.9 * total - report.memory["states"]) / (report.memory["activations"] / cfg.max_tokens)) // 256 * 256
    assert problem.startswith("memory: ~") and "does not fit 90% of a" in problem
    assert f"max_tokens {fit:,} with accum_steps {-(-cfg.max_tokens // fit)}" in problem
    assert "model.checkpoint_activations: true (~" in problem and "FSDP over 8 GPUs, accelerate_configs/fsdp.yaml" \
        in problem and "LoRA" not in problem
    tuned = dataclasses.replace(report, cfg=dataclasses.replace(report.cfg, init_from="runs/a/model"))
    assert "LoRA, finetune.lora_r: 8 (~" in memory_fixes(tuned, total)
    args = ["--data.train", f"{cfg.data.train}", "--data.valid", f"{cfg.data.valid}", "--data.cache_dir",
            f"{cfg.data.cache_dir}", "--model.preset", "tiny", "--tokenizer.vocab_size", "300", "--max_steps", "10"]
    assert main(["check", *args, "--probe-steps", "0", "--gpu-memory", "0.001"]) == 1
    out = capsys.readouterr().out
    assert "memory per process on a GPU" in out and "fused attention)" in out  # a GPU's kernel, not this CPU's
    assert "problem   memory: ~" in out and "of a 1.02 MiB GPU" in out


def test_tiny_validation_set_is_named(report):
    assert len(report.problems) == 1
    assert "tiny validation set: 40 pairs (< 100)" in report.problems[0] and "data.valid" in report.problems[0]


def test_a_sound_setup_has_no_problems(cfg, tmp_path):
    write_pairs(tmp_path / "valid", generate_pairs(120, seed=11))
    sound = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, valid=str(tmp_path / "valid")))
    r = preflight(sound, probe_steps=0)
    assert r.pairs["valid"] == 120 and r.problems == []
    assert r.lines()[-1] == "problems  none found"


def test_dirty_corpus_counts_drops_by_reason(corpus_dir, tmp_path):
    good = list(dict.fromkeys(generate_pairs(80, seed=3)))[:60]  # 60 distinct pairs
    bad = ([("", "eine Zeile")] * 35 + [("a\x00b", "c d")] * 10 + [(" ".join(["w"] * 50), "x y")] * 5
           + [("one two three four five six seven eight nine ten", "eins")] * 10 + [good[0]] * 5)
    write_pairs(tmp_path / "train", good + bad)
    cfg = tiny_config(corpus_dir, tmp_path, data=DataConfig(
        train=str(tmp_path / "train"), valid=str(corpus_dir / "valid"), test=str(corpus_dir / "test"),
        max_words=40, cache_dir=str(tmp_path / "cache")))
    r = preflight(cfg, probe_steps=0)
    assert r.read == 125
    # identical bad pairs count under their reason, not as duplicates: reasons are checked first
    assert r.dropped == {"empty": 35, "nul_byte": 10, "too_long": 5, "length_ratio": 10, "duplicate": 5}
    assert r.pairs["train"] == 60
    dropped = [p for p in r.problems if p.startswith("cleaning dropped")]
    assert len(dropped) == 1 and "65 of 125 training pairs (52%)" in dropped[0] and "'empty' (35)" in dropped[0]
    assert "dropped: empty 35, " in r.lines()[0]  # the largest first


def test_length_and_budget_problems_name_the_setting(cfg):
    cfg = dataclasses.replace(cfg, max_tokens=12, model=dataclasses.replace(cfg.model, max_positions=16))
    report = preflight(cfg, probe_steps=0)
    assert report.dropped["too_many_subwords"] > 0  # longer than max_positions: dropped and counted, never trained on
    assert any("max_tokens=12 is smaller than the longest training pair" in p for p in report.problems)


def test_unknown_characters_in_validation_are_named(cfg, tmp_path):
    write_pairs(tmp_path / "valid", [("Съешь же ещё этих мягких булок", "да выпей чаю")] * 100)
    odd = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, valid=str(tmp_path / "valid")))
    r = preflight(odd, probe_steps=0)
    assert r.unk_rate["src"] > 0.5 and r.unk_rate["tgt"] > 0.5
    assert sum("vocabulary too small" in p and "tokenizer.vocab_size" in p for p in r.problems) == 2


def test_process_count_from_flag_profile_or_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_NUM_PROCESSES", raising=False)
    assert launch_processes()[0] == 1
    monkeypatch.setenv("ACCELERATE_NUM_PROCESSES", "4")
    assert launch_processes() == (4, "ACCELERATE_NUM_PROCESSES")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert launch_processes() == (8, "WORLD_SIZE")
    assert launch_processes(profile=ROOT / "accelerate_configs" / "cpu_2proc.yaml")[0] == 2
    assert launch_processes(flag=3, profile=ROOT / "accelerate_configs" / "cpu_2proc.yaml") == (3, "--num-processes")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(NmtError, match="WORLD_SIZE='two'"):
        launch_processes()


def test_check_and_dry_run_print_the_same_report(corpus_dir, tmp_path, capsys):
    args = ["--data.train", f"{corpus_dir}/train", "--data.valid", f"{corpus_dir}/valid", "--data.test",
            f"{corpus_dir}/test", "--data.cache_dir", f"{tmp_path}/cache", "--output_dir", f"{tmp_path}/run",
            "--model.preset", "tiny", "--tokenizer.vocab_size", "300", "--max_tokens", "400", "--max_steps", "10",
            "--num-processes", "2", "--probe-steps", "1"]
    assert main(["check", *args]) == 1  # a problem found: the tiny validation set
    checked = capsys.readouterr().out.splitlines()
    assert main(["train", "--dry-run", *args]) == 1
    dry = capsys.readouterr().out.splitlines()
    assert checked[0] == "nmt check: default config for 2 processes (from --num-processes)"
    assert [line for line in checked if not line.startswith("time")] == [line for line in dry if not line.startswith("time")]
    assert any(line.startswith("problem   tiny validation set") for line in checked)
    assert not (tmp_path / "run").exists()  # a dry run trains and writes nothing


def test_the_plan_lines_are_the_resolution_training_makes(cfg, report, tmp_path):
    """nmt check prints the plan `nmt.plan.resolve` makes for training: one line per value it chose, none for the
    values given."""
    given = [line for line in report.lines() if line.startswith("plan") or line.startswith("  ")]
    assert "model.size" not in "".join(given) and "tokenizer.vocab_size" not in "".join(given)  # the fixture sets them
    auto = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, vocab_size=None),
                               model=ModelConfig(d_model=48, n_heads=2))
    r = preflight(auto, probe_steps=0)
    lines = [line for line in r.lines() if line.startswith("  ")]
    assert "  tokenizer.vocab_size 1,000: for 600 training pairs" in lines
    keys = [line.split()[0] for line in lines]
    assert "model.n_encoder_layers" in keys and "model.d_model" not in keys and "model.size" not in keys
    assert any(line.startswith("  model.n_encoder_layers 1: the rest of model tiny") for line in lines)
    assert (r.cfg.model.d_model, r.cfg.model.n_encoder_layers, r.cfg.tokenizer.vocab_size) == (48, 1, 1000)
    built = ModelConfig.preset("tiny", d_model=48, src_vocab_size=r.src_vocab_size, tgt_vocab_size=r.tgt_vocab_size)
    assert r.n_params == Seq2SeqTransformer(built).num_parameters()  # the probe measured the model training builds
