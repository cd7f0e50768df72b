"""The config tree: YAML, overrides and Python build the same thing; bad keys and types are named."""

import re
import shutil
from pathlib import Path

import pytest
import yaml

from nmt.config import (
    MODEL_PRESETS,
    SIZE_FIELDS,
    ModelConfig,
    TrainConfig,
    config_fields,
    from_dict,
    load_config,
    parse_override,
    save_yaml,
    set_path,
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


def test_floats_in_exponent_form_are_floats():
    """YAML 1.1 (PyYAML's) reads 1e-3 (no dot) as a string; `--optim.lr 1e-3` and `lr: 1e-3` in a file mean the
    number."""
    cfg = load_config(None, ["optim.lr=1e-3", "optim.eps=1E-9"])
    assert (cfg.optim.lr, cfg.optim.eps) == (0.001, 1e-9)
    with pytest.raises(NmtError, match=r"'optim\.eps': -1e-09 is outside the allowed range"):
        load_config(None, ["optim.eps=-1e-9"])
    with pytest.raises(NmtError, match="expected float"):
        load_config(None, ["optim.lr=1e-3x"])


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


def test_the_configuration_page_holds_every_key():
    from nmt.config import reference_markdown, table_in

    page = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert table_in(page) == reference_markdown(), "regenerate: python -m nmt.config docs/configuration.md"


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


@pytest.mark.parametrize("data, message", [
    ({"tune_alpha": [0.8]}, "eval_beam > 1"),
    ({"tune_alpha": [], "eval_beam": 4}, "at least one alpha"),
    ({"tune_alpha": [-1.0], "eval_beam": 4}, r"'tune_alpha': \[-1.0\] is outside the allowed range \[0, 10\]"),
    ({"tokenizer": {"kind": "unigram", "dropout": 0.1}}, "needs kind bpe"),
    ({"tokenizer": {"dropout": 1.0}}, r"allowed range \[0, 1\)"),
])
def test_tune_alpha_and_dropout_are_checked(data, message):
    with pytest.raises(NmtError, match=message):
        from_dict(TrainConfig, data)
    assert from_dict(TrainConfig, {"tune_alpha": [0, 1], "eval_beam": 4}).tune_alpha == [0.0, 1.0]


# --- every numeric key with 0, a negative and an absurd value (enumerated from the dataclasses) ---------------

def numeric_keys(cls=TrainConfig, prefix=""):
    """(dotted key, field, number type, container) for every int/float field, nested sections included."""
    import dataclasses
    import types
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from numeric_keys(tp, f"{prefix}{f.name}.")
            continue
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        container = typing.get_origin(tp) if typing.get_origin(tp) in (list, tuple) else None
        inner = typing.get_args(tp)[0] if container else tp
        if inner in (int, float):
            yield prefix + f.name, f, inner, container


def search_keys():
    from nmt.decoding import SearchConfig

    return [(key, f, kind, c) for key, f, kind, c in numeric_keys(SearchConfig)]


ALL_NUMERIC = list(numeric_keys()) + [("search:" + k, f, kind, c) for k, f, kind, c in search_keys()]
# one config under which every rule between keys holds, so a value is judged by its own range only
CONTEXT = {"eval_beam": 4}


def test_every_numeric_key_declares_its_range():
    from nmt.config import RANGE

    assert len(ALL_NUMERIC) > 40  # the walk finds the keys (nested sections, optional and list-valued ones)
    undeclared = [key for key, f, _, _ in ALL_NUMERIC if RANGE not in f.metadata]
    assert not undeclared, f"declare an interval with ranged(default, '[lo, hi]') for {undeclared}"


def bad_values(kind):
    return [0, -1, 10**15, 10**400] + ([-0.5, 1e30, float("inf"), float("nan")] if kind is float else [])


@pytest.mark.parametrize("key, f, kind, container", ALL_NUMERIC, ids=[k[0] for k in ALL_NUMERIC])
def test_every_numeric_key_refuses_values_outside_its_range_by_name(key, f, kind, container):
    from nmt.config import RANGE
    from nmt.decoding import SearchConfig

    allowed = f.metadata[RANGE]
    for value in bad_values(kind):
        given = value if container is None else [value, value] if container is tuple else [value]
        if key.startswith("search:"):
            build = lambda: SearchConfig(**{key[7:]: given})  # noqa: B023
        else:
            data = {k: v for k, v in CONTEXT.items() if k != key}
            set_path(data, key, given)
            build = lambda: from_dict(TrainConfig, data)  # noqa: B023
        if value in allowed:  # legal: 0 where the range says so (e.g. dropout, warmup_steps, average_last)
            assert value == 0, f"{key} allows {value}: negative and absurd values must be refused"
            assert build() is not None
        else:
            name = key.removeprefix("search:")
            with pytest.raises(NmtError, match=rf"'{re.escape(name)}': .* outside the allowed range") as e:
                build()
            assert str(allowed) in str(e.value)


def test_keys_whose_zero_means_something_accept_it():
    cfg = from_dict(TrainConfig, {"optim": {"clip_norm": 0, "warmup_steps": 0, "label_smoothing": 0},
                                  "model": {"dropout": 0, "src_vocab_size": 0}, "average_last": 0, "seed": 0})
    assert (cfg.optim.clip_norm, cfg.model.dropout, cfg.average_last) == (0, 0, 0)


def test_path_like_keys_declare_a_kind():
    from nmt.config import PATH, walk

    looks_like_a_path = re.compile(r"(^|_)(dir|file|path|from|train|valid|test|resume)$")
    fields = [(key, f) for key, f, _ in walk(TrainConfig()) if looks_like_a_path.search(key.split(".")[-1])]
    assert {"output_dir", "data.cache_dir", "data.train", "resume"} <= {key for key, _ in fields}
    undeclared = [key for key, f in fields if PATH not in f.metadata]
    assert not undeclared, f"declare a path kind with path_key(default, kind) for {undeclared}"


def test_a_config_changed_after_construction_is_checked_again():
    from nmt.config import check_config

    cfg = TrainConfig()
    cfg.optim.lr = -1.0
    with pytest.raises(NmtError, match=r"'optim\.lr': -1\.0 is outside the allowed range \[0, 1\]"):
        check_config(cfg)


def test_a_key_given_twice_in_a_yaml_is_named_with_both_lines(tmp_path, capsys):
    from nmt.cli import main

    path = tmp_path / "twice.yaml"
    path.write_text("optim:\n  lr: 0.001\n  warmup_steps: 10\n  lr: 0.1\nmax_steps: 5\n"
                    f"data:\n  train: {tmp_path / 'none'}\n  cache_dir: {tmp_path / 'cache'}\n")
    assert main(["check", "--config", str(path)]) == 2  # before: lr 0.1, the first silently dropped
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"nmt check: error: {path}:4: key 'lr' is given twice in one section (first on line 2); YAML "
                   "would keep only the last silently: delete one"]


def test_yaml_is_read_with_the_yaml_1_2_core_schema(tmp_path, capsys):
    """No octal without 0o, no base 60, no yes/no/on/off booleans (YAML 1.1's: 511, 90 and False before)."""
    from nmt.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("data:\n  split_seed: 0777\n  tgt_lang: no\n  src_lang: on\nseed: 0o17\noptim:\n  lr: 1e-3\n")
    cfg = load_config(path)
    assert (cfg.data.split_seed, cfg.data.tgt_lang, cfg.data.src_lang, cfg.seed, cfg.optim.lr) == (777, "no", "on",
                                                                                                   15, 0.001)
    saved = tmp_path / "saved.yaml"
    save_yaml(cfg, saved)
    assert load_config(saved) == cfg and yaml.safe_load(saved.read_text())["data"]["tgt_lang"] == "no"
    path.write_text(f"eval_every: 1:30\ndata:\n  train: {tmp_path / 'none'}\n")
    assert main(["check", "--config", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "nmt check: error: config key 'eval_every': expected int, got '1:30' (str)"]
    assert main(["check", "--config", str(path), "--eval_every", "10", "--tokenizer.joint", "yes"]) == 2
    assert "config key 'tokenizer.joint': expected bool, got 'yes'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, key, value", [
    (["--data.tgt_lang", "../../etc"], "data.tgt_lang", "../../etc"),
    (["--data.src_lang", "e n"], "data.src_lang", "e n"),
    (["data.tgt_lang=<2de>"], "data.tgt_lang", "<2de>"),
    (["--data.train", "[{path: x, tgt_lang: a/b}]"], "data.train[0].tgt_lang", "a/b"),
])
def test_every_language_code_follows_one_rule(tmp_path, capsys, flags, key, value):
    from nmt.cli import main

    code = main(["check", "--data.train", str(tmp_path / "none"), *flags])  # before: top-level codes taken as given
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"nmt check: error: config key '{key}': {value!r} is not a language code (letters, digits, _ or -, at most "
        "32 characters, e.g. de or pt_BR)"]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_home_and_environment_variables_in_path_keys_are_expanded_where_the_config_is_read(corpus_dir, tmp_path,
                                                                                          monkeypatch, capsys):
    from nmt.cli import main

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    corpus = tmp_path / "co$t"  # a literal $: $$ in a file, as it is in a flag
    shutil.copytree(corpus_dir, corpus)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CORPORA", str(tmp_path))
    monkeypatch.chdir(cwd)
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train: $CORPORA/co$$t/train\n  valid: ${CORPORA}/co$$t/valid\n"
                    "  cache_dir: ~/cache\noutput_dir: ~/runs/x\n")
    out = home / "runs" / "$x"  # from a flag: the shell has expanded what it meant to, nmt expands nothing more
    argv = ["train", "--config", str(path), "--model.preset", "tiny", "--tokenizer.vocab_size", "300",
            "--max_tokens", "400", "--max_steps", "2", "--eval_every", "2", "--eval_max_sentences", "4",
            "--data.test", f"{corpus}/test", "--output_dir", str(out)]
    assert main(argv) == 0, capsys.readouterr().err  # before: $t and $x are not set
    assert (out / "model" / "config.json").is_file() and (home / "cache").is_dir()
    assert not list(cwd.iterdir())  # before the expansion: checked expanded, written to ./~/runs/x
    saved = load_config(out / "config.yaml")  # nmt's own config.yaml reads back as it was ($ written $$)
    assert (saved.output_dir, saved.data.train, saved.data.test) == (str(out), f"{corpus}/train", f"{corpus}/test")
    assert TrainConfig(output_dir="~/py").output_dir == str(home / "py")  # a leading ~ from Python alike
    path.write_text("output_dir: $NOT_SET_ANYWHERE/run\n")
    assert main(["check", "--config", str(path)]) == 2
    assert f"{path}: config key 'output_dir': '$NOT_SET_ANYWHERE/run' names the environment variable " \
           "$NOT_SET_ANYWHERE, which is not set; set it, write the path out, or write $$ for a literal $" in \
           capsys.readouterr().err
