"""nmt.average: the mean of a run's last checkpoints, into a model directory of its own."""

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

    from nmt.average import average_weights

    for i, value in enumerate((1.0, 2.0, 6.0)):
        (tmp_path / str(i)).mkdir()
        save_file({"w": torch.full((2, 2), value), "b": torch.tensor([value, -value])},
                  str(tmp_path / str(i) / "model.safetensors"))
    avg = average_weights([tmp_path / str(i) for i in range(3)])
    assert torch.equal(avg["w"], torch.full((2, 2), 3.0)) and torch.equal(avg["b"], torch.tensor([3.0, -3.0]))
    with pytest.raises(NmtError, match="cannot read"):
        average_weights([tmp_path / "0", tmp_path / "missing"])


def test_nmt_average_command(tiny_cfg, tmp_path, capsys):
    from nmt.cli import main

    tiny_cfg.max_steps, tiny_cfg.save_every, tiny_cfg.keep_last = 6, 2, 3
    train(tiny_cfg)
    assert main(["average", tiny_cfg.output_dir, "--last", "3", "-o", str(tmp_path / "avg")]) == 0
    assert Translator.from_pretrained(tmp_path / "avg").translate(["The dog sleeps."], beam_size=1)
    summary = json.loads((tmp_path / "avg" / "training.json").read_text())
    assert [Path(p).name for p in summary["averaged"]] == ["step_2", "step_4", "step_6"]
    assert main(["average", str(tmp_path), "-o", str(tmp_path / "x")]) == 2
    assert "averaging needs 2 or more" in capsys.readouterr().err


def test_average_of_checkpoints_with_other_names_is_refused(tmp_path):
    from safetensors.torch import save_file

    from nmt.average import average_weights

    for name, key in (("a", "w"), ("b", "v")):
        (tmp_path / name).mkdir()
        save_file({key: torch.zeros(2)}, str(tmp_path / name / "model.safetensors"))
    with pytest.raises(NmtError, match="other names"):
        average_weights([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(NmtError, match="nothing to average"):
        average_weights([])


def test_load_into_fills_the_shared_embedding_stored_once(tmp_path):
    from nmt.average import load_into

    source, target = tiny_model(seed=1, share=True), tiny_model(seed=2, share=True)
    source.save_pretrained(tmp_path)  # shared tensors are stored once: no src_embed.weight in the file
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert "src_embed.weight" not in weights
    load_into(target, weights)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name
