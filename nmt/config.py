"""The configuration chapter: the typed configuration tree, one set of dataclasses used from YAML, the command line
and Python alike, and everything that reads, checks and describes it. No torch here, and no YAML until a file or
an override is read.

In reading order: the allowed values of each key (`ranged`, `path_key`, `check_fields`), which the fields
declare; the config dataclasses (`TrainConfig` and its sections), their YAML files and command-line overrides;
strict building from plain data (`from_dict`, `to_dict`: unknown keys and wrong types raise `NmtError` naming
the key); and the configuration reference generated from the fields' comments (docs/configuration.md's table
and `nmt train --help`):

    python -m nmt.config docs/configuration.md    # rewrite the page's table from nmt/config.py

Launch settings (processes, precision, GPUs) live in accelerate_configs/, not here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nmt.errors import NmtError

# --- What a key allows: intervals and path kinds ---------------------------------------------------------------------
# What values a config key or flag allows: an interval for every numeric key, a kind for every path key.
#
# A dataclass field declares them in its metadata (`ranged`, `path_key`), and `check_fields` checks an
# instance in one place, naming the key, the value and what is allowed. The same call expands a leading `~` in its
# path keys (`expand_home`), whichever way the config was built. Environment variables (`$VAR`, `${VAR}`; `$$` for
# a literal `$`) are expanded in the values of config files only (`expand_file_paths`, called by `load_config`):
# a flag's value has been through the shell already, and a value given in Python is the path it says. No torch and
# no filesystem here: path keys are checked against the disk by `nmt.validate` at the start of training and
# `nmt check`.

RANGE, PATH = "range", "path"  # the metadata keys
# what each path kind must be on disk: the README table's "allowed" column and nmt.validate's messages
PATH_KINDS = {
    "folder": "a folder path (created if missing)",
    "corpus": "a corpus: PREFIX of .<lang> files, a .tsv/.jsonl/.csv file, a save_to_disk folder, hub: or builtin:",
    "checkpoint": "latest, auto, or a checkpoint folder output_dir/checkpoints/step_N",
    "model": "a model directory (output_dir/model or output_dir/best) with config.json, weights and tokenizer",
}


@dataclass(frozen=True)
class Range:
    """A closed, open or half-open interval written as in mathematics: "[0, 1)", "(0, 10]", "[1, 1e9]".

    Both ends are finite, so an absurd value (a typo's extra zeros, inf, nan) is always refused.
    """

    text: str
    lo: float = field(init=False, compare=False)
    hi: float = field(init=False, compare=False)
    lo_open: bool = field(init=False, compare=False)
    hi_open: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        m = re.fullmatch(r"([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])", self.text)
        if not m:
            raise ValueError(f"not an interval: {self.text!r}")
        lo, hi = float(m[2]), float(m[3])
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ValueError(f"an interval needs finite ends, low <= high: {self.text!r}")
        for name, value in (("lo", lo), ("hi", hi), ("lo_open", m[1] == "("), ("hi_open", m[4] == ")")):
            object.__setattr__(self, name, value)

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, float) and math.isnan(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        return self.text


def ranged(default: Any, allowed: str) -> Any:
    """A numeric dataclass field whose values (each element of a list or tuple; None passes) lie in `allowed`."""
    return field(default=default, metadata={RANGE: Range(allowed)})


def path_key(default: Any, kind: str) -> Any:
    """A dataclass field naming a path of `kind` (a key of PATH_KINDS), checked by nmt.validate.check_paths."""
    if kind not in PATH_KINDS:
        raise ValueError(f"unknown path kind {kind!r}")
    return field(default=default, metadata={PATH: kind})


def allowed_text(f: dataclasses.Field) -> str:
    """What a field allows, in a few words: its interval or its path kind (empty when neither)."""
    if RANGE in f.metadata:
        return str(f.metadata[RANGE])
    return f.metadata.get(PATH, "")


def check_fields(obj: Any, prefix: str = "", noun: str = "config key") -> None:
    """Refuse the first field of dataclass `obj` whose value lies outside its declared range, after expanding a
    leading `~` in its path keys (`expand_home`).

    The message names the key (`prefix` + field name), the value and the allowed interval.
    """
    expand_home(obj)
    for f in dataclasses.fields(obj):
        allowed = f.metadata.get(RANGE)
        value = getattr(obj, f.name)
        if allowed is None or value is None:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item not in allowed:
                raise NmtError(f"{noun} '{prefix}{f.name}': {value!r} is outside the allowed range {allowed}")


def expand_home(obj: Any) -> None:
    """Replace a leading `~` (or `~user`) in the path keys of dataclass `obj` (each item of a list) by the home folder
    it stands for. Idempotent, so a config checked again is unchanged; `./~` names a folder called `~`."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if PATH not in f.metadata or value is None:
            continue
        home = lambda v: os.path.expanduser(v) if isinstance(v, str) else v  # a non-string is the type check's
        expanded = [home(v) for v in value] if isinstance(value, list) else home(value)
        if expanded != value:
            setattr(obj, f.name, expanded)


VARIABLE = re.compile(r"\$(?:\$|(\w+)|\{([^}]*)\})")  # $$ (a literal $), $VAR, ${VAR}


def expand_path(text: Any, key: str) -> Any:
    """`text`, a path as a config file gives it, with a leading `~`, `$VAR` and `${VAR}` expanded and `$$` read as
    one `$` (as docker-compose and make do); a non-string is returned as it is, for the type check. A variable that
    is not set is an error naming the key, rather than a folder named `$VAR` made later."""
    if not isinstance(text, str):
        return text

    def value(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        name = m[1] or m[2]
        if name not in os.environ:
            raise NmtError(f"{key}: {text!r} names the environment variable ${name}, which is not set; set it, write "
                           "the path out, or write $$ for a literal $")
        return os.environ[name]

    user = re.match(r"~[^/]*", text)  # expanded apart: the home folder's own name is not read for variables
    if user is None:
        return VARIABLE.sub(value, text)
    return os.path.expanduser(user[0]) + VARIABLE.sub(value, text[user.end():])


def expand_file_paths(cls: type, data: dict, where: str = "") -> None:
    """Expand (`expand_path`) every path value of `data`, a config file's mapping for dataclass `cls`, in place;
    `where` (the file) starts each message."""
    _map_paths(cls, data, lambda text, key: expand_path(text, f"{where}{': ' if where else ''}config key {key!r}"))


def escape_paths(cls: type, data: dict) -> None:
    """The inverse for a file nmt writes (config.yaml): each `$` of a path value doubled, so that reading the file
    as a config gives the path back as it was."""
    _map_paths(cls, data, lambda text, key: text.replace("$", "$$"))


def _map_paths(cls: type, data: Any, fn: Any, prefix: str = "") -> None:
    """Replace each string of a path key in `data` (plain data for dataclass `cls`: sections, lists, corpus items)
    by fn(text, dotted key), in place. What is not of the expected shape is left to `from_dict` to name."""
    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        key, value = f"{prefix}{f.name}", data[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            _map_paths(hints[f.name], value, fn, key + ".")
        elif PATH in f.metadata:
            data[f.name] = _map_path(value, key, fn)


def _map_path(value: Any, key: str, fn: Any) -> Any:
    if isinstance(value, str):
        return fn(value, key)
    if isinstance(value, list):  # data.train: paths and corpus items
        out = []
        for i, item in enumerate(value):
            if isinstance(item, dict):
                item = dict(item)
                _map_paths(CorpusSpec, item, fn, f"{key}[{i}].")
            out.append(_map_path(item, f"{key}[{i}]", fn) if isinstance(item, str) else item)
        return out
    return value


def walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) for every leaf field of a tree of dataclass instances."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from walk(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


# --- The configuration tree ------------------------------------------------------------------------------------------
BUILTIN = "builtin:synthetic"  # the embedded corpus (nmt.synthetic)
LANG = re.compile(r"[A-Za-z0-9_-]+")  # a language code: a file suffix and a tag <2xx>
MAX_LANG_CODE = 32  # characters of a language code (BCP 47 tags and NLLB's eng_Latn are far shorter)


def check_lang_code(value: Any, where: str) -> str:
    """`value` when it is a language code (`LANG`: letters, digits, _ or -, at most MAX_LANG_CODE characters), else
    NmtError naming `where` (e.g. "config key 'data.tgt_lang'", "--tgt-lang"). The one rule for every language code
    nmt is given: a code names files (PREFIX.<lang>) and a tag <2lang>, so it may hold neither a path nor a space."""
    if not (isinstance(value, str) and len(value) <= MAX_LANG_CODE and LANG.fullmatch(value)):
        raise NmtError(f"{where}: {str(value)[:60]!r} is not a language code (letters, digits, _ or -, at most "
                       f"{MAX_LANG_CODE} characters, e.g. de or pt_BR)")
    return value


@dataclass
class CorpusSpec:
    """One item of a data.train/valid/test list with languages of its own (a multilingual run's corpus)."""

    path: str = path_key("", "corpus")  # as a plain data.train item: PREFIX, table file, dataset dir, builtin:
    src_lang: str | None = None  # this corpus's source language (null: data.src_lang)
    tgt_lang: str | None = None  # this corpus's target language (null: data.tgt_lang)
    weight: float | None = ranged(None, "(0, 1e6]")  # train only: times seen per epoch (null: data.weights' or 1)


@dataclass(frozen=True)
class DataSource:
    """A data.train/valid/test item resolved: path, languages, weight (1 where none is given)."""

    path: str
    src_lang: str
    tgt_lang: str
    weight: float = 1.0

    @property
    def pair(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"


def lang_tag(lang: str) -> str:
    """The source-side token that asks a multilingual model for target language `lang`."""
    return f"<2{lang}>"


@dataclass
class DataConfig:
    """Where the parallel text comes from and how it is cleaned."""

    train: str | list[str | CorpusSpec] = path_key(BUILTIN, "corpus")  # a corpus or a list of them (docs/multilingual.md)
    weights: list[float] | None = ranged(None, "(0, 1e6]")  # per train corpus: times seen per epoch (upsampling: [1, 2])
    valid: str | list[str | CorpusSpec] | None = path_key(None, "corpus")  # forms of train; None carves valid_ratio off
    test: str | list[str | CorpusSpec] | None = path_key(None, "corpus")  # forms of train; None carves test_ratio off
    src_lang: str = "en"  # source language code: file suffix, JSON field or translation key
    tgt_lang: str = "xx"  # target language code
    temperature: float = ranged(1.0, "(0, 100]")  # corpus i's share of an epoch ~ size_i^(1/T): 1 proportional, 5 flatter
    multilingual: bool = False  # target-language tags even for one language pair (true: the model can be extended)
    valid_ratio: float = ranged(0.01, "[0, 1)")  # share of train held out for validation when valid is None
    test_ratio: float = ranged(0.01, "[0, 1)")  # share of train held out for test when test is None
    split_seed: int = ranged(1, "[0, 2147483647]")  # seed of the train/valid/test carving
    max_words: int = ranged(250, "[1, 1e6]")  # drop pairs with a side longer than this many whitespace words
    max_chars: int = ranged(3000, "[1, 1e8]")  # drop pairs with a side longer than this many characters
    max_subwords: int = ranged(512, "[1, 1e6]")  # drop pairs with a side longer than this many subwords (after tokenizing)
    max_ratio: float = ranged(3.0, "[1, 1e3]")  # drop pairs whose word-length ratio exceeds this (sides > ratio_min_words)
    ratio_min_words: int = ranged(3, "[0, 1e6]")  # the length-ratio filter applies only when the longer side has more words
    dedupe: bool = True  # drop exact duplicate pairs from train
    dedupe_eval: bool = False  # drop training pairs equal (after normalisation) to a validation or test pair
    max_train_pairs: int | None = ranged(None, "[1, 1e12]")  # use only the first N training pairs (quick experiments)
    cache_dir: str = path_key("~/.cache/nmt", "folder")  # encoded datasets and trained tokenizers, keyed by content
    shared_cache: bool = True  # cache_dir is seen by every node: only the global main process prepares (false: each node's)

    def __post_init__(self) -> None:
        check_fields(self, "data.")
        for side in ("src_lang", "tgt_lang"):
            check_lang_code(getattr(self, side), f"config key 'data.{side}'")
        n_train = 1 if isinstance(self.train, str) else len(self.train)
        _check(n_train > 0, "data.train", "needs at least one corpus")
        if self.weights is not None:
            _check(len(self.weights) == n_train, "data.weights", f"needs one weight per train corpus ({n_train})")
        for name in ("train", "valid", "test"):
            value = getattr(self, name)
            for i, item in enumerate(value if isinstance(value, list) else []):
                if isinstance(item, dict):  # given from Python: read as YAML's would be
                    item = value[i] = from_dict(CorpusSpec, item, f"data.{name}[{i}]")
                if isinstance(item, CorpusSpec):
                    check_fields(item, f"data.{name}[{i}].")
                    _check(bool(item.path), f"data.{name}[{i}].path", "is required: the corpus to read")
                    for side in ("src_lang", "tgt_lang"):
                        if getattr(item, side) is not None:
                            check_lang_code(getattr(item, side), f"config key 'data.{name}[{i}].{side}'")
                    _check(item.weight is None or name == "train", f"data.{name}[{i}].weight",
                           "weights only the training corpora")
                    _check(item.weight is None or self.weights is None, f"data.{name}[{i}].weight",
                           "give either data.weights or per-corpus weights, not both")
        for split in ("valid", "test") if self.is_multilingual else ():
            for i, corpus in enumerate(self.corpora(split)):
                _check(corpus.tgt_lang in self.target_languages(), f"data.{split}[{i}].tgt_lang" if isinstance(
                    getattr(self, split), list) else "data.tgt_lang", f"{corpus.tgt_lang!r} is no target language of "
                    f"data.train ({', '.join(self.target_languages())}): the model would have no tag for it")
        for i, corpus in enumerate(self.corpora("train") if self.is_multilingual else []):
            _check(corpus.src_lang != corpus.tgt_lang, f"data.train[{i}].tgt_lang",
                   f"equals its src_lang {corpus.src_lang!r}")

    def corpora(self, split: str) -> list[DataSource]:
        """data.train/valid/test as resolved `DataSource` items (empty for a null valid or test), languages and weight
        filled in from data.src_lang, data.tgt_lang and data.weights."""
        value = getattr(self, split)
        items = [] if value is None else [value] if isinstance(value, str) else value
        weights = self.weights if split == "train" and self.weights else [None] * len(items)
        out = []
        for item, weight in zip(items, weights):
            if isinstance(item, str):
                out.append(DataSource(item, self.src_lang, self.tgt_lang, weight or 1.0))
            else:
                out.append(DataSource(item.path, item.src_lang or self.src_lang, item.tgt_lang or self.tgt_lang,
                                  item.weight or weight or 1.0))
        return out

    def pairs(self) -> list[str]:
        """The language pairs of the training corpora ("en-de"), in order of first appearance."""
        return list(dict.fromkeys(c.pair for c in self.corpora("train")))

    @property
    def is_multilingual(self) -> bool:
        """Target-language tags are prepended to the source: the corpora name several pairs, or data.multilingual."""
        return self.multilingual or len(self.pairs()) > 1

    def target_languages(self) -> list[str]:
        """The target languages a multilingual run trains, sorted: one tag each."""
        return sorted({c.tgt_lang for c in self.corpora("train")})

    def tags(self) -> list[str]:
        """The target-language tags reserved in the tokenizer (none for a one-pair run)."""
        return [lang_tag(lang) for lang in self.target_languages()] if self.is_multilingual else []


@dataclass
class TokenizerConfig:
    """The subword model trained on the training text."""

    kind: Literal["bpe", "unigram"] = "bpe"  # subword algorithm
    vocab_size: int | None = ranged(None, "[16, 1e7]")  # vocabulary per tokenizer (null: the plan's, by corpus size)
    joint: bool = True  # one vocabulary for both languages (enables shared embeddings)
    min_frequency: int = ranged(2, "[0, 1e9]")  # BPE: merges need at least this many occurrences
    dropout: float | None = ranged(None, "[0, 1)")  # BPE-dropout p, re-segmented each epoch (null: the budget plan's, 0 off)
    train_sample: int | None = ranged(None, "[1, 1e12]")  # train the tokenizer on N random training pairs (all encoded)
    reserved: list[str] = field(default_factory=list)  # tokens kept whole, ids 4 on, e.g. ["<bt>"] (back-translation tag)
    split_punctuation: bool = True  # each punctuation mark its own pre-token (no subword joins a word and a mark)

    def __post_init__(self) -> None:
        check_fields(self, "tokenizer.")
        _check(all(isinstance(t, str) and t and not any(c.isspace() for c in t) for t in self.reserved),
               "tokenizer.reserved", "must be tokens without spaces, e.g. [\"<bt>\"]")
        _check(not {"<pad>", "<unk>", "<s>", "</s>"} & set(self.reserved), "tokenizer.reserved",
               "cannot repeat <pad> <unk> <s> </s>")
        _check(not self.dropout or self.kind == "bpe", "tokenizer.dropout", "is BPE-dropout: needs kind bpe")


@dataclass
class ModelConfig:
    """An encoder-decoder Transformer. Vocabulary sizes of 0 are filled in from the tokenizer; the size fields
    left null come from the preset `size` names, or, for size "auto", from the run's plan (`nmt.plan`: the corpus
    size, the measured speed and the budget).
    """

    src_vocab_size: int = ranged(0, "[0, 1e7]")  # source vocabulary (0: from the tokenizer)
    tgt_vocab_size: int = ranged(0, "[0, 1e7]")  # target vocabulary (0: from the tokenizer)
    size: Literal["auto", "tiny", "d128", "d192", "small", "base", "big"] = "auto"  # shape preset (auto: planned)
    d_model: int | None = ranged(None, "[1, 65536]")  # width of the residual stream (null: from size)
    n_heads: int | None = ranged(None, "[1, 1024]")  # attention heads; d_model must divide by it (null: from size)
    n_encoder_layers: int | None = ranged(None, "[1, 1000]")  # encoder depth (null: from size)
    n_decoder_layers: int | None = ranged(None, "[1, 1000]")  # decoder depth (null: from size)
    d_ff: int | None = ranged(None, "[1, 1e6]")  # feed-forward inner width (null: from size)
    dropout: float | None = ranged(None, "[0, 1)")  # on embeddings and residual branches (null: from size)
    attention_dropout: float | None = ranged(None, "[0, 1)")  # on attention weights (null: dropout's; Marian: 0)
    activation_dropout: float | None = ranged(None, "[0, 1)")  # on the feed-forward activation (null: dropout's; Marian: 0)
    activation: Literal["relu", "gelu", "silu"] = "relu"  # feed-forward non-linearity (silu: Marian's swish)
    pre_norm: bool = True  # LayerNorm before each sublayer (stable); False: post-norm as in Vaswani et al.
    share_embeddings: bool = True  # one embedding table for source, target and output (joint vocab only)
    scale_embedding: bool = True  # multiply embeddings by sqrt(d_model) before adding positions
    init_std: float | None = ranged(None, "[0, 10]")  # fresh weights ~ N(0, init_std); 0: Xavier (null: nmt's start)
    checkpoint_activations: bool = False  # training keeps each layer's input only and recomputes the rest (less memory)
    positions: Literal["interleaved", "halves", "m2m100"] = "interleaved"  # sinusoids: nmt's, Marian's, M2M100's
    final_logits_bias: bool = False  # a fixed (not trained) bias added to the output logits (Marian's)
    max_positions: int = ranged(1024, "[2, 1e6]")  # longest sequence the sinusoidal table covers
    pad_id: int = ranged(0, "[0, 1e7]")  # padding id: masks are derived from it
    bos_id: int = ranged(2, "[0, 1e7]")  # decoder start id (may equal pad_id, as in Marian)
    eos_id: int = ranged(3, "[0, 1e7]")  # end-of-sentence id
    forced_bos_id: int | None = ranged(None, "[0, 1e7]")  # first generated token, forced (M2M100's target language)

    @staticmethod
    def renamed_keys(data: dict, where: str) -> dict:
        """`preset`, the older name of `size` (`from_dict` calls this)."""
        if "preset" in data:
            preset = data.pop("preset")
            if preset not in MODEL_PRESETS:
                raise NmtError(f"config key '{where}.preset': unknown preset {preset!r}; "
                               f"choose one of {', '.join(MODEL_PRESETS)}")
            if data.setdefault("size", preset) != preset:
                raise NmtError(f"config key '{where}.preset': {preset!r} contradicts size {data['size']!r}; give one")
        return data

    def __post_init__(self) -> None:
        check_fields(self, "model.")
        if self.size != "auto":
            _check(self.size in MODEL_PRESETS, "model.size", f"unknown size {self.size!r}; choose auto or one of "
                   f"{', '.join(MODEL_PRESETS)}")
            for name, value in MODEL_PRESETS[self.size].items():
                if getattr(self, name) is None:
                    setattr(self, name, value)
        if self.d_model is not None and self.n_heads is not None:
            _check(self.d_model % self.n_heads == 0, "model.d_model",
                   f"{self.d_model} must divide by n_heads={self.n_heads}")
        if self.share_embeddings and self.src_vocab_size and self.tgt_vocab_size:
            _check(self.src_vocab_size == self.tgt_vocab_size, "model.share_embeddings",
                   "needs equal source and target vocabularies (a joint tokenizer); set it to false")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named size (tiny, small, base, big) with field overrides."""
        if name not in MODEL_PRESETS:
            raise NmtError(f"model.preset: unknown preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
        return cls(size=name, **overrides)

    def fresh_std(self) -> float:
        """The standard deviation fresh matrices are drawn with (0: Xavier-uniform matrices and N(0, d_model^-1/2)
        embeddings): init_std, every matrix and embedding then drawn from N(0, init_std); where it is null, 0.02 from
        d_model 128 on for all matrices but attention's input projections, which with the embeddings keep the Xavier
        start (`mixed_start`), and Xavier below (the 32-wide `tiny`, where 0.02 was not measured)."""
        if self.init_std is not None:
            return self.init_std
        return INIT_STD if (self.d_model or 0) >= 128 else 0.0

    def mixed_start(self) -> bool:
        """Whether fresh weights take nmt's default start (init_std null, d_model from 128): matrices N(0, 0.02) as
        transformers' Marian draws them, but attention's input projections Xavier-uniform and the embeddings
        N(0, d_model^-1/2), as Xavier's start has them. Queries and keys meet in a product: both drawn at 0.02, every
        score starts near zero and each one's gradient, proportional to the other, too, so attention stays uniform
        for the first few hundred steps; embeddings at 0.02, scaled by sqrt(d_model), start at a fifth of the
        positions' scale. A short run ends inside that plateau (benchmarks/quickstart.py, docs/results.md)."""
        return self.init_std is None and (self.d_model or 0) >= 128

    def dropout_at(self, where: str) -> float:
        """The dropout on the attention weights or the feed-forward activation (`where`: "attention" or
        "activation"): its own setting, else `dropout`'s (as nmt has always trained; Marian uses 0 there)."""
        own = getattr(self, f"{where}_dropout")
        return self.dropout if own is None else own

    def unresolved(self) -> list[str]:
        """The size fields still null (size "auto" before the corpus size is known)."""
        return [name for name in SIZE_FIELDS if getattr(self, name) is None]


INIT_STD = 0.02  # `ModelConfig.fresh_std` from d_model 128 on
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=64, dropout=0.0),
    "d128": dict(d_model=128, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=512, dropout=0.1),
    "d192": dict(d_model=192, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=768, dropout=0.1),
    "small": dict(d_model=256, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=1024, dropout=0.1),
    "base": dict(d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048, dropout=0.1),
    "big": dict(d_model=1024, n_heads=16, n_encoder_layers=6, n_decoder_layers=6, d_ff=4096, dropout=0.3),
}
SIZE_FIELDS = tuple(MODEL_PRESETS["base"])


@dataclass
class OptimConfig:
    """AdamW with linear warmup, then inverse-square-root or linear decay."""

    lr: float | None = ranged(None, "[0, 1]")  # peak learning rate, reached after warmup_steps (null: for the width)
    warmup_steps: int | None = ranged(None, "[0, 1e9]")  # linear warmup to lr over this many steps (null: the plan's)
    schedule: Literal["inverse_sqrt", "linear"] = "inverse_sqrt"  # after warmup: lr*sqrt(warmup/step), or linear to 0
    decay_steps: int | None = ranged(None, "[1, 1e12]")  # linear: lr 0 and the run ends here (null: planned/run's steps)
    betas: tuple[float, float] = ranged((0.9, 0.98), "[0, 1)")  # Adam betas
    eps: float = ranged(1e-9, "[0, 1)")  # Adam epsilon
    weight_decay: float = ranged(0.0, "[0, 10]")  # decoupled weight decay
    clip_norm: float = ranged(1.0, "[0, 1e6]")  # clip the global gradient norm (0: off)
    label_smoothing: float = ranged(0.1, "[0, 1)")  # mass spread over the vocabulary

    def __post_init__(self) -> None:
        check_fields(self, "optim.")


FREEZE_PARTS = ("embeddings", "encoder", "decoder", "cross_attention")  # finetune.freeze's names (nmt.adapters)
LORA_TARGETS = ["qkv", "q", "kv", "out", "up", "down"]  # the attention and feed-forward linears of nmt's model


@dataclass
class FinetuneConfig:
    """Parameter-efficient fine-tuning of an `init_from` model: frozen parts, or LoRA adapters (`nmt.adapters`)."""

    freeze: list[str] = field(default_factory=list)  # parts kept fixed: embeddings, encoder, decoder, cross_attention
    lora_r: int = ranged(0, "[0, 65536]")  # LoRA rank (0: off); the base weights stay fixed, needs peft (nmt[lora])
    lora_alpha: float = ranged(16.0, "(0, 1e6]")  # LoRA scaling: the update is multiplied by lora_alpha / lora_r
    lora_dropout: float = ranged(0.0, "[0, 1)")  # dropout on the input of the LoRA branch
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # names of the linears adapted

    def __post_init__(self) -> None:
        check_fields(self, "finetune.")
        unknown = [name for name in self.freeze if name not in FREEZE_PARTS]
        _check(not unknown, "finetune.freeze", f"unknown part(s) {', '.join(map(repr, unknown))}; choose from "
               f"{', '.join(FREEZE_PARTS)}")
        _check(not (self.lora_r and self.freeze), "finetune.freeze",
               "LoRA (lora_r > 0) already keeps every base weight fixed; leave freeze empty")
        _check(bool(self.lora_targets) and all(isinstance(t, str) and t for t in self.lora_targets),
               "finetune.lora_targets", f"needs module names, e.g. {LORA_TARGETS}")


@dataclass
class TrainConfig:
    """Everything a training run needs. Build it from YAML (`load_config`), flags, or Python."""

    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    output_dir: str = path_key("runs/default", "folder")  # checkpoints, metrics.jsonl, config.yaml, and the final model/
    seed: int = ranged(1, "[0, 2147483647]")  # seeds model init, data order and dropout
    max_tokens: int | None = ranged(None, "[1, 1e9]")  # per process and micro-batch: padded tokens of the longer side
    accum_steps: int = ranged(1, "[1, 1e6]")  # micro-batches per optimizer step (each process)
    max_steps: int | None = ranged(None, "[1, 1e12]")  # stop after this many optimizer steps
    max_epochs: int | None = ranged(None, "[1, 1e9]")  # stop after this many epochs (null: the budget ends the run, else 10)
    eval_every: int | None = ranged(None, "[1, 1e12]")  # validate every N optimizer steps, and at the end (null: the plan's)
    eval_beam: int = ranged(1, "[1, 1000]")  # beam size for validation BLEU (1: greedy)
    eval_max_sentences: int | None = ranged(None, "[1, 1e12]")  # BLEU on the first N valid pairs (null: 500 if max_minutes)
    save_every: int | None = ranged(None, "[1, 1e12]")  # checkpoint every N optimizer steps and at the end (null: planned)
    keep_last: int | None = ranged(None, "[0, 1e6]")  # checkpoints kept besides best/ (null: 2, or average_last if more)
    log_every: int = ranged(50, "[1, 1e12]")  # metrics.jsonl and trackers every N steps
    log_with: list[str] = field(default_factory=list)  # accelerate trackers, e.g. ["tensorboard"]
    resume: str | None = path_key(None, "checkpoint")  # "latest", "auto" (latest if any, else fresh) or a checkpoint
    overwrite: bool = False  # a fresh run into a used output_dir first moves the old run aside (to output_dir.old-TIME)
    resume_with_changes: bool = False  # resume although data, tokenizer, model or optim settings differ from the checkpoint
    allow_data_change: bool = False  # resume although the data files differ from the checkpoint's (its tokenizer is kept)
    init_from: str | None = path_key(None, "model")  # a model directory to fine-tune: its architecture, tokenizer, weights
    max_minutes: float | None = ranged(None, "(0, 1e8]")  # wall-clock budget: stop cleanly (evaluate, save) once it is spent
    max_bad_steps: int = ranged(20, "[1, 1e9]")  # stop after this many non-finite or out-of-memory steps in a row
    patience: int | None = ranged(None, "[1, 1e9]")  # early stopping: stop after this many validations without a new best
    average_last: int | None = ranged(None, "[0, 1e6]")  # average the last N checkpoints at the end, kept if no worse
    tune_alpha: list[float] | None = ranged(None, "[0, 10]")  # alphas tried on validation at the end (and 0.6); best wins
    pad_to_multiple_of: int | None = ranged(None, "[1, 4096]")  # pad batch lengths to a multiple of this (8: tensor cores)
    compile: bool = False  # torch.compile the training objective and the decoder step (fullgraph); slower on a CPU
    dist_timeout_minutes: float = ranged(30.0, "(0, 1e6]")  # process group timeout of a collective (data prep waits outside)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.keep_last is not None and self.average_last is not None:
            _check(self.keep_last >= self.average_last, "average_last", f"needs keep_last >= {self.average_last}")
        _check(not (self.overwrite and self.resume), "overwrite", "starts a fresh run; it cannot go with resume")
        _check(not self.data.is_multilingual or self.tokenizer.joint, "tokenizer.joint",
               f"a multilingual run ({', '.join(self.data.pairs())}) needs one joint vocabulary: set it to true")
        if self.tune_alpha is not None:
            _check(len(self.tune_alpha) > 0, "tune_alpha", "needs at least one alpha (or null)")
            _check(self.eval_beam > 1, "tune_alpha", "needs eval_beam > 1: greedy search ignores the length penalty")
        if self.finetune.lora_r:
            _check(bool(self.init_from), "finetune.lora_r", "adapts a trained model: give init_from (a model directory)")


def _check(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise NmtError(f"config key {key!r}: {what}")


def check_config(cfg: TrainConfig) -> None:
    """Check every section again (ranges, then the rules between keys): a config built in Python may have been
    changed after construction (`cfg.optim.lr = -1`), which its `__post_init__` never saw."""
    for section in (cfg.data, cfg.tokenizer, cfg.model, cfg.optim, cfg.finetune, cfg):
        section.__post_init__()


# --- YAML files and command-line overrides -----------------------------------------------------------------------
# YAML is read by PyYAML's SafeLoader (no tags that build objects, no `!!python`) with YAML 1.2's core schema for
# plain scalars instead of PyYAML's YAML 1.1 one: `0777` is the int 777 (octal is `0o777`), `1:30` is the string
# "1:30" (no base 60), `no`, `yes`, `on` and `off` are strings (only true and false are booleans), `1e-3` is a
# float, a date is a string. A key given twice in one mapping is an error (YAML keeps the last silently), and so is
# an integer of more than MAX_DIGITS digits (Python refuses to convert over 4,300; no key takes a tenth of that).

CORE_SCHEMA = (  # (tag, pattern, the characters a match starts with): YAML 1.2's core schema, tried in this order
    ("tag:yaml.org,2002:bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("tag:yaml.org,2002:int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", "-+0123456789"),
    ("tag:yaml.org,2002:float", r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)"
                                r"|\.(nan|NaN|NAN)", "-+.0123456789"),
)
YAML_1_1_ONLY = {f"tag:yaml.org,2002:{name}" for name in ("bool", "int", "float", "timestamp", "value")}
MAX_DIGITS = 100


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """A TrainConfig from a YAML file (optional; its path keys expanded, `expand_file_paths`) and `key.sub=value`
    overrides, applied in order, whose values are taken as they are given (the shell has expanded them)."""
    data = read_yaml(path) if path else {}
    if path:
        expand_file_paths(TrainConfig, data, str(path))
    for item in overrides or []:
        key, value = parse_override(item)
        set_path(data, key, value)
    return from_dict(TrainConfig, data)


def read_yaml(path: str | Path) -> dict:
    """The mapping a YAML file holds, as written (no path expanded)."""
    import yaml  # here, not at the top: `nmt --help` and `nmt info` read no YAML

    path = Path(path)
    if not path.is_file():
        raise NmtError(f"config file not found: {path}")
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"))
    except _DuplicateKey as e:
        raise NmtError(f"{path}:{e.line}: key {e.key!r} is given twice in one section (first on line {e.first}); "
                       "YAML would keep only the last silently: delete one") from None
    except _LongNumber as e:
        raise NmtError(f"{path}:{e.line}: {e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise NmtError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise NmtError(f"{path}: the top level must be a mapping of config keys")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """`model.d_model=256` -> ("model.d_model", 256); the value is read as YAML (numbers, lists, null)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise NmtError(f"override {item[:80]!r}: write it as key=value, e.g. model.d_model=256")
    import yaml

    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except _DuplicateKey as e:
        raise NmtError(f"override {item!r}: key {e.key!r} is given twice; delete one") from None
    except _LongNumber as e:
        raise NmtError(f"override {key.strip().lstrip('-')!r}: {e}") from None
    except yaml.YAMLError:
        value = raw
    return key.strip().lstrip("-"), value


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, line: int):
        super().__init__(key)
        self.key, self.first, self.line = key, first, line


class _LongNumber(Exception):
    def __init__(self, digits: int, line: int):
        super().__init__(f"a number of {digits:,} digits, more than any config key allows (at most {MAX_DIGITS}); "
                         "give a value in the key's allowed range (nmt train --help lists them)")
        self.line = line


def _load_yaml(text: str) -> Any:
    """`yaml.safe_load` with YAML 1.2 core-schema scalars, except that a key given twice in one mapping raises
    `_DuplicateKey` (PyYAML keeps the last one without a word, so a second `lr:` further down would silently win)
    and an integer of more than MAX_DIGITS digits raises `_LongNumber`."""
    import yaml

    return yaml.load(text, Loader=_yaml_classes()[0])


@functools.cache
def _yaml_classes() -> tuple[type, type]:
    """(the loader, the dumper): SafeLoader and SafeDumper with YAML 1.2 core-schema resolvers of their own."""
    import yaml

    kept = {first: [(tag, rx) for tag, rx in pairs if tag not in YAML_1_1_ONLY]
            for first, pairs in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    class UniqueKeyLoader(yaml.SafeLoader):
        yaml_implicit_resolvers = {first: pairs for first, pairs in kept.items() if pairs}

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                lines: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: later keys may override it
                        continue
                    key, line = self.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
                    try:
                        if key in lines:
                            raise _DuplicateKey(key, lines[key], line)
                        lines[key] = line
                    except TypeError:  # an unhashable key: the base class names that error
                        continue
            return super().construct_mapping(node, deep)

    for tag, pattern, first in CORE_SCHEMA:
        UniqueKeyLoader.add_implicit_resolver(tag, re.compile(rf"(?:{pattern})\Z"), list(first))  # PyYAML: re.match
    UniqueKeyLoader.add_constructor("tag:yaml.org,2002:bool", _core_bool)
    UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _core_int)
    UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _core_float)

    class CoreDumper(yaml.SafeDumper):
        """Quotes a string that either schema would read as something else ("no" for YAML 1.1, "1e3" for 1.2), so
        what nmt writes reads back the same with either."""

        def resolve(self, kind, value, implicit):
            tag = super().resolve(kind, value, implicit)
            if kind is yaml.ScalarNode and implicit[0] and tag == "tag:yaml.org,2002:str":
                return next((t for t, pattern, _ in CORE_SCHEMA if re.fullmatch(pattern, value)), tag)
            return tag

    return UniqueKeyLoader, CoreDumper


def _core_scalar(loader: Any, node: Any, kind: str) -> str:
    text = loader.construct_scalar(node)
    pattern = next(p for t, p, _ in CORE_SCHEMA if t.endswith(kind))
    if not re.fullmatch(pattern, text):
        import yaml

        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not a YAML 1.2 {kind}", node.start_mark)
    return text


def _core_bool(loader: Any, node: Any) -> bool:
    return _core_scalar(loader, node, "bool").lower() == "true"


def _core_int(loader: Any, node: Any) -> int:
    text = _core_scalar(loader, node, "int")
    if len(text.lstrip("+-")) > MAX_DIGITS:
        raise _LongNumber(len(text.lstrip("+-")), node.start_mark.line + 1)
    return int(text[2:], 8) if text.startswith("0o") else int(text[2:], 16) if text.startswith("0x") else int(text, 10)


def _core_float(loader: Any, node: Any) -> float:
    text = _core_scalar(loader, node, "float")
    return float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))


def set_path(data: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = data
    for name in parents:
        child = node.setdefault(name, {})
        if not isinstance(child, dict):
            raise NmtError(f"override {dotted!r}: {name!r} is not a section")
        node = child
    node[last] = value


def save_yaml(cfg: Any, path: str | Path) -> None:
    """`cfg` as a YAML file that `load_config` reads back as it was (each `$` of a path doubled, `escape_paths`)."""
    import yaml

    data = to_dict(cfg)
    if dataclasses.is_dataclass(cfg):
        escape_paths(type(cfg), data)
    Path(path).write_text(yaml.dump(data, Dumper=_yaml_classes()[1], sort_keys=False), encoding="utf-8")


# --- Dataclasses from plain data and back, strictly ------------------------------------------------------------------
# Dataclasses from plain data and back, strictly: unknown keys and wrong types raise `NmtError` naming the key
# (`from_dict`); `to_dict` gives the plain nested dict for YAML and JSON. Knows no config class.

def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from a dict, rejecting unknown keys and wrong types by name. A class with a static
    `renamed_keys(data, where) -> data` maps its older key names first."""
    if not isinstance(data, dict):
        raise NmtError(f"config key {where or '<root>'!r}: expected a mapping, got {type(data).__name__}")
    data = dict(data)
    if hasattr(cls, "renamed_keys"):  # a class's older key names (ModelConfig: preset)
        data = cls.renamed_keys(data, where)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise NmtError(f"unknown config key {path!r}; valid keys here: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        for member in members[:-1]:  # str | list[str]: the first that takes the value
            try:
                return _coerce(member, value, path)
            except NmtError:
                continue
        return _coerce(members[-1], value, path)
    if origin is Literal:
        if value not in args:
            raise NmtError(f"config key {path!r}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise NmtError(f"config key {path!r}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
        if origin is tuple and len(args) > 1 and args[1] is not Ellipsis and len(items) != len(args):
            raise NmtError(f"config key {path!r}: expected {len(args)} values, got {len(items)}")
        return tuple(items) if origin is tuple else items
    return _scalar(tp, value, path)


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value) if abs(value) < 2**1023 else math.inf if value > 0 else -math.inf  # refused by its range
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise NmtError(f"config key {path!r}: expected {tp.__name__}, got {value!r} ({type(value).__name__})")
    return value


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (lists for tuples) suitable for YAML/JSON."""
    return _plain(cfg)


def flat(d: dict, prefix: str = "") -> dict:
    """A nested dict as one level of dotted keys: {"optim": {"lr": 1}} -> {"optim.lr": 1}."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(getattr(value, "name", value))  # an object given from Python (a tracker in log_with): its name


# --- The configuration reference -------------------------------------------------------------------------------------
# The configuration reference, from the config dataclasses' field comments: the table of
# docs/configuration.md (`reference_markdown`) and `nmt train --help` (`reference_text`).

def config_fields(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, Any, str, str]]:
    """(dotted key, type, default, comment, allowed) for every field: the configuration reference.
    `allowed` is a numeric key's interval or a path key's kind (`ranged`, `path_key`), else empty."""
    import inspect

    comments = _field_comments(inspect.getsource(cls))
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            rows += config_fields(hints[f.name], key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((key, _type_name(hints[f.name]), default, comments.get(f.name, ""), allowed_text(f)))
    return rows


def _field_comments(source: str) -> dict[str, str]:
    out = {}
    for line in source.splitlines():
        name, colon, rest = line.strip().partition(":")
        if colon and name.isidentifier() and "#" in rest:
            out[name] = rest.split("#", 1)[1].strip()
    return out


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def reference_markdown() -> str:
    """The table of docs/configuration.md, generated from the field comments of the config dataclasses."""
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, tp, default, doc, allowed in config_fields():
        shown = "null" if default is None else json_default(default)
        allowed = f"`{allowed}`" if allowed[:1] in "[(" and allowed else allowed
        lines.append(f"| `{key}` | {tp.replace('|', 'or')} | `{shown}` | {allowed} | {doc.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def reference_text() -> str:
    """The same reference as `reference_markdown`, for a terminal (`nmt train --help`): keys grouped by section,
    each with its type, default and allowed values, then its meaning on the next line."""
    groups: dict[str, list[str]] = {}
    for key, tp, default, doc, allowed in config_fields():
        section = key.split(".")[0] if "." in key else "training"
        shown = "null" if default is None else json_default(default)
        groups.setdefault(section, []).append(f"  --{key} {tp} = {shown}{f'  (allowed: {allowed})' if allowed else ''}\n"
                                              f"        {doc}")
    out = ["config keys: override any as --KEY VALUE or KEY=VALUE; docs/configuration.md has the same table"]
    for section, lines in groups.items():
        out += ["", f"{section}:", *lines]
    return "\n".join(out) + "\n"


def json_default(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"


def table_in(page: str) -> str:
    """The generated table as a page holds it, between its START and END markers."""
    return page[page.index(START) + len(START): page.index(END)]


def main(argv: list[str] | None = None) -> None:
    """Rewrite the table between the markers of the page named on the command line (atomically)."""
    path = Path((argv if argv is not None else sys.argv[1:])[0])
    page = path.read_text(encoding="utf-8")
    new = page.replace(START + table_in(page) + END, START + reference_markdown() + END)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":  # through the module nmt.config: the table names its classes, not __main__'s copies
    import importlib

    importlib.import_module("nmt.config").main()
