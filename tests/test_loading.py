"""The loading chapter (nmt.loading): a model directory opens to the model that was saved, and one whose config
is not its weights' (edited, copied, planted tensors) is refused from the safetensors header, before anything of
its size is allocated."""

from __future__ import annotations

import pytest
import torch
from helpers import src_batch, tgt_in_batch, tiny_model

from nmt.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from nmt.loading import open_model

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

    from nmt.errors import NmtError

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
    from nmt.errors import NmtError

    directory = _saved(tmp_path, width=512, max_positions=10**6)  # the weights' own d_model: a 1.9 GiB table
    with pytest.raises(NmtError, match=r"config.json: max_positions=1000000 at d_model=512 asks for a 1.9 GiB"):
        open_model(directory)


def test_every_stored_tensor_is_checked_by_name_shape_and_dtype(tmp_path):
    from safetensors.torch import load_file, save_file

    from nmt.errors import NmtError

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
