"""CTranslate2: a trained model exported as a CTranslate2 model directory, and decoding with it (the runtime
`Translator.from_ctranslate2` searches through). The one home of the optional `ctranslate2` package
(`pip install ctranslate2`, or the `ct2` extra).

`export_ctranslate2(model_dir, out)` writes CT2's own `model.bin`, `config.json` and vocabulary files, plus nmt's
tokenizer and `nmt_ctranslate2.json` (the nmt model config), so `Translator.from_ctranslate2(out)` needs nothing
else. `CT2Model` is the exported model searched like nmt's own: ids in, `Hypothesis` lists out. Source token lists
given to CT2 directly must end in "</s>", as `PairTokenizer.src_tokens` returns them.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import torch

from nmt.batching import eval_batches, pad
from nmt.checkpoint import LANGUAGES_FILE, SEARCH_FILE, check_output_dir, write_directory
from nmt.config import ModelConfig, from_dict, to_dict
from nmt.decoding import Cancelled, Hypothesis, SamplingConfig, SearchConfig, length_limits
from nmt.engines import ATTENTION, GLOSSARY, SCORE, TARGET_CHOICE
from nmt.errors import NmtError
from nmt.loading import open_model
from nmt.tokenizer import UNK, PairTokenizer

log = logging.getLogger(__name__)

META_FILE = "nmt_ctranslate2.json"
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")
INSTALL_HINT = "pip install ctranslate2 (or pip install 'nmt[ct2]')"


def require_ctranslate2():
    """The `ctranslate2` module, or an NmtError saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise NmtError(f"the CTranslate2 backend needs the ctranslate2 package: {INSTALL_HINT}") from None
    return ctranslate2


def vocabulary(tokenizer: PairTokenizer, side: str) -> list[str]:
    """Token strings of one side, indexed by id (<pad> <unk> <s> </s> first)."""
    tok, size = (tokenizer.src, tokenizer.src_vocab_size) if side == "src" else (tokenizer.tgt, tokenizer.tgt_vocab_size)
    tokens = [tok.id_to_token(i) for i in range(size)]
    if None in tokens or len(set(tokens)) != size:
        raise NmtError(f"the {side} vocabulary has missing or repeated tokens; CTranslate2 needs one string per id")
    return tokens


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().contiguous().numpy()


def _linear(spec, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = _np(weight)
    if bias is not None:
        spec.bias = _np(bias)


def _norm(spec, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _np(norm.weight), _np(norm.bias)


def _attention(spec, attn, norm: torch.nn.LayerNorm) -> None:
    """Our fused layouts are CT2's: self-attention linear[0] = [q; k; v]; cross-attention linear[0] = q,
    linear[1] = [k; v]; the last linear is the output projection. Heads are contiguous slices in both."""
    if attn.cross:
        _linear(spec.linear[0], attn.q.weight, attn.q.bias)
        _linear(spec.linear[1], attn.kv.weight, attn.kv.effective_bias())
    else:
        _linear(spec.linear[0], attn.qkv.weight, attn.qkv.effective_bias())
    _linear(spec.linear[-1], attn.out.weight, attn.out.bias)
    _norm(spec.layer_norm, norm)


def _ffn(spec, ff, norm: torch.nn.LayerNorm) -> None:
    _linear(spec.linear_0, ff.up.weight, ff.up.bias)
    _linear(spec.linear_1, ff.down.weight, ff.down.bias)
    _norm(spec.layer_norm, norm)


def build_spec(model, src_vocab: list[str], tgt_vocab: list[str]):
    """A validated `ctranslate2.specs.TransformerSpec` holding `model`'s weights (float32, unquantized).

    Pre-norm and post-norm both map: CT2 applies each sublayer's LayerNorm before (pre_norm) or after
    the residual sum, and a pre-norm stack ends in a final LayerNorm, as ours does. Positions are our
    own interleaved sin/cos table (CT2's built-in table concatenates sin and cos, so it is set explicitly).
    """
    require_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    cfg: ModelConfig = model.cfg
    act = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[cfg.activation]  # exact erf GELU
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=cfg.pre_norm, activation=act,
        alignment_layer=-1, alignment_heads=cfg.n_heads)  # return_attention: the last layer's heads averaged
    positions = _np(model.positions)  # (max_positions, D)
    enc, dec = spec.encoder, spec.decoder
    enc.scale_embeddings = dec.scale_embeddings = True  # x * sqrt(D) + position
    enc.embeddings[0].weight, dec.embeddings.weight = _np(model.src_embed.weight), _np(model.tgt_embed.weight)
    enc.position_encodings.encodings = dec.position_encodings.encodings = positions
    dec.projection.weight = _np(model.tgt_embed.weight)  # tied output projection, no bias
    if cfg.pre_norm:
        _norm(enc.layer_norm, model.enc_norm)
        _norm(dec.layer_norm, model.dec_norm)
    for layer_spec, layer in zip(enc.layer, model.encoder):
        _attention(layer_spec.self_attention, layer.attn, layer.sub_attn.norm)
        _ffn(layer_spec.ffn, layer.ff, layer.sub_ff.norm)
    for layer_spec, layer in zip(dec.layer, model.decoder):
        _attention(layer_spec.self_attention, layer.self_attn, layer.sub_self.norm)
        _attention(layer_spec.attention, layer.cross_attn, layer.sub_cross.norm)
        _ffn(layer_spec.ffn, layer.ff, layer.sub_ff.norm)
    spec.config.layer_norm_epsilon = model.decoder[0].sub_ff.norm.eps
    spec.config.unk_token, spec.config.eos_token = tgt_vocab[UNK], tgt_vocab[cfg.eos_id]
    spec.config.bos_token = spec.config.decoder_start_token = tgt_vocab[cfg.bos_id]
    spec.register_source_vocabulary(list(src_vocab))
    spec.register_target_vocabulary(list(tgt_vocab))
    try:
        spec.validate()
    except ValueError as e:
        raise NmtError(f"CTranslate2 rejected the model ({e})") from None
    return spec


def save_ctranslate2(model, src_vocab: list[str], tgt_vocab: list[str], out_dir: str | Path,
                     quantization: str | None = None, extra_meta: dict | None = None) -> Path:
    """Write `model` (a Seq2SeqTransformer) as a CTranslate2 model directory; returns it.

    `quantization` (e.g. "int8") is applied to the stored weights; None keeps float32.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise NmtError(f"--quantization: {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    spec = build_spec(model, src_vocab, tgt_vocab)
    spec.optimize(quantization=quantization)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))  # model.bin, config.json, shared_ (or source_ + target_) vocabulary.json
    meta = {"model": to_dict(model.cfg), "quantization": quantization or "float32",
            "alignment_heads": model.cfg.n_heads, **(extra_meta or {})}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    return out_dir


def export_ctranslate2(model_dir: str | Path, out_dir: str | Path, quantization: str | None = None,
                       force: bool = False) -> Path:
    """`nmt export MODEL_DIR --to ctranslate2 OUT`: the model, its tokenizer and its config into OUT, written as a
    sibling temporary directory and renamed into place (a failed export leaves OUT as it was). An existing non-empty
    OUT is replaced only with `force`, and never when it is (or holds) MODEL_DIR."""
    require_ctranslate2()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output_dir(out_dir, [model_dir], force, "OUT")
    opened = open_model(model_dir)
    model, tokenizer = opened.model.eval(), opened.tokenizer
    def write(partial: Path) -> None:
        save_ctranslate2(model, vocabulary(tokenizer, "src"), vocabulary(tokenizer, "tgt"), partial, quantization,
                         {"exported_from": str(model_dir.resolve())})
        tokenizer.save(partial)
        for name in (SEARCH_FILE, LANGUAGES_FILE):  # the tuned alpha stays the default; the target languages
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, partial / name)

    return write_directory(out_dir, write)


class CT2Model:
    """An exported model loaded by CTranslate2, searched like nmt's own: ids in, `Hypothesis` lists out (an
    `nmt.engines.Engine`: it searches, samples and places markup; glossaries, scoring given targets, attention
    pictures and a target language chosen per call need nmt's own search)."""

    name = "ctranslate2"

    def __init__(self, directory: str | Path, device: str = "cpu", compute_type: str = "default", threads: int = 0):
        ct2 = require_ctranslate2()
        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise NmtError(f"{directory}: no {META_FILE}; make it with nmt export MODEL_DIR --to ctranslate2 {directory}")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        self.cfg = from_dict(ModelConfig, meta["model"], "model")
        self.alignment_heads = meta.get("alignment_heads", 1)  # exports before they were recorded: CT2's default
        self._alignment_said = False
        src, tgt = _read_vocabularies(directory)
        self.src_vocab, self.tgt_vocab = src, tgt
        self.tgt_index = {t: i for i, t in enumerate(tgt)}
        dev = torch.device(device)
        try:
            self.translator = ct2.Translator(str(directory), device=dev.type, device_index=dev.index or 0,
                                             compute_type=compute_type, intra_threads=threads)
        except (RuntimeError, ValueError) as e:
            raise NmtError(f"{directory}: CTranslate2 cannot load it ({e})") from None

    @staticmethod
    def supports(feature: str) -> bool:
        return feature not in (GLOSSARY, SCORE, ATTENTION, TARGET_CHOICE)

    def search(self, src_ids: list[list[int]], search: SearchConfig, batch_tokens: int,
               sampling: SamplingConfig | None = None, terms=None, joins=None, cancelled=None,
               logprobs: bool = False) -> dict[int, list[Hypothesis]]:
        """Hypotheses for every input, keyed by position, as `nmt.decoding.search_encoded` returns them.

        Batches are nmt's (length-sorted, a token budget); each is decoded with the longest length limit of
        its sentences. Greedy output equals nmt's; beam scores are CTranslate2's, logprob / length ** alpha
        (nmt's are GNMT's, logprob / ((5 + length) / 6) ** alpha), so n-best orders can differ. `sampling` draws
        with CTranslate2's own sampler (same options; its draws differ from nmt's, and seeding it with
        `ctranslate2.set_random_seed` did not make two runs equal in our tests). `cancelled` is asked before the
        search only (it is one call); `logprobs`: CTranslate2's search scores leave out </s>, its forced decoding
        gives them whole (`add_logprobs`).
        """
        if terms is not None:
            raise NmtError("CTranslate2 takes no glossary: give the PyTorch model (MODEL_DIR) for that")
        if cancelled is not None and cancelled():
            raise Cancelled("the search was cancelled: nobody waits for its result")
        cfg, out = self.cfg, {}
        options = {} if sampling is None else self._sampling_options(sampling, search)
        never = [[self.tgt_vocab[cfg.pad_id]], [self.tgt_vocab[cfg.bos_id]]]
        for batch in eval_batches([len(s) for s in src_ids], batch_tokens, 0, 1):
            rows = batch.tolist()
            tokens = [[self.src_vocab[i] for i in src_ids[r]] for r in rows]
            # nmt's limit counts the final </s> (forced at the limit); CT2's max_decoding_length does not
            limit = int(length_limits(pad([src_ids[r] for r in rows], cfg.pad_id), cfg.pad_id, search).max())
            results = self.translator.translate_batch(
                tokens, **{"beam_size": search.beam_size, "num_hypotheses": search.nbest, **options},
                length_penalty=search.alpha, max_decoding_length=max(limit - 1, 1), return_scores=True,
                return_end_token=True, suppress_sequences=never, no_repeat_ngram_size=search.no_repeat_ngram_size)
            for r, res in zip(rows, results):
                out[r] = [self._hypothesis(h, s) for h, s in zip(res.hypotheses, res.scores)]
        if logprobs and out:
            self.add_logprobs(src_ids, out, batch_tokens)
        return out

    def score(self, src_ids: list[list[int]], tgt_ids: list[list[int]], batch_tokens: int):
        raise NmtError("scoring needs the PyTorch model: use Translator.from_pretrained(MODEL_DIR)")

    @staticmethod
    def _sampling_options(sampling: SamplingConfig, search: SearchConfig) -> dict:
        if sampling.seed is not None:
            require_ctranslate2().set_random_seed(sampling.seed)
        greedy = sampling.temperature == 0 or sampling.topk == 1
        return {"beam_size": 1, "num_hypotheses": 1 if greedy else search.nbest, "sampling_topp": sampling.topp,
                "sampling_topk": 1 if greedy else sampling.topk, "sampling_temperature": max(sampling.temperature, 1e-6)}

    def add_logprobs(self, src_ids: list[list[int]], found: dict[int, list[Hypothesis]], batch_tokens: int) -> None:
        """Each hypothesis' `logprob` (in place): the sum of its tokens' log-probabilities, </s> included, by
        CTranslate2's forced decoding of it (one more pass, `score_batch`; a </s> the length limit added counts at
        the model's probability of it)."""
        rows = [(i, h) for i in sorted(found) for h in found[i]]
        results = self.translator.score_batch(
            [[self.src_vocab[t] for t in src_ids[i]] for i, _ in rows],
            [[self.tgt_vocab[t] for t in h.tokens[:-1]] for _, h in rows],  # CTranslate2 adds the </s>
            max_batch_size=batch_tokens, batch_type="tokens")
        for (_, h), result in zip(rows, results):
            h.logprob = float(sum(result.log_probs))

    def cross_attentions(self, src_ids: list[list[int]], tgt_ids: list[list[int]],
                         layer: int = -1) -> list[torch.Tensor]:
        """Per pair, the (T_i, S_i) cross-attention of the last decoder layer, heads averaged, with which the model
        reads target `tgt_ids[i]` (ending in </s>) after source `src_ids[i]`: as `nmt.attention.cross_attentions`
        gives nmt's model, by CTranslate2's decoding forced through the target (`target_prefix`,
        `return_attention`; an export averages every head of the last layer for it, as `alignment_heads` in its
        nmt_ctranslate2.json records; an older export gives the first head's only, said once). The last layer's
        only: the export keeps one alignment layer."""
        if layer not in (-1, self.cfg.n_decoder_layers - 1):
            raise NmtError(f"a CTranslate2 export gives the last decoder layer's attention only, not layer {layer}")
        if self.alignment_heads != self.cfg.n_heads and not self._alignment_said:
            self._alignment_said = True
            log.warning("this CTranslate2 export gives the attention of one head of %d: tags are placed less well "
                        "than by the PyTorch model; export it again (nmt export MODEL_DIR --to ctranslate2 DIR)",
                        self.cfg.n_heads)
        results = self.translator.translate_batch(
            [[self.src_vocab[i] for i in s] for s in src_ids],
            target_prefix=[[self.tgt_vocab[i] for i in t[:-1]] for t in tgt_ids],
            max_decoding_length=max(len(t) for t in tgt_ids), beam_size=1, return_attention=True,
            return_end_token=True)
        return [torch.tensor(r.attention[0][: len(t)]) for r, t in zip(results, tgt_ids)]

    def _hypothesis(self, tokens: list[str], score: float) -> Hypothesis:
        """CT2 tokens -> ids ending in </s> (added when the length limit cut the hypothesis, as nmt does)."""
        ids = [self.tgt_index.get(t, UNK) for t in tokens]
        finished = ids[-1:] == [self.cfg.eos_id]
        return Hypothesis(ids if finished else ids + [self.cfg.eos_id], score, logprob=float("nan"), finished=True)


def _read_vocabularies(directory: Path) -> tuple[list[str], list[str]]:
    def read(name: str) -> list[str]:
        return json.loads((directory / f"{name}_vocabulary.json").read_text(encoding="utf-8"))

    if (directory / "shared_vocabulary.json").is_file():
        shared = read("shared")
        return shared, shared
    try:
        return read("source"), read("target")
    except FileNotFoundError:
        raise NmtError(f"{directory}: no CTranslate2 vocabulary files; is it a CTranslate2 model directory?") from None
