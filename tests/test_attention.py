"""Cross-attention alignments: the recomputed weights are the ones the model used, and the picture is a PNG."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import EOS, one_thread, src_batch, tiny_model  # noqa: F401  (one_thread: module-wide)
from matplotlib.image import imread

from nmt import Translator, train
from nmt.attention import cross_attention, cross_attentions, plot_alignment
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.errors import NmtError
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def model_dir(corpus_dir, tmp_path_factory) -> Path:
    cfg = tiny_config(corpus_dir, tmp_path_factory.mktemp("attention"), max_steps=40, eval_every=10_000,
                      save_every=10_000, log_every=100)
    try:
        return train(cfg).model_dir
    finally:
        reset_accelerate_state()


@pytest.mark.parametrize("pre_norm", [True, False])
def test_weights_are_the_ones_the_model_attends_with(pre_norm):
    """Weights @ values, through the output projection, must equal what the cross-attention module returned
    in a real forward pass (so the recomputation cannot drift from SDPA); rows are distributions."""
    model = tiny_model(seed=4, layers=2, pre_norm=pre_norm)
    src_ids = src_batch(torch.Generator().manual_seed(4), [6], 24)
    tgt = [5, 9, 7, EOS]
    for layer in (0, -1):
        block = model.decoder[layer]
        outputs: list[torch.Tensor] = []
        handle = block.cross_attn.register_forward_hook(lambda m, args, out, seen=outputs: seen.append(out))
        with torch.no_grad():
            model(src_ids, torch.tensor([[2, *tgt[:-1]]]))
            per_head = cross_attention(model, src_ids, tgt, layer=layer, average=False)  # (H, T, S)
            values = block.cross_kv(model.encode(src_ids))[1][0]  # (H, S, Dh)
            mixed = (per_head @ values).transpose(0, 1).reshape(len(tgt), -1)  # (T, D)
            assert torch.allclose(block.cross_attn.out(mixed), outputs[0][0], atol=1e-5)
        handle.remove()
        weights = cross_attention(model, src_ids, tgt, layer=layer)
        assert weights.shape == (len(tgt), 6)
        assert (weights >= 0).all() and torch.allclose(weights.sum(1), torch.ones(len(tgt)), atol=1e-5)
        assert torch.allclose(weights, per_head.mean(0))
    assert not torch.allclose(cross_attention(model, src_ids, tgt, 0), cross_attention(model, src_ids, tgt, -1))


def test_a_padded_batch_gives_each_pair_its_weights_alone():
    model = tiny_model(seed=5, layers=2)
    gen = torch.Generator().manual_seed(5)
    sources = [src_batch(gen, [n], 24)[0].tolist() for n in (7, 3, 5)]
    targets = [[5, 9, 7, EOS], [6, EOS], [4, 8, 8, 11, 12, EOS]]
    batched = cross_attentions(model, sources, targets, layer=0)
    for src, tgt, weights in zip(sources, targets, batched):
        assert torch.allclose(weights, cross_attention(model, torch.tensor(src), tgt, layer=0), atol=1e-5)


def test_translator_attention_and_picture(model_dir, tmp_path):
    translator = Translator.from_pretrained(model_dir)
    text = "The dog sleeps."
    src, tgt, weights = translator.attention(text, beam_size=2)
    assert src == translator.tokenizer.src_tokens(text) and src[-1] == "</s>" and tgt[-1] == "</s>"
    assert weights.shape == (len(tgt), len(src))
    assert torch.allclose(weights.sum(1), torch.ones(len(tgt)), atol=1e-5)
    out = plot_alignment(src, tgt, weights, tmp_path / "pics" / "a.png", title=text)
    assert out == tmp_path / "pics" / "a.png"
    image = imread(out)
    assert image.ndim == 3 and image.shape[0] >= 400 and image.shape[1] >= 600
    assert image[..., :3].std() > 0.05  # a picture, not a blank canvas


def test_cli_draws_the_first_sentence(model_dir, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("The dog sleeps.\nI am young.\n")
    assert main(["translate", str(model_dir), "--beam", "2", "--input", str(tmp_path / "in.txt"),
                 "--attention", str(tmp_path / "first.png")]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2  # translations on stdout, untouched
    assert "first.png" in captured.err
    assert imread(tmp_path / "first.png").shape[0] >= 400


def test_mistakes_are_clear(model_dir, tmp_path):
    with pytest.raises(NmtError, match="do not match"):
        plot_alignment(["a", "</s>"], ["b", "</s>"], torch.full((3, 2), 0.5), tmp_path / "x.png")
    with pytest.raises(NmtError, match="cannot write this format"):
        plot_alignment(["a"], ["b"], torch.ones(1, 1), tmp_path / "x.nope")
    model = tiny_model()
    with pytest.raises(NmtError, match="decoder layer 3 does not exist"):
        cross_attention(model, src_batch(torch.Generator().manual_seed(0), [4], 24), [5, EOS], layer=3)
    with pytest.raises(NmtError, match="without padding"):
        cross_attention(model, src_batch(torch.Generator().manual_seed(0), [4, 2], 24)[1], [5, EOS])
