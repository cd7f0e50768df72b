"""The one resolution (nmt.plan.resolve): a config with open fields, the corpus and the measured speed in; a
complete config and the plan that says what was chosen out."""

import pytest

from nmt.config import MODEL_PRESETS, FinetuneConfig, ModelConfig, OptimConfig, TokenizerConfig, TrainConfig, load_config
from nmt.plan import (
    BATCHES,
    FILL,
    FINETUNE_LR,
    GPU_BATCHES,
    KEYS,
    LORA_LR,
    SIZES,
    TARGET_STEPS,
    TRAIN_SHARE,
    Facts,
    Measured,
    Plan,
    batches_for,
    flops_per_token,
    get,
    open_keys,
    resolve,
    retime,
    rung,
    settings,
    vocab_size_for,
)

TATOEBA = Facts(train_pairs=47_842, epoch_cost=335_492, longest_cost=30)  # as prepared: ~7 cost tokens a pair


def speed_for(steps: int, minutes: float, model: str = "d192"):
    """The speed at which `model` takes `steps` 2,048-token steps in the training share of `minutes`."""
    per_token = 60 * minutes * TRAIN_SHARE / (steps * 2048 * FILL)
    return lambda dims, tokens: per_token * flops_per_token(dims) / flops_per_token(rung(model))


def budget(minutes: float, **overrides) -> TrainConfig:
    return TrainConfig(max_minutes=minutes, **overrides)


def test_tatoeba_25_minutes_on_a_fast_cpu():
    """A fast 2-core CPU takes ~4,800 2,048-token steps of d192 in 25 minutes: d192 with 1,024-token batches (twice
    the updates), lr 0.0011, warmup 12% of the steps, 16 validations, 3 checkpoints averaged."""
    cfg, plan = resolve(budget(25), TATOEBA, speed=speed_for(4800, 25))
    assert (cfg.model.size, cfg.model.d_model, cfg.model.n_encoder_layers, cfg.model.d_ff) == ("d192", 192, 3, 768)
    assert cfg.max_tokens == 1024 and plan.steps == 9600 and cfg.optim.lr == pytest.approx(1.1e-3)
    assert cfg.optim.warmup_steps == 1152 and cfg.eval_every == 600 and cfg.save_every == cfg.eval_every
    assert cfg.average_last == 3 and cfg.keep_last >= 3 and cfg.model.dropout == 0.1
    assert cfg.tokenizer.dropout == 0.0 and cfg.tokenizer.vocab_size == 8_000  # ~27 epochs over 48k pairs
    assert cfg.max_epochs is None and cfg.max_steps is None  # the budget ends the run


def test_a_budget_alone_sets_no_epoch_limit_and_no_budget_trains_ten_epochs():
    cfg, plan = resolve(budget(25), TATOEBA, speed=speed_for(4800, 25))
    assert cfg.max_epochs is None and plan.reasons["max_epochs"] == "the 25-minute budget ends the run"
    cfg, plan = resolve(TrainConfig(), TATOEBA)
    assert cfg.max_epochs == 10 and "max_epochs" in plan.chosen
    mine, plan = resolve(budget(25, max_epochs=3), TATOEBA, speed=speed_for(4800, 25))
    assert mine.max_epochs == 3 and "max_epochs" not in plan.chosen  # what the user wrote, and nothing printed
    assert plan.epochs == pytest.approx(3, rel=0.01)  # the epochs bound the plan first


def test_the_resolved_config_has_no_open_field_left():
    """Every open key is chosen; the only nulls left are chosen ones that mean something (no epoch limit under a
    budget, all validation pairs)."""
    dims = {f"model.{k}" for k in ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff")}
    for cfg in (TrainConfig(), budget(25), budget(25, optim=OptimConfig(schedule="linear"))):
        out, plan = resolve(cfg, TATOEBA, speed=speed_for(4800, 25))
        assert set(open_keys(cfg)) - set(plan.chosen) == dims  # the shape: named by model.size, which is chosen
        assert set(open_keys(out)) == {k for k, v in plan.chosen.items() if v is None}


def test_every_printed_value_is_the_resolved_one_and_given_values_print_nothing():
    given = TrainConfig(max_minutes=25, max_tokens=1000, optim=OptimConfig(lr=0.002), model=ModelConfig(d_model=64))
    out, plan = resolve(given, TATOEBA, speed=speed_for(4800, 25))
    printed = plan.lines()[1:]
    for line in printed:
        key, rest = line.strip().split(" ", 1)
        value = rest.split(":", 1)[0]
        assert value == __import__("nmt.plan", fromlist=["show"]).show(get(out, key)), line
    keys = [line.split()[0] for line in printed]
    assert {"max_tokens", "optim.lr", "model.d_model", "model.size"}.isdisjoint(keys)  # given, or not all chosen
    assert (out.max_tokens, out.optim.lr, out.model.d_model) == (1000, 0.002, 64)
    assert out.model.n_encoder_layers == 3 and "model.n_encoder_layers" in keys  # the rest of the shape, chosen


def test_the_quickstart_config_prints_only_what_it_leaves_open():
    """configs/default.yaml gives the lr, warmup and cadence: the plan names none of them; a default nmt changed
    on measurement (punctuation as its own pre-token, the initialisation) is printed with its reason (issue 48)."""
    from pathlib import Path

    default = load_config(Path(__file__).parent.parent / "configs" / "default.yaml")
    out, plan = resolve(default, Facts(20_000, 200_000, 40))
    assert list(plan.chosen) == ["average_last", "keep_last"] == open_keys(default)
    assert (out.optim.lr, out.optim.warmup_steps, out.eval_every) == (0.002, 200, 250)
    assert [line.split(":")[0] for line in plan.lines()[1:]] == ["  average_last 0", "  keep_last 2",
                                                                  "  tokenizer.split_punctuation true",
                                                                  "  model.init_std null"]
    assert "measured +1.6 test BLEU" in plan.lines()[-2] and "on the quickstart and on Tatoeba" in plan.lines()[-1]
    import dataclasses

    without = dataclasses.replace(default, tokenizer=TokenizerConfig(split_punctuation=False),
                                  model=dataclasses.replace(default.model, init_std=0.0))
    assert not resolve(without, Facts(20_000, 200_000, 40))[1].defaults  # a setting given is not printed


def test_warmup_and_validations_scale_with_the_budget():
    short, long = (resolve(budget(m), TATOEBA, speed=speed_for(4800 * m // 25, m)) for m in (10, 75))
    for cfg, plan in (short, long):
        assert cfg.optim.warmup_steps == round(0.12 * plan.steps) and plan.steps // cfg.eval_every == 16
    assert (short[0].model.size, long[0].model.size) == ("d128", "small")  # a longer budget affords a wider model
    assert short[0].optim.warmup_steps < 1000  # a share of the run, not a fixed 1,000


def test_a_slower_machine_gets_a_smaller_model_and_a_faster_one_a_larger():
    slow, _ = resolve(budget(25), TATOEBA, speed=speed_for(1500, 25))
    fast, _ = resolve(budget(25), TATOEBA, speed=speed_for(30_000, 25))
    assert slow.model.size == "d128" and slow.optim.lr > 1.1e-3  # narrower: higher peak lr
    assert fast.model.size == "small" and fast.max_tokens == 4096  # enough steps for full batches


def test_the_batch_is_the_largest_that_allows_the_target_steps_else_the_smallest():
    """More, smaller updates under a short budget: each halving of the batch doubles the steps."""
    for steps_at_2048, tokens in ((2 * TARGET_STEPS, 4096), (TARGET_STEPS, 2048), (TARGET_STEPS - 100, 1024),
                                  (1000, 1024)):
        cfg, plan = resolve(budget(25, model=ModelConfig(size="d192")), TATOEBA, speed=speed_for(steps_at_2048, 25))
        assert cfg.max_tokens == tokens and cfg.max_tokens in BATCHES
        assert ("the largest batch that allows them" in plan.reasons["max_tokens"]) == (plan.steps >= TARGET_STEPS)
    assert resolve(TrainConfig(), TATOEBA)[0].max_tokens == BATCHES[0]  # no budget: the largest


def gpu_speed(launch_s: float, per_token_s: float, fits: int, model: str = "small"):
    """A GPU's step-time model, as a speed probe answers it: a step of `model` takes `launch_s` (its kernels' launches)
    plus `per_token_s` a token, other shapes by their FLOPs; a batch of more than `fits` tokens runs out of memory
    (None). Records what it was asked to time."""
    def speed(dims, tokens):
        speed.asked.append((dims.name, tokens))
        if tokens > fits:
            return None
        return (launch_s / (tokens * FILL) + per_token_s) * flops_per_token(dims) / flops_per_token(rung(model))

    speed.asked = []
    return speed


WMT_SLICE = Facts(train_pairs=2_000_000, epoch_cost=60_000_000, longest_cost=200)


def test_on_a_gpu_the_batch_is_the_largest_that_fits_and_allows_the_target_steps():
    """On a GPU the plan climbs rungs to 64k tokens, leaves out those that run out of memory (backing off from the
    largest), and times each rung it weighs at its own size (a launch-bound GPU's rate rises with the batch)."""
    assert batches_for("cuda:0") == GPU_BATCHES and batches_for("cpu") == BATCHES and max(GPU_BATCHES) == 65536
    speed = gpu_speed(launch_s=0.02, per_token_s=1e-7, fits=32768)
    cfg, plan = resolve(budget(120), WMT_SLICE, speed=speed, batches=GPU_BATCHES)
    assert cfg.max_tokens == 32768 and plan.steps >= TARGET_STEPS
    assert "65,536 did not fit the device's memory" in plan.reasons["max_tokens"]
    assert speed.asked[:2] == [("base", 65536), ("base", 32768)]  # out of memory at the top: one rung down
    assert all(tokens >= 32768 for _, tokens in speed.asked)  # no smaller batch timed: its rate is not the run's
    on_cpu_rungs, _ = resolve(budget(120), WMT_SLICE, speed=gpu_speed(0.02, 1e-7, fits=32768))
    assert on_cpu_rungs.max_tokens == 4096  # the CPU's rungs would have starved it


def test_a_short_budget_halves_a_gpus_batch_only_where_that_buys_updates():
    """Short of TARGET_STEPS, a compute-bound device halves the batch for twice the updates (as a CPU does), a
    launch-bound one keeps the larger batch: a halving there buys a few percent more updates of half the data."""
    short = budget(3, model=ModelConfig(size="base"))
    launch_bound, plan = resolve(short, WMT_SLICE, speed=gpu_speed(0.02, 1e-7, fits=65536), batches=GPU_BATCHES)
    assert launch_bound.max_tokens == 65536 and plan.steps < TARGET_STEPS
    assert "under 1.5x the updates a halving" in plan.reasons["max_tokens"]
    compute_bound, plan = resolve(short, WMT_SLICE, speed=gpu_speed(0.0, 1e-6, fits=65536), batches=GPU_BATCHES)
    assert compute_bound.max_tokens == 4096 and "so the smallest (more updates)" in plan.reasons["max_tokens"]


def test_a_model_that_fits_no_batch_is_named_with_the_fixes():
    from nmt.errors import NmtError

    with pytest.raises(NmtError, match="runs out of memory in batches of 4,096 tokens; give a smaller max_tokens"):
        resolve(budget(60, model=ModelConfig(size="base")), WMT_SLICE, speed=gpu_speed(0.02, 1e-7, fits=2048),
                batches=GPU_BATCHES)
    given, plan = resolve(budget(60, model=ModelConfig(size="base"), max_tokens=2048), WMT_SLICE,
                          speed=gpu_speed(0.02, 1e-7, fits=2048), batches=GPU_BATCHES)
    assert given.max_tokens == 2048 and plan.steps  # a batch size given is timed as given


def test_corpus_size_caps_the_model_and_sets_dropout():
    tiny, _ = resolve(budget(5), Facts(600, 6_000, 20), speed=speed_for(10**6, 5))
    assert tiny.model.size == "tiny" and tiny.model.dropout == 0.0 and tiny.tokenizer.vocab_size == 1_000
    small, _ = resolve(budget(60), Facts(10_000, 200_000, 40), speed=speed_for(20_000, 60))
    assert small.model.size == "d192" and small.model.dropout == 0.2  # many epochs over little data, no wider
    larger, _ = resolve(budget(60), Facts(30_000, 600_000, 40), speed=speed_for(20_000, 60))
    assert larger.model.size == "small" and larger.model.dropout == 0.1


def test_one_sizing_table_without_a_budget():
    """Without a time budget the model is the widest the corpus may use: the same table as the budget's cap."""
    for below, vocab, widest in SIZES:
        pairs = (below or 10**8) - 1
        cfg, _ = resolve(TrainConfig(), Facts(pairs, pairs * 10, 40))
        assert cfg.model.size == widest and cfg.tokenizer.vocab_size == vocab == vocab_size_for(pairs)
        assert (cfg.model.d_model, cfg.model.d_ff) == (MODEL_PRESETS[widest]["d_model"], MODEL_PRESETS[widest]["d_ff"])


def test_many_epochs_over_a_small_corpus_turn_on_bpe_dropout():
    small = Facts(10_000, 200_000, 40)
    many, plan = resolve(budget(60), small, speed=speed_for(20_000, 60))
    assert plan.epochs >= 100 and many.tokenizer.dropout == 0.1 and "each epoch segmented anew" in plan.reasons[
        "tokenizer.dropout"]
    few, plan = resolve(budget(10), small, speed=speed_for(1500, 10))
    assert plan.epochs < 100 and few.tokenizer.dropout == 0.0
    assert resolve(budget(60, tokenizer=TokenizerConfig(dropout=0.3)), small, speed=speed_for(20_000, 60))[0] \
        .tokenizer.dropout == 0.3  # given: kept
    unigram, plan = resolve(budget(60, tokenizer=TokenizerConfig(kind="unigram")), small, speed=speed_for(20_000, 60))
    assert unigram.tokenizer.dropout is None and "tokenizer.dropout" not in plan.chosen  # BPE-dropout needs merges


def test_max_tokens_never_below_the_longest_pair():
    cfg, _ = resolve(budget(25), Facts(47_842, 1_050_000, 5000), speed=speed_for(4800, 25))
    assert cfg.max_tokens == 5000


def test_exact_epoch_steps_are_used_when_known():
    facts = Facts(47_842, 335_492, 30, epoch_steps=lambda max_tokens: 7 if max_tokens == 4096 else 13)
    cfg, plan = resolve(TrainConfig(max_epochs=4), facts)
    assert plan.steps == 28 and cfg.max_tokens == 4096


def test_a_linear_schedule_ends_with_the_planned_steps():
    cfg, plan = resolve(budget(25, optim=OptimConfig(schedule="linear")), TATOEBA, speed=speed_for(4800, 25))
    assert cfg.optim.decay_steps == plan.steps == 9600
    assert resolve(budget(25), TATOEBA, speed=speed_for(4800, 25))[0].optim.decay_steps is None  # not needed
    given = budget(25, optim=OptimConfig(schedule="linear", decay_steps=100))
    assert resolve(given, TATOEBA, speed=speed_for(4800, 25))[0].optim.decay_steps == 100


def test_the_plan_round_trips_and_a_resume_keeps_its_choices_without_timing():
    cfg, plan = resolve(budget(25), TATOEBA, speed=speed_for(4800, 25))
    saved = Plan.from_dict(plan.to_dict())
    assert saved == plan

    def no_timing(dims, tokens):
        raise AssertionError("a resume timed again")

    again, kept = resolve(budget(25), Facts(10, 100, 5), speed=no_timing, previous=saved)  # the corpus no longer matters
    assert again == cfg and kept.chosen == plan.chosen


def test_retiming_replans_the_steps_left_and_keeps_a_passed_warmup():
    cfg, plan = resolve(budget(25), TATOEBA, speed=speed_for(4800, 25))
    new = retime(plan, Measured(step=50, seconds_per_step=60 * 25 * TRAIN_SHARE / 4800 * 1.5, elapsed_s=60), cfg)
    slower = settings(cfg, new)
    assert new.steps < plan.steps and new.retimed["at_step"] == 50
    assert slower.eval_every == new.steps // 16 and slower.optim.warmup_steps == round(0.12 * new.steps)
    assert (slower.optim.lr, slower.model.d_model, slower.max_tokens) == (cfg.optim.lr, cfg.model.d_model, cfg.max_tokens)
    late = settings(cfg, retime(plan, Measured(step=1200, seconds_per_step=0.25, elapsed_s=600), cfg))
    assert late.optim.warmup_steps == cfg.optim.warmup_steps  # the lr already reached its peak
    mine, plan2 = resolve(budget(25, eval_every=7), TATOEBA, speed=speed_for(4800, 25))
    assert settings(mine, retime(plan2, Measured(50, 1.0, 60), mine)).eval_every == 7  # a given value stays
    first = retime(plan, Measured(50, 0.3, 60), cfg)
    second = retime(first, Measured(1200, 0.3, 600, validation_s=5.0), cfg)  # past the first one's warmup
    assert settings(cfg, second).optim.warmup_steps == settings(cfg, first).optim.warmup_steps < 1200
    assert settings(cfg, second).eval_every != settings(cfg, first).eval_every  # re-planned on the validation's time


def test_retiming_with_a_timed_validation_fits_the_validations_in_their_share_of_the_time_left():
    cfg, plan = resolve(budget(25), TATOEBA, speed=speed_for(4800, 25))
    step_s = 60 * 25 * TRAIN_SHARE / 4800
    cheap_plan = retime(plan, Measured(step=700, seconds_per_step=step_s, elapsed_s=300, validation_s=1.0), cfg)
    dear_plan = retime(plan, Measured(step=700, seconds_per_step=step_s, elapsed_s=300, validation_s=60.0), cfg)
    cheap, dear = settings(cfg, cheap_plan), settings(cfg, dear_plan)
    assert dear.eval_every > cheap.eval_every and dear_plan.steps < cheap_plan.steps  # fewer validations, fewer steps
    left = 60 * 25 - 300
    validations = (dear_plan.steps - 700) // dear.eval_every
    assert validations * 60.0 <= 0.15 * left + 60.0 and dear_plan.retimed["validation_s"] == 60.0


def test_fine_tuning_has_its_own_plan_and_the_flags_given_win():
    """init_from under a budget: the fine-tuning learning rate (LoRA's higher), the warmup and the validation
    cadence, each printed with its reason; the model directory's shape and dropout come in as `inherited` (as
    nmt.training.run.inherited passes them, and the lr of a model nmt trained: test_finetune); an explicit flag is
    kept and the plan says so."""
    d128 = ModelConfig(**{k: MODEL_PRESETS["d128"][k] for k in ("d_model", "n_heads", "n_encoder_layers",
                                                                "n_decoder_layers", "d_ff")}, dropout=0.1)
    model = {"model.dropout": "as the model was trained (its training.json)"}
    speed = speed_for(1200, 2, "d128")
    scratch, _ = resolve(budget(2, model=d128, tokenizer=TokenizerConfig(vocab_size=8000)), TATOEBA, speed=speed)
    tuned, plan = resolve(budget(2, init_from="runs/a/model", model=d128, tokenizer=TokenizerConfig(vocab_size=8000)),
                          TATOEBA, speed=speed, inherited=model)
    assert (scratch.optim.lr, tuned.optim.lr) == (pytest.approx(1.3e-3), FINETUNE_LR)
    assert tuned.optim.warmup_steps == round(0.12 * plan.steps)
    assert tuned.eval_every == plan.steps // 16 and tuned.model.dropout == 0.1
    lines = plan.lines()
    assert lines[0].startswith("plan: fine-tuning runs/a/model, chosen for the 2-minute budget")
    printed = {line.split()[0]: line for line in lines[1:]}
    assert "unknown training" in printed["optim.lr"] and "fine-tuning with 5% validated lower" in printed[
        "optim.warmup_steps"]
    assert "against the start's" in printed["eval_every"] and "as the model was trained" in printed["model.dropout"]
    lora, plan = resolve(budget(2, init_from="runs/a/model", model=d128, finetune=FinetuneConfig(lora_r=8)), TATOEBA,
                         speed=speed)
    assert lora.optim.lr == LORA_LR > FINETUNE_LR and "LoRA (rank 8)" in plan.reasons["optim.lr"]
    mine, plan = resolve(budget(2, init_from="runs/a/model", model=d128, optim=OptimConfig(lr=5e-4), eval_every=50),
                         TATOEBA, speed=speed)
    assert (mine.optim.lr, mine.eval_every) == (5e-4, 50) and "optim.lr" not in plan.chosen
    assert f"  optim.lr 0.0005: given, kept over the fine-tuning rule's {FINETUNE_LR:g}" in plan.lines()
    assert any(line.startswith("  eval_every 50: given, kept over") for line in plan.lines())


def test_keys_cover_every_field_the_plan_fills():
    assert len(KEYS) == len(set(KEYS))
    for key in KEYS:
        get(TrainConfig(), key)  # each is a real config key
