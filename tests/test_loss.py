"""The loss: a sum over real target tokens, so any split of a batch adds up to the whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nmt.model import label_smoothed_nll

PAD, V = 0, 11


def batch(seed: int, B: int = 5, T: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B,T,V), labels (B,T)) with rows of 1..T real labels then padding."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * 3
    labels = torch.randint(1, V, (B, T), generator=gen)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    labels[torch.arange(T)[None, :] >= lengths[:, None]] = PAD
    return logits, labels


@pytest.mark.parametrize("seed", range(3))
def test_no_smoothing_is_cross_entropy_over_real_tokens(seed):
    logits, labels = batch(seed)
    loss, nll, n_tokens = label_smoothed_nll(logits, labels, PAD, smoothing=0.0)
    expected = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(nll, expected, atol=1e-4, rtol=1e-6)
    assert n_tokens == int(labels.ne(PAD).sum())


def test_smoothing_matches_its_formula():
    """(1 - eps) * nll + eps * (mean over the vocabulary of -log p), summed over real tokens."""
    logits, labels = batch(3)
    eps = 0.1
    loss, nll, _ = label_smoothed_nll(logits, labels, PAD, smoothing=eps)
    real = labels.ne(PAD)
    lp = torch.log_softmax(logits[real], dim=-1)
    expected = ((1 - eps) * -lp.gather(1, labels[real][:, None]).squeeze(1) - eps * lp.mean(-1)).sum()
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-6)
    assert not torch.isclose(loss, nll)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_padding_positions_do_not_contribute(smoothing):
    logits, labels = batch(4)
    noisy = logits.clone()
    noisy[labels.eq(PAD)] = torch.randn_like(noisy[labels.eq(PAD)]) * 100
    assert labels.eq(PAD).any()
    a, b = label_smoothed_nll(logits, labels, PAD, smoothing), label_smoothed_nll(noisy, labels, PAD, smoothing)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    assert a[2] == b[2]
    noisy.requires_grad_(True)
    label_smoothed_nll(noisy, labels, PAD, smoothing)[0].backward()
    assert noisy.grad[labels.eq(PAD)].abs().max() == 0


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("cut", [1, 2, 4])
def test_sums_over_parts_of_a_batch_add_up_to_the_whole(smoothing, cut):
    """Per-token normalisation happens once per optimizer step, so the loss sums and token counts of
    micro-batches must add up exactly to those of the whole batch (also with different padded widths)."""
    logits, labels = batch(5)
    whole = label_smoothed_nll(logits, labels, PAD, smoothing)
    # the second part trimmed to its own longest row, as its collator would pad it
    width = int(labels[cut:].ne(PAD).sum(1).max())
    parts = [label_smoothed_nll(logits[:cut], labels[:cut], PAD, smoothing),
             label_smoothed_nll(logits[cut:, :width], labels[cut:, :width], PAD, smoothing)]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole[0], atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(parts[0][1] + parts[1][1], whole[1], atol=1e-4, rtol=1e-6)
    assert parts[0][2] + parts[1][2] == whole[2]
    mean_of_means = (parts[0][0] / parts[0][2] + parts[1][0] / parts[1][2]) / 2
    assert not torch.isclose(mean_of_means, whole[0] / whole[2])  # why sums: means of parts would differ


def test_all_padding_gives_zero():
    loss, nll, n = label_smoothed_nll(torch.randn(2, 3, V), torch.zeros(2, 3, dtype=torch.long), PAD, 0.1)
    assert float(loss) == 0.0 and float(nll) == 0.0 and n == 0


def test_bf16_logits_get_a_bf16_gradient_and_a_float32_loss():
    logits, labels = batch(7)
    x = logits.bfloat16().requires_grad_(True)
    loss, nll, _ = label_smoothed_nll(x, labels, PAD, 0.1)
    assert loss.dtype == nll.dtype == torch.float32
    loss.backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()
