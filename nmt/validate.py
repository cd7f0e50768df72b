"""User input checked where it enters: path keys against the disk, command-line numbers against their ranges,
text input as UTF-8, and the one line the command line prints for an exception the input caused.

The intervals and path kinds themselves are declared on the config dataclasses (nmt.config); this module
applies the checks that need the filesystem or argparse. No torch here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from nmt.checkpoint import COMPLETE, CONFIG_FILE, JOINT_FILE, SRC_FILE, TGT_FILE, WEIGHTS_FILE
from nmt.compat import state_dict_mismatch
from nmt.config import PATH, PATH_KINDS, RANGE, CorpusSpec, Range, TrainConfig, check_config, read_yaml, walk
from nmt.errors import NmtError

TABLE_SUFFIXES = (".tsv", ".jsonl", ".json", ".csv")
DISK_MARKERS = ("dataset_dict.json", "dataset_info.json", "state.json")  # what Dataset(Dict).save_to_disk writes


def check_run(cfg: TrainConfig) -> None:
    """Everything about `cfg` that can be checked before any work: ranges and rules (again, for a config changed
    after construction) and every path key against the disk. Called at the start of training and `nmt check`."""
    check_config(cfg)
    check_paths(cfg)
    check_overwrite(cfg)
    if cfg.finetune.lora_r and not _installed("peft"):
        raise NmtError("finetune.lora_r needs peft: pip install 'nmt[lora]'")


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (peft imports transformers: seconds)."""
    return importlib.util.find_spec(module) is not None


def check_paths(cfg: TrainConfig) -> None:
    """Each path key (declared with `path_key` in nmt.config) is what its kind needs: a folder, a corpus, a
    checkpoint, a model directory. Raises NmtError naming the key, the path and what it should be."""
    for key, f, value in walk(cfg):
        kind = f.metadata.get(PATH)
        if kind is not None and value is not None:
            for i, item in enumerate(value if isinstance(value, (list, tuple)) else [value]):  # data.train may list
                if isinstance(item, CorpusSpec):  # a corpus with languages of its own: its files are named by them
                    langs = {k: v for k, v in (("src_lang", item.src_lang), ("tgt_lang", item.tgt_lang)) if v}
                    own = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **langs))
                    PATH_CHECKS[kind](f"{key}[{i}].path", Path(item.path), own)
                else:
                    PATH_CHECKS[kind](key, Path(str(item)), cfg)  # expanded where the config is read


def check_overwrite(cfg: TrainConfig) -> None:
    """`overwrite` moves a used output_dir aside as a whole, as `<output_dir>.old-<time>`: refuse an output_dir that
    has no name of its own to move (`.`, `..`, `/`) or that holds the working directory or the home folder."""
    if not cfg.overwrite:
        return
    out = Path(cfg.output_dir)
    where, cwd, home = out.resolve(), Path.cwd().resolve(), Path(os.path.expanduser("~")).resolve()
    if where == cwd:
        what = "is the working directory"
    elif where in cwd.parents:
        what = "holds the working directory"
    elif where == home or where in home.parents:
        what = "is or holds your home folder"
    elif out.name in ("", ".."):
        what = "names no folder of its own"
    else:
        return
    raise NmtError(f"config key 'output_dir': {cfg.output_dir} {what}, which --overwrite would move aside as a whole; "
                   "give the run a folder of its own, e.g. --output_dir runs/NAME")


def _refuse(key: str, path: Path, problem: str, kind: str) -> NmtError:
    return NmtError(f"config key {key!r}: {path} {problem}; give {PATH_KINDS[kind]}")


def check_folder(key: str, path: Path, cfg: TrainConfig) -> None:
    """A folder we write into: an existing folder, or a path that can be created."""
    if path.exists():
        if not path.is_dir():
            raise _refuse(key, path, "is a file, not a folder", "folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise _refuse(key, path, "is not writable", "folder")
        return
    parent = next(p for p in path.absolute().parents if p.exists())
    if not parent.is_dir():
        raise _refuse(key, path, f"cannot be created: {parent} is a file", "folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _refuse(key, path, f"cannot be created: {parent} is not writable", "folder")


def check_corpus(key: str, path: Path, cfg: TrainConfig) -> None:
    """A corpus: hub:/builtin: (not paths), a save_to_disk folder, a table file, or a prefix of two text files."""
    if str(path).startswith(("hub:", "builtin:")):
        return
    if path.is_dir():
        if not any((path / name).is_file() for name in DISK_MARKERS):
            raise _refuse(key, path, "is a folder, but not one written by Dataset.save_to_disk", "corpus")
        return
    if path.suffix.lower() in TABLE_SUFFIXES:
        if not path.is_file():
            raise _refuse(key, path, "not found (data file not found)", "corpus")
        return
    src, tgt = cfg.data.src_lang, cfg.data.tgt_lang
    for side in (Path(f"{path}.{src}"), Path(f"{path}.{tgt}")):
        if side.is_dir():
            raise _refuse(key, side, "is a folder, not a text file with one sentence per line", "corpus")
        if not side.is_file():
            found = f" ({path} is a file, but not .tsv/.jsonl/.csv)" if path.is_file() else ""
            raise NmtError(f"config key {key!r}: data file not found: {side}{found}; give a prefix of "
                           f".{src}/.{tgt} files, a .tsv/.jsonl/.csv file, a save_to_disk folder, hub: or builtin:")


def check_checkpoint(key: str, path: Path, cfg: TrainConfig) -> None:
    """`latest` or `auto` (resolved later, against output_dir) or a complete checkpoint folder."""
    if str(path) in ("latest", "auto"):
        return
    if not path.exists():
        raise _refuse(key, path, "does not exist", "checkpoint")
    if not path.is_dir():
        raise _refuse(key, path, "is a file, not a folder", "checkpoint")
    if not (path / COMPLETE).is_file():
        raise _refuse(key, path, f"is not a complete nmt checkpoint (no {COMPLETE})", "checkpoint")


def check_model_dir(key: str, path: Path, cfg: TrainConfig) -> None:
    """A model directory as training writes it (what fine-tuning or a teacher would start from); init_from may be a
    Hub id too (`ORG/NAME`, resolved when the run starts: nmt.hub)."""
    from nmt.hub import is_repo_id

    if key == "init_from" and is_repo_id(str(path)):
        return
    if not path.exists():
        raise _refuse(key, path, "does not exist", "model")
    if not path.is_dir():
        raise _refuse(key, path, "is a file, not a folder", "model")
    has = lambda names: all((path / name).is_file() for name in names)
    missing = [" or ".join("+".join(n) for n in group) for group in MODEL_FILES if not any(map(has, group))]
    if missing:
        raise _refuse(key, path, f"is not an nmt model directory (no {', '.join(missing)})", "model")


# what Seq2SeqTransformer.save_pretrained and PairTokenizer.save write; each entry is a list of alternatives,
# each a set of files
MODEL_FILES = ([(CONFIG_FILE,)], [(WEIGHTS_FILE,)], [(JOINT_FILE,), (SRC_FILE, TGT_FILE)])
PATH_CHECKS: dict[str, Callable[[str, Path, TrainConfig], None]] = {
    "folder": check_folder, "corpus": check_corpus, "checkpoint": check_checkpoint, "model": check_model_dir}


# --- command-line numbers -------------------------------------------------------------------------


MAX_NUMBER_CHARS = 100  # longer is no number of any flag's range


class Number:
    """An argparse `type` that reads an int or float and refuses values outside an interval with argparse's own
    message and exit code 2. The interval is given ("[1, 1000]") or taken from the dataclass field the flag sets
    ("nmt.decoding:SearchConfig.beam_size"), looked up only when a value is parsed (no torch import for --help)."""

    def __init__(self, kind: type, allowed: str):
        self.kind, self._allowed = kind, allowed
        self.__name__ = kind.__name__  # argparse names the type in some messages

    @property
    def allowed(self) -> Range:
        if self._allowed[:1] in "[(":
            return Range(self._allowed)
        module, _, attr = self._allowed.partition(":")
        cls_name, name = attr.split(".")
        cls = getattr(importlib.import_module(module), cls_name)
        return next(f for f in dataclasses.fields(cls) if f.name == name).metadata[RANGE]

    def __call__(self, text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS:  # Python refuses ints over 4,300 digits; none of ours needs 100
            raise argparse.ArgumentTypeError(f"a value of {len(text):,} characters is outside the allowed range "
                                             f"{self.allowed}")
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if self.kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if value not in self.allowed:
            raise argparse.ArgumentTypeError(f"{text} is outside the allowed range {self.allowed}")
        return value


# --- text input -------------------------------------------------------------------------------------


def utf8_lines(stream: Iterable[bytes | str], name: str) -> Iterator[str]:
    """`nmt.textfiles.utf8_lines` (line ends kept), the one reader of text lines, imported when first called: the
    command line imports this module for `nmt --help`, which needs no pyarrow."""
    from nmt.textfiles import utf8_lines as lines

    return lines(stream, name)


# --- explaining exceptions ------------------------------------------------------------------------------

def load_state_error(err: RuntimeError, checkpoint: Path, cfg: TrainConfig) -> Exception:
    """The NmtError for a checkpoint whose weights do not fit the model `cfg` builds (another size or depth),
    naming the tensor, both shapes and the config keys that changed; `err` itself when it is something else."""
    if (what := state_dict_mismatch(err)) is None:
        return err
    what = what.replace("in the model", "in the model this config builds")
    changed = changed_sizes(cfg)
    return NmtError(f"cannot resume from {checkpoint}: {what}{'; changed: ' + changed if changed else ''}. "
                    f"Resume with the config the run was started with ({Path(cfg.output_dir) / 'config.yaml'}) "
                    "or train the new model into a new output_dir")


def changed_sizes(cfg: TrainConfig) -> str:
    """The keys that shape the weights whose values in `cfg` differ from output_dir/config.yaml (the run being
    resumed), e.g. "model.d_model 32 -> 64"."""
    path = Path(cfg.output_dir) / "config.yaml"
    try:
        before = read_yaml(path) if path.is_file() else {}
    except NmtError:
        return ""
    diffs = []
    for key in SHAPE_KEYS:
        section, name = key.split(".")
        old, new = (before.get(section) or {}).get(name), getattr(getattr(cfg, section), name)
        if old is not None and old != new:
            diffs.append(f"{key} {old} -> {new}")
    return ", ".join(diffs)


SHAPE_KEYS = ("model.d_model", "model.n_heads", "model.n_encoder_layers", "model.n_decoder_layers", "model.d_ff",
              "model.src_vocab_size", "model.tgt_vocab_size", "model.share_embeddings", "model.max_positions",
              "tokenizer.vocab_size", "tokenizer.joint")


def error_line(err: BaseException) -> tuple[str, int]:
    """(one line, exit code) for an exception that reached the command line: 2 when the user's input caused it
    (NmtError; a file that cannot be read or written), else 1 with a pointer to --debug."""
    if isinstance(err, NmtError):
        return str(err), err.exit_code
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or err}", 2
    if isinstance(err, UnicodeDecodeError):
        return f"input is not valid UTF-8 ({err.reason} at byte {err.start + 1})", 2
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {first} (unexpected: run again with --debug for the traceback)", 1
