"""Seq2SeqLoss: one objective for any model following the contract (logits through the label-smoothed
cross-entropy), with the plain model's state dict layout; its CPU variant (nmt.kernels.PackedLoss) gives the same
sums."""

import pytest
import torch
from helpers import PAD, tiny_model
from safetensors.torch import load_model, save_model

from nmt.kernels import PackedLoss, use_cpu_kernels
from nmt.model import LossSums, Seq2SeqLoss, label_smoothed_nll, unwrap_objective

V = 24


class LogitsOnly(torch.nn.Module):
    """nmt's model seen through the generic contract only: forward -> logits, nothing else."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.pad_id = model, 0

    def forward(self, src_ids, tgt_in_ids):
        return self.inner(src_ids, tgt_in_ids)


def batch():
    src_ids = torch.tensor([[5, 6, 7, 3], [8, 9, 3, PAD]])
    tgt_in_ids = torch.tensor([[2, 5, 6], [2, 7, PAD]])
    labels = torch.tensor([[5, 6, 3], [7, 3, PAD]])
    return src_ids, tgt_in_ids, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_packed_cpu_objective_and_any_models_give_the_same_sums(smoothing):
    model = tiny_model(seed=0, vocab=V, dropout=0.0)
    objective = use_cpu_kernels(Seq2SeqLoss(model, smoothing), packed_loss=True)
    assert type(objective) is PackedLoss and type(use_cpu_kernels(LogitsOnly(model))) is LogitsOnly
    packed = objective(*batch())
    plain = Seq2SeqLoss(LogitsOnly(model), smoothing)(*batch())
    src_ids, tgt_in_ids, labels = batch()
    reference = label_smoothed_nll(model(src_ids, tgt_in_ids), labels, PAD, smoothing)
    assert isinstance(packed, LossSums) and packed.tokens == plain.tokens == reference[2] == 5
    for got in (packed, plain):
        torch.testing.assert_close(got.loss, reference[0], atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(got.nll, reference[1], atol=1e-5, rtol=1e-6)
    assert packed.loss.requires_grad and not packed.nll.requires_grad


def test_pad_id_comes_from_the_model():
    model = LogitsOnly(tiny_model(seed=0, vocab=V))
    model.pad_id = 1
    assert Seq2SeqLoss(model).pad_id == 1
    assert Seq2SeqLoss(tiny_model(seed=0, vocab=V)).pad_id == 0  # from model.cfg.pad_id


def test_state_dict_is_the_plain_models(tmp_path):
    """Checkpoints written through the objective load into a bare model, and old ones into the objective."""
    model = tiny_model(seed=0, vocab=V)
    objective = Seq2SeqLoss(model)
    assert list(objective.state_dict()) == list(model.state_dict())
    save_model(objective, str(tmp_path / "new.safetensors"))  # as accelerate's save_state writes it
    bare = tiny_model(seed=1, vocab=V)
    assert load_model(bare, str(tmp_path / "new.safetensors")) == (set(), [])
    save_model(tiny_model(seed=2, vocab=V), str(tmp_path / "old.safetensors"))  # a model file written before
    restored = Seq2SeqLoss(tiny_model(seed=3, vocab=V))
    load_model(restored, str(tmp_path / "old.safetensors"))  # strict: missing or unexpected names raise
    for a, b in zip(tiny_model(seed=2, vocab=V).state_dict().values(), restored.model.state_dict().values()):
        assert torch.equal(a, b)
    assert unwrap_objective(restored) is restored.model and unwrap_objective(model) is model


def test_fsdp_keeps_the_prefix():
    objective = Seq2SeqLoss(tiny_model(seed=0, vocab=V), flat_state_dict=False)
    assert all(k.startswith("model.") for k in objective.state_dict())
