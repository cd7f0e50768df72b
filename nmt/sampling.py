"""Sampling instead of searching: which tokens may be drawn (top-k, top-p), how sharply (temperature), and the
seeded draw itself. `nmt.search` runs the loop; this module only chooses the next token of each row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nmt.config import check_fields, ranged

SEEDS = 10**9 + 1  # seeds are 0 .. 1e9 (the range of SamplingConfig.seed)


@dataclass
class SamplingConfig:
    """Draw each next token from the model's distribution instead of taking the best one.

    Sampled back-translation gives the forward model more varied synthetic sources than beam search
    (Edunov et al. 2018). With topk 1, or temperature 0, sampling is greedy search.
    """

    topk: int = ranged(0, "[0, 1e6]")  # draw only among the k most likely tokens (0: no limit)
    topp: float = ranged(1.0, "(0, 1]")  # ... and among the fewest most likely tokens holding probability >= p
    temperature: float = ranged(1.0, "[0, 1e3]")  # divides the log-probabilities: < 1 sharper, > 1 flatter, 0 greedy
    seed: int | None = ranged(0, "[0, 1e9]")  # same seed, inputs and batches: same samples; None: torch's global RNG

    def __post_init__(self) -> None:
        check_fields(self, noun="sampling setting")

    def generator(self, device: torch.device) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


def choose(lp: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """lp (N, V) log-probabilities -> (N,) one token per row, drawn from the tempered top-k / top-p set; the
    argmax at temperature 0 or top-k 1.

    Top-k and top-p are applied to the model's own distribution (before the temperature), as fairseq does;
    the most likely token is always kept, so every row can draw. With top-k the draw looks at k tokens a
    row only; top-p alone sorts the whole vocabulary.
    """
    if cfg.temperature == 0 or cfg.topk == 1:
        return lp.argmax(-1)
    V = lp.shape[1]
    k = cfg.topk if 0 < cfg.topk < V else (V if cfg.topp < 1 else 0)
    if not k:
        return torch.multinomial(torch.softmax(lp / cfg.temperature, dim=-1), 1, generator=generator).squeeze(1)
    top, token = lp.topk(k, dim=1)  # (N, k), most likely first
    if cfg.topp < 1:
        probs = top.exp()
        before = probs.cumsum(1) - probs  # (N, k) mass of the tokens ranked above each one
        top = top.masked_fill(before >= cfg.topp, -torch.inf)
    pick = torch.multinomial(torch.softmax(top / cfg.temperature, dim=-1), 1, generator=generator)  # (N, 1)
    return token.gather(1, pick).squeeze(1)
