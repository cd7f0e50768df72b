"""`nmt info`: what a model directory holds, read from JSON and the safetensors header, never from a pickle."""

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)

from nmt import train
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.config import TokenizerConfig
from nmt.errors import NmtError
from nmt.loading import open_model
from nmt.tokenizer import PairTokenizer, train_tokenizer
from nmt.tools.info import command_line, describe, lines
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def model_dir(corpus_dir, tmp_path_factory) -> Path:
    cfg = tiny_config(corpus_dir, tmp_path_factory.mktemp("info"), max_steps=6, eval_every=3, save_every=100)
    try:
        return train(cfg).model_dir
    finally:
        reset_accelerate_state()


def test_describe_reports_the_model_and_its_training(model_dir):
    info = describe(model_dir)
    summary = json.loads((model_dir / "training.json").read_text())
    assert info["architecture"] == json.loads((model_dir / "config.json").read_text())
    assert info["architecture"]["d_model"] == 32 and info["architecture"]["n_encoder_layers"] == 1
    assert info["parameters"] == open_model(model_dir).model.num_parameters()
    assert info["dtypes"] == {"F32": info["tensors"]}
    tok = PairTokenizer.load(model_dir)
    assert info["vocab"] == {"joint": True, "src": tok.src_vocab_size, "tgt": tok.tgt_vocab_size}
    assert info["vocab"]["src"] == info["architecture"]["src_vocab_size"]
    assert info["data"]["pairs"] == json.loads((model_dir.parent / "data.json").read_text())["pairs"]
    assert info["data"]["clean"]["read"] == 600
    assert info["step"] == summary["step"] in (3, 6)
    assert info["best"]["bleu"] == summary["metrics"]["bleu"] and "chrf" in info["best"]
    assert info["argv"] == summary["argv"] == sys.argv and info["num_processes"] == 1
    text = "\n".join(lines(info))
    assert f"({info['parameters']:,})" in text and f"step {info['step']}: BLEU" in text and "joint" in text


class Trap:
    """Unpickling this creates the file `path`: proof that a pickle was loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


class Watch:
    """Records files opened from Python and classes looked up by unpickling (PEP 578 audit events)."""

    active: "Watch | None" = None
    installed = False

    def __init__(self):
        self.opened, self.unpickled = [], []

    def __enter__(self):
        if not Watch.installed:  # audit hooks cannot be removed; one hook serves every Watch
            sys.addaudithook(Watch._hook)
            Watch.installed = True
        Watch.active = self
        return self

    def __exit__(self, *exc):
        Watch.active = None

    @staticmethod
    def _hook(event, args):
        watch = Watch.active
        if watch is not None and event == "open" and isinstance(args[0], (str, Path)):
            watch.opened.append(str(args[0]))
        elif watch is not None and event == "pickle.find_class":
            watch.unpickled.append(args)


def test_info_never_unpickles(model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    sentinel = tmp_path / "pickle-was-loaded"
    (d / "model.bin").write_bytes(pickle.dumps(Trap(sentinel)))
    (d / "training_args.bin").write_bytes(pickle.dumps(Trap(sentinel)))
    with Watch() as watch:
        info = describe(d)
        assert main(["info", str(d)]) == 0
    assert info["parameters"] > 0
    assert not sentinel.exists() and watch.unpickled == []
    assert not [p for p in watch.opened if p.endswith(".bin")]
    assert any(p.endswith("training.json") for p in watch.opened)  # the watch does see what info opens
    with Watch() as control, open(d / "model.bin", "rb") as f:
        pickle.load(f)
    assert sentinel.exists() and control.unpickled  # the trap and the watch both work


def test_separate_vocabularies(model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    (d / "tokenizer.json").rename(d / "tokenizer.src.json")
    tgt = train_tokenizer(["ein kleines haus am see", "das ist gut"] * 50, TokenizerConfig(vocab_size=40))
    tgt.save(str(d / "tokenizer.tgt.json"))  # a vocabulary of its own (an identical copy would be joint)
    info = describe(d)
    assert info["vocab"] == {"joint": False, "src": PairTokenizer.load(model_dir).src_vocab_size,
                             "tgt": tgt.get_vocab_size()}
    assert "separate: source" in "\n".join(lines(info))


def test_without_training_json_the_architecture_is_still_shown(model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    (d / "training.json").unlink()
    info = describe(d)
    assert info["step"] is None and info["best"] == {} and info["command"] == ""
    assert lines(info)[-1] == "training      unknown (no training.json)"


@pytest.mark.parametrize("broken, needle", [
    ("config.json", "config.json: missing"),
    ("model.safetensors", "model.safetensors: missing"),
])
def test_missing_files_are_named(model_dir, tmp_path, broken, needle):
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    (d / broken).unlink()
    with pytest.raises(NmtError, match=needle):
        describe(d)


def test_corrupt_weights_and_missing_dir(model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(model_dir, d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(NmtError, match="model.safetensors: not a readable safetensors file"):
        describe(d)
    with pytest.raises(NmtError, match="no such model directory"):
        describe(tmp_path / "nope")


def test_command_line():
    assert command_line(["/x/.venv/bin/nmt", "train", "--config", "my cfg.yaml"]) == "nmt train --config 'my cfg.yaml'"
    assert command_line(["/src/nmt/cli.py", "train"]) == "nmt train"
    assert command_line(["run.py", "--max_steps", "5"]) == "run.py --max_steps 5"


def test_cli_info_text_and_json(model_dir, capsys):
    assert main(["info", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model         {model_dir}\n") and "architecture  1+1 layers" in out
    assert main(["info", str(model_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(describe(model_dir)))
    assert main(["info", str(model_dir.parent / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"nmt info: error: {model_dir.parent / 'nope'}: no such model directory"


def test_the_safetensors_header_is_read_as_the_library_reads_it(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from nmt.tools.info import safetensors_header, weights_summary

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16), "c": torch.zeros(2, 2, 2)},
              str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    header = safetensors_header(tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()} == \
            {k: (v["dtype"], v["shape"]) for k, v in header.items()}
    assert weights_summary(tmp_path / "w.safetensors") == {"parameters": 25, "tensors": 3, "dtypes": {"F32": 2, "BF16": 1}}
    (tmp_path / "w.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(NmtError, match="not a readable safetensors file"):
        safetensors_header(tmp_path / "w.safetensors")
