"""The data pipeline on a real corpus: padding in training batches, tokenizer and encoding throughput,
peak memory, and the second run's cache hit.

Runs nmt.data.prepare (the training pipeline) with its cache in a temporary directory, twice. The
tokenizer trainer and the encoder are wrapped to time them and count their calls: the second run must
call neither. Padding is measured on one epoch of the training sampler (length buckets, token budget)
against random batches under the same budget.

    python benchmarks/padding.py ../shared/data/tatoeba-en-de
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import nmt.data  # noqa: E402
import nmt.encoding  # noqa: E402
from nmt.batching import TokenBatchSampler  # noqa: E402
from nmt.config import DataConfig, TokenizerConfig  # noqa: E402


class Counted:
    """Wraps a function of `module` (nmt.data, nmt.encoding): calls, seconds, and items (pairs) it handled."""

    def __init__(self, name: str, count_items, module=nmt.data):
        self.module, self.name, self.fn, self.count_items = module, name, getattr(module, name), count_items
        self.calls, self.seconds, self.items = 0, 0.0, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.items += self.count_items(*args, **kwargs)
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __enter__(self) -> Counted:
        setattr(self.module, self.name, self)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.module, self.name, self.fn)


def run_prepare(data: DataConfig, tok: TokenizerConfig) -> tuple[object, dict]:
    """One prepare() with the tokenizer trainer and the batch encoder wrapped; seconds, calls, memory.

    Memory is the process's peak RSS (it sees the Rust tokenizer's and Arrow's allocations, which tracemalloc
    does not, and costs no time); its growth during prepare is what the pipeline added to the peak.
    """
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with Counted("train_pair_tokenizer", lambda src, tgt, cfg, n=None: n or 0) as trainer, \
            Counted("_encode_batch", lambda batch, tokenizer: len(batch["src"]), nmt.encoding) as encoder:
        start = time.perf_counter()
        corpus = nmt.data.prepare(data, tok)
        total = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return corpus, {"seconds": total, "tokenizer": trainer, "encoder": encoder,
                    "maxrss_mb": rss_after / 1024, "maxrss_growth_mb": (rss_after - rss_before) / 1024}


def random_batches(cost: np.ndarray, budget: int, seed: int) -> list[np.ndarray]:
    """The baseline: pairs in random order, a batch closed when one more pair would break the budget."""
    order = np.random.default_rng(seed).permutation(len(cost))
    batches, start, longest = [], 0, 0
    for i, idx in enumerate(order):
        longest_with = max(longest, cost[idx])
        if i > start and (i - start + 1) * longest_with > budget:
            batches.append(order[start:i])
            start, longest_with = i, cost[idx]
        longest = longest_with
    batches.append(order[start:])
    return batches


def padding(batches: list[np.ndarray], src_len: np.ndarray, tgt_len: np.ndarray) -> dict:
    """Padding fractions as the collator pads: source to its longest row, decoder side to the longest + 1."""
    real_src = padded_src = real_tgt = padded_tgt = 0
    for b in batches:
        s, t = src_len[b], tgt_len[b]  # tgt_len: <s> + target in, target + </s> out
        real_src, padded_src = real_src + s.sum(), padded_src + len(b) * s.max()
        real_tgt, padded_tgt = real_tgt + t.sum(), padded_tgt + len(b) * t.max()
    return {"batches": len(batches), "src": 1 - real_src / padded_src, "tgt": 1 - real_tgt / padded_tgt,
            "all": 1 - (real_src + real_tgt) / (padded_src + padded_tgt),
            "tokens_per_batch": (padded_src + padded_tgt) / 2 / len(batches)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("corpus", help="folder with train/valid/test.{en,de}, e.g. ../shared/data/tatoeba-en-de")
    p.add_argument("--src-lang", default="en")
    p.add_argument("--tgt-lang", default="de")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    folder = Path(args.corpus)
    with tempfile.TemporaryDirectory() as cache:
        data = DataConfig(train=str(folder / "train"), valid=str(folder / "valid"), test=str(folder / "test"),
                          src_lang=args.src_lang, tgt_lang=args.tgt_lang, cache_dir=cache)
        tok = TokenizerConfig(vocab_size=args.vocab)
        corpus, first = run_prepare(data, tok)
        _, second = run_prepare(data, tok)
    train = corpus.splits["train"]
    n_pairs = {k: len(v) for k, v in corpus.splits.items()}
    t, e = first["tokenizer"], first["encoder"]
    print(f"corpus {folder}: pairs {n_pairs}; cleaning dropped {corpus.stats.clean['dropped']}")
    print(f"first prepare (read, clean, train tokenizer, encode): {first['seconds']:.1f}s")
    print(f"  tokenizer training ({args.vocab} BPE, joint): {t.seconds:.1f}s, {t.items / t.seconds:,.0f} pairs/s")
    print(f"  encoding (Dataset.map, batched): {e.items:,} pairs in {e.seconds:.1f}s, {e.items / e.seconds:,.0f} pairs/s")
    print(f"  memory: peak RSS of the process {first['maxrss_mb']:.0f} MiB, +{first['maxrss_growth_mb']:.0f} MiB "
          f"during prepare")
    hit = second["tokenizer"].calls == 0 and second["encoder"].calls == 0
    print(f"second prepare, same cache: {second['seconds']:.2f}s; tokenizer trained {second['tokenizer'].calls}x, "
          f"batches encoded {second['encoder'].calls}x: {'cache hit' if hit else 'CACHE MISS'}")
    table = train.with_format("arrow")[:]  # one Arrow table (row selections applied): columns without a Python loop
    cost = table.column("cost").to_numpy()
    src_len, tgt_len = nmt.encoding.pair_lengths(train)  # tgt_len counts </s> (or <s>) too
    trained = TokenBatchSampler(cost, args.max_tokens, seed=args.seed, ties=src_len)  # as nmt.train builds it
    cost_only = TokenBatchSampler(cost, args.max_tokens, seed=args.seed)
    rows = {"nmt: length buckets, ties by source": padding(trained.plan(0).batches, src_len, tgt_len),
            "length buckets by cost only": padding(cost_only.plan(0).batches, src_len, tgt_len),
            "random batches, same budget": padding(random_batches(cost, args.max_tokens, args.seed), src_len,
                                                  tgt_len)}
    print(f"padding in one epoch of training batches (max_tokens {args.max_tokens}):")
    print(f"  {'batching':36s} {'batches':>7s} {'padded/side':>12s} {'source':>7s} {'target':>7s} {'both':>7s}")
    for name, r in rows.items():
        print(f"  {name:36s} {r['batches']:7d} {r['tokens_per_batch']:12.0f} "
              f"{r['src']:7.1%} {r['tgt']:7.1%} {r['all']:7.1%}")
    collation(train, trained.plan(0).batches, args.max_tokens)
    if not hit:
        sys.exit(1)


def collation(train, batches: list[np.ndarray], max_tokens: int, most: int = 200) -> None:
    """Collation time per micro-batch (the nmt sampler's first `most` batches): nmt's Collator against the bare
    vectorised pad of the same three tensors (numpy, no shift: the least a collator can do) and against padding
    row by row (what the collator did before: a Python loop over the rows)."""
    import torch

    from nmt.batching import Collator

    def vectorised(rows, offset):
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        out = np.zeros((len(rows), int(lengths.max()) + offset), dtype=np.int64)
        out[np.arange(out.shape[1]) < lengths[:, None]] = np.concatenate(rows)
        return torch.from_numpy(out)

    def row_by_row(rows):
        out = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        return out

    systems = {"nmt Collator": lambda ex: Collator()(ex),
               "vectorised pad": lambda ex: [vectorised([np.asarray(e["src_ids"]) for e in ex], 0),
                                             *(vectorised([np.asarray(e["tgt_ids"]) for e in ex], 1) for _ in "io")],
               "row by row": lambda ex: [row_by_row([e["src_ids"] for e in ex]),
                                         row_by_row([[1, *e["tgt_ids"]] for e in ex]),
                                         row_by_row([[*e["tgt_ids"], 2] for e in ex])]}
    chosen = batches[:most]
    columns = [train[b.tolist()] for b in chosen]  # {"src_ids": [...], "tgt_ids": [...]}, as the DataLoader reads
    windows = [[{"src_ids": s, "tgt_ids": t} for s, t in zip(c["src_ids"], c["tgt_ids"])] for c in columns]
    rows = sum(len(w) for w in windows) / len(windows)
    times = {}
    for name, collate in systems.items():
        start = time.perf_counter()
        for window in windows:
            collate(window)
        times[name] = (time.perf_counter() - start) / len(windows) * 1000
    print(f"collation per micro-batch ({len(windows)} of max_tokens {max_tokens}, {rows:.0f} rows on average):")
    for name, ms in times.items():
        print(f"  {name:36s} {ms:8.2f} ms  x{ms / times['vectorised pad']:.2f} the vectorised pad")


if __name__ == "__main__":
    main()
