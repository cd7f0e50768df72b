"""Reading a parallel corpus into a `datasets.Dataset` with string columns "src" and "tgt": text file pairs, TSV,
JSONL, CSV, save_to_disk folders, the Hub and the builtin synthetic corpus (`load_split` picks by the spec).
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import datasets
import pyarrow as pa

from nmt.compat import generator_yielded_nothing
from nmt.config import BUILTIN, DataConfig
from nmt.errors import NmtError
from nmt.tables import open_arrow
from nmt.textfiles import text_pair_batches, tsv_batches, utf8_lines, write_arrow


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        yield from enumerate(utf8_lines(f, path, keep_ends=False), 1)


def read_text_pair(src: str, tgt: str) -> Iterator[dict]:
    """Line i of `src` with line i of `tgt` (as dicts; `load_split` writes them to Arrow in chunks instead)."""
    for batch in text_pair_batches(Path(src), Path(tgt)):
        for a, b in zip(batch.column("src").to_pylist(), batch.column("tgt").to_pylist()):
            yield {"src": a, "tgt": b}


def read_tsv(path: str) -> Iterator[dict]:
    """Column 1 is the source, column 2 the target; further columns (attribution) are ignored."""
    for batch in tsv_batches(Path(path)):
        for a, b in zip(batch.column("src").to_pylist(), batch.column("tgt").to_pylist()):
            yield {"src": a, "tgt": b}


class _KeyTwice(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's keys and values as a dict, refusing a key given twice (`json.loads` keeps the last)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _KeyTwice(key)
        out[key] = value
    return out


def read_jsonl(path: str, src_lang: str, tgt_lang: str) -> Iterator[dict]:
    for i, line in _lines(Path(path)):
        if not line.strip():
            continue
        try:
            record = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            raise NmtError(f"{path}:{i}: not valid JSON ({e.msg}); each line must be one JSON object") from None
        except _KeyTwice as e:
            raise NmtError(f"{path}:{i}: key {e.args[0]!r} is given twice in one object; JSON readers keep only the "
                           "last silently: delete one") from None
        yield _pick_fields(record, src_lang, tgt_lang, f"{path}:{i}")


def read_csv(path: str, src_lang: str, tgt_lang: str) -> Iterator[dict]:
    """A header row naming the columns (the languages, or source and target), then one pair per record; a quoted
    field may span lines."""
    with open(path, "rb") as f:
        reader = csv.DictReader(utf8_lines(f, path))
        try:
            for row in reader:
                yield _pick_fields(row, src_lang, tgt_lang, f"{path}:{reader.line_num}")
        except csv.Error as e:  # a field over csv's limit, most often a quote left open
            raise NmtError(f"{path}:{reader.line_num + 1}: the record that starts here is not CSV that can be read "
                           f"({e}); fix or remove it (a field holds at most {csv.field_size_limit():,} characters), or "
                           "give the corpus as .tsv or .jsonl") from None


def _pick_fields(record: dict, src_lang: str, tgt_lang: str, where: str) -> dict:
    """Source/target from {"translation": {src_lang: .., tgt_lang: ..}}, {src_lang: ..}, or {"source": ..}."""
    if not isinstance(record, Mapping):
        raise NmtError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if isinstance(record.get("translation"), Mapping):
        record = record["translation"]
    for src_key, tgt_key in ((src_lang, tgt_lang), ("source", "target"), ("src", "tgt")):
        if src_key in record and tgt_key in record:
            src, tgt = record[src_key], record[tgt_key]
            if not isinstance(src, str) or not isinstance(tgt, str):
                raise NmtError(f"{where}: fields {src_key!r} and {tgt_key!r} must be strings")
            return {"src": src, "tgt": tgt}
    raise NmtError(f"{where}: missing field; expected {src_lang!r} and {tgt_lang!r} (optionally inside "
                   f"'translation'), or 'source' and 'target'; found {sorted(record)}")


@functools.cache
def _builtin_splits() -> dict:
    from nmt.synthetic import builtin_splits

    return builtin_splits()


def read_builtin(split: str) -> Iterator[dict]:
    for src, tgt in _builtin_splits()[split]:
        yield {"src": src, "tgt": tgt}


def load_split(spec: str, cfg: DataConfig, split: str, cache: Path, whole_ok: bool = True) -> datasets.Dataset | None:
    """The Dataset (columns src, tgt) that `spec` names for `split`.

    A source with named splits (builtin, save_to_disk DatasetDict, Hub) gives that split or None;
    a single-split source gives all of itself, or None when `whole_ok` is False.
    """
    if spec == BUILTIN:
        return _from_generator(read_builtin, {"split": split}, cache)
    if spec.startswith("hub:"):
        return _from_dataset_dict(_load_hub(spec[4:]), spec, cfg, split, whole_ok)
    path = Path(spec)
    if path.is_dir():
        return _from_dataset_dict(_load_disk(path), spec, cfg, split, whole_ok)
    if not whole_ok:
        return None
    suffix = path.suffix.lower()
    if suffix == ".tsv":
        return _from_arrow_file(lambda: tsv_batches(path), "tsv", _stamp(path), cache)
    if suffix in (".jsonl", ".json"):
        return _from_generator(read_jsonl, {"path": str(path), "src_lang": cfg.src_lang,
                                            "tgt_lang": cfg.tgt_lang, "stamp": _stamp(path)}, cache)
    if suffix == ".csv":
        return _from_generator(read_csv, {"path": str(path), "src_lang": cfg.src_lang,
                                          "tgt_lang": cfg.tgt_lang, "stamp": _stamp(path)}, cache)
    src, tgt = Path(f"{path}.{cfg.src_lang}"), Path(f"{path}.{cfg.tgt_lang}")
    for p in (src, tgt):
        if not p.is_file():
            raise NmtError(f"data file not found: {p} (from {spec!r}: give a prefix of .{cfg.src_lang}/.{cfg.tgt_lang} "
                           "files, a .tsv/.jsonl/.csv file, a save_to_disk folder, hub:NAME or builtin:synthetic)")
    return _from_arrow_file(lambda: text_pair_batches(src, tgt), "text", _stamp(src) + _stamp(tgt), cache)


def _from_arrow_file(batches: Callable[[], Iterator[pa.RecordBatch]], kind: str, stamp: str,
                     cache: Path) -> datasets.Dataset:
    """The text read once into an Arrow file named by the files' stamps, then opened memory-mapped."""
    out = cache / "read" / f"{kind}-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.arrow"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_arrow(batches(), out)
    return open_arrow(out, f"nmt-{out.stem}")


def _stamp(path: Path) -> str:
    """Changes when the file does, so the reading cache never serves stale text."""
    if not path.is_file():
        raise NmtError(f"data file not found: {path}")
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _from_generator(fn: Callable, kwargs: dict, cache: Path) -> datasets.Dataset:
    # kwargs (with the file stamp) key datasets' own cache; NmtError raised inside is unwrapped
    def gen(**kw):  # a closure keeps the reader's exceptions ours
        yield from fn(**{k: v for k, v in kw.items() if k != "stamp"})
    gen.__name__ = f"nmt_{fn.__name__}"
    features = datasets.Features({"src": datasets.Value("string"), "tgt": datasets.Value("string")})
    try:
        return datasets.Dataset.from_generator(gen, gen_kwargs=kwargs, features=features,
                                               cache_dir=str(cache / "datasets"))
    except Exception as e:  # datasets wraps generator errors in DatasetGenerationError
        cause = e
        while cause is not None and not isinstance(cause, NmtError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise cause from None
        if generator_yielded_nothing(e):
            where = kwargs.get("path") or " + ".join(str(kwargs[k]) for k in ("src", "tgt") if k in kwargs)
            raise NmtError(f"no training pairs in {where or kwargs} (empty file?)") from None
        raise


def _load_disk(path: Path):
    try:
        return datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise NmtError(f"{path}: a folder, but not one written by Dataset.save_to_disk") from None


def _load_hub(name: str):
    repo, _, config = name.partition(":")
    try:
        return datasets.load_dataset(repo, config or None)
    except Exception as e:
        raise NmtError(f"hub:{name}: could not load from the Hugging Face Hub ({str(e).splitlines()[0]}); "
                       "offline, save it with save_to_disk elsewhere and pass the folder") from None


SPLIT_NAMES = {"train": ("train",), "valid": ("validation", "valid", "dev"), "test": ("test",)}


def _from_dataset_dict(obj, spec: str, cfg: DataConfig, split: str, whole_ok: bool) -> datasets.Dataset | None:
    if not isinstance(obj, datasets.DatasetDict) and not whole_ok:
        return None
    if isinstance(obj, datasets.DatasetDict):
        name = next((n for n in SPLIT_NAMES[split] if n in obj), None)
        if name is None:
            if split == "train":
                raise NmtError(f"{spec}: no train split (found {', '.join(obj)})")
            return None
        obj = obj[name]
    return obj.map(_normalize_record, fn_kwargs={"src_lang": cfg.src_lang, "tgt_lang": cfg.tgt_lang,
                                                 "where": spec}, remove_columns=obj.column_names)


def _normalize_record(record: dict, src_lang: str, tgt_lang: str, where: str) -> dict:
    return _pick_fields(record, src_lang, tgt_lang, where)
