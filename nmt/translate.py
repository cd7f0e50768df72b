"""The translation chapter: translating and scoring text with trained model directories (token-budget batches,
output in input order), with nmt's own search or a CTranslate2 export of the model (`nmt.ct2`).

`Translator.from_pretrained(d).translate([...])` is the Python entry (text in, text out); `translations` gives each
sentence's `Translation` (its score, confidence, n-best list, a guard's doubt); `translate_stream` keeps memory flat on
inputs of any size by working through them a chunk at a time. `Translator.from_pretrained([d1, d2])` is an
ensemble (`nmt.decoding`): one vocabulary, log-probabilities averaged per step. `Translator.from_ctranslate2(d)`
decodes a model exported by `nmt export` with CTranslate2 instead (same methods, except `attention` and `score`,
which need the PyTorch model).

Sampling is one keyword: `translate(texts, sampling=SamplingConfig(topk=10, temperature=1.0, seed=0))` draws each
translation instead of searching for it (`sampling=None`, the default: beam search with `beam_size`;
`translations(texts, nbest=n)` draws n samples per sentence). `translate_stream(lines, sampling=...)` alike.
"""

from __future__ import annotations

import codecs
import logging
import math
import os
import select
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nmt import markup
from nmt.batching import eval_batches
from nmt.checkpoint import (
    read_languages,
    search_defaults,
)
from nmt.compat import bound_onednn_primitive_caches
from nmt.constraints import Glossary
from nmt.ct2 import CT2Model
from nmt.decoding import (
    SEEDS,
    Ensemble,
    SamplingConfig,
    Score,
    SearchConfig,
)
from nmt.engines import ATTENTION, GLOSSARY, SCORE, TARGET_CHOICE, Engine, TorchEngine
from nmt.errors import NmtError
from nmt.guard import Guard, language_of
from nmt.interop import model_directory
from nmt.kernels import use_cpu_kernels
from nmt.language import base
from nmt.loading import open_model
from nmt.model import Seq2SeqTransformer
from nmt.textfiles import without_bom
from nmt.tokenizer import PairTokenizer, as_text

# --- Translating with a model directory ------------------------------------------------------------------------------

log = logging.getLogger(__name__)

# characters of a source kept per model position before tokenising: a subword is a few characters, so the first
# max_positions subwords of a cut sentence are those of the whole one, and long_inputs="split" still translates
# CHARS_PER_POSITION / 4 or so pieces (65,536 characters for max_positions 1024)
CHARS_PER_POSITION = 64


@dataclass(frozen=True)
class Translation:
    """One sentence's translation and what the model thinks of it (`Translator.translations`); callers read the
    fields they need.

    `score` is the search's ranking score (log-probability / length penalty), as n-best lists show it.
    `mean_logprob` is the model's log-probability of the translation (nats) per generated token, </s> included,
    with nothing added for length: comparable across sentences of any length (a </s> forced at the length limit
    counts 0, as the search scores it). `confidence` is its exponential, the geometric mean of the tokens'
    probabilities, 0-1: it ranks a model's translations, the lowest first to a person (docs/serving.md). A blank
    source (nothing given to the model) has the empty translation, mean_logprob 0 and confidence 1. `doubt`: with a
    guard, why the translation is doubtful ("off-target: en", "loop"), "" if it is not. `alternatives`: with
    nbest > 1, the next best hypotheses (nbest - 1 of them, best first; `nbest` is the whole list).
    """

    text: str
    score: float
    mean_logprob: float
    doubt: str = ""
    alternatives: tuple[Translation, ...] = ()

    @property
    def confidence(self) -> float:
        return math.exp(self.mean_logprob)

    @property
    def nbest(self) -> tuple[Translation, ...]:
        """This translation and its alternatives, best first."""
        return (replace(self, alternatives=()), *self.alternatives)

    @classmethod
    def best_of(cls, hypotheses: list[Translation]) -> Translation:
        """The first of `hypotheses` (best first), the others its alternatives."""
        return replace(hypotheses[0], alternatives=tuple(hypotheses[1:]))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype's names


def decoding_device(device: str | torch.device | None = None) -> torch.device:
    """Where to decode: `device` as given ("cpu", "cuda:1"), or where none is (None, "auto"), the GPU when torch
    sees one, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise NmtError(f"--device {device!r} is no device torch knows: cpu, cuda, cuda:1, ... or auto") from None


def decoding_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The precision of the weights and the search (`DTYPES`: fp32, bf16, fp16). On a GPU, fp32 matrix products
    run in TF32 (torch's "high" precision: fp32's range, a 10-bit mantissa, Ampere's tensor cores); fp16 is for
    GPUs (a CPU computes it slowly, without fp16 units: bf16 or fp32 there)."""
    if dtype not in DTYPES:
        raise NmtError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "fp16" and device.type == "cpu":
        raise NmtError("--dtype fp16 is for GPUs; on a CPU decode in bf16 (where it has bf16 units) or fp32")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return DTYPES[dtype]


class Translator:
    """A trained model and its tokenizer, ready to translate sentences."""

    def __init__(self, model: Seq2SeqTransformer | Ensemble | CT2Model, tokenizer: PairTokenizer,
                 device: str | torch.device | None = None,
                 search_defaults: dict | None = None, languages: dict | None = None, dtype: str = "fp32"):
        """`model`: a PyTorch model (or an `Ensemble`), searched by nmt (`TorchEngine`, on `device` in `dtype`), or
        a CTranslate2 export (`CT2Model`), its own engine."""
        self.device = decoding_device(device)
        if isinstance(model, torch.nn.Module):
            model = model.to(self.device, decoding_dtype(dtype, self.device)).eval()
        self.model = model
        self.engine: Engine = TorchEngine(model, self.device) if isinstance(model, torch.nn.Module) else model
        self.tokenizer = tokenizer
        self.search_defaults = search_defaults or {}  # SearchConfig fields used unless a call gives them
        self.languages = languages  # the model directory's languages.json (nmt.checkpoint), None where it has none
        self._cut_said = False  # whether a source cut before tokenising has been reported (`_cut_long`)
        self._aliases_said: set[str] = set()  # the language aliases already reported (`target_language`)
        self.pytorch: Translator | None = None  # beside a CTranslate2 export: its PyTorch model, for glossaries

    @property
    def target_languages(self) -> list[str]:
        """The languages this model translates into, as its languages.json names them (empty: it does not say)."""
        return list((self.languages or {}).get("target_languages", []))

    @property
    def source_languages(self) -> list[str]:
        """The source languages an imported M2M100/NLLB model can be told (`src_lang`); empty for a model that reads
        the languages it was trained on untold."""
        return list((self.languages or {}).get("first_tokens") or {})

    def target_language(self, tgt_lang: str | None) -> str | None:
        """`tgt_lang` as the model names it: an imported M2M100/NLLB model's alias mapped (de -> deu_Latn, said
        once), any other code as it is."""
        code = ((self.languages or {}).get("aliases") or {}).get(tgt_lang, tgt_lang)
        if code != tgt_lang and tgt_lang not in self._aliases_said:
            self._aliases_said.add(tgt_lang)
            log.info("target language %s is %s in this model", tgt_lang, code)
        return code

    def first_token(self, tgt_lang: str | None) -> int | None:
        """The id of the token an imported M2M100/NLLB model's translation into `tgt_lang` starts with (None: the
        model's own forced_bos_id, or none)."""
        firsts = (self.languages or {}).get("first_tokens") or {}
        code = self.target_language(tgt_lang)
        if code not in firsts:
            return None
        token_id = self.tokenizer.tgt.token_to_id(firsts[code])
        if token_id is None:
            raise NmtError(f"the tokenizer has no token {firsts[code]!r} that languages.json names for {code!r}")
        return token_id

    def _search(self, tgt_lang: str | None, **settings) -> SearchConfig:
        """The SearchConfig of one call: `settings`, and the first token `tgt_lang` forces (`first_token`) unless
        they name one."""
        search = SearchConfig(**{"first_token": self.first_token(tgt_lang), **settings})
        token = search.first_token
        if token is not None and not self.engine.supports(TARGET_CHOICE) and token != self.model.cfg.forced_bos_id:
            raise NmtError("choosing an imported M2M100/NLLB model's target language per translation needs the "
                           "PyTorch model (nmt translate MODEL_DIR without --ct2)")
        return search

    def source_tag(self, tgt_lang: str | None) -> int | None:
        """The id of the target-language tag that starts every source of a multilingual model (None for a model of
        one pair). NmtError for a target language the model was not trained for, or none where it needs one."""
        tags, targets = (self.languages or {}).get("tags") or {}, self.target_languages
        tgt_lang = self.target_language(tgt_lang)
        if (tgt_lang is None and (self.languages or {}).get("first_tokens")
                and getattr(self.model.cfg, "forced_bos_id", None) is None):
            raise NmtError(f"this model translates into {len(targets)} languages: give the target language "
                           f"(--tgt-lang, tgt_lang=), one of {', '.join(targets)}")
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
        """The engine's name: "torch" (nmt's own search) or "ctranslate2"."""
        return self.engine.name

    @classmethod
    def from_pretrained(cls, directory: str | Path | list[str | Path], device: str | torch.device | None = None,
                        revision: str | None = None, dtype: str = "fp32") -> Translator:
        """Load config.json, model.safetensors and tokenizer.json from a model directory; from a list of
        them, an ensemble (same tokenizer required; search defaults from the first). A Hub id `ORG/NAME` (at
        `revision`) names the model directory it holds, or its transformers model imported once, as `nmt
        translate ORG/NAME` does (`nmt.interop.model_directory`). `device`: where to decode (None: the GPU when
        there is one, `decoding_device`); `dtype`: the weights' and the search's precision (`decoding_dtype`)."""
        if isinstance(directory, (list, tuple)):
            return cls._ensemble([model_directory(d, revision) for d in directory], device, dtype)
        directory = model_directory(directory, revision)
        bound_onednn_primitive_caches()  # before the first packed linear (nmt.compat)
        opened = open_model(directory)
        model = use_cpu_kernels(opened.model, packed_linears=True)  # fixed weights (fp32 on a CPU only)
        return cls(model, opened.tokenizer, device, opened.search, opened.languages, dtype)

    @classmethod
    def _ensemble(cls, directories: list[Path], device, dtype: str = "fp32") -> Translator:
        if not directories:
            raise NmtError("give at least one model directory")
        if len(directories) == 1:
            return cls.from_pretrained(directories[0], device, dtype=dtype)
        members = [cls.from_pretrained(d, "cpu") for d in directories]  # moved once, together
        for d, m in zip(directories[1:], members[1:]):
            if not m.tokenizer.same_as(members[0].tokenizer):
                raise NmtError(f"{d}: its tokenizer differs from {directories[0]}'s; an ensemble needs models "
                               "trained with one tokenizer (nmt average combines checkpoints of one run instead)")
        model = Ensemble([m.model for m in members])
        return cls(model, members[0].tokenizer, device, members[0].search_defaults, members[0].languages, dtype)

    @classmethod
    def from_ctranslate2(cls, directory: str | Path, device: str | torch.device | None = None,
                         compute_type: str = "default", threads: int = 0) -> Translator:
        """A model exported by `nmt export MODEL_DIR --to ctranslate2 DIR`, decoded by CTranslate2.

        `compute_type` is CTranslate2's ("default": as exported, e.g. int8; "float32", "int8", ...); `threads`
        its intra-op threads (0: its default). Greedy translations equal the PyTorch model's (float32 export).
        """

        directory, device = Path(directory), decoding_device(device)
        model = CT2Model(directory, device=str(device), compute_type=compute_type, threads=threads)
        tokenizer = PairTokenizer.load(directory)
        tokenizer.check_fits(model.cfg.src_vocab_size, model.cfg.tgt_vocab_size, directory)
        return cls(model, tokenizer, device, search_defaults(directory), read_languages(directory))

    def with_pytorch(self, pytorch: Translator) -> Translator:
        """This CTranslate2 translator with `pytorch` (the model it was exported from, `from_pretrained`) to translate
        what CTranslate2 cannot: a call with a glossary. NmtError where their tokenizers differ."""
        if self.engine.supports(GLOSSARY) or not pytorch.engine.supports(GLOSSARY):
            raise NmtError("with_pytorch pairs a CTranslate2 export with a PyTorch model")
        if not pytorch.tokenizer.same_as(self.tokenizer):
            raise NmtError("the CTranslate2 export and the model directory have different tokenizers: give the model "
                           "the export was made from (nmt export MODEL_DIR --to ctranslate2 DIR)")
        self.pytorch = pytorch
        return self

    def attention(self, text: str, layer: int = -1, beam_size: int = 4, tgt_lang: str | None = None,
                  src_lang: str | None = None, **search_kwargs) -> tuple[list[str], list[str], torch.Tensor]:
        """Translate one sentence and return its cross-attention alignment.

        Returns (source subword tokens (S,) ending in </s>, target tokens (T,) ending in </s>, weights (T, S)):
        row t is how the step that produced target token t attended over the source, averaged over the heads
        of decoder layer `layer` (default: the last). Draw it with `nmt.attention.plot_alignment`.
        """
        if not self.engine.supports(ATTENTION):
            raise NmtError("attention pictures need one PyTorch model: use Translator.from_pretrained(MODEL_DIR)")
        limit = self.model.cfg.max_positions
        text = self._cut_long(text, limit)
        ids = self._source_ids([text], limit, "truncate", tgt_lang, src_lang)[0][0]
        search_kwargs = {**self.search_defaults, **search_kwargs}
        search_kwargs["max_new_tokens"] = min(search_kwargs.get("max_new_tokens", limit), limit - 1)
        search = self._search(tgt_lang, beam_size=beam_size, **search_kwargs)
        best = self.engine.search([ids], search, len(ids))[0][0].tokens
        weights = self.engine.cross_attentions([ids], [best], layer)[0]
        src_tokens = self.tokenizer.src_tokens(text)
        if len(ids) > len(src_tokens) or ids[0] != self.tokenizer.src.token_to_id(src_tokens[0]):  # a tag leads
            src_tokens = [self.tokenizer.src.id_to_token(ids[0])] + src_tokens
        src_tokens = src_tokens if len(src_tokens) == len(ids) else src_tokens[: len(ids) - 1] + ["</s>"]
        return src_tokens, self.tokenizer.tgt_tokens(best), weights

    def translate(self, texts: list[str], **options) -> list[str]:
        """Translate sentences: one string per sentence, in input order. `options` are those of `translations` (all
        but nbest), which gives each sentence's n-best list and what the model thinks of it."""
        if "nbest" in options:
            raise NmtError("translate gives one translation per sentence: for n-best lists call "
                           "translations(texts, nbest=N) and read each one's .nbest")
        return [t.text for t in self.translations(texts, confidence=False, **options)]

    def translations(self, texts: list[str], *, nbest: int = 1, confidence: bool = True, beam_size: int = 4,
                     batch_tokens: int = 4096, long_inputs: str = "truncate", sampling: SamplingConfig | None = None,
                     tgt_lang: str | None = None, glossary: Glossary | dict | list | None = None,
                     format: str = "text", cancelled=None, guard: Guard | bool | None = None,
                     src_lang: str | None = None, **search_kwargs) -> list[Translation]:
        """Translate sentences: one `Translation` per sentence, in input order, with its text, the search's score,
        the model's mean log-probability and confidence, why a guard doubts it, and with nbest > 1 its `nbest`
        list (exactly `nbest` hypotheses, best first: when the search finds fewer distinct ones, a one-token
        length limit or a vocabulary smaller than the beam, the last one found repeats).

        Options:
        - `beam_size` (4), `sampling`: a `SamplingConfig` draws translations instead of beam search (nbest: samples
          per sentence; their log-probabilities are the model's own of the drawn tokens, before the temperature);
          any `SearchConfig` field (alpha, max_len_a, ...).
        - `batch_tokens` (4096): source tokens per batch.
        - `long_inputs`: a source is cut to CHARS_PER_POSITION characters per model position before it is
          tokenised (said once); one longer than the model's max_positions subwords is truncated ("truncate", the
          default) or cut into pieces translated one after the other ("split"), with a warning either way; a split
          sentence's k-th hypothesis joins its pieces' k-th, scored by the sum of their scores, its mean
          log-probability over all its pieces' tokens.
        - `tgt_lang`, `src_lang`: the target of a multilingual model; an imported M2M100/NLLB model's source
          language, a code or "auto" (each sentence's told; `source_starts`), None: the one it was imported with.
          Other models read their languages untold.
        - `glossary` (a `Glossary`, a dict or [source, target] pairs): where a sentence holds a source term (whole
          words, case as given), the translation holds its target term, by constrained beam search
          (`nmt.constraints`); a sentence that holds none is translated as without a glossary. A CTranslate2
          translator given its PyTorch model (`with_pytorch`) has that model translate the sentences that hold a
          term (constrained search is nmt's own), CTranslate2 the others.
        - `format="html"` or `"xml"` reads each sentence as markup (`nmt.markup`): its plain text is translated (as
          the same words without tags would be) and its tags are put back around the words the model's
          cross-attention aligns with those they enclosed; the translation is written escaped (nbest 1). A
          sentence may come parsed already (`markup.parse`'s `Marked`: the server parses each once, to price it).
        - `guard` (True or a `nmt.guard.Guard`): each translation checked for another language than the target
          (where the model names its languages) and for loops; a flagged one is searched for again (`nmt.guard`),
          and what stays doubtful says why (`Translation.doubt`; nbest 1, beam search).
        - `cancelled` (a function), asked before every search step: once it returns True, the call raises
          `nmt.decoding.Cancelled` (a server's model call whose clients all gave up stops there; CTranslate2's search
          is one call, asked before it only).

        `confidence=False`: the caller reads no `mean_logprob` or `confidence` (they are NaN): a CTranslate2 export
        skips the forced decoding of each translation that gives them (`CT2Model.add_logprobs`), as `translate` does.

        A blank sentence (or one of which the tokenizer keeps nothing) is not given to the model: its translation
        is "" with score 0 and confidence 1.
        """
        texts = list(texts)
        options = dict(beam_size=beam_size, batch_tokens=batch_tokens, long_inputs=long_inputs, sampling=sampling,
                       tgt_lang=tgt_lang, format=format, cancelled=cancelled, src_lang=src_lang, **search_kwargs)
        if glossary is not None and self.pytorch is not None:
            glossary = glossary if isinstance(glossary, Glossary) else Glossary.from_pairs(glossary)
            held = [i for i, t in enumerate(texts) if format != "text" or glossary.targets_in(t)]
            rest = sorted(set(range(len(texts))) - set(held))
            out: list = [None] * len(texts)
            for rows, translator, extra in ((held, self.pytorch, {"glossary": glossary}), (rest, self, {})):
                done = translator.translations([texts[i] for i in rows], nbest=nbest, confidence=confidence,
                                               guard=guard, **options, **extra) if rows else []
                for i, translation in zip(rows, done):
                    out[i] = translation
            return out
        if markup.check_format(format) != "text":
            return self._marked(texts, nbest, confidence, {**options, "glossary": glossary, "guard": guard})
        if guard:
            return self._guarded(texts, Guard() if guard is True else guard, nbest, confidence,
                                 {**options, "glossary": glossary})
        if long_inputs not in ("truncate", "split"):
            raise NmtError(f"long_inputs must be 'truncate' or 'split', got {long_inputs!r}")
        limit = self.model.cfg.max_positions
        search_kwargs = {**self.search_defaults, **search_kwargs}
        search_kwargs["max_new_tokens"] = min(search_kwargs.get("max_new_tokens", limit), limit - 1)
        beams = beam_size if sampling is None else max(beam_size, nbest)  # nbest samples need no beams
        search = self._search(tgt_lang, beam_size=beams, nbest=nbest, **search_kwargs)
        pieces, owner = self._pieces(texts, limit, long_inputs, tgt_lang, src_lang)
        terms = None
        if glossary is not None:
            if sampling is not None or not self.engine.supports(GLOSSARY):
                raise NmtError("a glossary needs nmt's own beam search: leave out sampling (--sampling), and with "
                               "CTranslate2 (--ct2 DIR) give the PyTorch model too (MODEL_DIR), which translates "
                               "with a glossary")
            terms = self._terms(glossary, texts, pieces, owner, limit)
            room = search_kwargs["max_new_tokens"] - 1  # </s> ends every translation
            for j, wanted in enumerate(terms):
                if sum(map(len, wanted)) > room:
                    raise NmtError(f"sentence {owner[j] + 1}: its glossary target terms are "
                                   f"{sum(map(len, wanted))} tokens, more than the {room} a translation may have "
                                   "(max_new_tokens, the model's max_positions): shorten the terms or leave some out")
        found = self.engine.search(pieces, search, batch_tokens, sampling, terms, None if terms is None else
                                   self._joins(), cancelled, logprobs=confidence) if pieces else {}
        hyps = [_exactly(found[j], nbest) for j in range(len(pieces))]  # (pieces, nbest)
        flat = self.tokenizer.decode_tgt([h.tokens for hs in hyps for h in hs]) if pieces else []
        decoded = [[(flat[j * nbest + k], h.score, h.logprob, len(h.tokens)) for k, h in enumerate(hyps[j])]
                   for j in range(len(pieces))]  # tokens with </s>: Hypothesis.logprob counts its log-probability
        return [Translation.best_of([Translation(t, s, (lp / n if n else 0.0) if confidence else math.nan)
                                    for t, s, lp, n in hs])
                for hs in _join_pieces(decoded, owner, len(texts), nbest)]

    def _guarded(self, texts: list[str], guard: Guard, nbest: int, confidence: bool, kwargs: dict) -> list[Translation]:
        """translations(..., guard=...): the translations, those `nmt.guard` flags searched for again with its
        fallback (a `beam_factor` times wider beam whose n-best list is read best first; no n-gram of
        `no_repeat_ngram_size` tokens twice for a loop), the first candidate that passes taking the place of the first
        translation; each says why it is still doubtful (`Translation.doubt`)."""
        if nbest != 1 or kwargs["sampling"] is not None:
            raise NmtError("guard checks one translation per sentence found by beam search: leave out nbest (--nbest) "
                           "and sampling (--sampling)")
        outputs = self.translations(texts, nbest=1, confidence=confidence, **kwargs)
        target, among = self.guard_languages(kwargs["tgt_lang"]) if guard.languages else (None, [])
        doubts = [guard.doubt(out.text, text, target, among) for out, text in zip(outputs, texts)]
        wide = kwargs["beam_size"] * guard.beam_factor
        for looped in (False, True):
            flagged = [i for i, d in enumerate(doubts) if d and (d == "loop") == looped]
            if not flagged or (wide <= kwargs["beam_size"] and not (looped and guard.no_repeat_ngram_size)):
                continue  # the fallback would search as the first search did
            fallback = {**kwargs, "beam_size": wide}
            if looped and guard.no_repeat_ngram_size:
                fallback["no_repeat_ngram_size"] = guard.no_repeat_ngram_size
            again = self.translations([texts[i] for i in flagged], nbest=wide, confidence=confidence, **fallback)
            for i, found in zip(flagged, again):
                mended = next((c for c in found.nbest
                               if not guard.doubt(c.text, texts[i], target, among)), None)
                if mended is not None:
                    outputs[i], doubts[i] = mended, ""
        if guard.pivot and target is not None and not kwargs.get("glossary"):
            self._pivoted(texts, outputs, doubts, guard, confidence, kwargs, target, among)
        return [replace(out, doubt=d) for out, d in zip(outputs, doubts)]

    def _pivoted(self, texts: list[str], outputs: list[Translation], doubts: list[str], guard: Guard, confidence: bool,
                 kwargs: dict, target: str, among: list[str]) -> None:
        """The translations still off target, through a pivot language where the model has one (`pivot_languages`):
        the source into the pivot, that into the target, each with the call's own search; one that then passes both
        checks takes the place of the first (its score that of the second leg). Changes `outputs` and `doubts`."""
        by_pivot: dict[str, list[int]] = {}
        pairs = (self.languages or {}).get("pairs") or []
        sources = sorted({*among, *(p[: -len(t) - 1] for p in pairs for t in among if p.endswith(f"-{t}"))})
        for i, doubt in enumerate(doubts):
            if doubt.startswith("off-target"):
                pivots = self.pivot_languages(target, language_of(texts[i], sources))
                if pivots:
                    by_pivot.setdefault(pivots[0], []).append(i)
        imported = bool(self.source_languages)  # an M2M100/NLLB import is told the pivot's language for the 2nd leg
        for pivot, rows in by_pivot.items():
            legs = self.translate([texts[i] for i in rows], **{**kwargs, "tgt_lang": pivot})
            seconds = self.translations(legs, nbest=1, confidence=confidence,
                                        **{**kwargs, "src_lang": pivot if imported else None})
            for i, leg, found in zip(rows, legs, seconds):
                if leg.strip() and not guard.doubt(found.text, texts[i], target, among):
                    outputs[i], doubts[i] = found, ""

    def pivot_languages(self, tgt_lang: str | None, source_language: str | None = None) -> list[str]:
        """The languages a translation into `tgt_lang` may go through when the direct one fails, English first: for
        a model nmt trained on several pairs, each target language it was trained to translate into `tgt_lang` and,
        where the source's language is known, from that language (languages.json's pairs); for an imported
        M2M100/NLLB model (trained on every direction), its English. Empty where there is none (one pair, or the
        source already in the only one)."""
        target = self.target_language(tgt_lang) if tgt_lang is not None else None
        if target is None or not self.target_languages:
            return []
        if self.source_languages:
            return [c for c in self.target_languages if base(c) == "en" != base(target)
                    and (source_language is None or base(source_language) != "en")]
        pairs = set((self.languages or {}).get("pairs") or [])
        found = [p for p in self.target_languages if p not in (target, source_language) and f"{p}-{target}" in pairs
                 and (source_language is None or f"{source_language}-{p}" in pairs)]
        return sorted(found, key=lambda p: (base(p) != "en", p))

    def guard_languages(self, tgt_lang: str | None) -> tuple[str | None, list[str]]:
        """(the target's code, the model's languages) for the guard's check, as the model names them (an imported
        NLLB's deu_Latn for the alias de; `nmt.language` tells NLLB codes by their ISO 639-1 code); (None, []) where
        the model does not name its languages (one pair, no languages.json)."""
        codes = self.target_languages
        if not codes:
            return None, []
        target = self.target_language(tgt_lang) if tgt_lang is not None else None
        return (codes[0] if target is None and len(codes) == 1 else target), codes

    def source_starts(self, texts: list[str], src_lang: str | None) -> list[int | None] | None:
        """Per text, the id of the language token an imported M2M100/NLLB model's source is to start with for
        `src_lang`: one of the model's codes or an alias (de for deu_Latn), or "auto", each text's language told by
        `nmt.language` among the model's (where two codes are one language to the identifier, zho_Hans and
        zho_Hant, the first); None (all, or a text too short to tell, said once per call) keeps the import's
        source language. NmtError for a model that takes no source language, or a code it does not have."""
        if src_lang is None:
            return None
        if not self.source_languages:
            raise NmtError(f"source language {src_lang!r}: this model takes no source language (it reads the "
                           "languages it was trained on untold); leave --src-lang (src_lang) out")
        firsts = self.languages["first_tokens"]
        starts = {code: self.tokenizer.src.token_to_id(token) for code, token in firsts.items()}
        if src_lang != "auto":
            from nmt.interop import language_token

            token = language_token(src_lang, firsts, "source language", say=f"src {src_lang}" not in self._aliases_said)
            self._aliases_said.add(f"src {src_lang}")
            return [self.tokenizer.src.token_to_id(token)] * len(texts)
        from nmt.language import TooShort, detect, knows

        among = [code for code in firsts if knows(code)]
        if not among:
            raise NmtError("the language identifier tells none of this model's languages: give the source language "
                           "(--src-lang CODE, src_lang=)")
        found: list[int | None] = []
        short = 0
        for text in texts:
            try:
                found.append(starts[detect(text, among, top=1)[0][0]] if text.strip() else None)
            except TooShort:
                found.append(None)
                short += 1
        if short:
            log.warning("%d of %d sentences are too short to tell their language: read as the import's source "
                        "language (give --src-lang CODE for them)", short, len(found))
        return found

    def check_format(self, format: str, nbest: int = 1) -> None:
        """NmtError where `format` cannot be translated with these settings: markup needs one translation per
        sentence."""
        if markup.check_format(format) == "text":
            return
        if nbest != 1:
            raise NmtError(f"format {format} gives one translation per sentence: leave out nbest (--nbest)")

    def _marked(self, texts: list[str], nbest: int, confidence: bool, kwargs: dict) -> list[Translation]:
        """translations(..., format="html"|"xml"): every sentence's plain text translated in one call, then the tags
        of those that have any placed through batched forced passes over their translations (`_with_tags`)."""
        format = kwargs["format"]
        self.check_format(format, nbest)
        marked = [t if isinstance(t, markup.Marked) else self.parse_markup(t, format, i) for i, t in enumerate(texts)]
        outputs = self.translations([m.text for m in marked], nbest=1, confidence=confidence, **{**kwargs, "format": "text"})
        plain = [out.text for out in outputs]
        tagged = [i for i, m in enumerate(marked) if m.elements]
        placed = dict(zip(tagged, self._with_tags([marked[i] for i in tagged], [plain[i] for i in tagged],
                                                  kwargs["tgt_lang"], kwargs["batch_tokens"], kwargs["src_lang"])))
        result = []
        for i, out in enumerate(outputs):
            text = placed[i] if i in placed else markup.escape(plain[i])
            result.append(replace(out, text=text))
        return result

    def parse_markup(self, text: str, format: str, index: int = 0) -> markup.Marked:
        """`text` as markup (`markup.parse`), cut first as a plain source is (`_cut_long`): of a line of megabytes
        only what the model can read is parsed, the elements still open there closed."""
        if not markup.needs_parsing(text):
            return markup.Marked(text, [])
        head = self._cut_long(text, self.model.cfg.max_positions)
        return markup.parse(head, format, index, cut=len(head) < len(text))

    def _with_tags(self, marked: list[markup.Marked], translations: list[str], tgt_lang: str | None,
                   batch_tokens: int, src_lang: str | None = None) -> list[str]:
        """Each translation of a `marked` text with its tags, placed through the cross-attention (heads averaged,
        last decoder layer; an ensemble's first model) of a teacher-forced pass over the translation as the target
        tokenizer writes it (the search's own tokens spell the same text): length-sorted batches of
        `batch_tokens`, each pass a fraction of what searching for the translations cost (`Engine.cross_attentions`;
        a CTranslate2 export's are the same weights)."""
        if not marked:
            return []
        limit, eos = self.engine.cfg.max_positions, self.engine.cfg.eos_id
        src_ids = [fitted[0] for fitted in
                   self._source_ids([m.text for m in marked], limit, "truncate", tgt_lang, src_lang)]
        specials = bool(self.tokenizer.src_specials)
        src_encodings = self.tokenizer.src.encode_batch([m.text for m in marked], add_special_tokens=specials)
        tgt_encodings = self.tokenizer.tgt.encode_batch(list(translations))  # as encode_tgt: the template's tokens
        tgt_ids = [[*e.ids, eos][: limit - 1] for e in tgt_encodings]
        weights: list = [None] * len(marked)
        lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]
        for batch in eval_batches(lengths, batch_tokens, 0, 1):
            rows = batch.tolist()
            for r, w in zip(rows, self.engine.cross_attentions([src_ids[r] for r in rows], [tgt_ids[r] for r in rows])):
                weights[r] = w  # (T, S)
        out = []
        for m, translation, s_ids, t_ids, s_enc, t_enc, w in zip(marked, translations, src_ids, tgt_ids,
                                                                  src_encodings, tgt_encodings, weights):
            src_spans = self._spans(s_enc, m.text, s_ids)
            tgt_spans = self._spans(t_enc, translation, t_ids)
            rows = [t for t, span in enumerate(tgt_spans) if span is not None]
            cols = [s for s, span in enumerate(src_spans) if span is not None]
            out.append(markup.insert(m, translation, [src_spans[s] for s in cols], [tgt_spans[t] for t in rows],
                                     w[rows][:, cols]))
        return out

    @staticmethod
    def _spans(encoding, text: str, ids: list[int]) -> list[tuple[int, int] | None]:
        """Per id of `ids` (the model's view of `text`: maybe a leading tag, a final </s>, cut to a length), the
        character range of `text` it stands for, read from the tokenizer's `encoding` of `text`; None for a token
        the text lacks. Where the encoding is not those ids (a typed control token spelled out), the words are
        spread evenly over them."""
        found = [None if special else span for span, special in zip(encoding.offsets, encoding.special_tokens_mask)]
        for lead in (0, 1):  # a multilingual source's tag leads the text's own tokens; </s> (or a cut one) ends them
            mine = len(ids) - 1 - lead
            if mine >= 0 and ids[lead: lead + mine] == encoding.ids[:mine]:
                return ([None] * lead + found[:mine] + [None] * len(ids))[: len(ids)]
        spread = markup.words(text)
        return [spread[i * len(spread) // len(ids)] if spread else None for i in range(len(ids))]

    def _terms(self, glossary, texts: list[str], pieces: list[list[int]], owner: list[int],
               limit: int) -> list[list[list[int]]]:
        """Per piece, the target terms (token ids) of the glossary's source terms that what the model reads holds:
        its sentence, or of a sentence cut into pieces or truncated (a piece of `limit` ids), that piece's text."""
        glossary = glossary if isinstance(glossary, Glossary) else Glossary.from_pairs(glossary)
        split = {i for i, j in zip(owner, owner[1:]) if i == j}
        found = [glossary.targets_in(self.tokenizer.src.decode(piece) if i in split or len(piece) >= limit
                                     else texts[i]) for piece, i in zip(pieces, owner)]
        wanted = sorted({t for ts in found for t in ts})
        ids = dict(zip(wanted, self.term_ids(wanted)))
        return [[ids[t] for t in ts if ids[t]] for ts in found]

    def _joins(self) -> torch.Tensor:
        """(V,) the target tokens that continue the word before them: no word-start mark (▁), a letter or digit
        first. None of them may follow a glossary term, which stays a whole word."""
        if getattr(self, "_joins_cache", None) is None:
            tokens = [self.tokenizer.tgt.id_to_token(i) or "" for i in range(self.model.cfg.tgt_vocab_size)]
            self._joins_cache = torch.tensor([t[:1].isalnum() for t in tokens])
        return self._joins_cache

    def term_ids(self, terms: list[str]) -> list[list[int]]:
        """Target terms as the model's target token ids, as text (a control token written in a term is text);
        NmtError for a term the target vocabulary cannot spell (it would be <unk>)."""
        tgt, controls = self.tokenizer.tgt, self.tokenizer.tgt_controls
        terms = list(terms)
        # a Unigram model (an imported Marian's, NLLB's) segments a typed "</s>" into the piece </s>: as_text spells
        # it out, as the source's and the labels' text is
        encoded = [as_text(tgt, e, controls, t, False)
                   for e, t in zip(tgt.encode_batch(terms, add_special_tokens=False), terms)] if terms else []
        unk, special = tgt.token_to_id("<unk>"), set(tgt.get_added_tokens_decoder())
        for term, ids in zip(terms, encoded):
            if unk is not None and unk in ids:
                raise NmtError(f"glossary target term {term!r} holds characters the model's target vocabulary lacks "
                               "(they would be <unk>): write it with characters the model knows")
            if special.intersection(ids):  # a control the search could never write as the term's text
                raise NmtError(f"glossary target term {term!r} holds a control token of the model ("
                               f"{', '.join(sorted({tgt.id_to_token(i) for i in special.intersection(ids)}))}): "
                               "a term is text the translation holds; leave it out")
        return encoded

    def _pieces(self, texts: list[str], limit: int, long_inputs: str, tgt_lang: str | None = None,
                src_lang: str | None = None) -> tuple[list[list[int]], list[int]]:
        """The model inputs (source ids fitted to `limit`) and the sentence each belongs to; a blank sentence, or
        one the tokenizer keeps nothing of, has none: the model would only make something up for it."""
        pieces, owner = [], []
        least = 2 if self.source_tag(tgt_lang) is None else 3  # more than </s> (and the tag)
        fitted_ids = self._source_ids(texts, limit, long_inputs, tgt_lang, src_lang)
        for i, (text, fitted) in enumerate(zip(texts, fitted_ids)):
            if text.strip() and len(fitted[0]) >= least:
                for piece in fitted:
                    pieces.append(piece)
                    owner.append(i)
        return pieces, owner

    def _source_ids(self, texts: list[str], limit: int, how: str, tgt_lang: str | None,
                    src_lang: str | None = None) -> list[list[list[int]]]:
        """Each text's source ids fitted to `limit` (`fit_length`: one piece, or several when split), each piece
        after the target-language tag of a multilingual model (`source_tag`), an imported M2M100/NLLB model's
        source starting with the language token `src_lang` names (`source_starts`). A text is first cut to
        CHARS_PER_POSITION characters per position (`cut_long`): tokenising a 64 MB line takes a minute, and no
        model reads more than `limit` subwords of it."""
        tag = self.source_tag(tgt_lang)
        # a user's text is text throughout: a tag typed at its start is not the tag (that is inserted by id)
        texts = [self._cut_long(text, limit) for text in texts]
        encoded = self.tokenizer.encode_src(texts, leading_tags=False)
        starts = self.source_starts(texts, src_lang)
        if starts is not None:  # the import's template put its source language token first
            encoded = [[start, *ids[1:]] if start is not None and ids else ids for start, ids in zip(starts, encoded)]
        if tag is None:
            return [fit_length(ids, limit, how) for ids in encoded]
        return [[[tag, *piece] for piece in fit_length(ids, limit - 1, how)] for ids in encoded]

    def score(self, sources: list[str], targets: list[str], batch_tokens: int = 4096,
              tgt_lang: str | None = None) -> list[Score]:
        """The log-probability (nats) of each target given its source, per token with </s>, in input order.

        Both sides are tokenized as in training; a source over max_positions is truncated (with a warning), a
        target over it is an error naming the line (1-based)."""
        if not self.engine.supports(SCORE):
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
        return self.engine.score(src_ids, tgt_ids, batch_tokens)

    def translate_documents(self, documents: list[str], **options) -> list[str]:
        """Documents in, documents out: each document's paragraphs (runs of non-blank lines) split into sentences
        (`nmt.sentences`), all the documents' sentences translated in one call (`translate`'s options), and each
        paragraph written back as one line of its translated sentences, blank lines kept, as `nmt translate
        --paragraphs` writes a file and the server a document."""
        from nmt.sentences import join_documents, split_documents

        if options.get("format", "text") != "text":
            raise NmtError("a document is translated as plain text, one translation a sentence: leave out format")
        layout, sentences = split_documents(documents)
        return join_documents(layout, self.translate(sentences, **options) if sentences else [])

    def translate_stream(self, lines: Iterable[str], chunk_size: int = 2000, failed: list[int] | None = None,
                         first_line: int = 1, nbest: int = 1, scores: bool = False, **options) -> Iterator[str]:
        """Translate an iterable of lines of any length, yielding output lines in input order (`translations`'
        options): a translation; with nbest > 1 text TAB score, repeated; with `scores`, text TAB mean
        log-probability TAB confidence (repeated for n-best), and with a guard TAB why it is doubtful (empty when
        it is not).

        Memory stays flat (one chunk at a time). If a chunk fails (out of memory, say), its lines are
        retried one by one; a line that still fails gives an empty output line and a warning, and its
        number (from `first_line`: the lines of a continued run are numbered as the whole input's) is appended to
        `failed`, so the other lines' translations are never lost.
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

        return self.translate_batches(chunks(), failed, first_line, nbest, scores, **options)

    def translate_batches(self, batches: Iterable[list[str]], failed: list[int] | None = None, first_line: int = 1,
                          nbest: int = 1, scores: bool = False, **options) -> Iterator[str]:
        """Like `translate_stream` for lines that come in groups (e.g. what has arrived on a pipe): each
        group is translated as soon as it comes, and its outputs are yielded before the next is read."""
        start = first_line
        for chunk in batches:
            chunk = [line.rstrip("\r\n") for line in chunk]
            found = self._translate_safely(chunk, start, nbest, scores, _seeded_from(options, start), failed)
            yield from (_line(t, nbest, scores, bool(options.get("guard"))) for t in found)
            start += len(chunk)

    def _translate_safely(self, chunk: list[str], first_line: int, nbest: int, confidence: bool, options: dict,
                          failed: list[int] | None) -> list[Translation | None]:
        """The chunk's translations; None for a line that failed alone (said, and numbered in `failed`)."""
        try:
            return self.translations(chunk, nbest=nbest, confidence=confidence, **options)
        except markup.MarkupError as e:  # its sentence, numbered as the input's lines
            raise NmtError(f"line {first_line + e.index}: {e.reason}") from None
        except NmtError:
            raise  # a bad setting (beam_size 0, ...) fails every line alike: say so once, not per line
        except Exception as e:  # noqa: BLE001 - any failure of a batch must not lose the other lines
            if len(chunk) == 1:
                return [_failed_line(first_line, e, failed)]
            log.warning("a batch of %d lines failed (%s); translating them one by one", len(chunk), e)
        out: list[Translation | None] = []
        for n, line in enumerate(chunk, first_line):
            try:
                out.extend(self.translations([line], nbest=nbest, confidence=confidence, **options))
            except Exception as e:  # noqa: BLE001
                out.append(_failed_line(n, e, failed))
        return out

    def _cut_long(self, text: str, limit: int) -> str:
        """`text` cut to `limit * CHARS_PER_POSITION` characters, said once per Translator on stderr (the log)."""
        most = limit * CHARS_PER_POSITION
        if len(text) <= most:
            return text
        if not self._cut_said:
            log.warning("a source sentence of %d characters was cut to %d (%d per model position, max_positions=%d) "
                        "before tokenising; later cuts are not reported", len(text), most, CHARS_PER_POSITION, limit)
            self._cut_said = True
        return text[:most]


def arrived_lines(stream, name: str = "stdin", limit: int = 2000) -> Iterator[list[str]]:
    """The lines of a pipe or terminal in groups as they arrive: waits for the first complete line, then takes
    the lines already waiting too (up to `limit`), so a pipe fed all at once still gets batches and memory stays
    flat however fast it is fed. Decoded as UTF-8, the BOM dropped from line 1 (`nmt.textfiles.without_bom`); the
    text read is kept in pieces and joined once a line is complete, so a line of any length costs its length."""
    fd, decoder, eof, line_no = stream.fileno(), codecs.getincrementaldecoder("utf-8")(), False, 0
    pieces: list[str] = []  # what has been read since the last line given out
    newlines = 0  # line ends in `pieces`
    while not eof or pieces:
        ready = True
        while ready and not eof and newlines < limit:  # one blocking read, then what is already there
            data = os.read(fd, 1 << 16)
            eof = not data
            try:
                text = decoder.decode(data, final=eof)
            except UnicodeDecodeError as e:
                bad = line_no + newlines + data[: e.start].count(b"\n") + 1
                raise NmtError(f"{name}:{bad}: not valid UTF-8 ({e.reason}); convert it, e.g. iconv -f latin1 -t utf-8") \
                    from None
            pieces.append(text)
            newlines += text.count("\n")
            ready = bool(select.select([fd], [], [], 0)[0])
        if not newlines and not eof:
            continue  # the line goes on: read more before joining anything
        lines = without_bom("".join(pieces), line_no + 1).split("\n", limit)  # at most `limit` whole lines, the rest
        pending = lines.pop()
        if eof and pending and "\n" not in pending:  # the last line, without a line end
            lines.append(pending)
            pending = ""
        pieces, newlines = ([pending], pending.count("\n")) if pending else ([], 0)
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


def _exactly(hyps: list, n: int) -> list:
    """`n` hypotheses: the search's best n, the last one repeated when it found fewer."""
    return (hyps + hyps[-1:] * (n - len(hyps)))[:n]


def _join_pieces(decoded: list[list[tuple]], owner: list[int], n: int, nbest: int) -> list[list[tuple]]:
    """Each piece's `nbest` (text, score, logprob, tokens) -> each of the `n` sentences' `nbest`: a sentence's
    k-th joins its pieces' k-th (pieces in order) with the sums of their numbers; a sentence without pieces gets
    ("", 0.0, 0.0, 0)."""
    out: list[list[list[tuple]]] = [[] for _ in range(n)]
    for hyps, i in zip(decoded, owner):
        out[i].append(hyps)
    return [[(" ".join(p[k][0] for p in parts), sum((p[k][1] for p in parts), 0.0),
              sum((p[k][2] for p in parts), 0.0), sum(p[k][3] for p in parts)) for k in range(nbest)]
            for parts in out]


def _seeded_from(kwargs: dict, first_line: int) -> dict:
    """A chunk's keywords with sampling seeded from its first line: one translate() call draws batch k with seed
    + k (fewer batches than lines), so the chunk starting at line n takes seed + n - 1 and no two chunks of a
    stream share random streams, while a stream of one chunk draws exactly as translate() does."""
    sampling = kwargs.get("sampling")
    if sampling is None or sampling.seed is None or first_line == 1:
        return kwargs
    return {**kwargs, "sampling": replace(sampling, seed=(sampling.seed + first_line - 1) % SEEDS)}


def _failed_line(n: int, error: Exception, failed: list[int] | None) -> None:
    log.warning("input line %d could not be translated (%s); writing an empty line", n, error)
    if failed is not None:
        failed.append(n)


def _line(found: Translation | None, nbest: int, scores: bool, guarded: bool) -> str:
    """A translation as `translate_stream` writes it; a line that failed is empty."""
    if found is None:
        return ""

    def fields(t: Translation) -> str:
        if scores:
            return f"{t.text}\t{t.mean_logprob:.4f}\t{t.confidence:.4f}" + (f"\t{t.doubt}" if guarded else "")
        return f"{t.text}\t{t.score:.4f}" if nbest > 1 else t.text
    return "\t".join(fields(t) for t in found.nbest)
