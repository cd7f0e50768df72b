"""The import graph: cheap things stay cheap (`import nmt`, `nmt --help`, `nmt info`, the config), and imports
point one way, as docs/development.md's layering says (config <- plan <- tokenizer <- data; model <- decoding <-
translate; ... <- training <- cli), read from the source of every module."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "numpy", "accelerate", "datasets", "evaluate", "matplotlib", "tokenizers", "safetensors", "yaml"}


def heavy_after(code: str) -> set[str]:
    """The HEAVY libraries in sys.modules after `code` ran in a fresh interpreter."""
    report = "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    proc = subprocess.run([sys.executable, "-c", code + report], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(json.loads(proc.stdout.splitlines()[-1])) & HEAVY


def cli(*argv: str) -> str:
    return f"from nmt.cli import main\ntry:\n    main({list(argv)!r})\nexcept SystemExit:\n    pass"


@pytest.mark.parametrize("code, loaded", [
    ("import nmt", set()),
    ("import nmt\nnmt.__all__, dir(nmt)", set()),
    ("import nmt.errors", set()),
    ("import nmt.config", set()),  # YAML is read inside read_yaml/parse_override/save_yaml
    ("import nmt.tools.info", set()),
    ("import nmt.validate", set()),
    ("import nmt.checkpoint", set()),  # torch and Accelerate load inside the functions that read weights
    ("import nmt.tokenizer", {"tokenizers"}),
    ("import nmt.batching", {"numpy", "tokenizers"}),  # torch when the collator builds its first batch
    ("import nmt.decoding", {"torch", "numpy", "tokenizers"}),  # search pads with collate, whose ids are the tokenizer's
    ("import nmt.translate", {"torch", "numpy", "tokenizers"}),  # no Accelerate, datasets, evaluate
    (cli("--help"), set()),
    (cli("train", "--help"), set()),
], ids=lambda v: v if isinstance(v, str) and "\n" not in v else None)
def test_what_an_import_loads(code, loaded):
    assert heavy_after(code) == loaded


def test_public_names_load_on_first_use():
    code = "import nmt\nfrom nmt import Translator, train, launch\nassert callable(train) and callable(launch)"
    assert {"torch", "accelerate", "datasets"} <= heavy_after(code)
    code = ("import nmt.train, nmt.launch\nimport nmt\n"
            "assert callable(nmt.train) and callable(nmt.launch) and nmt.train.__module__ == 'nmt.training.run'")
    heavy_after(code)  # importing the modules nmt.train / nmt.launch does not hide the functions of those names
    with pytest.raises(AssertionError, match="no attribute 'nope'"):
        heavy_after("import nmt\nnmt.nope")


def test_nmt_info_reads_json_and_headers_only(tmp_path):
    from helpers import tiny_model

    from nmt.config import TokenizerConfig
    from nmt.synthetic import generate_pairs
    from nmt.tokenizer import train_pair_tokenizer

    tiny_model(vocab=60).save_pretrained(tmp_path)
    pairs = generate_pairs(50, seed=1)
    train_pair_tokenizer(lambda: (s for s, _ in pairs), lambda: (t for _, t in pairs),
                         TokenizerConfig(vocab_size=60)).save(tmp_path)
    assert heavy_after(cli("info", str(tmp_path))) == {"tokenizers"}


# --- the layering, from the source ------------------------------------------------------------------------------

# Each module's layer: a module imports (at the top or inside a function) only modules of lower layers.
# docs/development.md states the arrows; a new module gets its layer here.
LAYERS = [
    {"errors", "synthetic"},
    {"compat"},  # names a changed private API in an NmtError
    {"metrics", "textfiles", "launch", "sentences", "markup", "language"},  # markup: tags out and back; language: ID
    {"config", "tools.plot", "hub", "guard"},  # plot: writes with textfiles; hub: Hub ids resolved to local
    # directories; guard: loops and off-target translations, told by language
    {"plan"},
    {"checkpoint"},  # a model directory's files name its ModelConfig
    {"tokenizer", "validate"},
    {"tables", "mixing"},  # the data layer by job: a Dataset read through its Arrow table; corpora mixed in an epoch
    {"readers", "cleaning", "encoding"},  # a corpus read; cleaned, deduplicated, its overlap counted; encoded
    {"data"},  # the prepared corpus: every step above, cached by content
    {"batching"},
    {"layers"},
    {"model"},
    {"kernels"},  # CPU stand-ins for the plain model's modules and objective
    {"constraints"},  # glossaries and the constraint state beam search carries
    {"decoding", "attention"},
    {"engines"},  # what a Translator decodes with: nmt's own search, or (ct2) a CTranslate2 export
    {"adapters"},
    {"loading"},  # the one loader of model directories (and average / merge-adapter, which make one from others)
    {"interop", "ct2"},  # ct2: a model exported to CTranslate2 and decoded by it (the translator's second engine)
    {"translate", "tools.info"},
    {"tools.backtranslate", "tools.request_batcher"},
    {"tools.libretranslate"},  # LibreTranslate's routes, over serve's Api (given, not imported)
    {"tools.serve"},
    {"training.fsdp"},  # FSDP2's shards gathered into nmt's checkpoint files and back (torch only)
    {"training.state"},
    {"training.evaluation"},
    {"training.loop"},
    {"training.timing"},  # the one timing probe and the config resolved with it (train and nmt check)
    {"training.run"},
    {"train", "tools.check"},
    {"cli"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
UPWARD = {  # the imports that point up on purpose, and why
    ("layers", "model"): "the annotation of a decoder layer's cache (SelfKV), imported under TYPE_CHECKING only",
    ("model", "decoding"): "Seq2SeqTransformer.generate, a convenience entry, calls search inside the method",
}
HOMES = {  # third-party library -> the only modules that import it (one home per library)
    "tokenizers": {"tokenizer"}, "evaluate": {"metrics"},
    "datasets": {"tables", "readers", "cleaning", "encoding", "data", "batching"},  # the data layer
    "pandas": {"cleaning"},  # the dedupe's string hashes
    "accelerate": {"compat", "launch", "checkpoint", *(n for n in LAYER if n.startswith("training."))},
    "matplotlib": {"tools.plot", "attention"}, "transformers": {"interop"},
    "starlette": {"tools.serve", "tools.libretranslate"},  # libretranslate: LibreTranslate's routes of the server
    "peft": {"adapters"}, "huggingface_hub": {"hub"}, "py3langid": {"language"}, "ctranslate2": {"ct2"},
    "uvicorn": {"tools.serve", "compat"},  # compat: the private protocol class serve extends
}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "nmt").rglob("*.py")):
        parts = path.relative_to(ROOT / "nmt").with_suffix("").parts
        if parts[0] != "metric_modules" and parts[-1] != "__init__":  # metric_modules: loaded by evaluate, by path
            out[".".join(parts)] = path
    return out


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function: nmt's without the "nmt." prefix."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            package = node.module in ("nmt", "nmt.training", "nmt.tools")  # from nmt import checkpoint: the module itself
            found |= {f"{node.module}.{a.name}" for a in node.names} if package else {node.module}
    return {name[4:] if name.startswith("nmt.") else name for name in found}


def test_every_module_has_a_layer():
    assert not sorted(set(modules()) - set(LAYER)), "give each new module its layer in LAYERS"


def test_imports_point_down_the_layers():
    wrong = []
    for name, path in modules().items():
        for dep in imports_of(path) & set(LAYER):
            if LAYER[dep] >= LAYER.get(name, len(LAYERS)) and (name, dep) not in UPWARD:
                wrong.append(f"{name} imports {dep}")
    assert not wrong, wrong


def test_each_library_has_one_home():
    imported = {name: imports_of(path) for name, path in modules().items()}
    wrong = [f"{name} imports {lib}" for name, found in imported.items() for lib, homes in HOMES.items()
             if name not in homes and any(d == lib or d.startswith(lib + ".") for d in found)]
    assert not wrong, wrong


def test_a_wrong_direction_import_is_caught(tmp_path):
    bad = tmp_path / "config.py"
    bad.write_text("def f():\n    from nmt.model import Seq2SeqTransformer\n")
    assert "model" in imports_of(bad) and LAYER["model"] > LAYER["config"]
