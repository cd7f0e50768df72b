"""The data chapter: a parallel corpus prepared for training, all cached by content (`prepare`): read
(`nmt.readers`), carved into train/valid/test, cleaned with counts (`nmt.cleaning`), the tokenizer trained, every
split encoded (`nmt.encoding`: columns "src_ids", "tgt_ids", their lengths and "cost", padded tokens), several
training corpora mixed (`nmt.mixing`). These modules and `nmt.tables` (a Dataset read through its Arrow table) are
the data layer's home of `datasets`, pyarrow and pandas.

In reading order: what preparing found (`CorpusStats`) and the prepared corpus (`Corpus`), then `prepare` and the
steps it takes: reading the splits, carving, the cache entry and its key.
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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from nmt.cleaning import clean, clean_eval, drop_long_eval, refuse_empty_eval
from nmt.compat import dataset_fingerprint
from nmt.config import DataConfig, DataSource, TokenizerConfig, lang_tag, to_dict
from nmt.encoding import drop_long, encode
from nmt.errors import NmtError
from nmt.mixing import Mixing, mix
from nmt.plan import vocab_size_for
from nmt.readers import load_split
from nmt.tables import arrow_batches, open_arrow, write_rows
from nmt.textfiles import write_arrow
from nmt.tokenizer import PairTokenizer, bulk_threads, train_pair_tokenizer

# --- The prepared corpus ---------------------------------------------------------------------------------------------

SPLITS = ("train", "valid", "test")
EVAL_SPLITS = ("valid", "test")
PREPARED_FORMAT = 2  # part of the cache key: bumped when what prepare writes under a key changes
log = logging.getLogger(__name__)


@dataclass
class CorpusStats:
    """What preparing a corpus found: read by training, `nmt check` and the log lines, and written as the run's
    data.json (`as_dict`)."""

    pairs: dict[str, int]  # each split's pairs, as training reads them
    clean: dict  # what cleaning did to train: {"read", "kept", "dropped": {reason: pairs}, "overlap": {split: pairs}}
    clean_eval: dict[str, dict]  # and to valid and test: {"read", "kept", "dropped"}
    sizing_pairs: int  # the training pairs left after cleaning: what sizes the vocabulary (and the plan's model)
    vocab_size: int | None  # the vocabulary size chosen and trained with; None for a tokenizer given
    fingerprints: dict[str, str]  # each split's files' sha256: what a resume checks (`nmt.checkpoint.FINGERPRINTS`)
    carved_from_train: list[str]  # the splits carved off the training corpus
    corpora: list  # each training corpus's pairs; with several, its line of the mixing (`mix`)
    cache: str  # the directory of the prepared entry
    seconds: dict[str, float]  # each phase's time
    eval_pairs: dict[str, list] = field(default_factory=dict)  # of several pairs: each eval split's [pair, rows]

    def as_dict(self) -> dict:
        """The JSON of data.json and training.json's "data" (eval_pairs only where a run has several pairs)."""
        out = dataclasses.asdict(self)
        if not self.eval_pairs:
            del out["eval_pairs"]
        return out


@dataclass
class Corpus:
    """Encoded splits, their tokenizer, what preparing them found, and how several training corpora are mixed."""

    splits: dict[str, datasets.Dataset]
    tokenizer: PairTokenizer
    stats: CorpusStats
    mixing: Mixing | None = None

    @property
    def epoch_rows(self) -> Callable[[int], np.ndarray] | None:
        """`epoch -> indices` of the training pairs an epoch reads (`Mixing.rows`); None: every pair once."""
        return None if self.mixing is None else self.mixing.rows


def overlap_line(stats: CorpusStats) -> str | None:
    """One line for the log: validation/test pairs that also occur in train; None when there are none."""
    overlap = stats.clean.get("overlap") or {}
    if not any(overlap.values()):
        return None
    found = " and ".join(f"{n} {name}" for name, n in overlap.items())
    removed = stats.clean["dropped"].get("in_valid_or_test")
    then = (f"data.dedupe_eval removed {removed} training pairs" if removed is not None
            else "set data.dedupe_eval: true to remove them from train")
    return f"{found} pairs also occur in the training data (after normalisation); {then}"


def eval_clean_line(stats: CorpusStats) -> str | None:
    """One line for the log: what cleaning dropped from validation and test (None when nothing), e.g.
    "cleaning dropped 1 of 40 valid pairs (too_long 1) and 0 of 40 test pairs: ..."."""
    splits = stats.clean_eval
    if not any(s["dropped"] for s in splits.values()):
        return None
    parts = [f"{s['read'] - s['kept']} of {s['read']} {name} pairs"
             + (f" ({', '.join(f'{reason} {n}' for reason, n in s['dropped'].items())})" if s["dropped"] else "")
             for name, s in splits.items()]
    return f"cleaning dropped {' and '.join(parts)}: empty or too long for the model, they are not scored"


# --- the prepared corpus: the whole preparation -------------------------------------------------


def prepare(cfg: DataConfig, tok_cfg: TokenizerConfig, main_first: Callable[[], ContextManager] | None = None,
            tokenizer: PairTokenizer | None = None, splits: tuple[str, ...] = SPLITS,
            max_positions: int | None = None) -> Corpus:
    """Read, carve, clean, train the tokenizer (unless given) and encode, all cached by content.

    `main_first` (e.g. nmt.launch.main_process_first) lets the main process fill the cache while the
    others wait and then read it. A null `tok_cfg.vocab_size` is the plan's (`nmt.plan.vocab_size_for`) for the number of
    training pairs left after cleaning, recorded as stats.sizing_pairs, the size trained with as stats.vocab_size
    (what the plan records: it is chosen here, once, because the tokenizer is trained before the plan can run; None
    for a given tokenizer). stats.seconds times each phase (`CorpusStats`).
    Every split keeps only pairs of at most data.max_subwords tokens a side, and at most `max_positions` (the
    model's) when given. stats.clean counts what cleaning did to train, stats.clean_eval to valid and test.
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
            # the entry's key holds the open size: the chosen one keys the tokenizer and the encodings, so a run
            # trains the vocabulary its plan prints, whichever size an earlier nmt chose for the same data
            work = work / f"vocab-{tok_cfg.vocab_size}"
            work.mkdir(exist_ok=True)
        vocab_size = None if tokenizer is not None else tok_cfg.vocab_size
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
    stats = CorpusStats(pairs={name: len(ds) for name, ds in encoded.items()}, clean=clean_stats,
                        clean_eval=eval_stats, sizing_pairs=sizing_pairs, vocab_size=vocab_size, seconds=seconds,
                        cache=str(work), **split_stats)
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


def corpora_line(stats: CorpusStats) -> str | None:
    """One line for the log: each training corpus's pairs per epoch and share, when there are several."""
    corpora = stats.corpora
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
    return PairTokenizer.load(work / "tokenizer").same_as(tokenizer)


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
