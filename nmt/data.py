"""A parallel corpus prepared for training: read (nmt.readers), carved, cleaned with counts, the tokenizer trained
and every split encoded (nmt.encoding), all cached by content (`prepare`). Every input becomes a Dataset with
string columns "src" and "tgt"; encoding adds "src_ids", "tgt_ids", their lengths and "cost" (padded tokens).

Validation and test are read like train and lose what no model can take (empty, NUL bytes, too long in words,
characters or subwords), counted per split; never duplicates or odd length ratios: they are what is measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

from nmt import clean as columns
from nmt.compat import dataset_fingerprint
from nmt.config import DataConfig, DataSource, TokenizerConfig, lang_tag, to_dict
from nmt.encoding import drop_long, encode
from nmt.errors import NmtError
from nmt.plan import vocab_size_for
from nmt.readers import load_split
from nmt.tables import arrow_batches, column, open_arrow, rows, write_rows
from nmt.textfiles import write_arrow
from nmt.tokenizer import PairTokenizer, bulk_threads, train_pair_tokenizer

SPLITS = ("train", "valid", "test")
EVAL_SPLITS = ("valid", "test")
# what validation and test drop (nmt.clean.REASONS): pairs no model can be fed; length_ratio and duplicates stay
EVAL_REASONS = ("empty", "nul_byte", "too_long")
PREPARED_FORMAT = 2  # part of the cache key: bumped when what prepare writes under a key changes
log = logging.getLogger(__name__)


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


@dataclass
class Corpus:
    """Encoded splits, their tokenizer, what cleaning dropped, and how several training corpora are mixed."""

    splits: dict[str, datasets.Dataset]
    tokenizer: PairTokenizer
    stats: dict = field(default_factory=dict)
    mixing: Mixing | None = None

    @property
    def epoch_rows(self) -> Callable[[int], np.ndarray] | None:
        """`epoch -> indices` of the training pairs an epoch reads (`Mixing.rows`); None: every pair once."""
        return None if self.mixing is None else self.mixing.rows


# --- cleaning -----------------------------------------------------------------------------------


def drop_reason(src: str, tgt: str, cfg: DataConfig) -> str | None:
    """Why a training pair is dropped, or None to keep it."""
    if not src.strip() or not tgt.strip():
        return "empty"
    if "\x00" in src or "\x00" in tgt:
        return "nul_byte"
    n_src, n_tgt = len(src.split()), len(tgt.split())
    if max(n_src, n_tgt) > cfg.max_words or max(len(src), len(tgt)) > cfg.max_chars:
        return "too_long"
    if max(n_src, n_tgt) > cfg.ratio_min_words and max(n_src, n_tgt) > cfg.max_ratio * max(min(n_src, n_tgt), 1):
        return "length_ratio"
    return None


def clean(ds: datasets.Dataset, cfg: DataConfig, evals: dict[str, datasets.Dataset] | None = None,
          among: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """(N,) bool: the pairs to keep (bad pairs and exact duplicates dropped), and counts per reason. `among` ((N,)
    bool): the rows that are training pairs (the others were carved off for validation or test; None: all).

    Whole columns at a time (`nmt.clean`). With `evals` (validation, test), stats["overlap"] counts their
    pairs that also occur in `ds` after normalisation (`nmt.clean.normalise`); `cfg.dedupe_eval` drops those
    training pairs ("in_valid_or_test").
    """
    evals = {name: (ev, columns.normalised_hashes(arrow_batches(ev))) for name, ev in (evals or {}).items()}
    other = np.concatenate([np.zeros(0, np.uint64), *(hashes for _, hashes in evals.values())])
    codes, near, hashes = columns.scan(arrow_batches(ds, 10_000), cfg, len(ds), other)
    if cfg.dedupe:  # over every pair: equal pairs share a drop code, so a repeat of a dropped one is dropped
        repeated = columns.repeats(hashes, lambda idx: rows(ds, idx), among)
    del hashes
    if among is not None:
        codes[~among] = -1  # not a training pair: neither kept nor counted
    reasons, counts = np.unique(codes[codes > 0], return_counts=True)
    dropped = Counter({columns.REASONS[r - 1]: int(n) for r, n in zip(reasons, counts)})
    stats = {"read": int(np.count_nonzero(codes >= 0))}
    kept = codes == 0
    del codes
    if cfg.dedupe:
        repeated &= kept
        dropped["duplicate"] = int(np.count_nonzero(repeated))
        kept &= ~repeated
        del repeated
    near &= kept
    if evals:
        in_eval, stats["overlap"] = _eval_overlap(ds, np.flatnonzero(near), evals)
        if cfg.dedupe_eval:
            dropped["in_valid_or_test"] = len(in_eval)
            kept[in_eval] = False
    stats.update(kept=int(np.count_nonzero(kept)), dropped={k: n for k, n in dropped.items() if n})
    return kept, stats


def _eval_overlap(ds: datasets.Dataset, candidates: np.ndarray,
                  evals: dict[str, tuple[datasets.Dataset, np.ndarray]]) -> tuple[np.ndarray, dict]:
    """The kept training rows that equal an eval pair after normalisation (`candidates`: those whose hash says
    they may); and per eval split (its pairs, their `nmt.clean.normalised_hashes`), how many of its pairs occur in
    training. Texts are read for the candidates and the eval pairs that share their hashes only."""
    found = rows(ds, candidates, normalised=True)  # one read of the training file
    hashes = np.sort(columns.pair_hashes(*(pa.array(side, pa.string()) for side in zip(*found))) if found else
                     np.zeros(0, np.uint64))
    texts = {name: rows(ev, np.flatnonzero(columns.is_in(ev_hashes, hashes)), normalised=True)
             for name, (ev, ev_hashes) in evals.items()}
    every = set().union(*texts.values())
    in_eval = candidates[np.fromiter((text in every for text in found), bool, len(found))]
    seen = {text for text in found if text in every}
    return in_eval, {name: sum(text in seen for text in pairs) for name, pairs in texts.items()}


def overlap_line(stats: dict) -> str | None:
    """One line for the log: validation/test pairs that also occur in train; None when there are none."""
    overlap = stats.get("clean", {}).get("overlap") or {}
    if not any(overlap.values()):
        return None
    found = " and ".join(f"{n} {name}" for name, n in overlap.items())
    removed = stats["clean"]["dropped"].get("in_valid_or_test")
    then = (f"data.dedupe_eval removed {removed} training pairs" if removed is not None
            else "set data.dedupe_eval: true to remove them from train")
    return f"{found} pairs also occur in the training data (after normalisation); {then}"


def clean_eval(ds: datasets.Dataset, name: str, cfg: DataConfig, work: Path,
               blocks: list[list] | None = None) -> tuple[datasets.Dataset, dict]:
    """Validation or test (`name`) without the pairs of `EVAL_REASONS`, and its counts {"read", "kept", "dropped"}.
    What is kept is a file of its own in `work` (unless nothing was dropped); nothing left is refused by
    `refuse_empty_eval`, once train's own cleaning has had its say. `blocks` ([language pair, rows] in order, a
    multilingual split's) are counted again after the cleaning, in place."""
    keep_codes = [0, *(columns.REASONS.index(r) + 1 for r in columns.REASONS if r not in EVAL_REASONS)]
    codes = np.concatenate([np.zeros(0, np.int8), *(columns.drop_codes(t.column("src"), t.column("tgt"), cfg)
                                                    for t in arrow_batches(ds, 10_000))])
    codes[np.isin(codes, keep_codes)] = 0
    reasons, counts = np.unique(codes[codes > 0], return_counts=True)
    kept = codes == 0
    _recount(blocks, kept)
    stats = {"read": len(ds), "kept": int(np.count_nonzero(kept)),
             "dropped": {columns.REASONS[r - 1]: int(n) for r, n in zip(reasons, counts)}}
    if kept.all() or not kept.any():
        return ds, stats
    out = work / f"{name}.clean.arrow"
    return (open_arrow(out, f"nmt-{work.name}-{out.stem}") if out.is_file() else write_rows(ds, kept, out)), stats


def refuse_empty_eval(stats: dict[str, dict]) -> None:
    """NmtError when cleaning left validation or test (`clean_eval`'s counts by split) without a pair."""
    for name, s in stats.items():
        if s["kept"] == 0:
            raise NmtError(f"no {name} pairs left after cleaning ({s['read']} read; dropped: {s['dropped']}); check "
                           f"data.{name} (or the files it is carved from) or raise data.max_words / data.max_chars")


def _recount(blocks: list[list] | None, kept: np.ndarray) -> None:
    """[language pair, rows] blocks of a split, in order, counted again after a filter `kept` ((N,) bool)."""
    if blocks:
        ends = np.cumsum([n for _, n in blocks])
        for block, part in zip(blocks, np.split(kept, ends[:-1])):
            block[1] = int(np.count_nonzero(part))


def drop_long_eval(ds: datasets.Dataset, name: str, limit: int, stats: dict,
                   blocks: list[list] | None = None) -> datasets.Dataset:
    """Encoded validation or test without pairs longer than `limit` tokens on a side (</s> counted), which the
    model could not take; counted in `stats` (`clean_eval`'s) as too_many_subwords, and in `blocks` (see
    `clean_eval`)."""
    cost = column(ds, "cost")
    if len(cost) == 0 or int(cost.max()) <= limit:
        return ds
    keep = np.flatnonzero(cost <= limit)
    if len(keep) == 0:
        raise NmtError(f"no {name} pairs left: all are longer than {limit} subwords (data.max_subwords, "
                       f"model.max_positions); check data.{name} or raise them")
    stats["dropped"]["too_many_subwords"] = len(cost) - len(keep)
    stats["kept"] = len(keep)
    _recount(blocks, cost <= limit)
    return ds.select(keep)


def eval_clean_line(stats: dict) -> str | None:
    """One line for the log: what cleaning dropped from validation and test (None when nothing), e.g.
    "cleaning dropped 1 of 40 valid pairs (too_long 1) and 0 of 40 test pairs: ..."."""
    splits = stats.get("clean_eval", {})
    if not any(s["dropped"] for s in splits.values()):
        return None
    parts = [f"{s['read'] - s['kept']} of {s['read']} {name} pairs"
             + (f" ({', '.join(f'{reason} {n}' for reason, n in s['dropped'].items())})" if s["dropped"] else "")
             for name, s in splits.items()]
    return f"cleaning dropped {' and '.join(parts)}: empty or too long for the model, they are not scored"


# --- the whole preparation -----------------------------------------------------------------------


def prepare(cfg: DataConfig, tok_cfg: TokenizerConfig, main_first: Callable[[], ContextManager] | None = None,
            tokenizer: PairTokenizer | None = None, splits: tuple[str, ...] = SPLITS,
            max_positions: int | None = None) -> Corpus:
    """Read, carve, clean, train the tokenizer (unless given) and encode, all cached by content.

    `main_first` (e.g. nmt.launch.main_process_first) lets the main process fill the cache while the
    others wait and then read it. A null `tok_cfg.vocab_size` is the plan's (`nmt.plan.vocab_size_for`) for the number of
    training pairs left after cleaning, recorded as stats["sizing_pairs"]. stats["seconds"] times each phase.
    Every split keeps only pairs of at most data.max_subwords tokens a side, and at most `max_positions` (the
    model's) when given. stats["clean"] counts what cleaning did to train, stats["clean_eval"] to valid and test.
    """
    from contextlib import nullcontext

    cache_root = Path(cfg.cache_dir)
    cache_root.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    with (main_first or nullcontext)():
        with _timed(seconds, "read"):
            raw, split_stats, among = _read_splits(cfg, cache_root)
        eval_pairs = split_stats.get("eval_pairs", {})
        if tokenizer is not None:
            _check_tags(tokenizer, cfg)
        tok_cfg = with_tags(tok_cfg, cfg)
        key = _content_key(raw, cfg, tok_cfg, None)
        if tokenizer is not None and not _holds_tokenizer(cache_root / "prepared" / key, tokenizer):
            key = _content_key(raw, cfg, tok_cfg, tokenizer)
        work = cache_root / "prepared" / key
        work.mkdir(parents=True, exist_ok=True)
        with _timed(seconds, "clean"):
            eval_stats = {}
            for name in EVAL_SPLITS:  # before train's: its overlap with them is counted against what they keep
                raw[name], eval_stats[name] = clean_eval(raw[name], name, cfg, work, eval_pairs.get(name))
            raw["train"], clean_stats, kept = _cached_clean(raw, cfg, work, among, split_stats.pop("rows"))
            refuse_empty_eval(eval_stats)
            del among
        sizing_pairs = len(raw["train"])
        if tok_cfg.vocab_size is None:
            tok_cfg = dataclasses.replace(tok_cfg, vocab_size=vocab_size_for(sizing_pairs))
        with _timed(seconds, "tokenizer"):
            tokenizer = tokenizer or _cached_tokenizer(raw["train"], tok_cfg, work)
        with _timed(seconds, "encode"):
            encoded = {name: encode(raw[name], tokenizer, work / f"{name}.encoded.arrow") for name in splits}
        del raw  # the encoded files hold what training reads; the raw splits' row mappings go
    limit = min(cfg.max_subwords, max_positions or cfg.max_subwords)
    if "train" in encoded:
        encoded["train"], clean_stats, mixing = _trained_on(encoded["train"], cfg, clean_stats, kept, split_stats,
                                                            limit)
    for name in EVAL_SPLITS:
        if name in encoded:
            encoded[name] = drop_long_eval(encoded[name], name, limit, eval_stats[name], eval_pairs.get(name))
    stats = {**split_stats, "clean": clean_stats, "clean_eval": eval_stats, "cache": str(work),
             "sizing_pairs": sizing_pairs, "pairs": {name: len(ds) for name, ds in encoded.items()}, "seconds": seconds}
    if line := eval_clean_line(stats):
        log.info("%s", line)
    return Corpus(encoded, tokenizer, stats, mixing if "train" in encoded else None)


def with_tags(tok_cfg: TokenizerConfig, cfg: DataConfig) -> TokenizerConfig:
    """`tok_cfg` with the target-language tags of a multilingual run (`DataConfig.tags`) reserved: each a token of
    its own, never split or learnt from the text."""
    missing = [tag for tag in cfg.tags() if tag not in tok_cfg.reserved]
    return dataclasses.replace(tok_cfg, reserved=[*tok_cfg.reserved, *missing]) if missing else tok_cfg


def _check_tags(tokenizer: PairTokenizer, cfg: DataConfig) -> None:
    """A tokenizer given (a resumed run's, a model fine-tuned) holds every target-language tag the data needs."""
    missing = [tag for tag in cfg.tags() if tokenizer.src.token_to_id(tag) is None]
    if missing:
        raise NmtError(f"the tokenizer has no token for the target-language tag(s) {', '.join(missing)} that data.train "
                       f"needs ({', '.join(cfg.pairs())}); train a new model, or keep its target languages")


def _trained_on(train: datasets.Dataset, cfg: DataConfig, clean_stats: dict, kept: list[int],
                split_stats: dict, limit: int) -> tuple[datasets.Dataset, dict, Mixing | None]:
    """The encoded training pairs training reads, those over `limit` tokens dropped, and how several corpora are
    mixed by their weights and the temperature (`kept`: how many pairs of each corpus cleaning kept, in order)."""
    train, clean_stats, long_kept = drop_long(train, limit, clean_stats)
    mixing = None
    if len(kept) > 1:
        origin = np.repeat(np.arange(len(kept)), kept)
        mixing, split_stats["corpora"] = mix(origin if long_kept is None else origin[long_kept], cfg)
    return train, clean_stats, mixing


@contextmanager
def _timed(seconds: dict, name: str):
    start = time.perf_counter()
    yield
    seconds[name] = round(time.perf_counter() - start, 3)


def train_specs(cfg: DataConfig) -> list[str]:
    """The training corpora's paths: data.train as a list."""
    return [c.path for c in cfg.corpora("train")]


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


def corpora_line(stats: dict) -> str | None:
    """One line for the log: each training corpus's pairs per epoch and share, when there are several."""
    corpora = stats.get("corpora")
    if not corpora or not isinstance(corpora[0], dict):
        return None
    shown = ", ".join(f"{c['pair']} {c['train']} {c['per_epoch']:,} of {c['pairs']:,} ({100 * c['share']:.1f}%)"
                      for c in corpora)
    return f"training corpora per epoch (pairs drawn of pairs kept, share): {shown}"


def _with_langs(cfg: DataConfig, source: DataSource) -> DataConfig:
    """`cfg` reading `source`'s languages (a reader takes the file suffixes and JSON fields from data.*_lang)."""
    if (source.src_lang, source.tgt_lang) == (cfg.src_lang, cfg.tgt_lang):
        return cfg
    return dataclasses.replace(cfg, src_lang=source.src_lang, tgt_lang=source.tgt_lang)


def tagged(ds: datasets.Dataset, tag: str, cache: Path) -> datasets.Dataset:
    """`ds` with `tag` before every source: the target-language tag of a multilingual run, a reserved token of the
    tokenizer (its own id). Written without a space: the tokenizer splits a reserved token off by itself, and a
    space before another tag (<bt>) would be a token of its own. A file of its own in `cache`/read, keyed by the
    content and the tag."""
    key = hashlib.sha256(f"{dataset_fingerprint(ds)}:{len(ds)}:{tag}:glued".encode()).hexdigest()[:16]
    out = cache / "read" / f"tagged-{key}.arrow"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)

        def batches() -> Iterator[pa.RecordBatch]:
            for table in arrow_batches(ds):
                src = pa.compute.binary_join_element_wise(tag, table.column("src"), "")
                yield from table.select(["tgt"]).add_column(0, "src", src).select(["src", "tgt"]).to_batches()

        write_arrow(batches(), out)
    return open_arrow(out, f"nmt-{out.parent.name}-{out.stem}")


def _read_splits(cfg: DataConfig, cache: Path) -> tuple[dict[str, datasets.Dataset], dict, np.ndarray | None]:
    """train, valid and test: from their own specs, from the first train corpus's named splits, or carved off it;
    and (N,) bool, the rows of train that stay training pairs when some were carved off (else None). Further
    training corpora are appended to train; stats["corpora"] holds each one's training pairs.

    A multilingual run (`DataConfig.is_multilingual`) reads each corpus with its own languages, its sources
    tagged with their target language, and holds validation and test out of every training corpus (the same rows
    of two directions of one corpus, so neither direction trains on the other's held-out pairs);
    stats["eval_pairs"] holds each validation and test split's language pairs, in order, with their rows."""
    sources, multi = cfg.corpora("train"), cfg.is_multilingual
    parts = [_read_train(source, cfg, cache) for source in sources]
    splits, carved, stays = {"train": parts[0]}, [], [np.ones(len(p), dtype=bool) for p in parts]
    eval_pairs = {}
    for name, ratio in (("valid", cfg.valid_ratio), ("test", cfg.test_ratio)):
        given, pieces, carving = cfg.corpora(name), [], False
        for source in given or (sources if multi else sources[:1]):
            spec_cfg = _with_langs(cfg, source)
            ds = load_split(source.path, spec_cfg, name, cache, whole_ok=bool(given))
            if ds is not None and multi:
                ds = tagged(ds, lang_tag(source.tgt_lang), cache)
            elif ds is None:
                if ratio <= 0:
                    raise NmtError(f"config key 'data.{name}': no {name} set given and data.{name}_ratio is 0")
                i, carving = sources.index(source), True
                ds = _carve(parts[i], stays[i], name, ratio, seed=cfg.split_seed + len(carved), cache=cache)
            pieces.append((source.pair, ds))
        if carving:
            carved.append(name)
        splits[name] = pieces[0][1] if len(pieces) == 1 else datasets.concatenate_datasets([p for _, p in pieces])
        eval_pairs[name] = [[pair, len(p)] for pair, p in pieces]
    sizes = [int(np.count_nonzero(s)) for s in stays]
    for name, ds in splits.items():
        if (sizes[0] if name == "train" else len(ds)) == 0:
            raise NmtError(f"the {name} split is empty (from {getattr(cfg, name) or sources[0].path!r})")
    if len(parts) > 1:
        splits["train"] = datasets.concatenate_datasets(parts)
    among = None if all(s.all() for s in stays) else np.concatenate(stays)
    stats = {"carved_from_train": carved, "corpora": sizes, "fingerprints": split_fingerprints(splits),
             "rows": [len(p) for p in parts]}
    if multi:
        stats["eval_pairs"] = eval_pairs
    return splits, stats, among


def _read_train(source: DataSource, cfg: DataConfig, cache: Path) -> datasets.Dataset:
    train = load_split(source.path, _with_langs(cfg, source), "train", cache)
    if len(train) == 0:
        raise NmtError(f"no training pairs in {source.path!r} (empty file?)")
    if cfg.max_train_pairs is not None:
        train = train.select(range(min(cfg.max_train_pairs, len(train))))
    if cfg.is_multilingual:
        train = tagged(train, lang_tag(source.tgt_lang), cache)
    return train


def _carve(train: datasets.Dataset, stays: np.ndarray, name: str, ratio: float, *, seed: int,
          cache: Path) -> datasets.Dataset:
    """The `name` split: a share `ratio` (rounded up) of the training pairs left (`stays`, (N,) bool, updated in
    place), drawn with `seed`, carved off; refused when either side would be empty. Train stays its file (cleaning
    writes the pairs it keeps to a file of their own); the held-out pairs get a small file of their own, so reading
    them never touches the pages of the whole corpus."""
    left = int(np.count_nonzero(stays))
    held = math.ceil(ratio * left)
    if not 0 < held < left:
        raise NmtError(f"config key 'data.{name}': {left} training pair(s) left are too few to carve a {name} set "
                       f"of data.{name}_ratio={ratio} from; give data.{name} (a separate file) or more pairs")
    key = f"{dataset_fingerprint(train)}:{ratio}:{seed}:{hashlib.sha256(np.packbits(stays).data).hexdigest()}"
    order = np.flatnonzero(stays)
    np.random.default_rng(seed).shuffle(order)
    picked = np.zeros(len(stays), dtype=bool)
    picked[order[:held]] = True
    del order
    stays &= ~picked
    out = cache / "read" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.arrow"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        return write_rows(train, picked, out)
    return open_arrow(out, f"nmt-{out.parent.name}-{out.stem}")


def split_fingerprints(raw: dict[str, datasets.Dataset]) -> dict[str, str]:
    """Per split, the sha256 of what the cache key is made of: its content fingerprint and length (a file is known
    by path, size and modification time, as the reading cache knows it), so a resume on changed data names it."""
    return {name: hashlib.sha256(f"{name}:{dataset_fingerprint(raw[name])}:{len(raw[name])}".encode()).hexdigest()
            for name in SPLITS}


def _holds_tokenizer(work: Path, tokenizer: PairTokenizer) -> bool:
    """Cache entry `work` trained `tokenizer`: given again (a resumed run's own), it reuses that entry's files."""
    if not (work / "tokenizer").is_dir():
        return False
    cached = PairTokenizer.load(work / "tokenizer")
    return (cached.src.to_str(), cached.tgt.to_str()) == (tokenizer.src.to_str(), tokenizer.tgt.to_str())


def _content_key(raw: dict[str, datasets.Dataset], cfg: DataConfig, tok_cfg: TokenizerConfig,
                 tokenizer: PairTokenizer | None) -> str:
    h = hashlib.sha256(f"format {PREPARED_FORMAT};".encode())
    for name in SPLITS:
        h.update(f"{name}:{dataset_fingerprint(raw[name])}:{len(raw[name])};".encode())
    # BPE-dropout changes only the training pairs' per-epoch segmentation (DropoutEpochs), not what is cached here;
    # the mixing weights only select from the encoded pairs
    tok = to_dict(tok_cfg) | {"dropout": None}
    data = to_dict(cfg) | {"cache_dir": None, "weights": None, "temperature": None, "shared_cache": None}
    h.update(json.dumps({"data": data, "tok": tok}, sort_keys=True).encode())
    if tokenizer is not None:
        h.update(tokenizer.src.to_str().encode() + tokenizer.tgt.to_str().encode())
    return h.hexdigest()[:16]


def _cached_clean(raw: dict[str, datasets.Dataset], cfg: DataConfig, work: Path, among: np.ndarray | None,
                  rows: list[int]) -> tuple[datasets.Dataset, dict, list[int]]:
    """The cleaned training split (its own Arrow file unless cleaning kept every row), the cleaning stats and how
    many pairs of each corpus it kept (`rows`: each one's rows in the file, in order; `among`: see `clean`)."""
    train, clean_file, stats_file = raw["train"], work / "train.clean.arrow", work / "clean.json"
    saved = json.loads(stats_file.read_text()) if stats_file.is_file() else None
    if saved is None or not (saved["whole"] or clean_file.is_file()):
        kept, stats = clean(train, cfg, {name: raw[name] for name in ("valid", "test")}, among)
        if stats["kept"] == 0:
            raise NmtError(f"no training pairs left after cleaning ({stats['read']} read; dropped: "
                           f"{stats['dropped']}); check the files or relax data.max_words / data.max_ratio")
        saved = {"stats": stats, "whole": bool(kept.all()),
                 "per_corpus": [int(np.count_nonzero(part)) for part in np.split(kept, np.cumsum(rows)[:-1])]}
        if not saved["whole"]:
            train = write_rows(train, kept, clean_file)  # written before the stats, which mark the pair complete
        del kept
        # a temporary name of our own: two runs may fill the same cache at once (the last rename wins)
        (work / f".clean.{os.getpid()}").write_text(json.dumps(saved))
        os.replace(work / f".clean.{os.getpid()}", stats_file)
    elif not saved["whole"]:
        train = open_arrow(clean_file, f"nmt-{work.name}-{clean_file.stem}")  # as write_rows opens it
    return train, saved["stats"], saved["per_corpus"]


def _cached_tokenizer(train: datasets.Dataset, tok_cfg: TokenizerConfig, work: Path) -> PairTokenizer:
    tok_dir = work / "tokenizer"
    if tok_dir.is_dir():
        return PairTokenizer.load(tok_dir)
    picked = np.ones(len(train), dtype=bool)
    if tok_cfg.train_sample is not None and tok_cfg.train_sample < len(train):
        picked[:] = False  # a sample the same on every run and process, read in file order
        picked[np.random.default_rng(0).choice(len(train), size=tok_cfg.train_sample, replace=False)] = True

    def texts(name: str) -> Callable[[], Iterator[list[str]]]:  # batches of one side, as tokenizers takes them
        def batches() -> Iterator[list[str]]:
            start = 0
            for table in arrow_batches(train, 10_000):
                yield table.column(name).filter(pa.array(picked[start: start + len(table)])).to_pylist()
                start += len(table)
        return batches

    with bulk_threads():
        tokenizer = train_pair_tokenizer(texts("src"), texts("tgt"), tok_cfg, int(picked.sum()))
    tmp = Path(tempfile.mkdtemp(dir=work, prefix=".tokenizer-"))
    tokenizer.save(tmp)
    try:
        os.replace(tmp, tok_dir)
    except OSError:  # another run filling the same cache got there first: use its (identical) tokenizer
        shutil.rmtree(tmp, ignore_errors=True)
        return PairTokenizer.load(tok_dir)
    return tokenizer
