"""Fine-tuning and continued training from a model directory (`init_from`): its architecture, tokenizer and
weights are used as they are (the tokenizer is never retrained: a new corpus is encoded with it), while the
optimizer, schedule and step count start fresh. Also how well the old tokenizer fits a new corpus."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from nmt.config import SIZE_FIELDS, TrainConfig
from nmt.errors import NmtError
from nmt.model_dir import load_model_config
from nmt.plan import open_keys
from nmt.tokenizer import PairTokenizer
from nmt.training.state import segmentation


def pretrained(cfg: TrainConfig) -> tuple[TrainConfig, PairTokenizer | None, dict[str, str]]:
    """`cfg` with the model and tokenizer settings of `cfg.init_from`, its tokenizer (None without init_from), and
    the keys `cfg` left open that the model directory fixed, with that reason (for the plan's printout).

    Mismatches are errors naming the key: another language pair, a joint config for a separate-vocabulary model
    (or the reverse), a vocabulary size or model size the directory does not have. `model.dropout` may differ.
    """
    if not cfg.init_from:
        return cfg, None, {}
    directory = Path(cfg.init_from)
    if not directory.is_dir():
        raise NmtError(f"init_from {directory}: not a folder; give a trained model directory (output_dir/model)")
    model_cfg = load_model_config(directory)
    tokenizer = PairTokenizer.load(directory)
    tokenizer.check_fits(model_cfg.src_vocab_size, model_cfg.tgt_vocab_size, directory)
    trained = _training_config(directory)
    _check_languages(cfg, trained, directory)
    _check_tokenizer(cfg, tokenizer, trained, directory)
    _check_sizes(cfg, model_cfg, directory)
    if cfg.model.dropout is not None:
        model_cfg = dataclasses.replace(model_cfg, dropout=cfg.model.dropout)
    tok_cfg = dataclasses.replace(cfg.tokenizer, vocab_size=(trained.get("tokenizer") or {}).get("vocab_size")
                                  or tokenizer.tgt_vocab_size, kind=_kind(tokenizer))
    out = dataclasses.replace(cfg, model=model_cfg, tokenizer=tok_cfg)
    fixed = set(open_keys(cfg)) - set(open_keys(out))
    return out, tokenizer, {k: f"the model directory's (init_from {directory})" for k in fixed}


def _training_config(directory: Path) -> dict:
    path = directory / "training.json"
    try:
        return json.loads(path.read_text())["config"] if path.is_file() else {}
    except (ValueError, KeyError, TypeError):
        raise NmtError(f"{path}: unreadable; is {directory} a model directory written by nmt?") from None


def _check_languages(cfg: TrainConfig, trained: dict, directory: Path) -> None:
    data = trained.get("data") or {}
    was, now = (data.get("src_lang"), data.get("tgt_lang")), (cfg.data.src_lang, cfg.data.tgt_lang)
    if None not in was and was != now:
        raise NmtError(f"init_from {directory}: it translates {was[0]}->{was[1]}, this config {now[0]}->{now[1]} "
                       "(data.src_lang / data.tgt_lang); fine-tune a model of the same language pair")


def _check_tokenizer(cfg: TrainConfig, tokenizer: PairTokenizer, trained: dict, directory: Path) -> None:
    if cfg.tokenizer.joint != tokenizer.joint:
        kind = "one joint vocabulary" if tokenizer.joint else "separate source and target vocabularies"
        raise NmtError(f"init_from {directory}: the model has {kind}; set tokenizer.joint: "
                       f"{str(tokenizer.joint).lower()} (the tokenizer comes from the model, it is not retrained)")
    given, had = cfg.tokenizer.vocab_size, (trained.get("tokenizer") or {}).get("vocab_size")
    if given is not None and given not in (had, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size):
        raise NmtError(f"init_from {directory}: tokenizer.vocab_size {given} is not the model's "
                       f"({had or tokenizer.tgt_vocab_size}); leave it null")


def _check_sizes(cfg: TrainConfig, model_cfg, directory: Path) -> None:
    for name in SIZE_FIELDS:
        given = getattr(cfg.model, name)
        if name != "dropout" and given is not None and given != getattr(model_cfg, name):
            raise NmtError(f"init_from {directory}: model.{name} is {getattr(model_cfg, name)} there, {given} in "
                           "this config; the architecture comes from the model directory (leave model sizes null)")


def _kind(tokenizer: PairTokenizer) -> str:
    return "unigram" if type(tokenizer.src.model).__name__ == "Unigram" else "bpe"




def check_same_tokenizer(model, tokenizer: PairTokenizer) -> None:
    """`train(cfg, model=M)` where M was loaded from a model directory: its tokenizer must be the run's."""
    origin = getattr(model, "pretrained_from", None)
    if origin is None or not Path(origin).is_dir():
        return
    try:
        theirs = PairTokenizer.load(origin)
    except NmtError:
        return  # weights saved without a tokenizer: nothing to compare
    if (theirs.src.to_str(), theirs.tgt.to_str()) != (tokenizer.src.to_str(), tokenizer.tgt.to_str()):
        raise NmtError(f"model was loaded from {origin}, but this run trained another tokenizer on its data, so the "
                       f"ids would mean other subwords; fine-tune with init_from={origin} (keeps its tokenizer)")




OVER_SEGMENTED = 1.5  # subwords per word over this multiple of the tokenizer's own corpus: a problem in nmt check
MAX_UNK = 0.01


def tokenizer_fit(directory: str, train) -> dict:
    """How model directory `directory`'s tokenizer segments `train` (an encoded split) against its own training
    data (`segmentation` in its training.json, when recorded), and the problems that shows."""
    path = Path(directory) / "training.json"
    old = json.loads(path.read_text()).get("segmentation") if path.is_file() else None
    new, problems = segmentation(train), []
    for side, name in (("src", "source"), ("tgt", "target")):
        ratio = new[side]["subwords_per_word"] / old[side]["subwords_per_word"] if old else 1.0
        if ratio > OVER_SEGMENTED:
            problems.append(f"init_from {directory}: its tokenizer cuts the new {name} into {ratio:.1f}x as many "
                            "subwords per word as its own training data (over-segmented: a new domain or script); "
                            "expect slower, weaker fine-tuning, or train a model with its own tokenizer")
        if new[side]["unk_rate"] > MAX_UNK:
            problems.append(f"init_from {directory}: {new[side]['unk_rate']:.1%} of the new {name} subwords are "
                            "<unk> under its tokenizer (characters it never saw)")
    return {"dir": str(directory), "new": new, "old": old, "problems": problems}
