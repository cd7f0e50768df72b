"""nmt.checkpoint: the mean of a run's last checkpoints, into a model directory of its own."""

import json
from pathlib import Path

import pytest
import torch
from helpers import one_thread, tiny_model  # noqa: F401  (one_thread: module-wide)

from nmt import Translator, train
from nmt.errors import NmtError

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_average_weights_is_the_mean(tmp_path):
    from safetensors.torch import save_file

    from nmt.checkpoint import average_weights

    for i, value in enumerate((1.0, 2.0, 6.0)):
        (tmp_path / str(i)).mkdir()
        save_file({"w": torch.full((2, 2), value), "b": torch.tensor([value, -value])},
                  str(tmp_path / str(i) / "model.safetensors"))
    avg = average_weights([tmp_path / str(i) for i in range(3)])
    assert torch.equal(avg["w"], torch.full((2, 2), 3.0)) and torch.equal(avg["b"], torch.tensor([3.0, -3.0]))
    with pytest.raises(NmtError, match="cannot read"):
        average_weights([tmp_path / "0", tmp_path / "missing"])


@pytest.fixture(scope="module")
def run_dir(corpus_dir, tmp_path_factory) -> Path:
    """A tiny run with checkpoints step_2, step_4, step_6 and its final model/."""
    from nmt.compat import reset_accelerate_state
    from tests.conftest import tiny_config

    cfg = tiny_config(corpus_dir, tmp_path_factory.mktemp("average"), max_steps=6, save_every=2, keep_last=3)
    try:
        train(cfg)
    finally:
        reset_accelerate_state()
    return Path(cfg.output_dir)


def test_nmt_average_command(run_dir, tmp_path, capsys):
    from nmt.cli import main

    assert main(["average", str(run_dir), "--last", "3", "-o", str(tmp_path / "avg")]) == 0
    assert Translator.from_pretrained(tmp_path / "avg").translate(["The dog sleeps."], beam_size=1)
    summary = json.loads((tmp_path / "avg" / "training.json").read_text())
    assert [Path(p).name for p in summary["averaged"]] == ["step_2", "step_4", "step_6"]
    assert main(["average", str(tmp_path), "-o", str(tmp_path / "x")]) == 2
    assert "averaging needs 2 or more" in capsys.readouterr().err


def test_average_never_writes_over_the_model_it_reads(run_dir, capsys):
    from nmt.cli import main

    model = run_dir / "model"
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    for force in ([], ["--force"]):  # before: written over in place, the old search.json kept as the default
        assert main(["average", str(run_dir), "--last", "2", "-o", str(model), *force]) == 2
        err = capsys.readouterr().err
        assert f"-o {model} is {model}, which this command reads" in err, err
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_average_replaces_a_used_directory_only_with_force_and_whole(run_dir, tmp_path, capsys):
    from nmt.cli import main

    out = tmp_path / "avg"
    argv = ["average", str(run_dir), "--last", "2", "-o", str(out)]
    assert main(argv) == 0
    (out / "search.json").write_text('{"alpha": 1.7}')  # tuned for other weights
    assert main(argv) == 2 and "exists and is not empty; choose another directory or pass --force" in \
        capsys.readouterr().err
    assert (out / "search.json").read_text() == '{"alpha": 1.7}'
    assert main([*argv, "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "training.json"]  # no stale search.json
    assert Translator.from_pretrained(out).search_defaults == {}
    assert [p.name for p in tmp_path.iterdir()] == ["avg"]  # no temporary or old directory left
    (out / "notes.txt").write_text("mine")  # no longer only what nmt wrote
    assert main([*argv, "--force"]) == 2
    assert f"-o {out} holds what nmt did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


def test_average_of_checkpoints_with_other_names_is_refused(tmp_path):
    from safetensors.torch import save_file

    from nmt.checkpoint import average_weights

    for name, key in (("a", "w"), ("b", "v")):
        (tmp_path / name).mkdir()
        save_file({key: torch.zeros(2)}, str(tmp_path / name / "model.safetensors"))
    with pytest.raises(NmtError, match="other names"):
        average_weights([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(NmtError, match="nothing to average"):
        average_weights([])


def test_load_into_fills_the_shared_embedding_stored_once(tmp_path):
    from nmt.checkpoint import load_into

    source, target = tiny_model(seed=1, share=True), tiny_model(seed=2, share=True)
    source.save_pretrained(tmp_path)  # shared tensors are stored once: no src_embed.weight in the file
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert "src_embed.weight" not in weights
    load_into(target, weights)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


class TiedOwnModel(torch.nn.Module):
    """A user's own model whose input embedding and output projection are one tensor."""

    def __init__(self, vocab: int = 300, d: int = 32):
        super().__init__()
        self.pad_id, self.bos_id, self.eos_id = 0, 2, 3
        self.inner = torch.nn.ModuleDict({"src_embed": torch.nn.Embedding(vocab, d)})
        self.transformer = torch.nn.Transformer(d, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.out = torch.nn.Linear(d, vocab, bias=False)
        self.out.weight = self.inner["src_embed"].weight

    def forward(self, src_ids, tgt_in_ids):
        embed = self.inner["src_embed"]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt_in_ids.shape[1], device=src_ids.device)
        h = self.transformer(embed(src_ids), embed(tgt_in_ids), tgt_mask=causal, tgt_is_causal=True,
                             src_key_padding_mask=src_ids.eq(self.pad_id), memory_key_padding_mask=src_ids.eq(self.pad_id))
        return self.out(h)


def test_averaging_an_own_model_with_tied_weights(tiny_cfg, capsys):
    """The checkpoints store the tied tensor once (under either name): the average fills the other name."""
    from nmt import train
    from nmt.checkpoint import average_weights, tied_names

    model = TiedOwnModel()
    assert tied_names(model) == [["inner.src_embed.weight", "out.weight"]]
    tiny_cfg.max_steps, tiny_cfg.save_every, tiny_cfg.average_last, tiny_cfg.keep_last = 6, 2, 3, 3
    train(tiny_cfg, model=model)
    assert "average of step_2, step_4, step_6" in capsys.readouterr().err
    from nmt.checkpoint import list_checkpoints

    averaged = average_weights(list_checkpoints(tiny_cfg.output_dir))
    assert len([k for k in averaged if k in ("inner.src_embed.weight", "out.weight")]) == 1  # stored once
    assert model.out.weight is model.inner["src_embed"].weight  # still tied after loading the average
