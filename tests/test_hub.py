"""Hub ids where a model directory is taken: `nmt import ORG/NAME`, `--init-from ORG/NAME`, `nmt translate
ORG/NAME` resolve through huggingface_hub's cache as transformers does, offline here, against a cache laid out as
huggingface_hub lays one out (models--ORG--NAME/blobs, snapshots/<commit>, refs/main) holding a tiny Marian model
with its SentencePiece models, built in the test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hub_cache_entry, marian_directory, one_thread  # noqa: F401  (one_thread: module-wide)

from nmt.cli import main
from nmt.synthetic import generate_pairs

pytest.importorskip("transformers")
REPO = "Helsinki-NLP/opus-mt-en-de"
SENTENCES = [s for s, _ in generate_pairs(6, seed=5)]


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> tuple[Path, Path]:
    """Two Marian directories as OPUS-MT ships them (different random weights): main's and another revision's."""
    pairs = generate_pairs(300, seed=7)
    return tuple(marian_directory(tmp_path_factory.mktemp(name), pairs, d_model=d) for name, d in (("a", 32), ("b", 16)))


@pytest.fixture
def hub(marian, tmp_path, monkeypatch) -> dict:
    """An offline Hugging Face cache in HF_HUB_CACHE holding REPO (main: the first model, a second commit: the
    other) and nmt's own cache under XDG_CACHE_HOME, both in tmp_path."""
    cache = tmp_path / "hf"
    main_commit = hub_cache_entry(cache, REPO, marian[0])
    other = hub_cache_entry(cache, REPO, marian[1], ref="v2")
    (cache / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text(main_commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return {"cache": cache, "main": main_commit, "other": other}


def _error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _translate(model: str, capsys, monkeypatch, *flags: str) -> list[str]:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(s + "\n" for s in SENTENCES)))
    capsys.readouterr()
    assert main(["translate", model, "--beam", "1", *flags]) == 0, capsys.readouterr().err
    return capsys.readouterr().out.splitlines()


def test_a_hub_id_imports_and_translates_from_the_cache_as_the_downloaded_directory_does(hub, marian, tmp_path,
                                                                                         capsys, monkeypatch, caplog):
    """`nmt import ORG/NAME` reads refs/main's snapshot, `--revision` another commit; `nmt translate ORG/NAME`
    imports the model once into nmt's cache and translates as the import of the directory itself does."""
    assert main(["import", str(marian[0]), str(tmp_path / "local")]) == 0
    caplog.clear()
    assert main(["import", REPO, str(tmp_path / "from-hub")]) == 0
    # each time a Hub id is read, nmt says so: a mistyped two-part path is a Hub id too (issue 47, row 14)
    assert f"nmt: {REPO} is no directory here: using the Hugging Face Hub model {REPO} (" in caplog.text
    for name in ("model.safetensors", "tokenizer.src.json", "tokenizer.tgt.json"):
        assert (tmp_path / "from-hub" / name).read_bytes() == (tmp_path / "local" / name).read_bytes()
    assert main(["import", REPO, str(tmp_path / "v2"), "--revision", "v2"]) == 0
    assert main(["import", str(marian[1]), str(tmp_path / "local-v2")]) == 0
    assert (tmp_path / "v2" / "model.safetensors").read_bytes() == (tmp_path / "local-v2" / "model.safetensors").read_bytes()

    expected = _translate(str(tmp_path / "local"), capsys, monkeypatch)
    assert len(expected) == len(SENTENCES)
    assert _translate(REPO, capsys, monkeypatch) == expected
    imported = tmp_path / "xdg" / "nmt" / "imported" / REPO.replace("/", "--") / hub["main"]
    assert (imported / "model.safetensors").read_bytes() == (tmp_path / "local" / "model.safetensors").read_bytes()
    assert _translate(REPO, capsys, monkeypatch, "--revision", hub["other"]) == \
        _translate(str(tmp_path / "local-v2"), capsys, monkeypatch)
    from nmt import Translator  # the same from Python

    assert Translator.from_pretrained(REPO).translate(SENTENCES, beam_size=1) == expected


def test_an_import_in_nmts_cache_is_used_only_while_it_is_the_import_of_its_snapshot(hub, marian, tmp_path, capsys,
                                                                                     monkeypatch, caplog):
    """nmt's import cache is keyed by id and commit (issue 47, row 13): an import changed by hand, or a snapshot of
    the same id and commit with other files (another cache), is imported again, not used as found."""
    expected = _translate(REPO, capsys, monkeypatch)
    imported = tmp_path / "xdg" / "nmt" / "imported" / REPO.replace("/", "--") / hub["main"]
    made = (imported / "model.safetensors").read_bytes()
    middle = len(made) // 2
    (imported / "model.safetensors").write_bytes(made[:middle] + bytes([made[middle] ^ 1]) + made[middle + 1:])  # by hand
    caplog.clear()
    assert _translate(REPO, capsys, monkeypatch) == expected
    assert (imported / "model.safetensors").read_bytes() == made and "importing it again" in caplog.text
    caplog.clear()
    assert _translate(REPO, capsys, monkeypatch) == expected and "importing it again" not in caplog.text  # as found
    other = tmp_path / "other-cache"  # the second model's files under the first one's commit
    hub_cache_entry(other, REPO, marian[1], commit=hub["main"])
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert main(["import", str(marian[1]), str(tmp_path / "second")]) == 0
    assert _translate(REPO, capsys, monkeypatch) == _translate(str(tmp_path / "second"), capsys, monkeypatch) != expected


def test_hf_home_locates_the_cache_when_hf_hub_cache_is_unset(hub, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert main(["import", REPO, str(tmp_path / "out")]) == 2
    assert str(tmp_path / "home" / "hub") in _error(capsys)
    (tmp_path / "home").mkdir()
    hub["cache"].rename(tmp_path / "home" / "hub")
    assert main(["import", REPO, str(tmp_path / "out")]) == 0


def test_offline_with_nothing_cached_names_the_id_and_the_variable(hub, tmp_path, capsys):
    assert main(["translate", "Helsinki-NLP/opus-mt-en-fr"]) == 2
    line = _error(capsys)
    assert "Helsinki-NLP/opus-mt-en-fr" in line and "HF_HUB_OFFLINE" in line and "HF_HUB_CACHE" in line
    assert main(["import", REPO, str(tmp_path / "out"), "--revision", "v3"]) == 2
    assert "at revision v3" in _error(capsys)


@pytest.mark.parametrize("revision", ["../../../ref", "/etc/ref", "refs//x", ".hidden", "v2/../main"])
def test_a_revision_that_is_a_path_is_refused_before_the_cache_is_read(hub, tmp_path, capsys, revision):
    """The cache reads refs/<revision> and then snapshots/<what that file holds>: a revision that climbs out of it
    would load any directory (issue 47, row 12). Branches, tags and commits (v2, a 40-hex id) pass, as above."""
    assert main(["import", REPO, str(tmp_path / "out"), "--revision", revision]) == 2
    assert f"--revision {revision!r}: not a branch, tag or commit name" in _error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_repository_with_only_pickled_weights_is_refused_with_the_conversion(hub, marian, tmp_path, capsys):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for p in marian[0].iterdir():
        if p.name != "model.safetensors":
            (pickled / p.name).write_bytes(p.read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"never read")
    hub_cache_entry(hub["cache"], "org/pickled", pickled)
    assert main(["import", "org/pickled", str(tmp_path / "out")]) == 2
    line = _error(capsys)
    assert "pytorch_model.bin" in line and "pickle" in line and "save_pretrained('DIR')" in line
    assert not (tmp_path / "out").exists()


def test_a_name_that_is_no_directory_nor_hub_id_keeps_its_message(hub, tmp_path, capsys):
    assert main(["import", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "no config.json" in _error(capsys)
    assert main(["import", str(tmp_path / "missing"), str(tmp_path / "out"), "--revision", "v2"]) == 2
    assert "not a Hub id" in _error(capsys)


def test_a_local_transformers_directory_is_imported_first(marian, capsys):
    assert main(["translate", str(marian[0])]) == 2
    assert f"nmt import {marian[0]} OUT" in _error(capsys)


@pytest.mark.parametrize("via", ["cli", "python"])
def test_init_from_a_hub_id_fine_tunes_its_import(via, hub, corpus_dir, tmp_path, fresh_accelerate_state):
    flags = ["--data.train", str(corpus_dir / "train"), "--data.valid", str(corpus_dir / "valid"),
             "--data.test", str(corpus_dir / "test"), "--data.cache_dir", str(tmp_path / "cache"),
             "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--max_tokens", "400",
             "--eval_max_sentences", "4"]
    if via == "cli":
        assert main(["train", "--init-from", REPO, *flags]) == 0
    else:  # nmt.train of a config naming the Hub id, as from a notebook
        import nmt
        from nmt.cli import overrides_from_flags
        from nmt.config import load_config

        nmt.train(load_config(None, overrides_from_flags(flags) + ["init_from=" + REPO]))
    imported = tmp_path / "xdg" / "nmt" / "imported" / REPO.replace("/", "--") / hub["main"]
    for name in ("tokenizer.src.json", "tokenizer.tgt.json"):
        assert (tmp_path / "run" / "model" / name).read_bytes() == (imported / name).read_bytes()


def test_nothing_reaches_the_hub_when_offline(hub, tmp_path):
    """In a fresh interpreter with every socket refused, `nmt import ORG/NAME` works from the cache alone."""
    code = ("import socket, sys\n"
            "def refuse(*a, **k): raise OSError('network used')\n"
            "socket.socket.connect = refuse\nsocket.create_connection = refuse\n"
            "from nmt.cli import main\n"
            f"sys.exit(main(['import', {REPO!r}, {str(tmp_path / 'out')!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
