"""The budget rule (nmt.budget): pure functions from corpus stats, speed and budget to a Plan."""

import pytest

from nmt.budget import BATCHES, FILL, TRAIN_SHARE, Budget, CorpusStats, Plan, Speed, make_plan, rung

TATOEBA = CorpusStats(train_pairs=47_842, epoch_cost=335_492, longest_cost=30)  # as prepared: ~7 cost tokens a pair


def speed_for(steps: int, minutes: float, model: str = "d192") -> Speed:
    """The speed at which `model` takes `steps` 2,048-token steps in the training share of `minutes`."""
    return Speed(60 * minutes * TRAIN_SHARE / (steps * BATCHES[-1] * FILL), rung(model))


def test_tatoeba_25_minutes_on_a_fast_cpu_gives_the_hand_tuned_recipe():
    """configs/tatoeba-en-de.yaml reached ~4,800 steps in 25 minutes on a fast 2-core CPU: d192, 2,048 tokens,
    lr 0.0011, warmup 600, validation every 300, 3 checkpoints averaged."""
    plan = make_plan(TATOEBA, Budget(25, None, None), speed_for(4800, 25))
    assert (plan.model, plan.d_model, plan.n_encoder_layers, plan.d_ff) == ("d192", 192, 3, 768)
    assert plan.max_tokens == 2048 and plan.steps == 4800 and plan.lr == pytest.approx(1.1e-3)
    assert 500 <= plan.warmup_steps <= 700 and 250 <= plan.eval_every <= 350 and plan.save_every == plan.eval_every
    assert plan.average_last == 3 and plan.keep_last >= 3 and plan.dropout == 0.1
    assert len(plan.reasons) == 7 and plan.reasons[0].startswith("model d192")
    assert plan.bpe_dropout is None  # ~27 epochs over 48k pairs
    assert plan.decay_steps == plan.steps  # where optim.schedule linear would end: the budget fixes the steps


def test_warmup_and_validations_scale_with_the_budget():
    short, long = (make_plan(TATOEBA, Budget(m, None, None), speed_for(4800 * m // 25, m)) for m in (10, 75))
    for plan in (short, long):
        assert plan.warmup_steps == round(0.12 * plan.steps) and plan.steps // plan.eval_every == 16
    assert (short.model, long.model) == ("d128", "small")  # a longer budget affords a wider model
    assert short.warmup_steps < 1000  # a share of the run, not a fixed 1,000


def test_a_slower_machine_gets_a_smaller_model_and_a_faster_one_a_larger():
    slow = make_plan(TATOEBA, Budget(25, None, None), speed_for(1500, 25))
    fast = make_plan(TATOEBA, Budget(25, None, None), speed_for(20_000, 25))
    assert slow.model == "d128" and slow.lr > 1.1e-3  # narrower: higher peak lr
    assert fast.model == "small" and fast.max_tokens == 4096  # enough steps for full batches


def test_corpus_size_caps_the_model_and_sets_dropout():
    tiny = make_plan(CorpusStats(600, 6_000, 20), Budget(5, None, None), speed_for(10**6, 5))
    assert tiny.model == "tiny" and tiny.dropout == 0.0
    small = make_plan(CorpusStats(10_000, 200_000, 40), Budget(60, None, None), speed_for(20_000, 60))
    assert small.model == "d192" and small.dropout == 0.2  # many epochs over little data, no wider than d192
    larger = make_plan(CorpusStats(30_000, 600_000, 40), Budget(60, None, None), speed_for(20_000, 60))
    assert larger.model == "small" and larger.dropout == 0.1


def test_many_epochs_over_a_small_corpus_turn_on_bpe_dropout():
    """Tatoeba's first 10,000 pairs in 75 minutes (~300 epochs): the defaults stopped gaining by mid-run, BPE-dropout
    0.1 validated higher (README "Levers tried"); at ~15 epochs, or over 30k pairs, or a smoke corpus: off."""
    small = CorpusStats(10_000, 200_000, 40)
    many = make_plan(small, Budget(60, None, None), speed_for(20_000, 60))
    assert many.epochs >= 100 and many.bpe_dropout == 0.1 and "BPE-dropout 0.1" in many.reasons[4]
    few = make_plan(small, Budget(10, None, None), speed_for(1500, 10))
    assert few.epochs < 100 and few.bpe_dropout is None and "BPE-dropout off" in few.reasons[4]
    assert make_plan(CorpusStats(30_000, 600_000, 40), Budget(600, None, None), speed_for(200_000, 600)).bpe_dropout is None
    assert make_plan(CorpusStats(600, 6_000, 20), Budget(60, None, None), speed_for(10**6, 60)).bpe_dropout is None


def test_the_plan_chooses_bpe_dropout_only_where_the_config_leaves_it_null():
    from nmt.config import TokenizerConfig, TrainConfig
    from nmt.training.planning import apply_plan, open_fields

    on = make_plan(CorpusStats(10_000, 200_000, 40), Budget(60, None, None), speed_for(20_000, 60))
    off = make_plan(TATOEBA, Budget(25, None, None), speed_for(4800, 25))
    cfg = TrainConfig(max_minutes=60)
    assert "tokenizer.dropout" in open_fields(cfg)
    assert apply_plan(cfg, on).tokenizer.dropout == 0.1 and apply_plan(cfg, off).tokenizer.dropout == 0.0  # chosen off
    assert open_fields(apply_plan(cfg, off)) == []
    for given in (0.0, 0.3):
        explicit = TrainConfig(tokenizer=TokenizerConfig(dropout=given))
        assert "tokenizer.dropout" not in open_fields(explicit) and apply_plan(explicit, on).tokenizer.dropout == given
    unigram = TrainConfig(tokenizer=TokenizerConfig(kind="unigram"))
    assert apply_plan(unigram, on).tokenizer.dropout is None  # BPE-dropout needs BPE merges
    everything = apply_plan(cfg, off)
    nulled = TrainConfig(**{**everything.__dict__, "tokenizer": TokenizerConfig()})
    assert open_fields(nulled) == []  # all else given: no plan is made for BPE-dropout alone


def test_step_bounds_without_a_time_budget():
    plan = make_plan(TATOEBA, Budget(None, 3000, None), None)
    assert plan.steps == 3000 and plan.warmup_steps == 360 and plan.max_tokens == 4096 and plan.model == "small"
    assert plan.decay_steps is None  # no time budget: a linear schedule ends with the run's own steps
    by_epochs = make_plan(TATOEBA, Budget(None, None, 2), None)
    assert by_epochs.steps == 2 * -(-TATOEBA.epoch_cost // int(4096 * FILL))


def test_max_tokens_never_below_the_longest_pair():
    plan = make_plan(CorpusStats(47_842, 1_050_000, 5000), Budget(25, None, None), speed_for(4800, 25))
    assert plan.max_tokens == 5000


def test_plan_round_trips_through_a_dict():
    plan = make_plan(TATOEBA, Budget(25, None, None), speed_for(4800, 25))
    assert Plan.from_dict(plan.to_dict()) == plan
    old = {k: v for k, v in plan.to_dict().items() if k not in ("decay_steps", "bpe_dropout")}
    assert Plan.from_dict(old).decay_steps is None  # a plan.json saved before decay_steps was planned
    assert Plan.from_dict(old).bpe_dropout is None  # or before BPE-dropout was: a resumed run keeps it off


def test_averaging_follows_the_checkpoints_the_run_will_save():
    from nmt.budget import average_for

    assert average_for(4800, 300) == 3 and average_for(4800, 1000) == 0  # 16 checkpoints; only 4


def test_explicit_values_win_field_by_field():
    from nmt.config import ModelConfig, OptimConfig, TrainConfig
    from nmt.training.planning import apply_plan, open_fields

    cfg = TrainConfig(max_tokens=1000, save_every=2000, optim=OptimConfig(lr=0.002), model=ModelConfig(d_model=64))
    plan = make_plan(TATOEBA, Budget(25, None, None), speed_for(4800, 25))
    out = apply_plan(cfg, plan)
    assert (out.max_tokens, out.save_every, out.optim.lr, out.model.d_model) == (1000, 2000, 0.002, 64)
    assert (out.optim.warmup_steps, out.eval_every, out.model.n_encoder_layers) == (576, 300, 3)  # from the plan
    assert out.average_last == 0  # 2 checkpoints at the given save_every: nothing to average
    assert open_fields(cfg)[:2] == ["eval_every", "keep_last"] and open_fields(out) == []


def test_a_linear_schedule_under_a_time_budget_ends_with_the_planned_steps():
    from nmt.config import OptimConfig, TrainConfig
    from nmt.training.planning import apply_plan, open_fields

    plan = make_plan(TATOEBA, Budget(25, None, None), speed_for(4800, 25))
    linear = TrainConfig(max_minutes=25, optim=OptimConfig(schedule="linear"))
    assert "optim.decay_steps" in open_fields(linear) and apply_plan(linear, plan).optim.decay_steps == 4800
    assert apply_plan(TrainConfig(max_minutes=25), plan).optim.decay_steps is None  # inverse_sqrt: not needed
    given = TrainConfig(max_minutes=25, optim=OptimConfig(schedule="linear", decay_steps=100))
    assert "optim.decay_steps" not in open_fields(given) and apply_plan(given, plan).optim.decay_steps == 100
