"""Parameter-efficient fine-tuning (nmt.adapters): an imported Marian model fine-tuned with LoRA and with frozen
parts learns while the weights it must not touch stay bit-identical; a LoRA run's adapter merges into a plain
model directory that translates as the adapted model does; LoRA and frozen runs resume exactly and average."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import marian_directory, one_thread  # noqa: F401  (one_thread: module-wide)
from safetensors.torch import load_file

from nmt import Translator, train
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.config import FinetuneConfig, ModelConfig, OptimConfig, TokenizerConfig
from nmt.loading import open_model
from nmt.synthetic import generate_pairs
from nmt.tokenizer import PairTokenizer
from tests.conftest import tiny_config

pytest.importorskip("transformers")
pytest.importorskip("peft")
STEPS = 8  # a checkpoint at 4 and at 8


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random Marian model (d_model 32) imported as an nmt model directory."""
    hf = marian_directory(tmp_path_factory.mktemp("marian"), generate_pairs(300, seed=7))
    out = tmp_path_factory.mktemp("imported") / "opus"
    assert main(["import", str(hf), str(out)]) == 0
    return out


def _finetune(corpus_dir: Path, out: Path, base: Path, finetune: FinetuneConfig, **overrides):
    settings = dict(init_from=str(base), model=ModelConfig(), tokenizer=TokenizerConfig(), finetune=finetune,
                    optim=OptimConfig(lr=3e-2, warmup_steps=2, weight_decay=0.01), max_steps=STEPS, save_every=4,
                    eval_every=4, keep_last=4)
    cfg = tiny_config(corpus_dir, out, **settings | overrides)
    reset_accelerate_state()
    try:
        train(cfg)
    finally:
        reset_accelerate_state()
    return cfg


@pytest.fixture(scope="module")
def lora_run(corpus_dir, base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora")
    _finetune(corpus_dir, out, base, FinetuneConfig(lora_r=8, lora_alpha=16, lora_dropout=0.1))
    return out / "run"


@pytest.fixture(scope="module")
def frozen_run(corpus_dir, base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("frozen")
    _finetune(corpus_dir, out, base, FinetuneConfig(freeze=["embeddings", "encoder"]))
    return out / "run"


def _valid_nll(model_dir: Path, corpus_dir: Path, checkpoint: Path | None = None) -> float:
    """Mean negative log-likelihood per target token of the validation pairs, of `model_dir`'s model (with the
    weights of `checkpoint`, a run's step_N, when given: what training ended with, which the kept model/ need not
    be, as the start is kept where no validation beat it)."""
    from nmt.checkpoint import load_into

    src = (corpus_dir / "valid.en").read_text(encoding="utf-8").splitlines()
    tgt = (corpus_dir / "valid.xx").read_text(encoding="utf-8").splitlines()
    opened = open_model(model_dir, merge_adapter=checkpoint is None)
    if checkpoint is not None:
        load_into(opened.model, load_file(str(checkpoint / "model.safetensors")))
    scores = Translator(opened.model.eval(), opened.tokenizer).score(src, tgt)
    return -sum(s.total for s in scores) / sum(len(s.token_logprobs) for s in scores)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _base_of(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's base weights, named as in the plain model."""
    return {k.replace(".base_layer", ""): v for k, v in checkpoint.items() if ".lora_" not in k}


def test_lora_fine_tuning_improves_validation_while_every_base_weight_stays_bit_identical(lora_run, base, corpus_dir):
    model, last = lora_run / "model", lora_run / "checkpoints" / f"step_{STEPS}"
    assert (model / "adapter_config.json").is_file() and (model / "adapter_model.safetensors").is_file()
    assert _valid_nll(model, corpus_dir, last) < _valid_nll(base, corpus_dir) - 0.05
    imported = _weights(base)
    for saved in (_weights(model), _base_of(_weights(lora_run / "checkpoints" / f"step_{STEPS}"))):
        assert saved.keys() == imported.keys()
        for name, tensor in imported.items():
            assert torch.equal(saved[name], tensor), name
    adapter = load_file(str(model / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.") for k in adapter)  # peft's own naming: PeftModel loads it
    assert any(v.abs().sum() > 0 for k, v in _weights(last).items() if "lora_B" in k)  # trained (lora_B starts at 0)


def test_freezing_embeddings_and_encoder_trains_only_the_decoder(frozen_run, base, corpus_dir):
    model, last = frozen_run / "model", frozen_run / "checkpoints" / f"step_{STEPS}"
    assert not (model / "adapter_config.json").exists()
    assert _valid_nll(model, corpus_dir, last) < _valid_nll(base, corpus_dir) - 0.05
    imported, tuned = _weights(base), _weights(last)
    # weight decay (0.01) left these alone too
    frozen = [k for k in imported if k.split(".")[0] in ("tgt_embed", "src_embed", "encoder", "enc_norm")]
    trained = [k for k in imported if k.startswith("decoder.") and k.endswith(".weight")]
    assert frozen and trained
    for name in frozen:
        assert torch.equal(tuned[name], imported[name]), name
    for name in trained:
        assert not torch.equal(tuned[name], imported[name]), name


def test_a_merged_adapter_is_a_plain_model_directory_translating_as_the_adapted_model(lora_run, corpus_dir, tmp_path):
    out = tmp_path / "merged"
    assert main(["merge-adapter", str(lora_run), str(out)]) == 0
    assert not (out / "adapter_config.json").exists() and (out / "config.json").is_file()
    src = (corpus_dir / "test.en").read_text(encoding="utf-8").splitlines()[:12]
    (tmp_path / "in.txt").write_text("\n".join(src) + "\n", encoding="utf-8")
    assert main(["translate", str(out), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt"),
                 "--beam", "2"]) == 0
    adapted = open_model(lora_run / "model", merge_adapter=False).model  # LoRA layers, unmerged
    assert any("lora_A" in name for name, _ in adapted.named_parameters())
    expected = Translator(adapted, PairTokenizer.load(lora_run / "model")).translate(src, beam_size=2)
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == expected
    ids = torch.tensor([[5, 6, 7, 8, 0]])
    with torch.no_grad():
        torch.testing.assert_close(open_model(out).model.eval()(ids, ids), adapted.eval()(ids, ids),
                                   atol=1e-5, rtol=0)


def test_merge_adapter_refuses_to_replace_a_directory_and_a_model_without_adapter(lora_run, frozen_run, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["merge-adapter", str(lora_run), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err and (out / "keep.txt").is_file()
    assert main(["merge-adapter", str(frozen_run), str(tmp_path / "other")]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


@pytest.mark.parametrize("key, value, needle", [
    ("init_lora_weights", "pissa", "an initialisation that changes the base weights"),  # before: merged, weights off by 1.24
    ("init_lora_weights", "olora", "an initialisation that changes the base weights"),
    ("peft_type", "IA3", "nmt loads LoRA adapters only"),  # before: an AttributeError
    ("use_rslora", True, "a peft setting nmt does not train with"),
    ("target_modules", ["tgt_embed"], "a list of the model's linears"),
    ("r", 64, "its LoRA matrices have rank [8]"),
])
def test_merge_adapter_builds_the_adapter_from_settings_nmt_writes_only(lora_run, tmp_path, capsys, key, value, needle):
    import json
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(lora_run / "model", planted)
    config = json.loads((planted / "adapter_config.json").read_text())
    (planted / "adapter_config.json").write_text(json.dumps(config | {key: value}))
    assert main(["merge-adapter", str(planted), str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and str(planted) in err[0], err
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("which", ["lora", "frozen"])
def test_a_resumed_run_continues_exactly_as_the_uninterrupted_one(which, lora_run, frozen_run, corpus_dir, base,
                                                                    tmp_path):
    whole = {"lora": lora_run, "frozen": frozen_run}[which]
    finetune = (FinetuneConfig(lora_r=8, lora_alpha=16, lora_dropout=0.1) if which == "lora"
                else FinetuneConfig(freeze=["embeddings", "encoder"]))
    _finetune(corpus_dir, tmp_path, base, finetune, max_steps=4)  # stopped after the checkpoint at 4
    _finetune(corpus_dir, tmp_path, base, finetune, resume="latest")
    a, b = (_weights(d / "checkpoints" / f"step_{STEPS}") for d in (whole, tmp_path / "run"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise: the LoRA dropout's RNG and the optimizer restored


def test_average_of_a_lora_run_is_an_adapter_directory_of_the_mean_adapter(lora_run, base, tmp_path):
    out = tmp_path / "avg"
    assert main(["average", str(lora_run), "--last", "2", "-o", str(out)]) == 0
    points = [load_file(str(lora_run / "checkpoints" / f"step_{s}" / "model.safetensors")) for s in (4, STEPS)]
    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert adapter
    for key, value in adapter.items():
        name = key.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        torch.testing.assert_close(value, (points[0][name] + points[1][name]) / 2, atol=0, rtol=0)
    imported = _weights(base)
    assert all(torch.equal(_weights(out)[k], v) for k, v in imported.items())  # the base as it was
    merged = open_model(out).model.state_dict()  # the averaged adapter merged on loading
    assert not torch.equal(merged["encoder.0.attn.qkv.weight"], imported["encoder.0.attn.qkv.weight"])


def test_average_of_a_frozen_run_keeps_the_frozen_weights(frozen_run, base, tmp_path):
    out = tmp_path / "avg"
    assert main(["average", str(frozen_run), "--last", "2", "-o", str(out)]) == 0
    imported, averaged = _weights(base), _weights(out)
    step_4, last = (_weights(frozen_run / "checkpoints" / f"step_{s}") for s in (4, STEPS))
    for name, tensor in imported.items():
        if name.startswith(("tgt_embed.", "encoder.")):
            assert torch.equal(averaged[name], tensor), name
        else:
            torch.testing.assert_close(averaged[name], (step_4[name] + last[name]) / 2, atol=0, rtol=0)


# --- what a user gets wrong ------------------------------------------------------------------------------------------


def _train_args(corpus_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["train", "--data.train", str(corpus_dir / "train"), "--data.cache_dir", str(tmp_path / "cache"),
            "--output_dir", str(tmp_path / "run"), "--max_steps", "1", *extra]


def test_an_unknown_part_to_freeze_is_named_with_the_parts_there_are(corpus_dir, tmp_path, capsys):
    assert main(_train_args(corpus_dir, tmp_path, "--finetune.freeze", "[encoder, attention]")) == 2
    err = capsys.readouterr().err
    assert "finetune.freeze" in err and "'attention'" in err and "embeddings, encoder, decoder, cross_attention" in err


def test_lora_needs_a_model_to_adapt_and_peft(corpus_dir, base, tmp_path, capsys, monkeypatch):
    assert main(_train_args(corpus_dir, tmp_path, "--finetune.lora_r", "4")) == 2
    err = capsys.readouterr().err
    assert "finetune.lora_r" in err and "give init_from" in err
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    assert main(_train_args(corpus_dir, tmp_path, "--init-from", str(base), "--finetune.lora_r", "4")) == 2
    assert "finetune.lora_r needs peft: pip install 'nmt[lora]'" in capsys.readouterr().err
