"""Label-smoothed cross-entropy summed over real (non-pad) target tokens.

Sums, not means: the training loop divides by the number of target tokens in the whole optimizer
step (all processes, all micro-batches), so the gradient does not depend on how a step is split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def label_smoothed_nll(logits: torch.Tensor, labels: torch.Tensor, pad_id: int,
                       smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """logits (B, T, V), labels (B, T) -> (smoothed loss sum, nll sum, number of real tokens).

    Only positions whose label is not `pad_id` are scored, so padding costs no softmax.
    """
    real = labels.ne(pad_id)  # (B, T)
    lprobs = F.log_softmax(logits[real].float(), dim=-1)  # (N, V)
    target = labels[real]
    nll = -lprobs.gather(1, target[:, None]).squeeze(1)
    loss = (1.0 - smoothing) * nll - smoothing * lprobs.mean(-1) if smoothing > 0 else nll
    return loss.sum(), nll.sum().detach(), int(real.sum())
