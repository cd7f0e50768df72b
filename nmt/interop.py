"""Hugging Face transformers translation models in and out: the one home of `transformers` (`pip install 'nmt[hf]'`).

Import (`nmt import HF_DIR OUT`, `Seq2SeqTransformer.from_hf`) reads a `MarianMTModel` (OPUS-MT) or an
`M2M100ForConditionalGeneration` (M2M100, NLLB) directory into an nmt model directory. The weights map one to
one: nmt's options (`ModelConfig.positions`, `scale_embedding`, `activation`, `final_logits_bias`, `pre_norm`)
say what the architecture does, and token ids are the model's own (pad, end and decoder start included). A
directory to import is untrusted: nmt reads and checks config.json before transformers sees it (a supported
model_type, no auto_map, no quantizer, attention eager or sdpa), transformers is then called with
trust_remote_code=False, use_safetensors=True, attn_implementation="eager" and local_files_only=True, pickled
weights (pytorch_model.bin) are refused with the command that converts them, and the tokenizer is read from its
fixed file names only.

Export (`nmt export --to transformers MODEL_DIR OUT`) writes the architecture the nmt model is exactly:
post-norm -> Marian; pre-norm with final norms -> Pegasus (sinusoids in halves, no offset) or, for positions
"m2m100", M2M100. nmt's own interleaved sin/cos layout is one fixed permutation of the residual-stream dimensions
away from the halves layout; a permutation applied to every weight that reads or writes the residual stream
(embeddings, projections, LayerNorm parameters) leaves the function unchanged, so it is exported through it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch

from nmt.config import ModelConfig
from nmt.errors import NmtError
from nmt.language import ISO639_3

INSTALL_HINT = "pip install 'nmt[hf]' (transformers, sentencepiece and protobuf)"
MARIAN, M2M100, PEGASUS = "marian", "m2m_100", "pegasus"
SUPPORTED = (MARIAN, M2M100, PEGASUS)  # the model types nmt imports (config.json's model_type)
ATTENTION = ("eager", "sdpa")  # transformers' built-in attention; nmt imports with eager
REFUSED_KEYS = ("auto_map", "custom_pipelines", "quantization_config")  # config.json keys naming code or a quantizer
ATTENTION_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal",
                  "experts_implementation", "_experts_implementation", "_experts_implementation_internal")
SHARD = re.compile(r"[\w.-]+\.safetensors")  # a weights shard's file name, in the directory itself
# a multilingual model's language tokens: M2M100's __de__ (the code inside), NLLB's deu_Latn (the code itself)
M2M100_LANG, NLLB_LANG = re.compile(r"__([a-z]{2,3}(?:_[A-Za-z]{2,4})?)__"), re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")
log = logging.getLogger(__name__)


def require_transformers():
    """The `transformers` module, or an NmtError saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise NmtError(f"Hugging Face interop needs the transformers package: {INSTALL_HINT}") from None
    return transformers


# --- import: transformers -> nmt ------------------------------------------------------------------------------


def _hf_config(hf_dir: Path):
    """The transformers config of `hf_dir`, read by nmt first (`_check_hf_config`) and only then by transformers,
    which then runs no code and fetches nothing."""
    transformers = require_transformers()
    _check_hf_config(hf_dir)
    try:
        return transformers.AutoConfig.from_pretrained(str(hf_dir), local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, KeyError) as e:
        raise NmtError(f"{hf_dir}/config.json: transformers cannot read it ({str(e).splitlines()[0]})") from None


def _check_hf_config(hf_dir: Path) -> None:
    """config.json as nmt imports it: a JSON object of a supported model type, naming no code of its own (auto_map),
    no quantizer and no attention or experts implementation but transformers' built-in eager and sdpa (another one
    is a kernel fetched from the Hub)."""
    from nmt.checkpoint import read_json

    path = hf_dir / "config.json"
    if not path.is_file():
        raise NmtError(f"{hf_dir}: no config.json; give a directory written by save_pretrained (a MarianMTModel "
                       "or M2M100ForConditionalGeneration)")
    raw = read_json(path)
    for key in REFUSED_KEYS:
        if key in raw:
            raise NmtError(f"{path}: {key} {str(raw[key])[:80]}: nmt runs no code and loads no quantizer from a model "
                           f"directory, and {', '.join(SUPPORTED)} need neither; remove the key")
    for key in ATTENTION_KEYS:
        if raw.get(key) not in (None, *ATTENTION):
            raise NmtError(f"{path}: {key} {str(raw[key])[:80]!r}: nmt imports with transformers' own attention "
                           f"({' or '.join(ATTENTION)}); remove the key")
    if raw.get("model_type") not in SUPPORTED:
        raise NmtError(f"{hf_dir}: model_type {str(raw.get('model_type'))[:80]!r} is not supported; nmt imports marian "
                       "(OPUS-MT), m2m_100 (M2M100, NLLB) and pegasus (what nmt exports pre-norm models as) models")


def _check_hf_weights(hf_dir: Path) -> None:
    """The weights as safetensors (one model.safetensors, or shards its index names in `hf_dir`): never a pickle."""
    from nmt.checkpoint import read_json

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        shards = set(weight_map.values()) if isinstance(weight_map, dict) else {None}
        bad = [s for s in shards if not (isinstance(s, str) and SHARD.fullmatch(s) and (hf_dir / s).is_file())]
        if bad:
            raise NmtError(f"{index}: shard {str(bad[0])[:80]!r} is not a .safetensors file in {hf_dir}; save the model "
                           "again with save_pretrained")
    elif not (hf_dir / "model.safetensors").is_file():
        pickled = sorted(p.name for p in hf_dir.glob("pytorch_model*.bin"))
        if pickled:
            raise NmtError(f"{hf_dir}: the weights are a pickle ({pickled[0]}), which nmt never reads (loading one can "
                           "run code); convert them where you trust the file: transformers.AutoModelForSeq2SeqLM."
                           "from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True)")
        raise NmtError(f"{hf_dir}: no model.safetensors; give a directory written by save_pretrained")


def _same(config, a: str, b: str) -> int:
    if getattr(config, a) != getattr(config, b):
        raise NmtError(f"config.json: {a}={getattr(config, a)} but {b}={getattr(config, b)}; nmt's encoder and "
                       "decoder share this size")
    return getattr(config, a)


def model_config_from_hf(config) -> ModelConfig:
    """The nmt ModelConfig that computes what a transformers Marian, M2M100 or Pegasus config describes."""
    act = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}.get(config.activation_function)
    if act is None:
        raise NmtError(f"config.json: activation_function {config.activation_function!r} has no nmt equivalent "
                       "(relu, gelu, swish/silu)")
    marian = config.model_type == MARIAN
    vocab = config.vocab_size
    tgt_vocab = getattr(config, "decoder_vocab_size", None) or vocab if marian else vocab
    shared = not marian or getattr(config, "share_encoder_decoder_embeddings", True)
    return ModelConfig(
        src_vocab_size=vocab, tgt_vocab_size=tgt_vocab, size="auto", d_model=config.d_model,
        n_heads=_same(config, "encoder_attention_heads", "decoder_attention_heads"),
        n_encoder_layers=config.encoder_layers, n_decoder_layers=config.decoder_layers,
        d_ff=_same(config, "encoder_ffn_dim", "decoder_ffn_dim"), dropout=float(config.dropout),
        attention_dropout=float(config.attention_dropout), activation_dropout=float(config.activation_dropout),
        activation=act,
        pre_norm=not marian, share_embeddings=shared and tgt_vocab == vocab,
        scale_embedding=bool(config.scale_embedding), positions="m2m100" if config.model_type == M2M100 else "halves",
        final_logits_bias=config.model_type != M2M100, max_positions=config.max_position_embeddings,
        pad_id=config.pad_token_id, bos_id=config.decoder_start_token_id, eos_id=config.eos_token_id)


def model_from_hf(hf_dir: str | Path):
    """A `Seq2SeqTransformer` computing exactly what the transformers model in `hf_dir` computes (its logits for
    the same ids), in float32."""
    from nmt.model import Seq2SeqTransformer

    hf_dir = Path(hf_dir)
    config = _hf_config(hf_dir)
    _check_hf_weights(hf_dir)
    transformers = require_transformers()
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(
        str(hf_dir), config=config, local_files_only=True, trust_remote_code=False, use_safetensors=True,
        attn_implementation="eager", dtype=torch.float32).eval()
    cfg = model_config_from_hf(config)
    inner = hf.get_encoder(), hf.get_decoder()
    enc, dec = inner
    if not torch.equal(hf.get_output_embeddings().weight, dec.embed_tokens.weight):
        raise NmtError(f"{hf_dir}: the output projection is not the decoder's embedding (tie_word_embeddings false); "
                       "nmt ties them")
    model = Seq2SeqTransformer(cfg)
    state = {"tgt_embed.weight": dec.embed_tokens.weight, "src_embed.weight": enc.embed_tokens.weight}
    if cfg.final_logits_bias:
        state["final_logits_bias"] = hf.final_logits_bias.reshape(-1)
    if cfg.pre_norm:
        state |= _norm("enc_norm", enc.layer_norm) | _norm("dec_norm", dec.layer_norm)
    for i, layer in enumerate(enc.layers):
        p = f"encoder.{i}."
        state |= _self_attention(p + "attn", layer.self_attn) | _norm(p + "sub_attn.norm", layer.self_attn_layer_norm)
        state |= _ffn(p, layer) | _norm(p + "sub_ff.norm", layer.final_layer_norm)
    for i, layer in enumerate(dec.layers):
        p = f"decoder.{i}."
        state |= _self_attention(p + "self_attn", layer.self_attn) | _norm(p + "sub_self.norm", layer.self_attn_layer_norm)
        a = layer.encoder_attn
        state |= {p + "cross_attn.q.weight": a.q_proj.weight, p + "cross_attn.q.bias": a.q_proj.bias,
                  p + "cross_attn.kv.weight": torch.cat([a.k_proj.weight, a.v_proj.weight]),
                  p + "cross_attn.kv.bias": torch.cat([torch.zeros_like(a.k_proj.bias), a.v_proj.bias]),
                  p + "cross_attn.out.weight": a.out_proj.weight, p + "cross_attn.out.bias": a.out_proj.bias}
        state |= _norm(p + "sub_cross.norm", layer.encoder_attn_layer_norm)
        state |= _ffn(p, layer) | _norm(p + "sub_ff.norm", layer.final_layer_norm)
    if model.src_embed is model.tgt_embed:
        if not torch.equal(state["src_embed.weight"], state["tgt_embed.weight"]):
            raise NmtError(f"{hf_dir}: the encoder and decoder embeddings differ although the vocabulary is shared")
    model.load_state_dict({k: v.detach().float().clone() for k, v in state.items()})
    return model.eval()


def _norm(name: str, norm) -> dict:
    if abs(norm.eps - 1e-5) > 1e-12:
        raise NmtError(f"a LayerNorm with epsilon {norm.eps}; nmt's use 1e-5")
    return {name + ".weight": norm.weight, name + ".bias": norm.bias}


def _self_attention(name: str, a) -> dict:
    """q, k, v projections fused as nmt's qkv. The key bias adds one constant to all of a query's scores, which
    the softmax cancels; nmt keeps it at zero."""
    return {name + ".qkv.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            name + ".qkv.bias": torch.cat([a.q_proj.bias, torch.zeros_like(a.k_proj.bias), a.v_proj.bias]),
            name + ".out.weight": a.out_proj.weight, name + ".out.bias": a.out_proj.bias}


def _ffn(prefix: str, layer) -> dict:
    return {prefix + "ff.up.weight": layer.fc1.weight, prefix + "ff.up.bias": layer.fc1.bias,
            prefix + "ff.down.weight": layer.fc2.weight, prefix + "ff.down.bias": layer.fc2.bias}


def tokenizer_from_hf(hf_dir: str | Path, config=None, src_lang: str | None = None, tgt_lang: str | None = None):
    """The `PairTokenizer` giving the ids the transformers tokenizer of `hf_dir` gives.

    A tokenizer.json is used as it is (a final-</s> template dropped: nmt appends </s> itself); Marian's
    SentencePiece models (source.spm, target.spm) are converted by transformers' converter with the ids of the
    joint vocab.json, one tokenizer per side. With `src_lang`/`tgt_lang` (M2M100, NLLB) the source starts with
    its language token and the target with its own, as transformers' tokenizer does with src_lang/tgt_lang.
    Only these fixed names are read: no file a tokenizer_config.json names, and no tokenizer code.
    """
    from nmt.tokenizer import PairTokenizer, read_tokenizer, with_template

    hf_dir = Path(hf_dir)
    config = config or _hf_config(hf_dir)
    if (hf_dir / "tokenizer.json").is_file():
        src = with_template(read_tokenizer(hf_dir / "tokenizer.json"), None, [])
        src.no_truncation()
        src.no_padding()
        tgt = None
    elif (hf_dir / "source.spm").is_file() and (hf_dir / "vocab.json").is_file():
        vocab = _read_json(hf_dir / "vocab.json")
        if (hf_dir / "target_vocab.json").is_file():
            raise NmtError(f"{hf_dir}: separate source and target vocabularies (target_vocab.json) are not supported; "
                           "nmt imports Marian models with one vocab.json")
        src, tgt = (_spm_tokenizer(hf_dir / f"{side}.spm", vocab) for side in ("source", "target"))
    else:
        raise NmtError(f"{hf_dir}: no tokenizer.json, nor Marian's source.spm + target.spm + vocab.json; save the "
                       "model's tokenizer there (tokenizer.save_pretrained), as a fast tokenizer where it has one")
    if config.model_type == M2M100:
        languages = model_languages(src, hf_dir)
        if not src_lang:
            raise NmtError(f"{hf_dir} is a multilingual M2M100/NLLB model: import it with its source language, nmt "
                           f"import {hf_dir} OUT --src-lang CODE (--tgt-lang CODE too, to fine-tune into one "
                           f"language); its languages: {', '.join(languages)}")
        src_token = language_token(src_lang, languages, "--src-lang")
        tgt = src  # without --tgt-lang: a target language per translation (the forced first token), no template
        if tgt_lang:
            tgt_token = language_token(tgt_lang, languages, "--tgt-lang")
            tgt = with_template(src, f"{tgt_token} $A", [tgt_token])
        src = with_template(src, f"{src_token} $A </s>", [src_token, "</s>"])
    elif src_lang or tgt_lang:
        raise NmtError(f"{hf_dir}: --src-lang/--tgt-lang are for multilingual M2M100/NLLB models; a Marian model "
                       "translates one language pair")
    return PairTokenizer(src, tgt)


def model_languages(tokenizer, where: Path) -> dict[str, str]:
    """A multilingual model's languages as its tokenizer's added tokens name them: code -> language token (`de` ->
    `__de__` of M2M100, `deu_Latn` -> `deu_Latn` of NLLB), each code checked by config's one rule (`check_lang_code`)."""
    from nmt.config import check_lang_code

    found = {}
    for token in sorted(t.content for t in tokenizer.get_added_tokens_decoder().values()):
        m = M2M100_LANG.fullmatch(token)
        code = m[1] if m else token if NLLB_LANG.fullmatch(token) else None
        if code is not None:
            found[check_lang_code(code, f"{where}: language token {token!r}")] = token
    if not found:
        raise NmtError(f"{where}: the tokenizer has no language tokens (M2M100's __en__, NLLB's eng_Latn); nmt "
                       "imports a multilingual model with them")
    return found


def language_aliases(languages: dict[str, str]) -> dict[str, str]:
    """The other names a user may give a model's language codes: its token (`__de__`), the ISO 639-1 code of an
    NLLB code (`de` for `deu_Latn`) and its ISO 639-3 part (`deu`), where exactly one of the model's codes has it."""
    by_iso3: dict[str, list[str]] = {}
    for code in languages:
        by_iso3.setdefault(code.split("_")[0], []).append(code)
    aliases = {token: code for code, token in languages.items() if token != code}
    for iso1, iso3 in ISO639_3.items():
        if len(by_iso3.get(iso3, ())) == 1 and iso1 not in languages:
            aliases[iso1] = by_iso3[iso3][0]
    aliases |= {iso3: codes[0] for iso3, codes in by_iso3.items() if len(codes) == 1 and iso3 not in languages}
    return aliases


def language_token(given: str, languages: dict[str, str], flag: str, say: bool = True) -> str:
    """The language token the code `given` names in a model of `languages` (code -> token, `model_languages`):
    the code itself, its token, or an alias (`language_aliases`: de -> deu_Latn), the mapping said when it is
    one; another code is an NmtError listing the model's codes."""
    from nmt.config import check_lang_code

    check_lang_code(given, flag)
    code = given if given in languages else language_aliases(languages).get(given)
    if code is None:
        near = [c for c in languages if c.split("_")[0] == ISO639_3.get(given, given)]
        hint = f" ({given} could be {' or '.join(near)}: give one)" if near else ""
        raise NmtError(f"{flag} {given!r} is not a language of this model{hint}; its languages: "
                       f"{', '.join(languages)}")
    if say and given != languages[code]:
        log.info("%s %s is %s in this model", flag, given, languages[code])
    return languages[code]


def _read_json(path: Path) -> dict:
    from nmt.checkpoint import read_json

    return read_json(path)


def _spm_tokenizer(path: Path, vocab: dict[str, int]):
    """One side of a Marian tokenizer: the SentencePiece model's segmentation (its pieces and scores), with the ids
    of the joint vocab.json (see `_foreign` for the pieces of the other side's model)."""
    from nmt.tokenizer import stripping_decoder

    try:
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf
        proto = import_protobuf().ModelProto()
    except ImportError:
        raise NmtError(f"reading {path.name} needs sentencepiece and protobuf: {INSTALL_HINT}") from None
    except Exception as e:  # noqa: BLE001 - protobuf's VersionError: a runtime older than sentencepiece's generated code
        raise NmtError(f"reading {path.name}: protobuf cannot load sentencepiece's model format ({e}); upgrade "
                       "protobuf (pip install -U protobuf)") from None
    proto.ParseFromString(path.read_bytes())
    if proto.trainer_spec.model_type != 1:  # sentencepiece's ModelType.UNIGRAM
        raise NmtError(f"{path}: not a unigram SentencePiece model; nmt imports Marian's unigram models")
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise NmtError(f"{path.parent / 'vocab.json'}: ids are not 0..{len(ids) - 1}")
    unk = proto.trainer_spec.unk_piece
    if unk not in vocab:
        raise NmtError(f"{path.parent / 'vocab.json'}: no {unk!r} (the unknown piece of {path.name}); transformers "
                       "needs it too: add it to vocab.json")
    # MarianTokenizer looks each piece the SentencePiece model gives up in vocab.json, and a piece missing there
    # (its control piece <s>, a character only ever seen inside longer pieces) is <unk>: here such a piece is not
    # in the segmenter, whose unknown piece is vocab.json's <unk>.
    proto.trainer_spec.unk_id = vocab[unk]
    scores = {p.piece: p.score for p in proto.pieces if p.piece in vocab}
    lowest = min(p.score for p in proto.pieces)
    pieces = sorted(vocab, key=vocab.get)
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, [(p, scores.get(p, _foreign(p, lowest))) for p in pieces])
    tok.add_special_tokens([t for t in ("</s>", "<unk>", "<pad>") if t in vocab])
    tok.decoder = stripping_decoder()  # as MarianTokenizer strips the text it decodes
    return tok


def _foreign(piece: str, lowest: float) -> float:
    """The score of a vocab.json piece that this side's SentencePiece model lacks. SentencePiece gives a character it
    does not know as itself, at its unknown score (the lowest minus 10), and transformers looks that string up in
    vocab.json: a single character scores so here. Longer pieces of the other side never win a segmentation."""
    return lowest - 10.0 if len(piece) == 1 else lowest - 1e6


def _fill_vocabulary(tokenizer, rows: int) -> None:
    """Published M2M100/NLLB checkpoints have more embedding rows than their tokenizer has tokens (the table is
    rounded up); the rows past the last token get placeholder special tokens, so that sizes agree and every id the
    model can emit decodes (to nothing, as transformers skips them)."""
    size = tokenizer.get_vocab_size()
    if size < rows:
        tokenizer.add_special_tokens([f"<unused_{i}>" for i in range(rows - size)])


def import_hf(hf_dir: str | Path, out: str | Path, src_lang: str | None = None, tgt_lang: str | None = None,
              force: bool = False, revision: str | None = None) -> Path:
    """`nmt import HF_DIR OUT`: the model and tokenizer of a transformers directory (or of a Hub id, `ORG/NAME` at
    `revision`, resolved by `nmt.hub.resolve`) as an nmt model directory, written under a temporary name and renamed
    into place (an existing non-empty OUT only with `force`, never HF_DIR)."""
    from nmt.checkpoint import check_output_dir, write_directory
    from nmt.hub import resolve

    hf_dir, out = resolve(hf_dir, revision), Path(out)
    check_output_dir(out, [hf_dir], force, "OUT")
    config = _hf_config(hf_dir)
    tokenizer = tokenizer_from_hf(hf_dir, config, src_lang, tgt_lang)
    model = model_from_hf(hf_dir)
    cfg = model.cfg
    record = None
    if config.model_type == M2M100:  # every language of the model stays a target (`nmt translate --tgt-lang`)
        from nmt.checkpoint import languages_record

        languages = model_languages(tokenizer.src, hf_dir)
        record = languages_record([], list(languages), []) | {"first_tokens": languages,
                                                               "aliases": language_aliases(languages)}
        if tgt_lang:  # the default target, as generate(forced_bos_token_id=...) does
            cfg.forced_bos_id = tokenizer.tgt.token_to_id(language_token(tgt_lang, languages, "--tgt-lang", say=False))
    for name, token in (("pad_id", "<pad>"), ("eos_id", "</s>")):
        if tokenizer.tgt.token_to_id(token) != getattr(cfg, name):
            raise NmtError(f"{hf_dir}: config.json's {name.replace('_id', '_token_id')} is {getattr(cfg, name)} but "
                           f"the tokenizer's {token} is {tokenizer.tgt.token_to_id(token)}")
    for side, rows in (("src", cfg.src_vocab_size), ("tgt", cfg.tgt_vocab_size)):
        _fill_vocabulary(getattr(tokenizer, side), rows)
    tokenizer.check_fits(cfg.src_vocab_size, cfg.tgt_vocab_size, hf_dir)
    def write(partial: Path) -> None:
        from nmt.checkpoint import LANGUAGES_FILE

        model.save_pretrained(partial)
        tokenizer.save(partial)
        if record is not None:
            (partial / LANGUAGES_FILE).write_text(json.dumps(record, indent=2), encoding="utf-8")

    return write_directory(out, write)


def model_directory(name_or_path: str | Path, revision: str | None = None, flag: str = "MODEL_DIR") -> Path:
    """The nmt model directory that `name_or_path` names for the commands that run a model (translate, evaluate,
    score, serve, init_from): a path as it is, a Hub id's snapshot (`nmt.hub.resolve`) when it holds an nmt model
    directory, and when it holds a transformers translation model, its import, made once into `nmt.hub.nmt_cache()`
    under the commit and reused. A local transformers directory is for `nmt import`: nmt keeps no copy of a folder
    that may change, while a Hub snapshot is a commit and does not."""
    from nmt.hub import nmt_cache, resolve

    directory = resolve(name_or_path, revision)
    if not _is_transformers_dir(directory):
        return directory
    if directory == Path(name_or_path):
        raise NmtError(f"{flag} {directory} is a transformers model directory; make an nmt model directory of it "
                       f"first: nmt import {directory} OUT, then give OUT")
    repo_id, commit = str(name_or_path), directory.name
    out = nmt_cache() / repo_id.replace("/", "--") / commit
    source = _fingerprint(directory)
    if (out / "config.json").is_file():
        record = out / IMPORT_RECORD
        if record.is_file() and _read_json(record) == {"source": source, "import": _fingerprint(out)}:
            return out
        # keyed by id and commit only, an import must still be of these files: another cache's snapshot under the
        # same commit, or an import changed by hand, is not used as found
        log.warning("nmt: %s is not the import of the snapshot %s of %s as it is now (changed since, or imported "
                    "from other files): importing it again", out, directory, repo_id)
        shutil.rmtree(out, ignore_errors=True)
    if _read_json(directory / "config.json").get("model_type") == M2M100:
        raise NmtError(f"{repo_id} is a multilingual M2M100/NLLB model: import it with its source language, nmt "
                       f"import {repo_id} OUT --src-lang CODE, then give OUT")
    log.info("importing %s (commit %s) into %s", repo_id, commit[:12], out)
    try:
        import_hf(directory, out)
    except NmtError:
        if (out / "config.json").is_file():  # another process (a rank of the same launch) imported it meanwhile
            return out
        raise
    from nmt.textfiles import atomic_file

    record = json.dumps({"source": source, "import": _fingerprint(out)}, indent=2)
    with atomic_file(out / IMPORT_RECORD) as f:  # what it was made from, and of: compared at each use
        f.write(record)
    return out


IMPORT_RECORD = "imported_from.json"  # in an import of nmt's cache: the sha256 of its source's files and its own


def _fingerprint(directory: Path) -> dict[str, str]:
    """The sha256 of each file in `directory` (links followed), by name; the import record itself left out."""
    import hashlib

    out = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name != IMPORT_RECORD):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        out[path.name] = digest.hexdigest()
    return out


def _is_transformers_dir(directory: Path) -> bool:
    """Whether `directory` holds a transformers model (its config.json names a model_type) rather than nmt's."""
    try:
        return "model_type" in json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return False


# --- export: nmt -> transformers ------------------------------------------------------------------------------


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers model type computing exactly what `cfg` computes, or an NmtError naming the option."""
    if cfg.positions == "m2m100":
        if not cfg.pre_norm:
            raise NmtError("model.pre_norm is false with positions m2m100: no transformers architecture computes "
                           "that; train with model.pre_norm true")
        return M2M100
    return PEGASUS if cfg.pre_norm else MARIAN


def hf_config(cfg: ModelConfig):
    """The transformers config of `cfg`'s architecture (see `hf_architecture`)."""
    transformers = require_transformers()
    arch = hf_architecture(cfg)
    if not cfg.share_embeddings or cfg.src_vocab_size != cfg.tgt_vocab_size:
        raise NmtError("model.share_embeddings is false: Marian, Pegasus and M2M100 as transformers builds them "
                       "share one embedding; train with a joint tokenizer and model.share_embeddings true")
    act = {"relu": "relu", "gelu": "gelu", "silu": "swish"}[cfg.activation]
    common = dict(vocab_size=cfg.tgt_vocab_size, d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
                  decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads,
                  decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
                  activation_function=act, dropout=cfg.dropout, attention_dropout=cfg.dropout_at("attention"),
                  activation_dropout=cfg.dropout_at("activation"), encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                  max_position_embeddings=cfg.max_positions, scale_embedding=cfg.scale_embedding,
                  pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id, decoder_start_token_id=cfg.bos_id,
                  forced_eos_token_id=None, tie_word_embeddings=True)
    if arch == M2M100:
        return transformers.M2M100Config(bos_token_id=None, **common)
    if arch == PEGASUS:
        return transformers.PegasusConfig(**common)
    return transformers.MarianConfig(share_encoder_decoder_embeddings=True, **common)


def hf_model_from_nmt(model):
    """A transformers model (Marian, Pegasus or M2M100) computing what the nmt `model` computes, in float32.

    nmt's interleaved positions are exported through the permutation of the residual-stream dimensions that puts
    the sines first and the cosines second (dimension j of the export is dimension `perm[j]` of nmt's)."""
    transformers = require_transformers()
    cfg = model.cfg
    config = hf_config(cfg)
    classes = {MARIAN: transformers.MarianMTModel, PEGASUS: transformers.PegasusForConditionalGeneration,
               M2M100: transformers.M2M100ForConditionalGeneration}
    hf = classes[config.model_type](config).eval()
    D = cfg.d_model
    perm = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)]) if cfg.positions == "interleaved" else None
    has_bias = getattr(hf, "final_logits_bias", None) is not None
    bias = getattr(model, "final_logits_bias", None)
    if bias is not None and not has_bias and bool(bias.ne(0).any()):
        raise NmtError("model.final_logits_bias is true (and the bias is not zero): M2M100 has no such bias")

    def rows(t):  # a tensor written to the residual stream: (D, ...) or (D,)
        return t if perm is None else t[perm]

    def cols(t):  # a weight reading the residual stream: (..., D)
        return t if perm is None else t[:, perm]

    def put(param, value) -> None:
        with torch.no_grad():
            param.copy_(value.detach().to(param.dtype))

    def norm(hf_norm, ours) -> None:
        put(hf_norm.weight, rows(ours.weight))
        put(hf_norm.bias, rows(ours.bias))

    def attention(hf_attn, q_w, q_b, k_w, k_b, v_w, v_b, out) -> None:
        for lin, w, b in ((hf_attn.q_proj, q_w, q_b), (hf_attn.k_proj, k_w, k_b), (hf_attn.v_proj, v_w, v_b)):
            put(lin.weight, cols(w))
            put(lin.bias, b)
        put(hf_attn.out_proj.weight, rows(out.weight))
        put(hf_attn.out_proj.bias, rows(out.bias))

    def ffn(hf_layer, ff) -> None:
        put(hf_layer.fc1.weight, cols(ff.up.weight))
        put(hf_layer.fc1.bias, ff.up.bias)
        put(hf_layer.fc2.weight, rows(ff.down.weight))
        put(hf_layer.fc2.bias, rows(ff.down.bias))

    enc, dec = hf.get_encoder(), hf.get_decoder()
    put(hf.get_input_embeddings().weight, cols(model.tgt_embed.weight))
    if has_bias:
        put(hf.final_logits_bias, (bias if bias is not None else torch.zeros(cfg.tgt_vocab_size)).reshape(1, -1))
    for hf_layer, layer in zip(enc.layers, model.encoder):
        qkv_w, qkv_b = layer.attn.qkv.weight.chunk(3), layer.attn.qkv.effective_bias().chunk(3)
        attention(hf_layer.self_attn, qkv_w[0], qkv_b[0], qkv_w[1], qkv_b[1], qkv_w[2], qkv_b[2], layer.attn.out)
        norm(hf_layer.self_attn_layer_norm, layer.sub_attn.norm)
        ffn(hf_layer, layer.ff)
        norm(hf_layer.final_layer_norm, layer.sub_ff.norm)
    for hf_layer, layer in zip(dec.layers, model.decoder):
        a = layer.self_attn
        qkv_w, qkv_b = a.qkv.weight.chunk(3), a.qkv.effective_bias().chunk(3)
        attention(hf_layer.self_attn, qkv_w[0], qkv_b[0], qkv_w[1], qkv_b[1], qkv_w[2], qkv_b[2], a.out)
        norm(hf_layer.self_attn_layer_norm, layer.sub_self.norm)
        c = layer.cross_attn
        kv_w, kv_b = c.kv.weight.chunk(2), c.kv.effective_bias().chunk(2)
        attention(hf_layer.encoder_attn, c.q.weight, c.q.bias, kv_w[0], kv_b[0], kv_w[1], kv_b[1], c.out)
        norm(hf_layer.encoder_attn_layer_norm, layer.sub_cross.norm)
        ffn(hf_layer, layer.ff)
        norm(hf_layer.final_layer_norm, layer.sub_ff.norm)
    if cfg.pre_norm:
        norm(enc.layer_norm, model.enc_norm)
        norm(dec.layer_norm, model.dec_norm)
    hf.tie_weights()
    hf.generation_config = generation_config(cfg)
    return hf


def generation_config(cfg: ModelConfig):
    """What `generate` needs to search as `nmt translate --beam 1` does: nmt's decoder start, never <pad> or <s>,
    the target language first (M2M100), </s> forced at the length limit, and that limit as its largest value
    (nmt's default max_new_tokens, within the position table; `max_length` counts the decoder start). nmt's limit
    also shrinks with the source (max_len_a + max_len_b * source length), which no generation setting expresses:
    a translation that has not ended by then is cut there by nmt and goes on in transformers."""
    from nmt.decoding import SearchConfig

    transformers = require_transformers()
    most = min(SearchConfig().max_new_tokens, cfg.max_positions - 1)
    return transformers.GenerationConfig(
        decoder_start_token_id=cfg.bos_id, pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id,
        forced_bos_token_id=cfg.forced_bos_id, forced_eos_token_id=cfg.eos_id,
        suppress_tokens=sorted({cfg.pad_id, cfg.bos_id} - {cfg.eos_id}), max_length=most + 1, num_beams=1,
        do_sample=False)


def hf_tokenizer_from_nmt(tokenizer, cfg: ModelConfig):
    """A `PreTrainedTokenizerFast` over nmt's joint tokenizer, its source template adding the final </s>."""
    from nmt.tokenizer import with_template

    transformers = require_transformers()
    if not tokenizer.one_file and tokenizer.joint and all(map(_is_sentencepiece, (tokenizer.src, tokenizer.tgt))):
        return _marian_tokenizer(tokenizer)
    if not tokenizer.one_file:
        raise NmtError("the model has separate source and target tokenizers (tokenizer.src.json, tokenizer.tgt.json) "
                       "that are not SentencePiece segmenters over one vocabulary (as an imported Marian model's are): "
                       "a transformers tokenizer is one; train with tokenizer.joint true")
    tok = tokenizer.src if tokenizer.src_specials else with_template(tokenizer.src, "$A </s>", ["</s>"])
    name = tok.id_to_token
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=name(cfg.pad_id), eos_token=name(cfg.eos_id),
        unk_token=name(tokenizer.unk_id), bos_token=name(cfg.bos_id) if cfg.bos_id != cfg.pad_id else None)


def _is_sentencepiece(tok) -> bool:
    """Whether `tok` is a unigram SentencePiece segmenter as `nmt import` converts one (Metaspace, no template)."""
    data = json.loads(tok.to_str())
    pre = data.get("pre_tokenizer") or {}
    return (data["model"].get("type") == "Unigram" and data.get("post_processor") is None
            and "Metaspace" in json.dumps(pre))


def _spm_proto(tok) -> bytes:
    """The SentencePiece model (a serialized ModelProto) that segments as the unigram tokenizer `tok` does: its
    pieces, scores and ids, its normalization (the precompiled character map, whitespace rules, dummy prefix), and
    </s>, <pad> and other added tokens as control pieces, <unk> as the unknown piece."""
    import base64

    from transformers.convert_slow_tokenizer import import_protobuf

    data = json.loads(tok.to_str())
    proto = import_protobuf().ModelProto()
    added = {t["content"] for t in data["added_tokens"]}
    unk_id = data["model"]["unk_id"]
    for i, (piece, score) in enumerate(data["model"]["vocab"]):
        kind = 2 if i == unk_id else 3 if piece in added else 1  # UNKNOWN, CONTROL, NORMAL
        proto.pieces.add(piece=piece, score=score, type=kind)
    spec = proto.trainer_spec
    spec.model_type, spec.vocab_size, spec.unk_id, spec.bos_id = 1, len(proto.pieces), unk_id, -1  # 1: UNIGRAM
    spec.unk_piece = proto.pieces[unk_id].piece
    for name, piece in (("eos", "</s>"), ("pad", "<pad>")):
        setattr(spec, f"{name}_id", -1 if tok.token_to_id(piece) is None else tok.token_to_id(piece))
        setattr(spec, f"{name}_piece", piece)
    norms = data["normalizer"]["normalizers"] if data["normalizer"]["type"] == "Sequence" else [data["normalizer"]]
    norm = proto.normalizer_spec
    norm.name = "identity"
    for part in norms:
        if part["type"] == "Precompiled":
            norm.precompiled_charsmap = base64.b64decode(part["precompiled_charsmap"])
    norm.remove_extra_whitespaces = any(part.get("pattern") == {"Regex": "\\A +| +\\z"} for part in norms)
    norm.escape_whitespaces = True
    norm.add_dummy_prefix = '"prepend_scheme": "never"' not in json.dumps(data["pre_tokenizer"])
    return proto.SerializeToString()


def _marian_tokenizer(tokenizer):
    """A `MarianTokenizer` over nmt's two SentencePiece segmenters (an imported Marian model's) and their one
    vocabulary: source.spm and target.spm segment as tokenizer.src.json and tokenizer.tgt.json do, and vocab.json
    gives their ids."""
    import tempfile

    transformers = require_transformers()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "source.spm").write_bytes(_spm_proto(tokenizer.src))
        (d / "target.spm").write_bytes(_spm_proto(tokenizer.tgt))
        vocab = tokenizer.tgt.get_vocab(with_added_tokens=True)
        (d / "vocab.json").write_text(json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1])),
                                                 ensure_ascii=False), encoding="utf-8")
        # the models are read into memory here, and save_pretrained writes them from there
        return transformers.MarianTokenizer(source_spm=str(d / "source.spm"), target_spm=str(d / "target.spm"),
                                            vocab=str(d / "vocab.json"))


def export_transformers(model_dir: str | Path, out: str | Path, force: bool = False) -> tuple[Path, str]:
    """`nmt export MODEL_DIR --to transformers OUT`: a directory `AutoModelForSeq2SeqLM.from_pretrained` and
    `AutoTokenizer.from_pretrained` load, written as a sibling temporary directory and renamed into place (a failed
    export leaves OUT as it was; an existing non-empty OUT only with `force`, never MODEL_DIR). Returns OUT and the
    transformers architecture chosen."""
    from nmt.checkpoint import check_output_dir, write_directory
    from nmt.loading import open_model

    require_transformers()
    model_dir, out = Path(model_dir), Path(out)
    check_output_dir(out, [model_dir], force, "OUT")
    opened = open_model(model_dir)
    model, tokenizer = opened.model.eval(), opened.tokenizer
    hf_tok = hf_tokenizer_from_nmt(tokenizer, model.cfg)
    hf = hf_model_from_nmt(model)
    def write(partial: Path) -> None:
        hf.save_pretrained(str(partial))
        hf_tok.save_pretrained(str(partial))

    return write_directory(out, write), type(hf).__name__
