"""The config tree: YAML, overrides and Python build the same thing; bad keys and types are named."""

from pathlib import Path

import pytest
import yaml

from nmt.config import ModelConfig, TrainConfig, config_fields, from_dict, load_config, parse_override, to_dict
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
