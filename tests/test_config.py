"""The config tree: YAML, overrides and Python build the same thing; bad keys and types are named."""

from pathlib import Path

import pytest
import yaml

from nmt.config import (
    AUTO_SIZES,
    MODEL_PRESETS,
    SIZE_FIELDS,
    ModelConfig,
    TokenizerConfig,
    TrainConfig,
    auto_sizes,
    config_fields,
    from_dict,
    load_config,
    parse_override,
    pin_sizes,
    resolve_sizes,
    to_dict,
)
from nmt.errors import NmtError

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_shipped_configs_exist():
    assert {p.name for p in CONFIGS} >= {"default.yaml", "tatoeba-en-de.yaml", "base-gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    raw = yaml.safe_load(path.read_text())
    if "model" in raw and "d_model" in raw["model"]:
        assert cfg.model.d_model == raw["model"]["d_model"]


def test_yaml_overrides_and_python_agree(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_model: 64\n  n_heads: 2\nmax_steps: 7\n")
    from_yaml = load_config(path, ["model.d_ff=128", "optim.betas=[0.9, 0.99]"])
    from_python = TrainConfig(model=ModelConfig(d_model=64, n_heads=2, d_ff=128), max_steps=7)
    from_python.optim.betas = (0.9, 0.99)
    assert to_dict(from_yaml) == to_dict(from_python)
    assert from_dict(TrainConfig, to_dict(from_yaml)) == from_yaml  # round trip


def test_preset_then_fields():
    cfg = from_dict(TrainConfig, {"model": {"preset": "base", "dropout": 0.2}})
    assert (cfg.model.d_model, cfg.model.n_encoder_layers, cfg.model.dropout) == (512, 6, 0.2)
    assert ModelConfig.preset("tiny").d_model == 32


@pytest.mark.parametrize("data, key", [
    ({"modle": {}}, "modle"),
    ({"model": {"d_modle": 3}}, "model.d_modle"),
    ({"model": {"d_model": "big"}}, "model.d_model"),
    ({"max_steps": 1.5}, "max_steps"),
    ({"model": {"activation": "tanh"}}, "model.activation"),
    ({"optim": {"betas": [0.9]}}, "optim.betas"),
    ({"tokenizer": {"joint": "yes"}}, "tokenizer.joint"),
    ({"model": {"d_model": 30, "n_heads": 4}}, "model.d_model"),
    ({"model": {"preset": "huge"}}, "model.preset"),
])
def test_bad_keys_and_types_are_named(data, key):
    with pytest.raises(NmtError, match=key.replace(".", r"\.")):
        from_dict(TrainConfig, data)


def test_int_is_accepted_for_float_but_bool_is_not_int():
    assert from_dict(TrainConfig, {"optim": {"lr": 1}}).optim.lr == 1.0
    with pytest.raises(NmtError, match="max_tokens"):
        from_dict(TrainConfig, {"max_tokens": True})


def test_parse_override():
    assert parse_override("model.d_model=256") == ("model.d_model", 256)
    assert parse_override("data.valid=null") == ("data.valid", None)
    assert parse_override("output_dir=runs/x") == ("output_dir", "runs/x")
    with pytest.raises(NmtError, match="key=value"):
        parse_override("model.d_model")


def test_missing_and_broken_yaml(tmp_path):
    with pytest.raises(NmtError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(NmtError, match="not valid YAML"):
        load_config(bad)


def test_config_reference_covers_every_field():
    rows = config_fields()
    keys = {r[0] for r in rows}
    assert {"model.d_model", "data.train", "optim.lr", "max_tokens", "tokenizer.vocab_size"} <= keys
    assert all(r[3] for r in rows), [r[0] for r in rows if not r[3]]  # every field documented


def test_readme_config_reference_is_in_sync():
    from nmt.config import reference_markdown

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    block = readme[readme.index(start) + len(start): readme.index(end)]
    hint = "regenerate: python -c 'from nmt.config import reference_markdown as r; print(r())'"
    assert block == reference_markdown(), hint


@pytest.mark.parametrize("pairs, vocab, size", [
    (0, 1_000, "tiny"), (999, 1_000, "tiny"), (1_000, 2_000, "small"), (19_999, 2_000, "small"),
    (20_000, 4_000, "small"), (48_000, 4_000, "small"), (100_000, 8_000, "small"), (300_000, 8_000, "base"),
    (1_000_000, 16_000, "base"), (4_500_000, 16_000, "base"), (5_000_000, 32_000, "base"), (10**9, 32_000, "base"),
])
def test_auto_sizes_table(pairs, vocab, size):
    auto = auto_sizes(pairs)
    assert (auto.train_pairs, auto.vocab_size, auto.model_size) == (pairs, vocab, size)


def test_auto_sizes_grow_with_the_corpus_and_the_docstring_shows_every_row():
    rows = [auto_sizes(n) for n in range(0, 10_000_000, 1_000)]
    order = list(MODEL_PRESETS)
    assert all(a.vocab_size <= b.vocab_size for a, b in zip(rows, rows[1:]))
    assert all(order.index(a.model_size) <= order.index(b.model_size) for a, b in zip(rows, rows[1:]))
    assert "big" not in {r.model_size for r in rows}  # only on request
    for _, vocab, size in AUTO_SIZES:
        assert f"| {vocab:,}" in auto_sizes.__doc__ and size in auto_sizes.__doc__


def test_sizes_left_null_are_chosen_and_explicit_ones_win():
    cfg, chosen = resolve_sizes(TrainConfig(), 48_000)
    assert cfg.tokenizer.vocab_size == 4_000 and cfg.model.size == "small"
    assert [getattr(cfg.model, f) for f in SIZE_FIELDS] == list(MODEL_PRESETS["small"].values())
    assert chosen[0] == "tokenizer.vocab_size 4,000" and chosen[1].startswith("model.size small (d_model 256")
    partial = TrainConfig(tokenizer=TokenizerConfig(vocab_size=3_000), model=ModelConfig(d_model=128, dropout=0.3))
    cfg, chosen = resolve_sizes(partial, 2_000_000)  # auto would say 16k and base
    assert cfg.tokenizer.vocab_size == 3_000 and (cfg.model.d_model, cfg.model.dropout) == (128, 0.3)
    assert (cfg.model.n_heads, cfg.model.n_encoder_layers, cfg.model.d_ff) == (8, 6, 2048)  # the rest from base
    assert chosen == ["model.size base (n_heads 8, n_encoder_layers 6, n_decoder_layers 6, d_ff 2048)"]
    given = load_config(Path(__file__).parent.parent / "configs" / "default.yaml")
    assert resolve_sizes(given, 40_000) == (given, [])  # everything given: nothing chosen


def test_shipped_configs_keep_their_sizes():
    root = Path(__file__).parent.parent / "configs"
    default, base = load_config(root / "default.yaml"), load_config(root / "base-gpu.yaml")
    assert default.tokenizer.vocab_size == 1000 and default.model.unresolved() == []
    assert (default.model.d_model, default.model.n_encoder_layers, default.model.d_ff) == (128, 2, 512)
    assert base.tokenizer.vocab_size == 32000 and base.model.size == "base"
    assert [getattr(base.model, f) for f in SIZE_FIELDS] == list(MODEL_PRESETS["base"].values())


def test_size_and_its_older_name_preset():
    by_size = from_dict(TrainConfig, {"model": {"size": "tiny", "d_ff": 96}})
    assert from_dict(TrainConfig, {"model": {"preset": "tiny", "d_ff": 96}}) == by_size
    assert (by_size.model.d_model, by_size.model.d_ff) == (32, 96)
    with pytest.raises(NmtError, match="contradicts size"):
        from_dict(TrainConfig, {"model": {"preset": "tiny", "size": "base"}})
    with pytest.raises(NmtError, match="model.size"):
        from_dict(TrainConfig, {"model": {"size": "huge"}})


def test_resumed_run_keeps_the_sizes_it_started_with():
    started, _ = resolve_sizes(TrainConfig(), 600)  # tiny, 1,000 subwords
    pinned = pin_sizes(TrainConfig(), to_dict(started))
    assert pinned.tokenizer.vocab_size == 1_000 and pinned.model.unresolved() == []
    assert resolve_sizes(pinned, 5_000_000)[0].model.d_model == 32  # the corpus size no longer matters
    explicit = TrainConfig(tokenizer=TokenizerConfig(vocab_size=500), model=ModelConfig(d_model=64, n_heads=2))
    kept = pin_sizes(explicit, to_dict(started))
    assert kept.tokenizer.vocab_size == 500 and (kept.model.d_model, kept.model.n_heads, kept.model.d_ff) == (64, 2, 64)


@pytest.mark.parametrize("data, message", [
    ({"tune_alpha": [0.8]}, "eval_beam > 1"),
    ({"tune_alpha": [], "eval_beam": 4}, "at least one alpha"),
    ({"tune_alpha": [-1.0], "eval_beam": 4}, r"'tune_alpha': \[-1.0\] is outside the allowed range \[0, 10\]"),
    ({"tokenizer": {"kind": "unigram", "dropout": 0.1}}, "needs kind bpe"),
    ({"tokenizer": {"dropout": 1.0}}, r"allowed range \(0, 1\)"),
])
def test_tune_alpha_and_dropout_are_checked(data, message):
    with pytest.raises(NmtError, match=message):
        from_dict(TrainConfig, data)
    assert from_dict(TrainConfig, {"tune_alpha": [0, 1], "eval_beam": 4}).tune_alpha == [0.0, 1.0]
