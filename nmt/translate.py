"""Translating and scoring text with trained model directories: token-budget batches, output in input order.

`Translator.from_pretrained(d).translate([...])` is the Python entry; `translate_stream` keeps
memory flat on inputs of any size by working through them a chunk at a time.
`Translator.from_pretrained([d1, d2])` is an ensemble (`nmt.decoding`): one vocabulary, log-probabilities
averaged per step. `Translator.from_ctranslate2(d)` decodes a model exported by `nmt export` with CTranslate2
instead (same methods, except `attention` and `score`, which need the PyTorch model).

Sampling is one keyword: `translate(texts, sampling=SamplingConfig(topk=10, temperature=1.0, seed=0))`
draws each translation instead of searching for it (`sampling=None`, the default: beam search with
`beam_size`; nbest > 1 gives that many samples per sentence). `translate_stream(lines, sampling=...)` alike.
"""

from __future__ import annotations

import codecs
import logging
import os
import select
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nmt.checkpoint import read_languages
from nmt.decoding import (
    SEEDS,
    Ensemble,
    SamplingConfig,
    Score,
    SearchConfig,
    beam_search,
    score_encoded,
    search_defaults,
    search_encoded,
)
from nmt.errors import NmtError
from nmt.kernels import use_cpu_kernels
from nmt.model import Seq2SeqTransformer
from nmt.tokenizer import PairTokenizer

if TYPE_CHECKING:
    from nmt.export import CT2Model

log = logging.getLogger(__name__)


class Translator:
    """A trained model and its tokenizer, ready to translate sentences."""

    def __init__(self, model: Seq2SeqTransformer | Ensemble | CT2Model, tokenizer: PairTokenizer,
                 device: str | torch.device = "cpu",
                 search_defaults: dict | None = None, languages: dict | None = None):
        self.model = model.to(device).eval() if isinstance(model, torch.nn.Module) else model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.search_defaults = search_defaults or {}  # SearchConfig fields used unless a call gives them
        self.languages = languages  # the model directory's languages.json (nmt.checkpoint), None where it has none

    @property
    def target_languages(self) -> list[str]:
        """The languages this model translates into, as its languages.json names them (empty: it does not say)."""
        return list((self.languages or {}).get("target_languages", []))

    def source_tag(self, tgt_lang: str | None) -> int | None:
        """The id of the target-language tag that starts every source of a multilingual model (None for a model of
        one pair). NmtError for a target language the model was not trained for, or none where it needs one."""
        tags, targets = (self.languages or {}).get("tags") or {}, self.target_languages
        if tgt_lang is not None and targets and tgt_lang not in targets:
            raise NmtError(f"target language {tgt_lang!r} is not one this model translates into; choose one of "
                           f"{', '.join(targets)}")
        if tgt_lang is not None and not targets:
            raise NmtError(f"target language {tgt_lang!r}: this is not a multilingual model (no languages.json); it "
                           "translates into one language: leave --tgt-lang (tgt_lang) out")
        if not tags:
            return None
        if tgt_lang is None:
            if len(tags) > 1:
                raise NmtError(f"this model translates into {len(tags)} languages: give the target language "
                               f"(--tgt-lang, tgt_lang=), one of {', '.join(targets)}")
            tgt_lang = targets[0]
        tag_id = self.tokenizer.src.token_to_id(tags[tgt_lang])
        if tag_id is None:
            raise NmtError(f"the tokenizer has no token {tags[tgt_lang]!r} that languages.json names for {tgt_lang!r}")
        return tag_id

    @property
    def backend(self) -> str:
        """"torch" (nmt's own search) or "ctranslate2"."""
        return "torch" if isinstance(self.model, torch.nn.Module) else "ctranslate2"

    @classmethod
    def from_pretrained(cls, directory: str | Path | list[str | Path], device: str | torch.device = "cpu") -> Translator:
        """Load config.json, model.safetensors and tokenizer.json from a model directory; from a list of
        them, an ensemble (same tokenizer required; search defaults from the first)."""
        if isinstance(directory, (list, tuple)):
            return cls._ensemble([Path(d) for d in directory], device)
        directory = Path(directory)
        model = use_cpu_kernels(Seq2SeqTransformer.from_pretrained(directory), packed_linears=True)  # fixed weights
        tokenizer = PairTokenizer.load(directory)
        tokenizer.check_fits(model.cfg.src_vocab_size, model.cfg.tgt_vocab_size, directory)
        return cls(model, tokenizer, device, search_defaults(directory), read_languages(directory))

    @classmethod
    def _ensemble(cls, directories: list[Path], device) -> Translator:
        if not directories:
            raise NmtError("give at least one model directory")
        if len(directories) == 1:
            return cls.from_pretrained(directories[0], device)
        members = [cls.from_pretrained(d) for d in directories]
        first = _tokenizer_text(members[0].tokenizer)
        for d, m in zip(directories[1:], members[1:]):
            if _tokenizer_text(m.tokenizer) != first:
                raise NmtError(f"{d}: its tokenizer differs from {directories[0]}'s; an ensemble needs models "
                               "trained with one tokenizer (nmt average combines checkpoints of one run instead)")
        model = Ensemble([m.model for m in members])
        return cls(model, members[0].tokenizer, device, members[0].search_defaults, members[0].languages)

    @classmethod
    def from_ctranslate2(cls, directory: str | Path, device: str | torch.device = "cpu", compute_type: str = "default",
                         threads: int = 0) -> Translator:
        """A model exported by `nmt export MODEL_DIR --to ctranslate2 DIR`, decoded by CTranslate2.

        `compute_type` is CTranslate2's ("default": as exported, e.g. int8; "float32", "int8", ...); `threads`
        its intra-op threads (0: its default). Greedy translations equal the PyTorch model's (float32 export).
        """
        from nmt.export import CT2Model

        directory = Path(directory)
        model = CT2Model(directory, device=str(device), compute_type=compute_type, threads=threads)
        tokenizer = PairTokenizer.load(directory)
        tokenizer.check_fits(model.cfg.src_vocab_size, model.cfg.tgt_vocab_size, directory)
        return cls(model, tokenizer, device, search_defaults(directory), read_languages(directory))

    def attention(self, text: str, layer: int = -1, beam_size: int = 4, tgt_lang: str | None = None,
                  **search_kwargs) -> tuple[list[str], list[str], torch.Tensor]:
        """Translate one sentence and return its cross-attention alignment.

        Returns (source subword tokens (S,) ending in </s>, target tokens (T,) ending in </s>, weights (T, S)):
        row t is how the step that produced target token t attended over the source, averaged over the heads
        of decoder layer `layer` (default: the last). Draw it with `nmt.attention.plot_alignment`.
        """
        from nmt.attention import cross_attention

        if self.backend != "torch" or isinstance(self.model, Ensemble):
            raise NmtError("attention pictures need one PyTorch model: use Translator.from_pretrained(MODEL_DIR)")
        limit = self.model.cfg.max_positions
        ids = self._source_ids([text], limit, "truncate", tgt_lang)[0][0]
        search_kwargs = {**self.search_defaults, **search_kwargs}
        search_kwargs["max_new_tokens"] = min(search_kwargs.get("max_new_tokens", limit), limit - 1)
        src_ids = torch.tensor([ids], device=self.device)
        with torch.inference_mode():
            best = beam_search(self.model, src_ids, SearchConfig(beam_size=beam_size, **search_kwargs))[0][0].tokens
            weights = cross_attention(self.model, src_ids, best, layer)
        src_tokens = self.tokenizer.src_tokens(text)
        if len(ids) > len(src_tokens) or ids[0] != self.tokenizer.src.token_to_id(src_tokens[0]):  # a tag leads
            src_tokens = [self.tokenizer.src.id_to_token(ids[0])] + src_tokens
        src_tokens = src_tokens if len(src_tokens) == len(ids) else src_tokens[: len(ids) - 1] + ["</s>"]
        return src_tokens, self.tokenizer.tgt_tokens(best), weights

    def translate(self, texts: list[str], beam_size: int = 4, nbest: int = 1, batch_tokens: int = 4096,
                  long_inputs: str = "truncate", sampling: SamplingConfig | None = None, tgt_lang: str | None = None,
                  **search_kwargs) -> list[str] | list[list[tuple[str, float]]]:
        """Translate sentences; returns one string per sentence, or with nbest > 1 one list of exactly `nbest`
        (translation, score) pairs per sentence, best first, always in input order.

        `sampling` (a `SamplingConfig`) draws translations instead of beam search (nbest: samples per
        sentence); `search_kwargs` are `SearchConfig` fields (alpha, max_len_a, ...).
        A blank sentence (or one of which the tokenizer keeps nothing) is not given to the model: its
        translation is "" (n-best: `nbest` times ("", 0.0)). A source longer than the model's max_positions is
        truncated (`long_inputs="truncate"`) or cut into pieces translated one after the other (`"split"`),
        with a warning either way; a split sentence's k-th hypothesis joins its pieces' k-th, scored by the
        sum of their scores. When the search finds fewer than `nbest` distinct hypotheses (a one-token length
        limit, a vocabulary smaller than the beam), the last one found repeats.
        """
        if long_inputs not in ("truncate", "split"):
            raise NmtError(f"long_inputs must be 'truncate' or 'split', got {long_inputs!r}")
        texts = list(texts)
        limit = self.model.cfg.max_positions
        search_kwargs = {**self.search_defaults, **search_kwargs}
        search_kwargs["max_new_tokens"] = min(search_kwargs.get("max_new_tokens", limit), limit - 1)
        beams = beam_size if sampling is None else max(beam_size, nbest)  # nbest samples need no beams
        search = SearchConfig(beam_size=beams, nbest=nbest, **search_kwargs)
        pieces, owner = self._pieces(texts, limit, long_inputs, tgt_lang)
        found: dict = {}
        if pieces and self.backend == "torch":
            with torch.inference_mode():
                found = search_encoded(self.model, pieces, search, batch_tokens, device=self.device, sampling=sampling)
        elif pieces:
            found = self.model.search(pieces, search, batch_tokens, sampling)
        hyps = [_exactly(found[j], nbest) for j in range(len(pieces))]  # (pieces, nbest)
        flat = self.tokenizer.decode_tgt([h.tokens for hs in hyps for h in hs]) if pieces else []
        decoded = [[(flat[j * nbest + k], hyps[j][k].score) for k in range(nbest)] for j in range(len(pieces))]
        joined = _join_pieces(decoded, owner, len(texts), nbest)
        return [hs[0][0] for hs in joined] if nbest == 1 else joined

    def _pieces(self, texts: list[str], limit: int, long_inputs: str,
                tgt_lang: str | None = None) -> tuple[list[list[int]], list[int]]:
        """The model inputs (source ids fitted to `limit`) and the sentence each belongs to; a blank sentence, or
        one the tokenizer keeps nothing of, has none: the model would only make something up for it."""
        pieces, owner = [], []
        least = 2 if self.source_tag(tgt_lang) is None else 3  # more than </s> (and the tag)
        for i, (text, fitted) in enumerate(zip(texts, self._source_ids(texts, limit, long_inputs, tgt_lang))):
            if text.strip() and len(fitted[0]) >= least:
                for piece in fitted:
                    pieces.append(piece)
                    owner.append(i)
        return pieces, owner

    def _source_ids(self, texts: list[str], limit: int, how: str, tgt_lang: str | None) -> list[list[list[int]]]:
        """Each text's source ids fitted to `limit` (`fit_length`: one piece, or several when split), each piece
        after the target-language tag of a multilingual model (`source_tag`)."""
        tag = self.source_tag(tgt_lang)
        encoded = self.tokenizer.encode_src(texts)
        if tag is None:
            return [fit_length(ids, limit, how) for ids in encoded]
        return [[[tag, *piece] for piece in fit_length(ids, limit - 1, how)] for ids in encoded]

    def score(self, sources: list[str], targets: list[str], batch_tokens: int = 4096,
              tgt_lang: str | None = None) -> list[Score]:
        """The log-probability (nats) of each target given its source, per token with </s>, in input order.

        Both sides are tokenized as in training; a source over max_positions is truncated (with a warning), a
        target over it is an error naming the line (1-based)."""
        if self.backend != "torch":
            raise NmtError("scoring needs the PyTorch model: use Translator.from_pretrained(MODEL_DIR)")
        if len(sources) != len(targets):
            raise NmtError(f"{len(sources)} sources but {len(targets)} targets: give one target per source")
        limit = self.model.cfg.max_positions
        src_ids = [fitted[0] for fitted in self._source_ids(list(sources), limit, "truncate", tgt_lang)]
        tgt_ids = self.tokenizer.encode_tgt(list(targets))
        for n, ids in enumerate(tgt_ids, 1):
            if len(ids) + 1 > limit:
                raise NmtError(f"target line {n} has {len(ids) + 1} subwords with </s>, more than model.max_positions="
                               f"{limit}: it cannot be scored")
        with torch.inference_mode():
            return score_encoded(self.model, src_ids, tgt_ids, batch_tokens, self.device)

    def translate_stream(self, lines: Iterable[str], chunk_size: int = 2000, failed: list[int] | None = None,
                         **kwargs) -> Iterator[str]:
        """Translate an iterable of lines of any length, yielding outputs in input order.

        Memory stays flat (one chunk at a time). If a chunk fails (out of memory, say), its lines are
        retried one by one; a line that still fails gives an empty output line and a warning, and its
        number (from 1) is appended to `failed`, so the other lines' translations are never lost.
        """
        def chunks() -> Iterator[list[str]]:
            chunk: list[str] = []
            for line in lines:
                chunk.append(line)
                if len(chunk) == chunk_size:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk

        return self.translate_batches(chunks(), failed, **kwargs)

    def translate_batches(self, batches: Iterable[list[str]], failed: list[int] | None = None,
                          **kwargs) -> Iterator[str]:
        """Like `translate_stream` for lines that come in groups (e.g. what has arrived on a pipe): each
        group is translated as soon as it comes, and its outputs are yielded before the next is read."""
        start = 1
        for chunk in batches:
            chunk = [line.rstrip("\r\n") for line in chunk]
            yield from self._flat(self._translate_safely(chunk, start, _seeded_from(kwargs, start), failed))
            start += len(chunk)

    def _translate_safely(self, chunk: list[str], first_line: int, kwargs: dict, failed: list[int] | None) -> list:
        try:
            return self.translate(chunk, **kwargs)
        except NmtError:
            raise  # a bad setting (beam_size 0, ...) fails every line alike: say so once, not per line
        except Exception as e:  # noqa: BLE001 - any failure of a batch must not lose the other lines
            if len(chunk) == 1:
                return [self._failed_line(first_line, e, kwargs, failed)]
            log.warning("a batch of %d lines failed (%s); translating them one by one", len(chunk), e)
        out = []
        for n, line in enumerate(chunk, first_line):
            try:
                out.extend(self.translate([line], **kwargs))
            except Exception as e:  # noqa: BLE001
                out.append(self._failed_line(n, e, kwargs, failed))
        return out

    @staticmethod
    def _failed_line(n: int, error: Exception, kwargs: dict, failed: list[int] | None):
        log.warning("input line %d could not be translated (%s); writing an empty line", n, error)
        if failed is not None:
            failed.append(n)
        return "" if kwargs.get("nbest", 1) == 1 else []

    @staticmethod
    def _flat(outputs) -> Iterator[str]:
        for out in outputs:
            yield out if isinstance(out, str) else "\t".join(f"{t}\t{s:.4f}" for t, s in out)



def arrived_lines(stream, name: str = "stdin", limit: int = 2000) -> Iterator[list[str]]:
    """The lines of a pipe or terminal in groups as they arrive: waits for the first complete line, then takes
    the lines already waiting too (up to `limit`), so a pipe fed all at once still gets batches and memory stays
    flat however fast it is fed."""
    fd, decoder, pending, eof, line_no = stream.fileno(), codecs.getincrementaldecoder("utf-8")(), "", False, 0
    while not eof or pending:
        ready = True
        while ready and not eof and pending.count("\n") < limit:  # one blocking read, then what is already there
            data = os.read(fd, 1 << 16)
            eof = not data
            try:
                pending += decoder.decode(data, final=eof)
            except UnicodeDecodeError as e:
                bad = line_no + pending.count("\n") + data[: e.start].count(b"\n") + 1
                raise NmtError(f"{name}:{bad}: not valid UTF-8 ({e.reason}); convert it, e.g. iconv -f latin1 -t utf-8") \
                    from None
            ready = bool(select.select([fd], [], [], 0)[0])
        lines = pending.split("\n", limit)  # at most `limit` complete lines, then the rest
        pending = lines.pop()
        if eof and pending and "\n" not in pending:  # the last line, without a line end
            lines.append(pending)
            pending = ""
        line_no += len(lines)
        if lines:
            yield lines


def fit_length(ids: list[int], limit: int, how: str) -> list[list[int]]:
    """A source of at most `limit` ids as is; a longer one truncated or split into pieces (each ending in </s>)."""
    if len(ids) <= limit:
        return [ids]
    body, eos = ids[:-1], ids[-1:]
    if how == "split":
        log.warning("a source sentence of %d subwords is longer than model.max_positions=%d: translating it "
                    "in %d pieces", len(ids), limit, -(-len(body) // (limit - 1)))
        return [body[i: i + limit - 1] + eos for i in range(0, len(body), limit - 1)]
    if how != "truncate":
        raise NmtError(f"long_inputs must be 'truncate' or 'split', got {how!r}")
    log.warning("a source sentence of %d subwords was truncated to model.max_positions=%d", len(ids), limit)
    return [body[: limit - 1] + eos]


def _tokenizer_text(tokenizer: PairTokenizer) -> tuple[str, str]:
    return tokenizer.src.to_str(), tokenizer.tgt.to_str()


def _exactly(hyps: list, n: int) -> list:
    """`n` hypotheses: the search's best n, the last one repeated when it found fewer."""
    return (hyps + hyps[-1:] * (n - len(hyps)))[:n]


def _join_pieces(decoded: list[list[tuple[str, float]]], owner: list[int], n: int,
                 nbest: int) -> list[list[tuple[str, float]]]:
    """Each piece's `nbest` (text, score) -> each of the `n` sentences' `nbest`: a sentence's k-th joins its
    pieces' k-th (pieces in order) with the sum of their scores; a sentence without pieces gets ("", 0.0)."""
    out: list[list[list[tuple[str, float]]]] = [[] for _ in range(n)]
    for hyps, i in zip(decoded, owner):
        out[i].append(hyps)
    return [[(" ".join(p[k][0] for p in parts), sum((p[k][1] for p in parts), 0.0)) for k in range(nbest)]
            for parts in out]


def _seeded_from(kwargs: dict, first_line: int) -> dict:
    """A chunk's keywords with sampling seeded from its first line: one translate() call draws batch k with seed
    + k (fewer batches than lines), so the chunk starting at line n takes seed + n - 1 and no two chunks of a
    stream share random streams, while a stream of one chunk draws exactly as translate() does."""
    sampling = kwargs.get("sampling")
    if sampling is None or sampling.seed is None or first_line == 1:
        return kwargs
    return {**kwargs, "sampling": replace(sampling, seed=(sampling.seed + first_line - 1) % SEEDS)}
