"""Subword tokenizers: trained with `tokenizers` from an iterator, saved as tokenizer.json.

The one home of the `tokenizers` library. Ids 0-3 are <pad>, <unk>, <s>, </s> in every tokenizer; then come
`tokenizer.reserved` tokens (e.g. a back-translation tag), kept whole and left out of decoded text.
"""

from __future__ import annotations

import heapq
import json
import os
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from nmt.checkpoint import check_fingerprint
from nmt.config import TokenizerConfig
from nmt.errors import NmtError
from nmt.model_dir import JOINT_FILE, SRC_FILE, TGT_FILE

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
PAD, UNK, BOS, EOS = range(4)


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig, length: int | None = None) -> Tokenizer:
    """Train one subword model on an iterator of sentences (memory stays flat).

    The tokenizer is deterministic even when `cfg.dropout` is set: BPE-dropout is applied to the training
    pairs only, by `DropoutSegmenter`, never by the saved tokenizer.
    """
    if cfg.vocab_size is None:
        raise NmtError("tokenizer.vocab_size is null: resolve the config first (nmt.plan.resolve)")
    if cfg.kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                      special_tokens=SPECIALS + cfg.reserved, show_progress=False)
    else:
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIALS + cfg.reserved,
                                          unk_token="<unk>", show_progress=False)
    _pipeline(tok)
    tok.train_from_iterator(_batched(texts), trainer=trainer, length=length)
    if [tok.token_to_id(s) for s in SPECIALS] != [PAD, UNK, BOS, EOS]:
        raise RuntimeError("special tokens did not get ids 0-3")
    return tok


def _pipeline(tok: Tokenizer) -> Tokenizer:
    """What every nmt tokenizer runs around its subword model: NFKC, split at spaces (kept as ▁) and back.
    No post-processor: the specials are added by nmt itself."""
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def _batched(texts: Iterable[str | list[str]], size: int = 1000) -> Iterator[list[str]]:
    """Batches of `size` texts; lists in `texts` are batches already and pass as they are."""
    batch: list[str] = []
    for text in texts:
        if isinstance(text, list):
            yield text
            continue
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _encode_batch(tok: Tokenizer, texts: list[str]) -> list:
    # encode_batch_fast (tokenizers >= 0.20.2) skips the character offsets, which nmt never reads
    fast = getattr(tok, "encode_batch_fast", None)
    return (fast or tok.encode_batch)(texts, add_special_tokens=False)


PARALLELISM = "TOKENIZERS_PARALLELISM"
_threads = {"set_by_nmt": False}


@contextmanager
def bulk_threads():
    """The tokenizer's own threads (one per core) for bulk work: training and encoding a whole corpus.

    Data preparation runs in one process per cache while the others wait, so it may use every core. A
    TOKENIZERS_PARALLELISM set by the user wins. Otherwise it is "true" inside and "false" after, so a
    process forked later (a DataLoader worker, Dataset.map(num_proc=...)) runs single-threaded, safely and
    without the tokenizers fork warning.
    """
    ours = os.environ.get(PARALLELISM) is None or _threads["set_by_nmt"]
    if ours:
        os.environ[PARALLELISM] = "true"
    try:
        yield
    finally:
        if ours:
            os.environ[PARALLELISM] = "false"
            _threads["set_by_nmt"] = True


class PairTokenizer:
    """Source and target tokenizers (the same object when the vocabulary is joint)."""

    def __init__(self, src: Tokenizer, tgt: Tokenizer | None = None):
        self.src = src
        self.tgt = tgt or src
        self.src.no_truncation()
        self.src.no_padding()

    @property
    def joint(self) -> bool:
        return self.src is self.tgt

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_vocab_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_vocab_size()

    def encode_src(self, texts: list[str]) -> list[list[int]]:
        """Source ids, each ending in </s>."""
        return [e.ids + [EOS] for e in _encode_batch(self.src, texts)]

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target ids without specials; the collator adds <s> and </s>."""
        return [e.ids for e in _encode_batch(self.tgt, texts)]

    def src_tokens(self, text: str) -> list[str]:
        """Source subword strings as the model sees them (with the final </s>)."""
        return self.src.encode(text, add_special_tokens=False).tokens + ["</s>"]

    def tgt_tokens(self, ids: list[int]) -> list[str]:
        return [self.tgt.id_to_token(i) or "<unk>" for i in ids]

    def decode_tgt(self, ids_batch: list[list[int]]) -> list[str]:
        """Detokenized text; stops at </s> and skips specials."""
        cut = [ids[: ids.index(EOS)] if EOS in ids else ids for ids in ids_batch]
        return self.tgt.decode_batch(cut, skip_special_tokens=True)

    def unknown_rate(self, texts: list[str], side: str = "src") -> float:
        """Share of subwords that are <unk> (vocabulary coverage); see `unknown_rate`."""
        return unknown_rate(self.encode_src(texts) if side == "src" else self.encode_tgt(texts))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.joint:
            self.src.save(str(directory / JOINT_FILE))
        else:
            self.src.save(str(directory / SRC_FILE))
            self.tgt.save(str(directory / TGT_FILE))

    @classmethod
    def load(cls, directory: str | Path) -> PairTokenizer:
        directory = Path(directory)
        if (directory / JOINT_FILE).is_file():
            return cls(_load_file(directory / JOINT_FILE))
        if (directory / SRC_FILE).is_file() and (directory / TGT_FILE).is_file():
            return cls(_load_file(directory / SRC_FILE), _load_file(directory / TGT_FILE))
        raise NmtError(f"{directory}: no {JOINT_FILE} (or {SRC_FILE} + {TGT_FILE}); is this an nmt model directory?")

    def check_fits(self, src_vocab_size: int, tgt_vocab_size: int, directory: str | Path) -> None:
        """Raises a named error when a model's vocabulary sizes are not this tokenizer's, or when model directory
        `directory` records another tokenizer than the file(s) it holds (`nmt.checkpoint.check_fingerprint`)."""
        if (src_vocab_size, tgt_vocab_size) != (self.src_vocab_size, self.tgt_vocab_size):
            raise NmtError(f"{directory}: the tokenizer ({self.src_vocab_size}/{self.tgt_vocab_size} tokens) does "
                           f"not match the model ({src_vocab_size}/{tgt_vocab_size}); copy the tokenizer that the "
                           "model was trained with")
        check_fingerprint(directory)



def unknown_rate(rows: Iterable[list[int]]) -> float:
    """Share of <unk> among the subword ids of `rows` (vocabulary coverage); a row's final </s> (the end a
    source gets) is not counted. Rows may be streamed: `nmt check` passes a whole validation set."""
    unk = total = 0
    for ids in rows:
        ids = ids[:-1] if ids and ids[-1] == EOS else ids
        unk += ids.count(UNK)
        total += len(ids)
    return unk / max(total, 1)


class DropoutSegmenter:
    """BPE-dropout (Provilkov et al. 2020) over a trained BPE tokenizer, with a seeded random generator.

    Each merge that could apply is skipped with probability `p`; the best remaining one is made; a word is
    done when every possible merge was skipped. `tokenizers` can do this itself (BPE(dropout=p)), but draws
    from a thread-local generator that cannot be seeded, so no two processes or runs would agree. Here the
    segmentation of a text is a function of (text, p, the generator's seed) only. With p = 0 it equals the
    tokenizer's own encoding.
    """

    def __init__(self, tok: Tokenizer, p: float):
        model = json.loads(tok.to_str())["model"]
        if model["type"] != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
                or model.get("byte_fallback"):
            raise NmtError("BPE-dropout needs a plain BPE tokenizer as nmt trains it (tokenizer.kind: bpe)")
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.vocab: dict[str, int] = model["vocab"]
        self.tok, self.p = tok, p
        self.specials = [t.content for t in tok.get_added_tokens_decoder().values()]

    def encode(self, text: str, rng: random.Random) -> list[int]:
        """Subword ids of `text` (no specials added), drawing from `rng`."""
        if any(s in text for s in self.specials):  # "<unk>" written in the text: the tokenizer's own ids
            return self.tok.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for word, _ in self.tok.pre_tokenizer.pre_tokenize_str(self.tok.normalizer.normalize_str(text)):
            ids += [self.vocab.get(piece, UNK) for piece in self._merge(list(word), rng.random)]
        return ids

    def _merge(self, symbols: list[str], draw) -> list[str]:
        """The symbols of one word after BPE with dropout.

        Each round ranks the merges that could apply (by merge rank, then position) and makes the first one not
        skipped, drawing once per merge looked at; the word is done when a round skips them all. The merges wait
        in a heap and the symbols form a linked list, so a round looks only at the merges it draws for plus the
        ones a merge made stale: O(n log n) for a word of n characters instead of a sort of all pairs per merge.
        """
        ranks, p, n = self.ranks, self.p, len(symbols)
        after, before = [*range(1, n), -1], [*range(-1, n - 1)]  # neighbours of position i; merged ones are None
        heap = [(rank, i) for i in range(n - 1) if (rank := ranks.get((symbols[i], symbols[i + 1]))) is not None]
        heapq.heapify(heap)
        skipped: list[tuple[int, int]] = []  # skipped in this round; candidates again in the next
        while heap:
            rank, i = heapq.heappop(heap)
            j = after[i]
            if symbols[i] is None or j < 0 or ranks.get((symbols[i], symbols[j])) != rank:
                continue  # stale: one of its symbols was merged into another pair since
            if draw() < p:
                skipped.append((rank, i))
                continue
            symbols[i], symbols[j] = symbols[i] + symbols[j], None
            after[i] = k = after[j]
            if k >= 0:
                before[k] = i
            for entry in skipped:
                heapq.heappush(heap, entry)
            skipped.clear()
            h = before[i]
            if h >= 0 and (rank := ranks.get((symbols[h], symbols[i]))) is not None:
                heapq.heappush(heap, (rank, h))
            if k >= 0 and (rank := ranks.get((symbols[i], symbols[k]))) is not None:
                heapq.heappush(heap, (rank, i))
        return [s for s in symbols if s is not None]


def _load_file(path: Path) -> Tokenizer:
    try:
        tok = Tokenizer.from_file(str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a bare Exception for bad JSON; a Rust panic for some bad models
        raise NmtError(f"{path}: not a readable tokenizer file ({str(e).splitlines()[0]})") from None
    if [tok.token_to_id(s) for s in SPECIALS] != [PAD, UNK, BOS, EOS]:
        raise NmtError(f"{path}: special tokens {SPECIALS} must have ids 0-3; it was not made by nmt")
    data = json.loads(tok.to_str())
    if data["model"].get("dropout") is not None:  # saved by an nmt before BPE-dropout moved out of the tokenizer
        data["model"]["dropout"] = None
        tok = Tokenizer.from_str(json.dumps(data))
    _check_pipeline(data, path)
    return tok


def _check_pipeline(data: dict, path: Path) -> None:
    """Accept only the pipeline nmt writes: its normalizer, pre-tokenizer, decoder and (no) post-processor, a BPE
    or Unigram model without options nmt does not set, and added tokens that are its specials and reserved tokens.

    A tokenizer.json is code in all but name: a planted normalizer or pre-tokenizer regex runs on every input, and
    `nmt serve` lets clients choose the input (a pattern with catastrophic backtracking stalls the server). The
    expected parts are the library's own serialization of what `train_tokenizer` sets, so they follow its version.
    """
    kind = data["model"].get("type")
    if kind not in ("BPE", "Unigram"):
        _refuse(path, "model", kind, "a BPE or Unigram model")
    fresh = json.loads(_pipeline(Tokenizer(models.BPE(unk_token="<unk>") if kind == "BPE" else models.Unigram()))
                       .to_str())
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder", "truncation", "padding"):
        if data.get(part) != fresh.get(part):
            _refuse(path, part, data.get(part), _shown(fresh.get(part)))
    options = {k: v for k, v in data["model"].items() if k not in ("vocab", "merges")}
    expected = {k: v for k, v in fresh["model"].items() if k not in ("vocab", "merges")}
    if kind == "Unigram":
        expected["unk_id"] = UNK
    if options != expected:
        _refuse(path, "model options", options, _shown(expected))
    for i, added in enumerate(data["added_tokens"]):
        plain = {"id": i, "content": added.get("content"), "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True}
        if added != plain or not isinstance(plain["content"], str) or any(c.isspace() for c in plain["content"]):
            _refuse(path, f"added token {i}", added, "a special token of one word, matched as written")


def _refuse(path: Path, part: str, found, expected: str) -> None:
    raise NmtError(f"{path}: unexpected {part} {_shown(found)} (nmt writes {expected}); this tokenizer was not made "
                   "by nmt or was edited: use the one saved with the model")


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 160 else text[:157] + "..."


def train_pair_tokenizer(src_texts, tgt_texts, cfg: TokenizerConfig, n_pairs: int | None = None) -> PairTokenizer:
    """Train the tokenizer(s) on training text. `src_texts`/`tgt_texts` are zero-argument callables
    returning fresh iterators, so each side can be streamed (twice for a joint vocabulary)."""
    if cfg.joint:
        def both() -> Iterator[str]:
            yield from src_texts()
            yield from tgt_texts()
        return PairTokenizer(train_tokenizer(both(), cfg, 2 * n_pairs if n_pairs else None))
    return PairTokenizer(train_tokenizer(src_texts(), cfg, n_pairs), train_tokenizer(tgt_texts(), cfg, n_pairs))
