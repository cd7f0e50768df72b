"""Every command the documentation shows is run, so README.md and docs/*.md cannot rot.

The commands are the lines of the fenced ```bash blocks, the fenced ```python blocks, and the inline spans of the
prose that start like a command line (`nmt ...`, `accelerate ...`, `bash run.sh`, `pip ...`). Each is run as a user
would type it, in a scratch directory that links the checkout's configs/, accelerate_configs/, run.py, run.sh and
.venv and holds the few files the pages take for granted (INPUTS, RUNS); the commands that train get FAST appended
(the test corpus, a tiny model, 3 steps). What one CPU machine cannot run is resolved instead: the SLURM script
runs under fake `srun`/`scontrol`/`accelerate` on a simulated 2-node allocation, launches with GPU profiles go
through accelerate's own argument handling, and usage lines with placeholders are checked against the parsers.
test_every_command_has_a_runner fails when a page gains a command that none of the rules here knows how to run.
This file holds the rules and the checks; tests/readme_harness.py the machinery (reading the pages, scratch
venvs, the fake cluster).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from readme_harness import (
    FAKES,
    USAGE,
    Cmd,
    accelerate_commands,
    link_venv,
    nmt_in_process,
    page_commands,
    parse_nmt,
    profile_of,
    resolve_launch,
    run_slurm_script,
    split_env,
    tail,
)

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
PNG = b"\x89PNG\r\n\x1a\n"

# Appended to every command that trains (and to load_config in the pages' Python): the test corpus of
# conftest.corpus_dir, a small model, 3 optimizer steps with a checkpoint each (`nmt average --last 3`).
# {corpus} and {cache} are filled in per session.
FAST = ["--data.train", "{corpus}/train", "--data.weights", "null",  # one corpus in place of the page's: no weights
        "--data.valid", "{corpus}/valid", "--data.test", "{corpus}/test",
        "--data.src_lang", "en", "--data.tgt_lang", "xx", "--data.cache_dir", "{cache}", "--tokenizer.vocab_size", "300",
        "--model.n_heads", "2", "--model.n_encoder_layers", "1", "--model.n_decoder_layers", "1", "--model.d_ff", "64",
        "--max_tokens", "400", "--max_steps", "3", "--eval_every", "3", "--save_every", "1", "--keep_last", "3",
        "--eval_max_sentences", "8", "--log_every", "1"]
STEPS = 3

# What the pages take for granted in the directory where their commands are typed; all else they make
# themselves. File -> (file of the test corpus, first n lines or all).
INPUTS = {"input.en": ("test.en", 5), "one.en": ("test.en", 1), "x": ("test.en", 1), "test.en": ("test.en", 10),
          "test.xx": ("test.xx", 10),
          "mono.de": ("test.en", 10)}  # back-translated by the page's reverse model, which FAST makes en -> xx
# Runs a page presupposes, copied from one tiny run trained once per module.
RUNS = {"README.md": ["runs/base"],  # nmt plot runs/small runs/base: a second run to overlay
        "docs/fast-decoding.md": ["runs/default"]}  # the run `bash run.sh` makes
LINKED = ["configs", "accelerate_configs", "run.py", "run.sh", "tests", "pyproject.toml"]

# Names a page's Python uses without defining them; the page says where they come from.
GIVENS = {
    "README.md": {"src_ids": lambda: _torch().tensor([[5, 6, 7, 3], [8, 9, 3, 0]]),  # the model contract
                  "tgt_in_ids": lambda: _torch().tensor([[2, 5, 6], [2, 8, 0]])},
    "docs/fast-decoding.md": {"translator": lambda: _translator("runs/default/model")},
}

# Blocks that continue an earlier block of their page: they run after it, in its directory and Python namespace.
# (a line of the later block, a line of the earlier block)
CONTINUES = [
    ("nmt translate runs/default/model --ct2 runs/default/ct2 --attention first.png < x",
     "nmt export runs/default/model --to ctranslate2 runs/default/ct2"),
    ("result = train(cfg, model=SeedTransformer(vocab, vocab))", "class SeedTransformer(nn.Module):"),
    ("nmt check --config configs/default.yaml --init-from runs/demo/model",
     "nmt train --config configs/default.yaml --output_dir runs/demo --overwrite"),
]

# Shown but not run, and why. Keys are the command (Python: the block), comments and extra blanks removed.
BENCHMARK = "a benchmark of minutes, run alone for its figures; tests/test_benchmarks.py runs each script in a tiny setting"
NOT_RUN = {
    "srun bash -c '...'": "a fragment of the SLURM script, which runs under fake srun (run_slurm)",
    "pip install deepspeed": "DeepSpeed is not installed here and does not run on CPU",
    "python benchmarks/decode_speed.py": BENCHMARK,
    "python benchmarks/recipe.py --data ../shared/data/tatoeba-en-de --minutes 10 --subset 10000 --subset-only "
    "--systems budget,tuned-fp32": BENCHMARK,
    "python benchmarks/recipe.py --data ../shared/data/tatoeba-en-de --minutes 25 --systems budget,tuned-fp32": BENCHMARK,
    "python benchmarks/recipe.py --data ../shared/data/tatoeba-en-de --minutes 25 --systems budget,tuned,baseline":
        BENCHMARK,
    "python benchmarks/recipe.py --data ../shared/data/tatoeba-en-de --minutes 10 --subset 10000 --subset-only "
    "--systems budget,fixed,tuned": BENCHMARK,
    "python benchmarks/recipe.py --data ../shared/data/tatoeba-en-de --minutes 10 --subset 10000 --subset-only "
    "--systems budget": BENCHMARK,
    "python benchmarks/recipe.py --data ../shared/data/tatoeba-en-de --minutes 10 --subset 10000 --subset-only "
    "--systems budget,tuned": BENCHMARK,
    "python benchmarks/train_speed.py --data ../shared/data/tatoeba-en-de --mode both --systems nmt": BENCHMARK,
    "python benchmarks/decode_speed.py --profile": BENCHMARK,
    "python benchmarks/decode_speed.py --rounds 3": BENCHMARK,
    "python benchmarks/decode_speed.py --rounds 3 --threads 2": BENCHMARK,
    'python benchmarks/decode_speed.py --rounds 3 --threads 2 --only "nmt,CT2 float32"': BENCHMARK,
    "python benchmarks/ensemble.py --data ../shared/data/tatoeba-en-de --minutes 12": BENCHMARK,
    "python benchmarks/ensemble.py --data ../shared/data/tatoeba-en-de --minutes 3 optim.warmup_steps=100 eval_every=100 "
    "save_every=100": BENCHMARK,
    "python benchmarks/quality.py --data ../shared/data/tatoeba-en-de --minutes 25": BENCHMARK,
    "python benchmarks/quality.py --data ../shared/data/tatoeba-en-de --minutes 25 --baseline": BENCHMARK,
    "python benchmarks/train_speed.py --mode fp32 --rounds 5": BENCHMARK,
    "python benchmarks/train_speed.py --mode bf16 --systems nmt,hf --bf16-rounds 1 --max-tokens 1024": BENCHMARK,
    "python benchmarks/peak.py": BENCHMARK,
    "python benchmarks/recipe.py --data ../shared/data/tatoeba-en-de --minutes 10 25 75 --subset 10000": BENCHMARK,
    "python benchmarks/code_shape.py": "prints line counts of this checkout; tests/test_code_shape.py runs it",
    "python benchmarks/serve_load.py runs/default/model --clients 16 --requests 20": BENCHMARK,
    "python benchmarks/padding.py ../shared/data/tatoeba-en-de": BENCHMARK,
    "python benchmarks/scale.py ../shared/data/tatoeba-en-de --sizes 100k,1M,3M --work /tmp/nmt-scale": BENCHMARK,
    "tgt_mask = get_tgt_mask(sequence_length)\npred = model(X, y_input, tgt_mask=tgt_mask, src_pad_mask=src_pad_mask, "
    "tgt_pad_mask=tgt_pad_mask)": "the failing code of the DataParallel question that the page explains",
}


def _torch():
    import torch

    return torch


def _translator(model_dir: str):
    from nmt import Translator

    return Translator.from_pretrained(model_dir)


# --- the commands of the pages ---------------------------------------------------------------------------------


COMMANDS = [c for page in PAGES for c in page_commands(page, (ROOT / page).read_text(encoding="utf-8"))]


def runner_for(cmd: Cmd) -> str | None:
    """How a command of the pages is run; None: nobody knows (test_every_command_has_a_runner fails)."""
    if cmd.key in NOT_RUN:
        return "not run"
    if cmd.kind == "python":
        return "python"
    if cmd.kind == "script":
        if not re.search(r"^srun ", cmd.text, re.M):
            return None
        return "slurm requeue" if "--requeue" in cmd.text else "slurm"
    env, argv = split_env(cmd.text)
    if argv[:2] == ["pip", "install"]:
        return "pip"
    if argv[:1] == ["curl"]:
        block = [c for c in COMMANDS if (c.page, c.block) == (cmd.page, cmd.block) and c.kind == "shell"]
        return "curl" if any(c.text.startswith("nmt serve ") for c in block) else None  # to its block's server
    if re.fullmatch(r"(nmt|accelerate) [\w-]+", cmd.text):
        return "usage"  # a command's name in the prose (`nmt info shows them`): it must exist
    if USAGE.search(re.sub(r"'[^']*'", "''", cmd.text)):  # a placeholder outside quotes ('[a, b]' is a YAML list)
        return "usage" if argv[:1] == ["nmt"] or argv[:2] == ["accelerate", "launch"] else None
    if argv[:2] == ["bash", "run.sh"] and argv[2:3] == ["test"]:
        return "run.sh test"
    if argv[:2] == ["bash", "run.sh"]:  # trains for real in the quickstart; the prose's variants are checked cheaper
        return "train" if cmd.block >= 0 else "run.sh variant"
    if argv[:2] == ["accelerate", "launch"] and "run.py" in argv and "--config_file" in argv:
        return "train" if profile_of(argv).get("use_cpu") else "resolve"
    if argv[:2] == ["nmt", "train"] and {"--resume", "--overwrite", "--init-from"} & set(argv):
        return "continued"
    if argv[:1] == ["nmt"] and argv[1:2] and argv[1] in ("train", "check"):
        return "train"
    if argv[:1] == ["nmt"] and argv[1:2] == ["serve"]:
        return "serve"
    if argv[:1] == ["nmt"] and argv[1:2] and argv[1] in NMT_CHECKS:
        return "nmt"
    return None


def unit_of(cmd: Cmd) -> tuple:
    """Commands of one unit run in order in one directory: a fenced block (with the blocks that continue it),
    or an inline command alone."""
    if cmd.block < 0 and runner_for(cmd) == "run.sh variant":
        return (cmd.page, "run.sh variants")
    if cmd.block < 0:
        return (cmd.page, "line", cmd.line)
    block = [c for c in COMMANDS if (c.page, c.block) == (cmd.page, cmd.block)]
    for later, earlier in CONTINUES:
        if any(later in c.text for c in block):
            return unit_of(next(c for c in COMMANDS if c.page == cmd.page and earlier in c.text))
    return (cmd.page, "block", cmd.block)


# runners that read nothing from the directory: they need no earlier command
STANDALONE = {"not run", "usage", "resolve", "slurm", "slurm requeue", "pip", "run.sh test", "run.sh variant"}


def before(cmd: Cmd) -> list[Cmd]:
    """The earlier commands of the unit whose files this one may need."""
    if runner_for(cmd) in STANDALONE:
        return []
    unit = unit_of(cmd)
    return [c for c in COMMANDS[: COMMANDS.index(cmd)] if unit_of(c) == unit and runner_for(c) not in STANDALONE]


# --- running them -----------------------------------------------------------------------------------------------


class Docs:
    """The scratch directories of the pages, and each command's outcome (every command runs once)."""

    def __init__(self, tmp: Path, corpus: Path):
        self.tmp, self.corpus = tmp, corpus
        self.fast = [a.format(corpus=corpus, cache=tmp / "cache") for a in FAST]
        self.done: dict[Cmd, BaseException | None] = {}
        self.dirs: dict[tuple, Path] = {}
        self.namespaces: dict[tuple, dict] = {}
        self.memo: dict = {}  # results shared by several commands
        self._tiny_run: Path | None = None
        self.env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                     "MASTER_PORT", "ACCELERATE_USE_CPU")}
        (tmp / "home").mkdir()
        # the venv of the checkout is active; HOME is scratch (accelerate's default config, ~/.cache/nmt)
        self.env.update(PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp / "home"),
                        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")

    def tiny_run(self) -> Path:
        """A run directory trained once per module (3 steps, 3 checkpoints, model/)."""
        if self._tiny_run is None:
            from nmt import train
            from tests.conftest import tiny_config

            cfg = tiny_config(self.corpus, self.tmp, max_steps=STEPS, eval_every=STEPS, save_every=1, keep_last=3)
            self._tiny_run = train(cfg).model_dir.parent
        return self._tiny_run

    def workdir(self, cmd: Cmd) -> Path:
        unit = unit_of(cmd)
        if unit not in self.dirs:
            self.dirs[unit] = d = Path(tempfile.mkdtemp(prefix="page-", dir=self.tmp))
            for name in LINKED:
                (d / name).symlink_to(ROOT / name)
            link_venv(d, RECORDED if runner_for(cmd) == "run.sh variant" else ())
            for name, (source, n) in INPUTS.items():
                lines = (self.corpus / source).read_text(encoding="utf-8").splitlines(keepends=True)
                (d / name).write_text("".join(lines[:n]), encoding="utf-8")
            for path in RUNS.get(cmd.page, []):
                shutil.copytree(self.tiny_run(), d / path)
        return self.dirs[unit]

    def run(self, cmd: Cmd, monkeypatch) -> None:
        for earlier in before(cmd):
            if missing_extra(earlier):  # skipped itself; what comes after does not use what it would make
                continue
            if earlier not in self.done:
                self._once(earlier, monkeypatch)
            if self.done[earlier] is not None:
                pytest.fail(f"{cmd.id} needs `{earlier.text}` ({earlier.id}), which failed: {self.done[earlier]}")
        if cmd in self.done:
            if self.done[cmd] is not None:
                raise self.done[cmd]
            return
        self._once(cmd, monkeypatch)
        if self.done[cmd] is not None:
            raise self.done[cmd]

    def _once(self, cmd: Cmd, monkeypatch) -> None:
        try:
            RUNNERS[runner_for(cmd)](self, cmd, monkeypatch)
            self.done[cmd] = None
        except BaseException as e:  # noqa: BLE001 (recorded for the commands that need this one)
            self.done[cmd] = e

    def shell(self, cmd: Cmd, extra: list[str] = (), env: dict | None = None) -> subprocess.CompletedProcess:
        line = " ".join([cmd.text, *map(shlex.quote, extra)])
        return subprocess.run(["bash", "-c", line], cwd=self.workdir(cmd), env={**self.env, **(env or {})},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)


RECORDED = ("accelerate", "nmt")  # replaced in .venv/bin for run.sh's variants


def run_training(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """`nmt train`, `nmt check`, `accelerate launch ... run.py` with a CPU profile, `bash run.sh`: with FAST."""
    from nmt.cli import overrides_from_flags
    from nmt.config import load_config

    proc = docs.shell(cmd, docs.fast)
    wd, (env, argv) = docs.workdir(cmd), split_env(cmd.text)
    if argv[:2] == ["nmt", "check"]:
        return check_preflight(proc, argv)
    assert proc.returncode == 0, tail(proc)
    if argv[0] == "bash":
        config, rest = env.get("CONFIG", "configs/default.yaml"), argv[2:]
        processes = yaml.safe_load((ROOT / env.get("PROFILE", "accelerate_configs/cpu.yaml")).read_text())["num_processes"]
    else:
        rest = argv[argv.index("run.py") + 1:] if "run.py" in argv else argv[2:]
        config = rest[rest.index("--config") + 1]
        rest = rest[: rest.index("--config")] + rest[rest.index("--config") + 2:]
        processes = profile_of(argv)["num_processes"] if "run.py" in argv else 1
        assert "model saved to" in proc.stdout, tail(proc)
    cfg = load_config(wd / config, overrides_from_flags([*rest, *docs.fast]))
    out = wd / cfg.output_dir
    summary = json.loads((out / "model" / "training.json").read_text())
    assert (summary["step"], summary["num_processes"]) == (STEPS, processes)
    assert proc.stderr.count(f"valid @ step {STEPS}:") == 1, tail(proc)  # the main process prints, the others not
    if argv[0] == "bash":
        check_run_sh(proc, out)


def run_continued(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """`nmt train` on an output_dir that holds a run (--resume: 3 more steps than FAST's, a budget change it
    may make; --overwrite: the old run is moved aside) or from a model directory (--init-from: its tokenizer file
    byte for byte)."""
    from nmt.cli import build_parser, overrides_from_flags
    from nmt.config import load_config

    wd, (_, argv) = docs.workdir(cmd), split_env(cmd.text)
    steps = 2 * STEPS if "--resume" in argv else STEPS
    args, overrides = build_parser().parse_known_args(argv[1:])
    output_dir = load_config(wd / args.config, overrides_from_flags([*overrides, *docs.fast])).output_dir
    out = wd / output_dir
    before = sorted(out.parent.glob(f"{out.name}.old-*"))
    proc = docs.shell(cmd, [*docs.fast, "--max_steps", str(steps)])
    assert proc.returncode == 0 and f"model saved to {output_dir}/model after {steps} steps" in proc.stdout, tail(proc)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1)), rows  # each step once, one run
    if "--resume" in argv:
        assert f"resumed from {output_dir}/checkpoints/step_{STEPS} at step {STEPS}" in proc.stderr, tail(proc)
    if "--overwrite" in argv:
        assert len(sorted(out.parent.glob(f"{out.name}.old-*"))) == len(before) + 1
    if "--init-from" in argv:
        source = wd / argv[argv.index("--init-from") + 1]
        assert (out / "model" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def check_run_sh(proc: subprocess.CompletedProcess, out: Path) -> None:
    """run.sh after training: test BLEU/chrF of the run's model and five translations."""
    n = int(re.search(r"^== test set: (\d+) sentences, beam 4$", proc.stdout, re.M)[1])
    assert n == 40 and len((out / "test.hyp").read_text().splitlines()) == n, tail(proc)
    assert re.search(r"^BLEU [\d.]+  nrefs:1\|", proc.stdout, re.M) and re.search(r"^chrF [\d.]+  ", proc.stdout, re.M)
    assert len([line for line in proc.stdout.splitlines() if "  =>  " in line]) == 5, tail(proc)


def check_preflight(proc: subprocess.CompletedProcess, argv: list[str]) -> None:
    args, _, _, _ = parse_nmt(argv)
    n = yaml.safe_load((ROOT / args.profile).read_text())["num_processes"] if args.profile else 1
    assert proc.stdout.startswith("nmt check: "), tail(proc)
    assert f"for {n} process" in proc.stdout.splitlines()[0]
    assert re.search(r"^time +[\d.]+ s/step", proc.stdout, re.M), tail(proc)  # the timed probe ran
    assert proc.returncode == (0 if "problems  none found" in proc.stdout else 1), tail(proc)


def run_nmt(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """`nmt translate/evaluate/plot/info/average/export` as written, then what it must have made. README's
    commands run in a shell; the docs pages' through nmt.cli.main in this process (the same parser and code,
    without starting an interpreter each: the pages are cheap to cover that way)."""
    args, words, stdin, stdout = parse_nmt(split_env(cmd.text)[1])
    wd = docs.workdir(cmd)
    if cmd.page == "README.md":
        proc = docs.shell(cmd)
        assert proc.returncode == 0, tail(proc)
        shown = proc.stdout
    else:
        shown = nmt_in_process(words, wd, stdin, stdout, monkeypatch)
    NMT_CHECKS[args.command](wd, args, stdin, (wd / stdout).read_text() if stdout else shown)


def check_translate(wd: Path, args, stdin: str | None, out: str) -> None:
    n = len((wd / (stdin or args.input)).read_text().splitlines())
    assert len(((wd / args.output).read_text() if args.output else out).splitlines()) == n
    if args.attention:
        assert (wd / args.attention).read_bytes().startswith(PNG)


def check_evaluate(wd: Path, args, stdin: str | None, out: str) -> None:
    bleu, chrf = out.splitlines()
    assert re.match(r"BLEU [\d.]+  nrefs:1\|", bleu) and re.match(r"chrF [\d.]+  nrefs:1\|", chrf), out


def check_plot(wd: Path, args, stdin: str | None, out: str) -> None:
    assert (wd / (args.output or f"{args.run_dirs[0]}/curves.png")).read_bytes().startswith(PNG)


def check_info(wd: Path, args, stdin: str | None, out: str) -> None:
    assert out.startswith("model ") and "\nparameters " in out and "\ncommand " in out, out


def check_average(wd: Path, args, stdin: str | None, out: str) -> None:
    summary = json.loads((wd / args.output / "training.json").read_text())
    assert len(summary["averaged"]) == args.last and (wd / args.output / "model.safetensors").is_file()


def check_export(wd: Path, args, stdin: str | None, out: str) -> None:
    assert (wd / args.out / "model.bin").is_file() and (wd / args.out / "tokenizer.json").is_file()


def check_score(wd: Path, args, stdin: str | None, out: str) -> None:
    lines = ((wd / args.output).read_text() if args.output else out).splitlines()
    assert len(lines) == len((wd / args.src).read_text().splitlines()), out
    for line in lines:
        fields = line.split("\t")
        assert len(fields) == (3 if args.per_token else 2) and float(fields[0]) <= float(fields[1]) <= 0, line


def check_backtranslate(wd: Path, args, stdin: str | None, out: str) -> None:
    """PREFIX.<the model's target> holds the translations, PREFIX.<its source> the input's lines, aligned."""
    from nmt.backtranslate import model_languages

    src_lang, tgt_lang = model_languages(wd / args.model_dir)
    text = (wd / args.input).read_text(encoding="utf-8").splitlines()
    synthetic = (wd / f"{args.output}.{tgt_lang}").read_text(encoding="utf-8").splitlines()
    assert (wd / f"{args.output}.{src_lang}").read_text(encoding="utf-8").splitlines() == text
    assert len(synthetic) == len(text) and all(s.startswith(f"{args.tag} ") for s in synthetic if args.tag)
    assert f"wrote {len(text)} pairs" in out


NMT_CHECKS = {"translate": check_translate, "evaluate": check_evaluate, "plot": check_plot, "info": check_info,
              "average": check_average, "export": check_export, "score": check_score,
              "backtranslate": check_backtranslate}


def run_serve(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """`nmt serve` as written but on a free loopback port: the `curl` commands of its block are sent to it,
    then SIGTERM, which it must answer by stopping with exit 0."""
    import signal

    _, argv = split_env(cmd.text)
    server = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", "0"], cwd=docs.workdir(cmd), env=docs.env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, server.stderr.read() if server.poll() is not None else "")
        port = line.split("127.0.0.1:")[1].split()[0]
        for client in (c for c in COMMANDS if (c.page, c.block) == (cmd.page, cmd.block) and runner_for(c) == "curl"):
            request = re.sub(r"(localhost|127\.0\.0\.1):\d+", f"127.0.0.1:{port}", client.text)
            docs.memo[client] = subprocess.run(["bash", "-c", request + " --noproxy '*' --write-out '\n%{http_code}'"],
                                               cwd=docs.workdir(cmd), env=docs.env, capture_output=True, text=True,
                                               timeout=120)
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0 and "nmt serve: stopped" in err, err[-2500:]


def run_curl(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """A request its block's `nmt serve` sent for it (run_serve): HTTP 200 with a JSON answer."""
    proc = docs.memo[cmd]
    assert proc.returncode == 0, tail(proc)
    body, status = proc.stdout.rsplit("\n", 1)
    assert status == "200", tail(proc)
    answer = json.loads(body)
    if "/translate" in cmd.text:
        sent = json.loads(re.search(r"-d '([^']*)'", cmd.text)[1])["sentences"]
        assert len(answer["translations"]) == len(sent) and all(isinstance(t, str) for t in answer["translations"])


def run_sh_variant(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """The run.sh variants of a page's prose (PROFILE=..., CONFIG=..., extra arguments), combined into one run
    with recording `accelerate` and `nmt` in .venv/bin: what run.sh hands them follows every variable and
    argument. The quickstart's `bash run.sh` trains through run.sh for real; that the cpu_2proc profile trains
    on 2 ranks is tests/test_parallel.py's."""
    from nmt.cli import overrides_from_flags
    from nmt.config import load_config

    variants = [split_env(c.text) for c in COMMANDS if c.page == cmd.page and runner_for(c) == "run.sh variant"]
    env = {name: value for assigned, _ in variants for name, value in assigned.items()}
    assert len(env) == sum(len(assigned) for assigned, _ in variants), "variants that set one variable twice"
    args = [word for _, argv in variants for word in argv[2:]]
    combined = Cmd(cmd.page, 0, "shell", shlex.join([*(f"{k}={v}" for k, v in env.items()), "bash", "run.sh",
                                                            *args]), -1)
    if combined not in docs.memo:
        record = Path(tempfile.mkdtemp(dir=docs.tmp))
        docs.memo[combined] = record, docs.shell(combined, docs.fast, env={"RECORD": str(record)})
    record, proc = docs.memo[combined]
    assert proc.returncode == 0, tail(proc)
    profile, config = env.get("PROFILE", "accelerate_configs/cpu.yaml"), env.get("CONFIG", "configs/default.yaml")
    extra = [*args, *docs.fast]
    out = load_config(docs.workdir(cmd) / config, overrides_from_flags(extra)).output_dir
    calls = sorted(record.iterdir(), key=lambda p: int(p.name))
    launch, evaluate, translate = [p.read_text().split("\0")[:-1] for p in calls]
    assert launch == ["accelerate", "launch", "--config_file", profile, "run.py", "--config", config, *extra]
    assert evaluate[:3] + evaluate[7:] == ["nmt", "evaluate", f"{out}/model", "--output", f"{out}/test.hyp"], evaluate
    assert translate == ["nmt", "translate", f"{out}/model"]
    assert "== test set: 40 sentences, beam 4" in proc.stdout  # the test split of the config's data


def run_pip(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """A dry run against what is installed, from the checkout (`-e .` names it): installs nothing, no network."""
    _, argv = split_env(cmd.text)
    proc = subprocess.run(["python", "-m", *argv[:2], "--dry-run", "--no-index", "--no-build-isolation", *argv[2:]],
                          cwd=ROOT, env=docs.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)


def run_tests_of_run_sh(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """`bash run.sh test` runs pytest with the project's settings; here it collects one file instead of running all."""
    proc = docs.shell(cmd, ["--collect-only", "-q", "tests/test_config.py"])
    assert proc.returncode == 0 and re.search(r"^\d+ tests collected", proc.stdout, re.M), tail(proc)


def check_node(ns, machine_rank: int, processes: int, machines: int, address: str, config: str) -> None:
    """One node of a multi-node launch: its rank, its share of the processes, the rendezvous, the training config."""
    from nmt.cli import overrides_from_flags
    from nmt.config import load_config

    assert (ns.machine_rank, ns.num_processes, ns.num_machines) == (machine_rank, processes, machines)
    assert (ns.node_rank, int(ns.nproc_per_node), int(ns.nnodes)) == (machine_rank, processes // machines, machines)
    endpoint = getattr(ns, "rdzv_endpoint", None) or f"{ns.master_addr}:{ns.master_port}"
    assert endpoint == address
    script = ns.training_script_args
    assert ns.training_script == "run.py" and script[:2] == ["--config", config]
    load_config(ROOT / config, overrides_from_flags(script[2:]))


def run_resolved(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """A launch with a GPU profile (two nodes by hand): resolved, since it cannot run here."""
    _, argv = split_env(cmd.text)
    ns = resolve_launch(argv[2:], monkeypatch)
    profile = profile_of(argv)
    rank = int(argv[argv.index("--machine_rank") + 1]) if "--machine_rank" in argv else profile["machine_rank"]
    check_node(ns, rank, profile["num_processes"], profile["num_machines"],
               f"{profile['main_process_ip']}:{profile['main_process_port']}", "configs/default.yaml")


def run_slurm(docs: Docs, cmd: Cmd, monkeypatch, status: int = 0) -> None:
    """Both nodes get their own --machine_rank, all 16 processes and the first host as rendezvous; with the
    command in double quotes instead, the batch host would expand $SLURM_NODEID once for both (the README's claim).
    `status`: the script's exit status when the launches (recorded only) make no checkpoint."""
    calls = run_slurm_script(docs.env, cmd.text, Path(tempfile.mkdtemp(dir=docs.tmp)), status)
    assert [c[0] for c in calls] == ["launch", "launch"], calls
    for node, call in enumerate(calls):
        check_node(resolve_launch(call[1:], monkeypatch), node, 16, 2, "gpu-01:29500", "configs/default.yaml")
    quoted, n = re.subn(r"bash -c '([^']*)'", r'bash -c "\1"', cmd.text)
    assert n == 1, "the script should pass the per-node command to srun in single quotes"
    calls = run_slurm_script(docs.env, quoted, Path(tempfile.mkdtemp(dir=docs.tmp)), status)
    assert [c[c.index("--machine_rank") + 1] for c in calls] == ["0", "0"]  # the fakes see the trap


PYTHON_ACCELERATE = """#!{python}
import json, os, sys
with open(os.path.join(os.environ["RECORD"], "pid"), "w") as f:
    f.write(str(os.getpid()))
script = sys.argv.index("run.py")
extra = json.loads(os.environ["FAST"]) + os.environ["EXTRA"].split()
os.execv(sys.executable, [sys.executable, *sys.argv[script:], *extra])
"""


def run_slurm_requeue(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """The requeue script: laid out as the plain one (2 nodes by the recording fakes); then on one node for real
    (its `accelerate` runs run.py in this process group): a SIGTERM to the task as the time limit nears, the run
    saves and exits 0, the script requeues the job; the requeued job continues from the checkpoint and finishes."""
    import signal
    import time

    run_slurm(docs, cmd, monkeypatch, status=1)  # no checkpoint made: not requeued, exit 1
    tmp = Path(tempfile.mkdtemp(dir=docs.tmp))
    for name in ("bin", "record", "configs", "accelerate_configs", "run.py"):
        (tmp / name).mkdir() if name in ("bin", "record") else (tmp / name).symlink_to(ROOT / name)
    fakes = {**FAKES, "srun": '#!/bin/bash\necho "srun $*" >> "$RECORD/calls"\nexec "$@"\n',
             "accelerate": PYTHON_ACCELERATE.format(python=ROOT / ".venv" / "bin" / "python")}
    for name, body in fakes.items():
        (tmp / "bin" / name).write_text(body)
        (tmp / "bin" / name).chmod(0o755)
    (tmp / "job.sh").write_text(cmd.text)
    env = {**docs.env, "PATH": f"{tmp / 'bin'}{os.pathsep}{docs.env['PATH']}", "RECORD": str(tmp / "record"),
           "SLURM_JOB_NODELIST": "gpu-01", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
           "SLURM_JOB_ID": "77", "FAST": json.dumps(docs.fast), "PYTHONPATH": str(ROOT)}
    run, calls = tmp / "runs" / "nmt-77", tmp / "record" / "calls"
    job = subprocess.Popen(["bash", "job.sh"], cwd=tmp, env={**env, "EXTRA": "--max_steps 1000"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list((run / "checkpoints").glob("step_2")) and job.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.kill(int((tmp / "record" / "pid").read_text()), signal.SIGTERM)  # --signal=TERM@300: the task, not the shell
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0 and "scontrol requeue 77" in calls.read_text(), f"{out[-2000:]}\n{err[-3000:]}"
    stopped = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    again = subprocess.run(["bash", "job.sh"], cwd=tmp, env={**env, "EXTRA": f"--max_steps {stopped + 2}"},
                           capture_output=True, text=True, timeout=300)  # the requeued job: the same script
    assert again.returncode == 0, tail(again)
    assert f"resumed from runs/nmt-77/checkpoints/step_{stopped} at step {stopped}" in again.stderr, tail(again)
    assert f"after {stopped + 2} steps" in again.stdout and (run / "model" / "training.json").is_file(), tail(again)
    assert calls.read_text().count("scontrol requeue") == 1  # finished: not queued again


def run_usage(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """A usage line with placeholders, or a command's name: the (sub)command and every option shown exist;
    the profile files too."""
    from nmt.cli import build_parser

    _, argv = split_env(cmd.text.replace("[", " ").replace("]", " "))
    if argv[0] == "accelerate" and len(argv) == 2:
        assert argv[1] in accelerate_commands(), sorted(accelerate_commands())
        return
    if argv[0] == "nmt":
        sub = next(a for a in build_parser()._actions if a.choices and "train" in a.choices).choices[argv[1]]
        known, flags = sub._option_string_actions, [w.split("=")[0] for w in argv[2:] if w.startswith("-") and w != "..."]
        assert all(f in known for f in flags), [f for f in flags if f not in known]
        return
    from accelerate.commands.launch import launch_command_parser

    script = next((i for i, w in enumerate(argv) if w.endswith(".py")), len(argv))
    known = launch_command_parser()._option_string_actions
    assert all(w in known for w in argv[2:script] if w.startswith("--")), argv[2:script]
    if "--config_file" in argv:
        template = argv[argv.index("--config_file") + 1]
        profiles = sorted(ROOT.glob(re.sub(r"<\w+>", "*", template)))
        assert profiles, template
        for profile in profiles:  # each profile the line stands for is understood by accelerate
            resolve_launch([w.replace(template, str(profile.relative_to(ROOT))) for w in argv[2:script + 1]], monkeypatch)
    sub = next(a for a in build_parser()._actions if a.choices and "train" in a.choices).choices["train"]
    assert all(w in sub._option_string_actions for w in argv[script + 1:] if w.startswith("--") and w != "...")


AFTER = {  # what some statements of the pages must have done, beyond not raising (by the statement's start)
    "result = train(cfg": lambda ns: (ns["result"].model_dir / "training.json").is_file(),
    "Translator.from_pretrained(result.model_dir).translate(": lambda ns: [type(s) for s in ns["_"]] == [str],
    "launch(train, (cfg,), num_processes=2)":
        lambda ns: json.loads((Path(ns["cfg"].output_dir) / "model" / "training.json").read_text())["num_processes"] == 2,
    "logits = model(src_ids, tgt_in_ids)": lambda ns: ns["logits"].shape == (2, 3, 8000),
    "out = model.generate(": lambda ns: ns["out"].dtype == _torch().long and ns["out"].shape[0] == 2,
    'model.save_pretrained("d")': lambda ns: Path("d/model.safetensors").is_file(),
    "export_ctranslate2(": lambda ns: Path("runs/default/ct2/model.bin").is_file(),
    "fast.translate(": lambda ns: [type(s) for s in ns["_"]] == [str],
    "plot_alignment(": lambda ns: Path("alignment.png").read_bytes().startswith(PNG),
}


def run_python(docs: Docs, cmd: Cmd, monkeypatch) -> None:
    """A Python block, statement by statement (like a notebook), in its directory; load_config gets FAST."""
    import nmt
    import nmt.config
    from nmt.compat import reset_accelerate_state

    real = nmt.config.load_config

    def load_config(path=None, overrides=None):
        return real(path, [*(overrides or []), *(f"{k[2:]}={v}" for k, v in zip(docs.fast[::2], docs.fast[1::2]))])

    monkeypatch.setattr(nmt, "load_config", load_config)
    monkeypatch.setattr(nmt.config, "load_config", load_config)
    monkeypatch.chdir(docs.workdir(cmd))
    ns = docs.namespaces.setdefault(unit_of(cmd), {"__name__": "__page__"})
    ns.update({name: make() for name, make in GIVENS.get(cmd.page, {}).items() if name not in ns})
    tree = ast.parse(cmd.text)
    try:
        for stmt in tree.body:
            source = ast.get_source_segment(cmd.text, stmt)
            if isinstance(stmt, ast.Expr):
                ns["_"] = eval(compile(ast.Expression(stmt.value), cmd.id, "eval"), ns)
            else:
                exec(compile(ast.Module([stmt], []), cmd.id, "exec"), ns)
            for start, check in AFTER.items():
                if source.startswith(start):
                    assert check(ns), f"{cmd.id}: {source}"
    finally:
        reset_accelerate_state()


RUNNERS = {"train": run_training, "continued": run_continued, "run.sh variant": run_sh_variant, "nmt": run_nmt,
           "pip": run_pip, "serve": run_serve, "curl": run_curl, "run.sh test": run_tests_of_run_sh,
           "resolve": run_resolved, "slurm": run_slurm, "slurm requeue": run_slurm_requeue, "usage": run_usage,
           "python": run_python}


# --- the tests --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def docs(corpus_dir, tmp_path_factory) -> Docs:
    return Docs(tmp_path_factory.mktemp("docs"), corpus_dir)


def marks(cmd: Cmd) -> list:
    out = []
    if runner_for(cmd) in ("train", "python") and ("cpu_2proc" in cmd.text or "num_processes=2" in cmd.text):
        out.append(pytest.mark.multiprocess)
    if runner_for(cmd) == "train" and "run.sh" in cmd.text:
        out.append(pytest.mark.slow)
    return out


def test_every_command_has_a_runner():
    unknown = [f"{c.id}: {c.text if c.kind == 'shell' else c.text.splitlines()[0]}" for c in COMMANDS
               if runner_for(c) is None]
    assert not unknown, ("commands the docs show but tests/test_readme.py cannot run; teach it (runner_for) or list "
                         "them in NOT_RUN with the reason:\n" + "\n".join(unknown))


def test_tables_name_only_what_the_pages_show():
    keys = {c.key for c in COMMANDS}
    assert not [k for k in NOT_RUN if k not in keys]
    assert all(any(a in c.text for c in COMMANDS) and any(b in c.text for c in COMMANDS) for a, b in CONTINUES)
    statements = [ast.get_source_segment(c.text, s) for c in COMMANDS if c.kind == "python" and c.key not in NOT_RUN
                  for s in ast.parse(c.text).body]
    assert not [k for k in AFTER if not any(s.startswith(k) for s in statements)]
    shown = "\n".join(c.text for c in COMMANDS)
    assert not [name for name in INPUTS if not re.search(rf"(?<![\w/.]){re.escape(name)}(?![\w/])", shown)]


def test_extraction_finds_new_commands():
    """A command added to a page is found, and one no rule knows is reported (so it cannot go untested)."""
    page = ("Intro `nmt info runs/x/model` and `torchrun\n  train.py` and `accelerate_configs/`.\n\n```bash\n"
            "nmt translate m < a.en   # a # comment\nfoo --bar \\\n  baz\n```\n\n```python\nx = 1\n```\n")
    found = [(c.line, c.kind, c.text) for c in page_commands("P.md", page)]
    assert found == [(1, "shell", "nmt info runs/x/model"), (1, "shell", "torchrun train.py"),
                     (5, "shell", "nmt translate m < a.en"), (6, "shell", "foo --bar baz"), (11, "python", "x = 1\n")]
    assert [runner_for(Cmd("P.md", 1, "shell", t, 0)) for t in ("torchrun train.py", "foo --bar baz")] == [None, None]


# Commands of the optional extras (pyproject: ct2, bench) and the module each needs: without it installed (the
# dev install of CI has ctranslate2 but not transformers) they are skipped.
OPTIONAL = [(re.compile(r"ctranslate2|--ct2|\bct2\b|\[ct2\]|\[bench\]"), "ctranslate2"),
            (re.compile(r"\[bench\]"), "transformers"),
            (re.compile(r"^nmt serve |^curl |\[serve\]"), "uvicorn")]


def missing_extra(cmd: Cmd) -> str | None:
    """The optional module `cmd` needs that is not installed, if any."""
    import importlib.util

    for pattern, module in OPTIONAL:
        if pattern.search(cmd.text) and importlib.util.find_spec(module) is None:
            return module
    return None


@pytest.mark.parametrize("cmd", [pytest.param(c, id=c.id, marks=marks(c)) for c in COMMANDS])
def test_command(cmd: Cmd, docs: Docs, monkeypatch):
    if runner_for(cmd) == "not run":
        pytest.skip(f"not run: {NOT_RUN[cmd.key]}")
    if missing := missing_extra(cmd):
        pytest.skip(f"needs {missing}, an optional extra that is not installed")
    docs.run(cmd, monkeypatch)
