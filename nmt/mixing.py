"""Several training corpora mixed into one epoch: each drawn `epoch_draws` times an epoch, by data.weights and
data.temperature (`mix`, `Mixing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nmt.config import DataConfig
from nmt.errors import NmtError


@dataclass
class Mixing:
    """Which training pairs each epoch reads when several corpora are mixed (`data.weights`, `data.temperature`):
    corpus i gives `draws[i]` pairs an epoch, as whole copies of itself and, for the rest, a sample of its pairs
    drawn anew each epoch from `seed` and the epoch (the same on every process, so resume and N processes agree).
    A corpus a temperature shrinks is thus seen in turn, not cut to one fixed subset."""

    origin: np.ndarray  # (N,) the corpus of each training pair
    draws: list[int]
    seed: int

    def rows(self, epoch: int) -> np.ndarray:
        """(sum(draws),) indices into the training split: epoch `epoch`'s pairs, corpus by corpus."""
        rng = np.random.default_rng([self.seed, epoch])
        parts = []
        for i, n_draws in enumerate(self.draws):
            idx = np.flatnonzero(self.origin == i)
            whole, rest = divmod(n_draws, len(idx))
            parts += [idx] * whole + [np.sort(rng.choice(idx, size=rest, replace=False))]
        return np.concatenate(parts)


def epoch_shares(sizes: list[int], weights: list[float], temperature: float) -> np.ndarray:
    """(C,) each corpus's share of an epoch: its weighted size (pairs times weight) raised to 1/temperature,
    normalised. Temperature 1 is proportional to the weighted sizes; a large one tends to equal shares."""
    m = np.asarray(sizes, float) * np.asarray(weights, float)
    scaled = np.exp((np.log(m) - np.log(m).max()) / temperature)  # m ** (1/T) without overflow
    return scaled / scaled.sum()


def epoch_draws(sizes: list[int], weights: list[float], temperature: float) -> list[int]:
    """Pairs drawn from each corpus per epoch. An epoch keeps the weighted total (sum of pairs times weight),
    divided by `epoch_shares`; at temperature 1 corpus i gives exactly its pairs times its weight (whole copies
    and a rounded fraction), so with weights 1 each pair is seen once per epoch."""
    if temperature == 1.0:
        return [int(w) * n + round((w % 1.0) * n) for n, w in zip(sizes, weights)]
    total = sum(n * w for n, w in zip(sizes, weights))
    return [max(1, round(share * total)) for share in epoch_shares(sizes, weights, temperature)]


def mix(origin: np.ndarray, cfg: DataConfig) -> tuple[Mixing, list[dict]]:
    """The mixing of the training corpora (each drawn `epoch_draws` times an epoch, by data.weights and
    data.temperature) and each one's line of the stats. `origin` (N,) is the corpus of each training pair."""
    sources = cfg.corpora("train")
    sizes = [int(np.count_nonzero(origin == i)) for i in range(len(sources))]
    if 0 in sizes:
        empty = sources[sizes.index(0)].path
        raise NmtError(f"data.train {empty}: no pairs left after cleaning; check the file or drop it from data.train")
    draws = epoch_draws(sizes, [s.weight for s in sources], cfg.temperature)
    corpora = [{"train": source.path, "pair": source.pair, "pairs": n, "weight": source.weight, "per_epoch": n_draws,
                "share": round(n_draws / sum(draws), 4)} for source, n, n_draws in zip(sources, sizes, draws)]
    return Mixing(origin, draws, cfg.split_seed), corpora
