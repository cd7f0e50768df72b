"""Label-smoothed cross-entropy summed over real (non-pad) target tokens.

Sums, not means: the training loop divides by the number of target tokens in the whole optimizer
step (all processes, all micro-batches), so the gradient does not depend on how a step is split.
"""

from __future__ import annotations

import torch


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-row label-smoothed cross-entropy with a hand-written backward.

    Autograd through log_softmax, gather and mean would keep or build four (N, V) tensors (log-probs,
    the gather's scattered gradient, the mean's expanded one and their sum); here the log-probs are the only
    one, and the backward turns them into the gradient in place: softmax - (1 - eps) onehot - eps / V.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, smoothing: float):
        lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # (N, V), fp32 also under autocast
        nll = -lprobs.gather(1, target[:, None]).squeeze(1)  # (N,)
        loss = (1.0 - smoothing) * nll - smoothing * lprobs.mean(-1) if smoothing > 0 else nll.clone()
        ctx.save_for_backward(lprobs, target)
        ctx.smoothing, ctx.dtype = smoothing, logits.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_nll):
        lprobs, target = ctx.saved_tensors  # a second backward fails the version check instead of going wrong
        eps, g = ctx.smoothing, grad_loss[:, None]  # (N, 1)
        grad = lprobs.exp_().mul_(g)  # softmax * g, in the log-probs' buffer
        if eps > 0:
            grad.sub_(g * (eps / grad.shape[1]))
        grad.scatter_add_(1, target[:, None], g * -(1.0 - eps))
        return grad.to(ctx.dtype), None, None


def smoothed_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                           smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V), target (N,) -> (smoothed loss (N,), nll (N,)), both fp32; the nll carries no gradient.

    loss = (1 - eps) * nll + eps * mean over the vocabulary of -log p (the smoothing mass spread uniformly).
    """
    return _SmoothedCrossEntropy.apply(logits, target, float(smoothing))


def label_smoothed_nll(logits: torch.Tensor, labels: torch.Tensor, pad_id: int,
                       smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """logits (B, T, V), labels (B, T) -> (smoothed loss sum, nll sum, number of real tokens).

    Only positions whose label is not `pad_id` are scored, so padding costs no softmax. nmt's own model
    does better: `model.packed_loss(src_ids, tgt_in_ids, labels)` projects only the real positions to the vocabulary.
    """
    real = labels.ne(pad_id)  # (B, T)
    loss, nll = smoothed_cross_entropy(logits[real], labels[real], smoothing)
    return loss.sum(), nll.sum().detach(), int(real.sum())
