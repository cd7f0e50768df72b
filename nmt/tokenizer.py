"""Subword tokenizers: trained with `tokenizers` from an iterator, saved as tokenizer.json.

The one home of the `tokenizers` library. Ids 0-3 are <pad>, <unk>, <s>, </s> in every tokenizer; then come
`tokenizer.reserved` tokens (e.g. a back-translation tag), kept whole and left out of decoded text.

Control tokens are never typed: "</s>", "<pad>", a language tag or any reserved token written in a text is
encoded as the characters it is made of (`PairTokenizer` reads added tokens in text as text). nmt inserts the
control tokens by id: the final </s>, the target-language tag, and the tags that lead a training source (the
ones nmt's data preparation and `nmt backtranslate --tag` write), which `split_leading_tags` takes off.
"""

from __future__ import annotations

import heapq
import json
import os
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from nmt.checkpoint import JOINT_FILE, SRC_FILE, TGT_FILE, check_fingerprint
from nmt.config import TokenizerConfig
from nmt.errors import NmtError

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
    _pipeline(tok, cfg.split_punctuation)
    tok.train_from_iterator(_batched(texts), trainer=trainer, length=length)
    if [tok.token_to_id(s) for s in SPECIALS] != [PAD, UNK, BOS, EOS]:
        raise RuntimeError("special tokens did not get ids 0-3")
    return tok


# A punctuation mark (Unicode P, and the ASCII marks of other categories, as tokenizers' Punctuation takes them)
# with the "▁" of a space before it: "here ." and "« oui »" keep one pre-token per mark, not a bare "▁" and the mark.
PUNCTUATION = "\u2581?[\\p{P}$+<=>^`|~]"


def _pipeline(tok: Tokenizer, split_punctuation: bool | str = False) -> Tokenizer:
    """What every nmt tokenizer runs around its subword model: NFKC, split at spaces (kept as ▁) and, with
    `split_punctuation`, around each punctuation mark (no subword then spans a word and its comma or quote), and
    back. No post-processor: the specials are added by nmt itself. `split_punctuation="marks"`: the split of
    tokenizers trained in 9d7aac3 (every mark alone, a "▁" before it a pre-token of its own), still loaded."""
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    if split_punctuation == "marks":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
    elif split_punctuation:  # after Metaspace: a mark splits off "▁word," and keeps the "▁" of a space before it
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(),
                                                     pre_tokenizers.Split(Regex(PUNCTUATION), "isolated")])
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


def _encode_batch(tok: Tokenizer, texts: list[str], specials: bool = False) -> list:
    # encode_batch_fast (tokenizers >= 0.20.2) skips the character offsets, which nmt never reads
    fast = getattr(tok, "encode_batch_fast", None)
    return (fast or tok.encode_batch)(texts, add_special_tokens=specials)


def typed_controls(tok: Tokenizer) -> frozenset[int]:
    """The control tokens (every added token: <pad> <unk> <s> </s>, tags, reserved) that `tok`'s subword model can
    produce from text. A Unigram model holds them as pieces of its vocabulary, the best scored of all, so a typed
    "<bt>" is segmented into the piece <bt> even with `encode_special_tokens`; BPE merges never build them."""
    if type(tok.model).__name__ != "Unigram":
        return frozenset()
    return frozenset(tok.get_added_tokens_decoder())


def as_text(tok: Tokenizer, encoding, controls: frozenset[int], text: str, specials: bool) -> list[int]:
    """The ids of `encoding` (of `text`, encoded with `specials` or not) with every control token its subword model
    produced from text (not one a template added) spelled out character by character, as text: a typed "<bt>" is
    "<", "b", "t", ">" (or <unk> for a character the vocabulary lacks). A <unk> standing for characters the model
    lacks is kept: only a piece spelled as its token is typed."""
    ids = encoding.ids
    if not controls or controls.isdisjoint(ids):
        return ids
    if not any(encoding.tokens):  # encode_batch_fast gives no pieces: encode this text again with them
        encoding = tok.encode(text, add_special_tokens=specials)
    out: list[int] = []
    for i, added, piece in zip(ids, encoding.special_tokens_mask, encoding.tokens):
        typed = i in controls and not added and piece == tok.id_to_token(i)
        out += [t.id for c in piece for t in tok.model.tokenize(c)] if typed else [i]
    return out


def leading_tags(tok: Tokenizer) -> dict[str, int]:
    """The tokens that may lead a training source as tags: every added token but <pad> <unk> <s> </s>."""
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.content not in SPECIALS}


def split_leading_tags(text: str, tags: dict[str, int]) -> tuple[list[int], str]:
    """The ids of the tags `text` starts with (glued or space-separated) and the text after them."""
    ids: list[int] = []
    while tags and (lead := next((t for t in tags if text.startswith(t)), None)):
        ids.append(tags[lead])
        text = text[len(lead):]
    return ids, text


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
    """Source and target tokenizers (the same object when the vocabulary is joint).

    nmt's own tokenizers have <pad> <unk> <s> </s> at ids 0-3 and no post-processor: nmt appends </s> to a
    source itself. An imported one (`nmt import`) keeps its model's ids, and where the model wants more than
    the final </s> (M2M100's language tags) its post-processor adds them: then the source's specials, and a
    target's leading tag, are the tokenizer's own.

    Added tokens written in a text are text (`encode_special_tokens`, a run-time switch that is not saved).
    """

    def __init__(self, src: Tokenizer, tgt: Tokenizer | None = None):
        self.src = src
        self.tgt = tgt or src
        self.src.no_truncation()
        self.src.no_padding()
        self.src.encode_special_tokens = self.tgt.encode_special_tokens = True  # "</s>" in a text is 4 characters
        self.lead_tags = {} if src.post_processor is not None else leading_tags(self.src)
        self.eos_id = self.tgt.token_to_id("</s>")
        self.unk_id = self.src.token_to_id("<unk>")
        self.src_specials = self.src.post_processor is not None  # the tokenizer adds the source's specials itself
        self.src_controls, self.tgt_controls = typed_controls(self.src), typed_controls(self.tgt)

    @property
    def joint(self) -> bool:
        """One vocabulary: an id means the same token on both sides (one tokenizer, or two segmenters over one
        vocabulary, as Marian's source and target SentencePiece models; then embeddings may be shared)."""
        return self.src is self.tgt or self.src.get_vocab(with_added_tokens=True) == self.tgt.get_vocab(True)

    @property
    def one_file(self) -> bool:
        """Source and target are one tokenizer, saved as tokenizer.json."""
        return self.src is self.tgt

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_vocab_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_vocab_size()

    def same_as(self, other: PairTokenizer) -> bool:
        """Whether `other` gives every text the same ids (the same vocabularies, merges and pipeline)."""
        return (self.src.to_str(), self.tgt.to_str()) == (other.src.to_str(), other.tgt.to_str())

    def encode_src(self, texts: list[str], leading_tags: bool = True) -> list[list[int]]:
        """Source ids, each ending in </s>. With `leading_tags`, the reserved tokens a text starts with (a training
        source's "<2de><bt> ...") are their ids (`split_leading_tags`); any other control string is text."""
        src, controls = self.src, self.src_controls
        if self.src_specials:
            return [as_text(src, e, controls, t, True) for e, t in zip(_encode_batch(src, texts, specials=True), texts)]
        if not (leading_tags and self.lead_tags):
            return [as_text(src, e, controls, t, False) + [self.eos_id] for e, t in zip(_encode_batch(src, texts), texts)]
        leads, rests = zip(*(split_leading_tags(text, self.lead_tags) for text in texts)) if texts else ((), ())
        return [lead + as_text(src, e, controls, t, False) + [self.eos_id]
                for lead, e, t in zip(leads, _encode_batch(src, list(rests)), rests)]

    def encode_tgt(self, texts: list[str]) -> list[list[int]]:
        """Target ids without </s> (the collator adds the decoder start and </s>), after a target language tag where
        the tokenizer adds one. A "</s>" written in a target is text: the words after it stay in the label."""
        return [as_text(self.tgt, e, self.tgt_controls, t, True)
                for e, t in zip(_encode_batch(self.tgt, texts, specials=True), texts)]

    def src_tokens(self, text: str) -> list[str]:
        """Source subword strings as the model sees them (with the final </s>)."""
        if self.src_specials:
            return self.src.encode(text).tokens
        return self.src.encode(text, add_special_tokens=False).tokens + ["</s>"]

    def tgt_tokens(self, ids: list[int]) -> list[str]:
        return [self.tgt.id_to_token(i) or "<unk>" for i in ids]

    def decode_tgt(self, ids_batch: list[list[int]]) -> list[str]:
        """Detokenized text; stops at </s> and skips specials."""
        cut = [ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids for ids in ids_batch]
        return self.tgt.decode_batch(cut, skip_special_tokens=True)

    def unknown_rate(self, texts: list[str], side: str = "src") -> float:
        """Share of subwords that are <unk> (vocabulary coverage); see `unknown_rate`."""
        return unknown_rate(self.encode_src(texts) if side == "src" else self.encode_tgt(texts))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.one_file:
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

    @classmethod
    def load_for(cls, directory: str | Path, model_cfg) -> PairTokenizer:
        """The tokenizer of model directory `directory`, checked to fit the model `model_cfg` configures."""
        tokenizer = cls.load(directory)
        tokenizer.check_fits(model_cfg.src_vocab_size, model_cfg.tgt_vocab_size, directory)
        return tokenizer

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
        self.tags = leading_tags(tok)

    def encode(self, text: str, rng: random.Random, leading_tags: bool = True) -> list[int]:
        """Subword ids of `text` (no specials added), drawing from `rng`. With `leading_tags`, tags that lead the
        text (a multilingual run's <2de>, a back-translation's <bt>) keep their ids, as in `PairTokenizer.encode_src`;
        the words after them, and any control string among them, are text segmented with dropout."""
        ids, text = split_leading_tags(text, self.tags) if leading_tags else ([], text)
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


def read_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer file as it is, unchecked (`nmt import` reads a transformers tokenizer.json with it)."""
    return Tokenizer.from_file(str(path))


def with_template(tok: Tokenizer, single: str | None, specials: list[str]) -> Tokenizer:
    """A copy of `tok` whose post-processor is the template `single` (e.g. "__en__ $A </s>") of the special tokens
    `specials`, or none (`single` None). An NmtError names a special token the vocabulary lacks."""
    ids = [(name, tok.token_to_id(name)) for name in specials]
    missing = [name for name, i in ids if i is None]
    if missing:
        raise NmtError(f"the tokenizer has no token {missing[0]!r}; give a language token of the model (as its "
                       "tokenizer writes it, e.g. __en__ or eng_Latn)")
    copy = Tokenizer.from_str(tok.to_str())
    copy.post_processor = None if single is None else processors.TemplateProcessing(single=single, special_tokens=ids)
    return copy


def _load_file(path: Path) -> Tokenizer:
    try:
        tok = Tokenizer.from_file(str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a bare Exception for bad JSON; a Rust panic for some bad models
        raise NmtError(f"{path}: not a readable tokenizer file ({str(e).splitlines()[0]})") from None
    data = json.loads(tok.to_str())
    if _is_imported(data):
        _check_imported(data, path, tok)
        return tok
    if [tok.token_to_id(s) for s in SPECIALS] != [PAD, UNK, BOS, EOS]:
        raise NmtError(f"{path}: special tokens {SPECIALS} must have ids 0-3; it was not made by nmt")
    if data["model"].get("dropout") is not None:  # saved by an nmt before BPE-dropout moved out of the tokenizer
        data["model"]["dropout"] = None
        tok = Tokenizer.from_str(json.dumps(data))
    _check_pipeline(data, path)
    return tok


# --- tokenizers converted from transformers' models (nmt import) -----------------------------------------------
# SentencePiece's pipeline as transformers' converters and tokenizer.json files write it: each part is one of
# these exact values (a Precompiled normalizer's table is data, not a pattern), so nothing open-ended runs.
_SPM_NORMALIZERS = [
    {"type": "Replace", "pattern": {"Regex": "\\A +| +\\z"}, "content": ""},
    {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
    {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    {"type": "Replace", "pattern": {"Regex": "\\A\u2581"}, "content": "\u2581\u2581"},
]
_SPM_DECODERS = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                 {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0},
                 {"type": "Replace", "pattern": {"Regex": "\\A +| +\\z"}, "content": ""}]  # an imported Marian's
_BPE_OPTIONS = {"dropout": [None], "unk_token": ["<unk>"], "continuing_subword_prefix": [None],
                "end_of_word_suffix": [None], "fuse_unk": [True, False], "byte_fallback": [False],
                "ignore_merges": [True, False]}


def stripping_decoder():
    """SentencePiece's detokenizer (each "\u2581" a space) that strips the spaces at both ends of the text (the dummy
    prefix's, a final "\u2581" piece's), as MarianTokenizer strips the text it decodes."""
    return decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(),
                              decoders.Replace(Regex("\\A +| +\\z"), "")])


def _is_imported(data: dict) -> bool:
    """A tokenizer of the SentencePiece kind that nmt import writes: nmt's own normalize with NFKC."""
    return all(part.get("type") != "NFKC" for part in _sequence(data.get("normalizer"), "normalizers")
               if isinstance(part, dict))


def _metaspace(part) -> bool:
    return (isinstance(part, dict) and set(part) == {"type", "replacement", "prepend_scheme", "split"}
            and part["type"] == "Metaspace" and part["replacement"] == "\u2581"
            and part["prepend_scheme"] in ("always", "first", "never") and isinstance(part["split"], bool))


def _sequence(part, key: str) -> list:
    if part is None:
        return []
    return part[key] if isinstance(part, dict) and part.get("type") == "Sequence" else [part]


def _check_imported(data: dict, path: Path, tok: Tokenizer) -> None:
    """Accept only the parts a converted SentencePiece tokenizer has (see the lists above)."""
    for norm in _sequence(data.get("normalizer"), "normalizers"):
        precompiled = isinstance(norm, dict) and set(norm) == {"type", "precompiled_charsmap"} \
            and norm["type"] == "Precompiled" and isinstance(norm["precompiled_charsmap"], str)
        if not precompiled and norm not in _SPM_NORMALIZERS:
            _refuse(path, "normalizer", norm, "SentencePiece's: Precompiled and its fixed whitespace rules")
    pre = _sequence(data.get("pre_tokenizer"), "pretokenizers")
    if len(pre) != 1 or not _metaspace(pre[0]):
        _refuse(path, "pre_tokenizer", data.get("pre_tokenizer"), "one Metaspace")
    for dec in _sequence(data.get("decoder"), "decoders"):
        if not _metaspace(dec) and dec not in _SPM_DECODERS:
            _refuse(path, "decoder", dec, "SentencePiece's Metaspace, or Replace/Fuse/Strip of its spaces")
    for part in ("truncation", "padding"):
        if data.get(part) is not None:
            _refuse(path, part, data.get(part), "none")
    model = data["model"]
    if model.get("type") == "Unigram":
        if model.get("byte_fallback") or set(model) != {"type", "unk_id", "vocab", "byte_fallback"}:
            _refuse(path, "model options", {k: v for k, v in model.items() if k != "vocab"}, "a plain Unigram")
    elif model.get("type") == "BPE":
        options = {k: v for k, v in model.items() if k not in ("type", "vocab", "merges")}
        if any(k not in _BPE_OPTIONS or v not in _BPE_OPTIONS[k] for k, v in options.items()):
            _refuse(path, "model options", options, "a plain BPE")
    else:
        _refuse(path, "model", model.get("type"), "a BPE or Unigram model")
    added = {}
    for token in data["added_tokens"]:
        if set(token) != {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"} \
                or not token["special"] or token["normalized"] or token["lstrip"] or token["rstrip"] \
                or token["single_word"] or not isinstance(token["content"], str) \
                or any(c.isspace() for c in token["content"]):
            _refuse(path, "added token", token, "a special token of one word, matched as written")
        added[token["content"]] = token["id"]
    _check_template(data.get("post_processor"), added, path)
    for name in ("</s>", "<unk>", "<pad>"):
        if tok.token_to_id(name) is None:
            raise NmtError(f"{path}: no {name} token; nmt needs </s>, <unk> and <pad>")


def _check_template(post, added: dict, path: Path) -> None:
    """None, or a TemplateProcessing that puts special tokens (a language tag, </s>) around the text."""
    if post is None:
        return
    shown = "a TemplateProcessing of special tokens around the text"
    if not isinstance(post, dict) or post.get("type") != "TemplateProcessing" \
            or set(post) != {"type", "single", "pair", "special_tokens"}:
        _refuse(path, "post_processor", post, shown)
    for item in post["single"] + post["pair"]:
        special, text = item.get("SpecialToken"), item.get("Sequence")
        if len(item) != 1 or not (special and special.get("id") in added or text and text.get("id") in ("A", "B")):
            _refuse(path, "post_processor item", item, shown)
    for name, spec in post["special_tokens"].items():
        if name not in added or spec != {"id": name, "ids": [added[name]], "tokens": [name]}:
            _refuse(path, "post_processor special token", spec, shown)


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
    ways = [json.loads(_pipeline(Tokenizer(models.BPE(unk_token="<unk>") if kind == "BPE" else models.Unigram()),
                                 split).to_str()) for split in (True, False, "marks")]
    fresh = next((way for way in ways if data.get("pre_tokenizer") == way.get("pre_tokenizer")), ways[0])
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
