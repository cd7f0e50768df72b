"""The loading chapter (nmt.loading): a model directory opens to the model that was saved, and one whose config
is not its weights' (edited, copied, planted tensors) is refused from the safetensors header, before anything of
its size is allocated; `nmt average` writes the mean of a run's last checkpoints as a model directory of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import one_thread, src_batch, tgt_in_batch, tiny_model  # noqa: F401  (one_thread: module-wide)

from nmt import Translator, train
from nmt.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from nmt.errors import NmtError
from nmt.loading import open_model

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

V = 24


@pytest.mark.parametrize("share,pre_norm", [(True, True), (False, False)])
def test_save_and_load_round_trip(tmp_path, share, pre_norm):
    model = tiny_model(seed=4, vocab=V, tgt_vocab=V if share else V + 3, share=share, pre_norm=pre_norm, layers=2)
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    loaded = open_model(tmp_path / "m").model.eval()
    assert loaded.cfg == model.cfg
    assert (loaded.src_embed is loaded.tgt_embed) == share
    gen = torch.Generator().manual_seed(0)
    src_ids, tgt_in_ids = src_batch(gen, [5, 2, 7], V), tgt_in_batch(gen, [3, 6, 1], V + 3 if not share else V)
    with torch.no_grad():
        assert torch.equal(loaded(src_ids, tgt_in_ids), model(src_ids, tgt_in_ids))


def _saved(tmp_path, width: int = 16, **config_changes):
    """A saved tiny model (one layer) whose config.json is then edited by `config_changes`."""
    import json

    tiny_model(seed=4, vocab=V, d_model=width).save_pretrained(tmp_path / "m")
    config = tmp_path / "m" / CONFIG_FILE
    config.write_text(json.dumps({**json.loads(config.read_text()), **config_changes}))
    return tmp_path / "m"


@pytest.mark.parametrize("changes, needles", [
    (dict(max_positions=10**9), ["config.json", "model.max_positions", "1000000000"]),
    # 10**6 positions at d_model 4096: a 15 GiB position table if the model were built before the check
    (dict(d_model=4096, n_heads=4, max_positions=10**6), ["config.json", "model.d_model is 4096", "have 16",
                                                          "tgt_embed.weight has shape [24, 16]", WEIGHTS_FILE]),
    (dict(d_ff=10**6, n_encoder_layers=1000), ["config.json", "model.n_encoder_layers is 1000", "have 1"]),
    (dict(d_ff=10**6), ["model.d_ff is 1000000", "encoder.0.ff.up.weight has shape [32, 16]"]),
    (dict(max_positions=10**6, d_model=16), None),  # 61 MiB of table at the model's own d_model: loads
])
def test_a_config_that_is_not_the_weights_is_refused_before_allocating(tmp_path, changes, needles):
    import resource
    import time


    directory = _saved(tmp_path, **changes)
    rss_before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    if needles is None:
        assert open_model(directory).model.positions.shape == (10**6, 16)
        return
    with pytest.raises(NmtError) as refused:
        open_model(directory)
    for needle in needles:
        assert needle in str(refused.value), str(refused.value)
    assert time.perf_counter() - start < 5  # header and JSON only; the shared CPUs make this generous
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000  # KiB: nothing of GiB size


def test_a_position_table_too_big_for_a_model_directory_is_refused(tmp_path):

    directory = _saved(tmp_path, width=512, max_positions=10**6)  # the weights' own d_model: a 1.9 GiB table
    with pytest.raises(NmtError, match=r"config.json: max_positions=1000000 at d_model=512 asks for a 1.9 GiB"):
        open_model(directory)


def test_every_stored_tensor_is_checked_by_name_shape_and_dtype(tmp_path):
    from safetensors.torch import load_file, save_file


    directory = _saved(tmp_path)
    weights = directory / WEIGHTS_FILE
    state = load_file(str(weights))
    state["decoder.0.cross_attn.q.weight"] = state["decoder.0.cross_attn.q.weight"][:, :8].contiguous()
    save_file(state, str(weights))
    with pytest.raises(NmtError, match=r"model.safetensors: decoder.0.cross_attn.q.weight has shape \[16, 8\] in "
                                       r"the file but \[16, 16\] in the model .*config.json describes"):
        open_model(directory)
    state = load_file(str(_saved(tmp_path / "int") / WEIGHTS_FILE))
    state["enc_norm.weight"] = state["enc_norm.weight"].long()
    save_file(state, str(tmp_path / "int" / "m" / WEIGHTS_FILE))
    with pytest.raises(NmtError, match=r"enc_norm.weight is stored as I64, not as floating point"):
        open_model(tmp_path / "int" / "m")
    state = load_file(str(_saved(tmp_path / "extra") / WEIGHTS_FILE))
    save_file({**state, "planted": torch.zeros(2)}, str(tmp_path / "extra" / "m" / WEIGHTS_FILE))
    with pytest.raises(NmtError, match=r"unexpected \['planted'\]"):
        open_model(tmp_path / "extra" / "m")


def test_weights_stored_in_bfloat16_load_as_float32(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = _saved(tmp_path)
    state = {k: v.bfloat16() for k, v in load_file(str(directory / WEIGHTS_FILE)).items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    loaded = open_model(directory).model
    assert loaded.tgt_embed.weight.dtype == torch.float32
    assert torch.equal(loaded.tgt_embed.weight, state["tgt_embed.weight"].float())


# --- nmt average: the mean of a run's last checkpoints -----------------------------------------------------

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


def test_a_model_directory_of_pickled_weights_is_refused_saying_how_to_convert(tmp_path, capsys):
    from nmt.cli import main

    directory = tmp_path / "m"
    tiny_model(seed=1, vocab=V).save_pretrained(directory)
    (directory / WEIGHTS_FILE).unlink()
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    assert main(["translate", str(directory)]) == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin), which nmt never reads" in err and "save_pretrained" in err and len(err.splitlines()) == 1
