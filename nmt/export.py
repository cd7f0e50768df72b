"""CTranslate2 export of a trained model, and decoding with the exported model.

The one home of the optional `ctranslate2` package (`pip install ctranslate2`, or the `ct2` extra).
`export_ctranslate2(model_dir, out)` writes a CTranslate2 model directory: CT2's own `model.bin`,
`config.json` and vocabulary files, plus nmt's tokenizer and `nmt_ctranslate2.json` (the nmt model
config), so `Translator.from_ctranslate2(out)` needs nothing else. Source token lists given to CT2
directly must end in "</s>", as `PairTokenizer.src_tokens` returns them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from nmt.batching import eval_batches, pad
from nmt.checkpoint import LANGUAGES_FILE, SEARCH_FILE
from nmt.config import ModelConfig, from_dict, to_dict
from nmt.decoding import Hypothesis, SamplingConfig, SearchConfig, length_limits
from nmt.errors import NmtError
from nmt.tokenizer import UNK, PairTokenizer

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
        (cfg.n_encoder_layers, cfg.n_decoder_layers), cfg.n_heads, pre_norm=cfg.pre_norm, activation=act)
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
    meta = {"model": to_dict(model.cfg), "quantization": quantization or "float32", **(extra_meta or {})}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    return out_dir


def export_ctranslate2(model_dir: str | Path, out_dir: str | Path, quantization: str | None = None,
                       force: bool = False) -> Path:
    """`nmt export MODEL_DIR --to ctranslate2 OUT`: the model, its tokenizer and its config into OUT, written as a
    sibling temporary directory and renamed into place (a failed export leaves OUT as it was). An existing non-empty
    OUT is replaced only with `force`, and never when it is (or holds) MODEL_DIR."""
    from nmt.checkpoint import write_directory
    from nmt.model import Seq2SeqTransformer
    from nmt.textfiles import refuse_output_dir

    require_ctranslate2()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    refuse_output_dir(out_dir, [model_dir], force, "OUT")
    model = Seq2SeqTransformer.from_pretrained(model_dir).eval()
    tokenizer = PairTokenizer.load(model_dir)
    tokenizer.check_fits(model.cfg.src_vocab_size, model.cfg.tgt_vocab_size, model_dir)
    def write(partial: Path) -> None:
        save_ctranslate2(model, vocabulary(tokenizer, "src"), vocabulary(tokenizer, "tgt"), partial, quantization,
                         {"exported_from": str(model_dir.resolve())})
        tokenizer.save(partial)
        for name in (SEARCH_FILE, LANGUAGES_FILE):  # the tuned alpha stays the default; the target languages
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, partial / name)

    return write_directory(out_dir, write)


class CT2Model:
    """An exported model loaded by CTranslate2, searched like nmt's own: ids in, `Hypothesis` lists out."""

    def __init__(self, directory: str | Path, device: str = "cpu", compute_type: str = "default", threads: int = 0):
        ct2 = require_ctranslate2()
        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise NmtError(f"{directory}: no {META_FILE}; make it with nmt export MODEL_DIR --to ctranslate2 {directory}")
        self.cfg = from_dict(ModelConfig, json.loads(meta_path.read_text(encoding="utf-8"))["model"], "model")
        src, tgt = _read_vocabularies(directory)
        self.src_vocab, self.tgt_vocab = src, tgt
        self.tgt_index = {t: i for i, t in enumerate(tgt)}
        dev = torch.device(device)
        try:
            self.translator = ct2.Translator(str(directory), device=dev.type, device_index=dev.index or 0,
                                             compute_type=compute_type, intra_threads=threads)
        except (RuntimeError, ValueError) as e:
            raise NmtError(f"{directory}: CTranslate2 cannot load it ({e})") from None

    def search(self, src_ids: list[list[int]], search: SearchConfig, batch_tokens: int,
               sampling: SamplingConfig | None = None) -> dict[int, list[Hypothesis]]:
        """Hypotheses for every input, keyed by position, as `nmt.decoding.search_encoded` returns them.

        Batches are nmt's (length-sorted, a token budget); each is decoded with the longest length limit of
        its sentences. Greedy output equals nmt's; beam scores are CTranslate2's, logprob / length ** alpha
        (nmt's are GNMT's, logprob / ((5 + length) / 6) ** alpha), so n-best orders can differ. `sampling` draws
        with CTranslate2's own sampler (same options; its draws differ from nmt's, and seeding it with
        `ctranslate2.set_random_seed` did not make two runs equal in our tests).
        """
        cfg, out = self.cfg, {}
        options = {} if sampling is None else self._sampling_options(sampling, search)
        never = [[self.tgt_vocab[cfg.pad_id]], [self.tgt_vocab[cfg.bos_id]]]
        for batch in eval_batches([len(s) for s in src_ids], batch_tokens, 0, 1):
            rows = batch.tolist()
            tokens = [[self.src_vocab[i] for i in src_ids[r]] for r in rows]
            # nmt's limit counts the final </s> (forced at the limit); CT2's max_decoding_length does not
            limit = int(length_limits(pad([src_ids[r] for r in rows]), cfg.pad_id, search).max())
            results = self.translator.translate_batch(
                tokens, **{"beam_size": search.beam_size, "num_hypotheses": search.nbest, **options},
                length_penalty=search.alpha, max_decoding_length=max(limit - 1, 1), return_scores=True,
                return_end_token=True, suppress_sequences=never)
            for r, res in zip(rows, results):
                out[r] = [self._hypothesis(h, s) for h, s in zip(res.hypotheses, res.scores)]
        return out

    @staticmethod
    def _sampling_options(sampling: SamplingConfig, search: SearchConfig) -> dict:
        if sampling.seed is not None:
            require_ctranslate2().set_random_seed(sampling.seed)
        greedy = sampling.temperature == 0 or sampling.topk == 1
        return {"beam_size": 1, "num_hypotheses": 1 if greedy else search.nbest, "sampling_topp": sampling.topp,
                "sampling_topk": 1 if greedy else sampling.topk, "sampling_temperature": max(sampling.temperature, 1e-6)}

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
