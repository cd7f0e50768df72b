"""What a trained model directory holds: architecture, size, vocabulary, training data, scores, provenance.

Reads config.json, training.json, the tokenizer JSON and the safetensors header only: no weights are
loaded and nothing is unpickled, so `describe` is safe on a directory from anywhere.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

from nmt.checkpoint import (
    SUMMARY_FILE,
    WEIGHTS_FILE,
    load_model_config,
    read_languages,
    read_search,
    read_summary,
)
from nmt.config import to_dict
from nmt.errors import NmtError


def describe(model_dir: str | Path) -> dict:
    """A plain dict describing the model in `model_dir` (output_dir/model or output_dir/best of a run).

    Keys: model_dir, architecture (the ModelConfig fields), parameters, tensors, dtypes, vocab
    ({"joint", "src", "tgt"}), and from training.json when present: step, best (validation metrics),
    data (pairs per split, cleaning), num_processes, argv, command; search (the tuned length penalty, from
    search.json) when training tuned it; languages (languages.json) for a multilingual model; translates
    ({source code: [target codes]}, `translates`).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise NmtError(f"{model_dir}: no such model directory")
    arch = load_model_config(model_dir)
    out = {"model_dir": str(model_dir), "architecture": to_dict(arch), **weights_summary(model_dir / WEIGHTS_FILE),
           "vocab": vocab_sizes(model_dir)}
    summary = read_summary(model_dir)
    argv = summary.get("argv") or []
    out.update(step=summary.get("step"), best=summary.get("metrics", {}), data=summary.get("data", {}),
               num_processes=summary.get("num_processes"), argv=argv, command=command_line(argv))
    if (search := read_search(model_dir)) is not None:
        out["search"] = search
    if (languages := read_languages(model_dir)) is not None:
        out["languages"] = languages
    out["translates"] = translates(languages, (summary.get("config") or {}).get("data") or {})
    return out


def translates(languages: dict | None, data: dict) -> dict[str, list[str]]:
    """{source code: [target codes]} the model translates: a multilingual model's pairs (languages.json), every
    language to every other of an imported many-to-many one (its targets, no pairs), else the data.src_lang and
    data.tgt_lang it was trained with; {} where none is known (an imported one-pair model)."""
    out: dict[str, list[str]] = {}
    if languages and languages["pairs"]:
        targets = sorted(languages["target_languages"], key=len, reverse=True)  # the longest first: codes may hold "-"
        for pair in languages["pairs"]:
            tgt = next((t for t in targets if pair.endswith("-" + t)), pair.rsplit("-", 1)[-1])
            out.setdefault(pair[: -len(tgt) - 1], []).append(tgt)
    elif languages and languages["target_languages"]:
        codes = languages["target_languages"]
        out = {s: [t for t in codes if t != s] for s in codes}
    elif isinstance(data.get("src_lang"), str) and isinstance(data.get("tgt_lang"), str):
        out = {data["src_lang"]: [data["tgt_lang"]]}
    return {s: sorted(set(ts)) for s, ts in sorted(out.items())}


def weights_summary(path: Path) -> dict:
    """Parameter count, tensor count and dtypes from the safetensors header (shapes only, no data read)."""
    if not path.is_file():
        raise NmtError(f"{path}: missing; {path.parent} holds no weights")
    tensors = safetensors_header(path)
    n_params, dtypes = 0, {}
    for name in sorted(tensors):
        n_params += math.prod(tensors[name]["shape"])
        dtypes[tensors[name]["dtype"]] = dtypes.get(tensors[name]["dtype"], 0) + 1
    # a shared source/target/output embedding is stored once, so this is the unique parameter count
    return {"parameters": n_params, "tensors": len(tensors), "dtypes": dtypes}


def safetensors_header(path: Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file, from its header alone.

    The format (huggingface/safetensors): 8 bytes little-endian N, then N bytes of JSON. Read here with json
    rather than with the safetensors library, which would import numpy or torch to answer `nmt info`."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= path.stat().st_size - 8:
                raise ValueError(f"header length {size} does not fit the file")
            header = json.loads(f.read(size))
        tensors = {name: spec for name, spec in header.items() if name != "__metadata__"}
        if not all(isinstance(s, dict) and {"dtype", "shape"} <= s.keys() for s in tensors.values()):
            raise ValueError("a tensor entry without dtype or shape")
    except (OSError, ValueError, AttributeError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise NmtError(f"{path}: not a readable safetensors file ({e})") from None
    return tensors


def vocab_sizes(model_dir: Path) -> dict:
    from nmt.tokenizer import PairTokenizer

    tok = PairTokenizer.load(model_dir)
    return {"joint": tok.joint, "src": tok.src_vocab_size, "tgt": tok.tgt_vocab_size}


def command_line(argv: list[str]) -> str:
    """The command that trained the model, as a shell line; the program by its name (`nmt`, `run.py`)."""
    if not argv:
        return ""
    program = Path(argv[0]).name
    program = "nmt" if program in ("cli.py", "__main__.py") else program  # python -m nmt.cli
    return shlex.join([program, *argv[1:]])


def lines(info: dict) -> list[str]:
    """`describe`'s dict as a few lines for the terminal."""
    a = info["architecture"]
    arch = (f"{a['n_encoder_layers']}+{a['n_decoder_layers']} layers (encoder+decoder), d_model {a['d_model']}, "
            f"{a['n_heads']} heads, d_ff {a['d_ff']}, {a['activation']}, {'pre' if a['pre_norm'] else 'post'}-norm, "
            f"dropout {a['dropout']}, max_positions {a['max_positions']}"
            f"{', shared embeddings' if a['share_embeddings'] and info['vocab']['joint'] else ''}")
    v = info["vocab"]
    vocab = f"joint, {v['src']:,} subwords" if v["joint"] else f"separate: source {v['src']:,}, target {v['tgt']:,}"
    dtypes = ", ".join(f"{k} x{n}" for k, n in info["dtypes"].items())
    out = [f"model         {info['model_dir']}",
           f"architecture  {arch}",
           f"parameters    {info['parameters'] / 1e6:.2f}M ({info['parameters']:,}) in {info['tensors']} tensors ({dtypes})",
           f"vocabulary    {vocab}"]
    if info["data"]:
        out.append(f"data          {_data(info['data'])}")
    if info["best"]:
        out.append(f"validation    step {info['step']}: {_scores(info['best'])}")
    if info.get("search"):
        s = info["search"]
        out.append(f"search        alpha {s.get('alpha')} by default (tuned on {s.get('tuned_on', 'validation')} "
                   f"with beam {s.get('beam_size')}; --alpha overrides)")
    if info.get("languages"):
        langs = info["languages"]
        out.append(f"languages     {', '.join(langs['pairs'])}; translate with --tgt-lang "
                   f"{' / '.join(langs['target_languages'])}")
    if info["command"]:
        procs = info.get("num_processes") or 1
        out.append(f"command       {info['command']}  ({procs} process{'es' if procs > 1 else ''})")
    if not info["data"] and not info["command"]:
        out.append(f"training      unknown (no {SUMMARY_FILE})")
    return out


def _data(data: dict) -> str:
    pairs = " / ".join(f"{k} {n:,}" for k, n in data.get("pairs", {}).items())
    clean = data.get("clean", {})
    dropped = ", ".join(f"{k} {n:,}" for k, n in clean.get("dropped", {}).items()) or "nothing"
    carved = data.get("carved_from_train") or []
    return (f"{pairs} pairs{' (' + ' and '.join(carved) + ' carved off train)' if carved else ''}; "
            f"cleaning read {clean.get('read', 0):,} training pairs, dropped {dropped}")


def _scores(best: dict) -> str:
    names = {"bleu": "BLEU", "chrf": "chrF", "valid_nll": "NLL", "valid_ppl": "perplexity"}
    shown = [f"{label} {best[key]:.2f}" for key, label in names.items() if isinstance(best.get(key), (int, float))]
    sig = f" (sacreBLEU {best['bleu_signature']})" if best.get("bleu_signature") else ""
    return ", ".join(shown) + sig
