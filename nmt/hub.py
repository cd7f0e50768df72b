"""Hugging Face Hub ids where nmt takes a model directory: `nmt import`, `init_from`, `nmt translate`, `evaluate`,
`score` and `serve` accept `ORG/NAME` (with `--revision`) as transformers' `from_pretrained` does.

`resolve` is the one resolution: a name that is an existing path is returned unchanged; an `ORG/NAME` that is not
one is the snapshot of that repository in the Hugging Face cache, downloaded first when the Hub may be reached,
with huggingface_hub's conventions: `HF_HUB_OFFLINE=1` (or `TRANSFORMERS_OFFLINE=1`) uses the cache only, the cache
is `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`. Only data files are fetched (JSON,
safetensors, SentencePiece models), never a pickle: a repository whose weights are only `pytorch_model.bin` is
refused with the command that converts it.

`nmt_cache` is where `nmt.interop.model_directory` keeps the transformers models it imported for the commands
that run a model.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from nmt.errors import NmtError

log = logging.getLogger(__name__)
# what nmt reads from a repository: configs, tokenizers, nmt's own JSON, the weights as safetensors, SentencePiece
# models (Marian's *.spm, NLLB's sentencepiece.bpe.model); never pytorch_model.bin, *.pt, *.ckpt, *.h5, *.msgpack
ALLOW = ["*.json", "*.safetensors", "*.spm", "sentencepiece*.model"]
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # weights a pickle holds: loading one can run code
TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable


def is_offline() -> bool:
    """Whether the Hub may not be reached: HF_HUB_OFFLINE (or transformers' TRANSFORMERS_OFFLINE) set true."""
    return any(os.environ.get(v, "").upper() in TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache() -> Path:
    """The Hugging Face cache as huggingface_hub finds it, read now (not when a library was imported)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def is_repo_id(name: str) -> bool:
    """Whether `name` names a Hub model (`ORG/NAME`) rather than a path: no such path exists and it is a valid id."""
    if not isinstance(name, str) or name.count("/") != 1 or Path(name).expanduser().exists():
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve(name_or_path: str | Path, revision: str | None = None) -> Path:
    """The local directory `name_or_path` names: a path as it is (its callers say when it is no directory), a Hub
    id `ORG/NAME` the snapshot of its `revision` (default main) in the Hugging Face cache, fetched if need be."""
    name = str(name_or_path)
    if not is_repo_id(name):
        if revision is not None:
            raise NmtError(f"--revision {revision}: {name} is not a Hub id (ORG/NAME); a revision names a commit, "
                           "branch or tag of a Hub repository, a local directory has none")
        return Path(name_or_path)
    folder = _snapshot(name, revision)
    # said every time: a mistyped two-part path ("runs/modle") is a valid Hub id too
    log.warning("nmt: %s is no directory here: using the Hugging Face Hub model %s%s (%s)", name, name,
                f" at revision {revision}" if revision else "", folder)
    return folder


# a branch, tag or commit of a Hub repository: names of these characters between single slashes (refs/pr/3), none
# starting with a dot (so no "..")
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*")


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if revision is not None and not _REVISION.fullmatch(revision):
        # the cache reads refs/<revision> and snapshots/<what it holds>: "../../x" or "/x" would name any file there
        raise NmtError(f"--revision {revision!r}: not a branch, tag or commit name (letters, digits, . _ - between "
                       "single slashes, as refs/pr/3; no '..', no leading '/')")
    offline, cache = is_offline(), hub_cache()
    at = f" at revision {revision}" if revision else ""
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=ALLOW,
                                        local_files_only=offline))
    except GatedRepoError:
        raise NmtError(f"{repo_id}: a gated model; accept its terms on huggingface.co and log in (hf auth login, or "
                       "set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise NmtError(f"{repo_id}: no revision {revision!r} on the Hub; give a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise NmtError(f"{repo_id}: no such directory, and no such model on the Hugging Face Hub (a private one needs "
                       "hf auth login or HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        if offline:
            raise NmtError(f"{repo_id}{at}: no such directory, and not in the Hugging Face cache ({cache}) while "
                           "HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, or set HF_HUB_CACHE to the "
                           "cache that holds it") from None
        raise NmtError(f"{repo_id}{at}: the Hugging Face Hub cannot be reached and the model is not in the cache "
                       f"({cache}); connect, or set HF_HUB_CACHE to a cache that holds it") from None
    except (HfHubHTTPError, OSError) as e:
        raise NmtError(f"{repo_id}{at}: downloading from the Hugging Face Hub failed ({str(e).splitlines()[0]})") from None
    if not any(folder.glob("*.safetensors")):
        _refuse_pickles(repo_id, revision, folder, offline)
    return folder


def _refuse_pickles(repo_id: str, revision: str | None, folder: Path, offline: bool) -> None:
    """No safetensors weights in the snapshot: name a pickle the repository has instead and how to convert it."""
    names = [p.name for p in folder.iterdir()]
    if not offline:
        from huggingface_hub import HfApi

        try:
            names = HfApi().list_repo_files(repo_id, revision=revision)
        except Exception:  # noqa: BLE001 - the listing only words the message; the snapshot has no weights either way
            pass
    pickled = sorted(n for n in names if n.endswith(PICKLES))
    at = f" --revision {revision}" if revision else ""
    if offline and not pickled:
        raise NmtError(f"{repo_id}{at}: the cached snapshot ({folder}) holds no .safetensors weights and HF_HUB_OFFLINE "
                       "is set; unset HF_HUB_OFFLINE to download them")
    if pickled:
        raise NmtError(f"{repo_id}: its weights are a pickle ({pickled[0]}), which nmt never downloads or reads "
                       "(loading one can run code); convert them where you trust the file: python -c \"import "
                       f"transformers as t; t.AutoModelForSeq2SeqLM.from_pretrained('{repo_id}'"
                       f"{f', revision={revision!r}' if revision else ''}).save_pretrained('DIR')\" (safetensors), "
                       "then give DIR; or give --revision of a safetensors conversion the repository has (refs/pr/N)")
    raise NmtError(f"{repo_id}{at}: no .safetensors weights in the repository; nmt reads a model directory written "
                   "by save_pretrained (transformers) or by nmt")


def nmt_cache() -> Path:
    """Where nmt keeps the models it imported from the Hub for translate, evaluate, serve and init_from:
    `$XDG_CACHE_HOME/nmt/imported` (else `~/.cache/nmt/imported`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "nmt" / "imported"
