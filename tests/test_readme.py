"""The commands the documentation shows are real, so README.md and docs/*.md cannot rot.

README.md is a guide a user follows command by command: every command of its fenced blocks runs here as typed,
in page order, in one scratch directory that links the checkout's configs/, accelerate_configs/, run.py and
run.sh and holds the few files the page takes for granted (a tiny corpus as D/, input.en). Commands that train
get a tiny setting appended (FAST, or for the own-corpus command a tiny budget); what one CPU cannot run (a
launch with a GPU profile) goes through accelerate's own argument handling instead.

The pages of docs/ are reference: each of their commands is checked where that is cheap and cannot run as
typed otherwise: nmt's parser takes it and every config key it sets loads (with its config file), accelerate
resolves every launch line, YAML blocks load as configs, the imports of Python blocks exist, benchmark flags
exist in their scripts, and the SLURM script runs under a fake 2-node allocation.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from readme_harness import (
    ROOT,
    Cmd,
    link_venv,
    page_commands,
    resolve_launch,
    run_slurm_script,
    split_env,
    tail,
    without_redirections,
)

README = page_commands("README.md", (ROOT / "README.md").read_text(encoding="utf-8"))
DOCS = [c for page in sorted((ROOT / "docs").glob("*.md"))
        for c in page_commands(f"docs/{page.name}", page.read_text(encoding="utf-8"))]
RUN = [c for c in README if c.fenced]  # run as typed
CHECKED = [c for c in README if not c.fenced] + DOCS  # checked without running

# Appended to commands that train from a --config (and to load_config in README's Python): the test corpus of
# conftest.corpus_dir, a tiny model, 3 optimizer steps with a checkpoint each. {corpus} is filled in per module.
FAST = ["--data.train", "{corpus}/train", "--data.valid", "{corpus}/valid", "--data.test", "{corpus}/test",
        "--data.src_lang", "en", "--data.tgt_lang", "xx", "--tokenizer.vocab_size", "300", "--model.d_model", "32",
        "--model.n_heads", "2", "--model.n_encoder_layers", "1", "--model.n_decoder_layers", "1", "--model.d_ff", "64",
        "--max_tokens", "400", "--max_steps", "3", "--eval_every", "3", "--save_every", "1", "--keep_last", "3",
        "--eval_max_sentences", "8", "--log_every", "1"]
STEPS = 3
# The own-corpus command runs with its own flags on the test corpus laid out as D/, and this appended: a later
# --max_minutes wins, so the budget plan runs as it does for 25 minutes, on a budget of 3 seconds.
TINY_BUDGET = ["--max_minutes", "0.05"]
LINKED = ["configs", "accelerate_configs", "run.py", "run.sh", "tests", "pyproject.toml"]
# The Hub ids README's commands name: an offline Hugging Face cache (HF_HUB_CACHE) holds a Marian model as OPUS-MT
# ships one under each, built when a command first names it
HUB_MODELS = ("Helsinki-NLP/opus-mt-en-de",)


# --- README: each command of its fenced blocks runs ---------------------------------------------------------------


def runner_for(cmd: Cmd) -> str | None:
    """How a fenced command of README runs; None: no rule knows it (test_every_readme_command_runs fails)."""
    if cmd.kind == "python":
        return "python"
    _, argv = split_env(cmd.text)
    if argv[:3] == ["bash", "run.sh", "test"]:
        return "run.sh test"
    if argv[:2] == ["bash", "run.sh"]:
        return "run.sh"
    if argv[:2] == ["pip", "install"]:
        return "pip"
    if argv[:2] == ["accelerate", "launch"] and "run.py" in argv:
        profile = yaml.safe_load((ROOT / argv[argv.index("--config_file") + 1]).read_text(encoding="utf-8"))
        return "train" if profile.get("use_cpu") else "resolve"
    if argv[:2] == ["nmt", "train"]:
        return "train" if "--config" in argv else "own corpus"
    if argv[:2] == ["nmt", "check"]:
        return "check"
    if argv[:2] == ["nmt", "serve"]:
        return "serve"
    if argv[:1] == ["curl"]:
        return "curl"
    if argv[:2] in (["nmt", "translate"], ["nmt", "evaluate"]):
        return "decode"
    if argv[:2] == ["nmt", "import"]:
        return "import"
    if argv[:2] == ["nmt", "export"]:
        return "export"
    return None


RUN_DIRS = re.compile(r"\bruns/\w+")
GLOSSARY_TARGET = "Haturi"  # a word of the synthetic target language (nmt.synthetic), the term README's glossary gives


def needs(cmd: Cmd) -> list[Cmd]:
    """The earlier commands that make what `cmd` uses: those naming one of its run directories (`runs/mine`),
    and for a `curl`, the `nmt serve` before it (which sends the request)."""
    earlier = RUN[: RUN.index(cmd)]
    if runner_for(cmd) == "curl":
        return [next(c for c in reversed(earlier) if runner_for(c) == "serve")]
    mine = set(RUN_DIRS.findall(cmd.text))
    return [c for c in earlier if mine & set(RUN_DIRS.findall(c.text)) and runner_for(c) != "curl"]


class Readme:
    """README's scratch directory and each command's outcome (every command runs once, earlier ones first)."""

    def __init__(self, tmp: Path, corpus: Path):
        self.dir = tmp / "readme"
        self.fast = [a.format(corpus=corpus) for a in FAST]
        self.done: dict[Cmd, BaseException | None] = {}
        self.memo: dict[Cmd, subprocess.CompletedProcess] = {}
        self.dir.mkdir()
        for name in LINKED:
            (self.dir / name).symlink_to(ROOT / name)
        link_venv(self.dir)
        (self.dir / "D").mkdir()
        for split in ("train", "valid", "test"):  # the own corpus: en -> de
            shutil.copy(corpus / f"{split}.en", self.dir / "D" / f"{split}.en")
            shutil.copy(corpus / f"{split}.xx", self.dir / "D" / f"{split}.de")
        lines = (corpus / "test.en").read_text(encoding="utf-8").splitlines(keepends=True)
        (self.dir / "input.en").write_text("".join(lines[:5]), encoding="utf-8")
        (self.dir / "big.en").write_text("".join(lines), encoding="utf-8")
        # what the pages' translate examples read: a glossary, markup, a document of two paragraphs
        (self.dir / "terms.tsv").write_text(f"{lines[0].split()[1]}\t{GLOSSARY_TARGET}\n", encoding="utf-8")
        tagged = [re.sub(r"^(\S+)", r"<b>\1</b>", line, count=1) for line in lines[:5]]
        (self.dir / "input.html").write_text("".join(tagged), encoding="utf-8")
        (self.dir / "letter.txt").write_text(f"{lines[0].strip()} {lines[1]}\n{lines[2]}", encoding="utf-8")
        (tmp / "home").mkdir()
        self.env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                     "MASTER_PORT", "ACCELERATE_USE_CPU")}
        # the scratch venv is active; HOME is scratch (accelerate's default config, ~/.cache/nmt)
        self.env.update(PATH=f"{self.dir / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp / "home"),
                        OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                        HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT), HF_HUB_CACHE=str(tmp / "hf-cache"))
        self.hub_built: set[str] = set()

    def run(self, cmd: Cmd, monkeypatch) -> None:
        if (error := self.outcome(cmd, monkeypatch)) is not None:
            raise error

    def outcome(self, cmd: Cmd, monkeypatch) -> BaseException | None:
        """What running `cmd` raised (None: it passed), running first what it needs."""
        if cmd not in self.done:
            for earlier in needs(cmd):
                if (error := self.outcome(earlier, monkeypatch)) is not None:
                    self.done[cmd] = pytest.fail.Exception(f"needs `{earlier.text}` ({earlier.id}), which failed: "
                                                           f"{error}")
                    return self.done[cmd]
            self._once(cmd, monkeypatch)
        return self.done[cmd]

    def _once(self, cmd: Cmd, monkeypatch) -> None:
        try:
            self.build_hub_models(cmd)
            RUNNERS[runner_for(cmd)](self, cmd, monkeypatch)
            self.done[cmd] = None
        except BaseException as e:  # noqa: BLE001 (recorded for the commands that need this one)
            self.done[cmd] = e

    def build_hub_models(self, cmd: Cmd) -> None:
        """The HUB_MODELS `cmd` names, in the offline cache as huggingface_hub lays out a download."""
        from helpers import hub_cache_entry, marian_directory

        from nmt.synthetic import generate_pairs

        for repo_id in HUB_MODELS:
            if repo_id in cmd.text and repo_id not in self.hub_built:
                built = self.dir.parent / "hub-models" / repo_id.replace("/", "--")
                built.mkdir(parents=True)
                hub_cache_entry(self.env["HF_HUB_CACHE"], repo_id, marian_directory(built, generate_pairs(300, seed=7)))
                self.hub_built.add(repo_id)

    def shell(self, text: str, extra: list[str] = ()) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", " ".join([text, *map(shlex.quote, extra)])], cwd=self.dir, env=self.env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)

    def load(self, config: str | None, flags: list[str]):
        from nmt.cli import overrides_from_flags
        from nmt.config import load_config

        return load_config(self.dir / config if config else None, overrides_from_flags(flags))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "model" / "training.json").read_text(encoding="utf-8"))


def run_sh(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """`bash run.sh` trains through accelerate launch, then prints test BLEU/chrF and five translations."""
    proc = readme.shell(cmd.text, readme.fast)
    assert proc.returncode == 0, tail(proc)
    out = readme.dir / readme.load("configs/default.yaml", readme.fast).output_dir
    assert f"nmt: trained {STEPS} steps" in proc.stdout and summary(out)["num_processes"] == 1, tail(proc)
    n = int(re.search(r"^== test set: (\d+) sentences, beam 4$", proc.stdout, re.M)[1])
    assert n == 40 and len((out / "test.hyp").read_text().splitlines()) == n, tail(proc)
    assert re.search(r"^BLEU [\d.]+  nrefs:1\|", proc.stdout, re.M) and re.search(r"^chrF [\d.]+  ", proc.stdout, re.M)
    assert len([line for line in proc.stdout.splitlines() if "  =>  " in line]) == 5, tail(proc)


def run_sh_test(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """`bash run.sh test` runs pytest with the project's settings; here it collects one file instead of running all
    (in this process: -n 0, no workers)."""
    proc = readme.shell(cmd.text, ["--collect-only", "-q", "-n", "0", "tests/test_config.py"])
    assert proc.returncode == 0 and re.search(r"^\d+ tests collected", proc.stdout, re.M), tail(proc)


def run_pip(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """A dry run against what is installed, from the checkout: installs nothing, no network."""
    _, argv = split_env(cmd.text)
    proc = subprocess.run(["python", "-m", *argv[:2], "--dry-run", "--no-index", "--no-build-isolation", *argv[2:]],
                          cwd=ROOT, env=readme.env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)


def run_own_corpus(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """The own-corpus command with its flags as written and TINY_BUDGET appended: the budget plan is printed
    with its reasons and saved, the run ends by itself and writes the model."""
    _, argv = split_env(cmd.text)
    proc = readme.shell(cmd.text, TINY_BUDGET)
    assert proc.returncode == 0, tail(proc)
    cfg = readme.load(None, [*argv[2:], *TINY_BUDGET])
    out = readme.dir / cfg.output_dir
    assert f"  model: {cfg.output_dir}/model" in proc.stdout and "stopped: the time budget is spent" in proc.stdout, \
        tail(proc)
    assert re.search(r"^nmt: plan: (fine-tuning \S+, )?chosen for the ", proc.stdout + proc.stderr, re.M), tail(proc)
    assert (out / "plan.json").is_file() and (out / "model" / "model.safetensors").is_file()


def run_training(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """`nmt train --config ...` and `accelerate launch ... run.py` with a CPU profile, with FAST appended; a
    resumed run continues from the checkpoint to 3 more steps, a fine-tuned one keeps its tokenizer file."""
    from nmt.cli import build_parser

    _, argv = split_env(cmd.text)
    args, flags = build_parser().parse_known_args(["train", *argv[argv.index("run.py") + 1:]] if "run.py" in argv
                                                  else argv[1:])
    resume = args.resume is not None
    extra = [*readme.fast, *(["--max_steps", str(2 * STEPS)] if resume else [])]
    proc = readme.shell(cmd.text, extra)
    assert proc.returncode == 0, tail(proc)
    cfg = readme.load(args.config, [*flags, *extra])
    out = readme.dir / cfg.output_dir
    processes = 1
    if "run.py" in argv:
        processes = yaml.safe_load((ROOT / argv[argv.index("--config_file") + 1]).read_text())["num_processes"]
    steps = 2 * STEPS if resume else STEPS
    assert f"nmt: trained {steps} steps" in proc.stdout and f"  model: {cfg.output_dir}/model" in proc.stdout, \
        tail(proc)
    assert summary(out)["num_processes"] == processes
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))  # each step once: one run
    if resume:
        assert f"resumed from {cfg.output_dir}/checkpoints/step_{STEPS} at step {STEPS}" in proc.stderr, tail(proc)
    if args.init_from:
        source = readme.dir / args.init_from
        assert (out / "model" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def run_check(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """`nmt check` reads the data, times its probe and exits 0 when it names no problem, else 1."""
    proc = readme.shell(cmd.text)
    assert proc.stdout.startswith("nmt check: "), tail(proc)
    assert re.search(r"^time +[\d.]+ s/step", proc.stdout, re.M), tail(proc)  # the timed probe ran
    assert proc.returncode == (0 if "problems  none found" in proc.stdout else 1), tail(proc)


def run_resolved(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """A launch with a GPU profile: accelerate resolves it into the profile's processes and run.py's config."""
    _, argv = split_env(cmd.text)
    check_launch(argv, monkeypatch)


def run_decode(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """`nmt translate` writes one line per input line (--paragraphs: per paragraph and blank line), as each of its
    options says: a glossary's term where its source term is, three TSV fields with --scores, the source's tags with
    --format html; `nmt evaluate` prints BLEU and chrF with signatures."""
    from nmt.sentences import paragraphs

    proc = readme.shell(cmd.text)
    assert proc.returncode == 0, tail(proc)
    words, redirect = without_redirections(split_env(cmd.text)[1])
    if words[1] == "translate":
        src = redirect["<"] if "<" in redirect else words[words.index("--input") + 1]
        dst = redirect[">"] if ">" in redirect else words[words.index("--output") + 1]
        given, out = ((readme.dir / path).read_text().splitlines() for path in (src, dst))
        assert len(out) == (len(list(paragraphs(given))) if "--paragraphs" in words else len(given)), tail(proc)
        if "--glossary" in words:
            term = (readme.dir / words[words.index("--glossary") + 1]).read_text().split("\t")[0]
            assert all(GLOSSARY_TARGET in o for g, o in zip(given, out) if term in g.split()), out
        if "--scores" in words:  # with --guard a 4th column: why a translation stays doubtful, or nothing
            columns = 4 if "--guard" in words else 3
            assert all(len(o.split("\t")) == columns and 0 <= float(o.split("\t")[2]) <= 1 for o in out), out
            assert all(o.split("\t")[3] in ("", "loop") for o in out if columns == 4), out  # one pair: no language
        if "--format" in words:
            assert all(o.count("<b>") == g.count("<b>") == o.count("</b>") for g, o in zip(given, out)), out
    else:
        bleu, chrf = proc.stdout.splitlines()
        assert re.match(r"BLEU [\d.]+  nrefs:1\|", bleu) and re.match(r"chrF [\d.]+  nrefs:1\|", chrf), proc.stdout


def run_serve(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """`nmt serve` as written but on a free loopback port; the `curl` commands after it are sent to it, then
    SIGTERM, which it answers by stopping with exit 0."""
    _, argv = split_env(cmd.text)
    server = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", "0"], cwd=readme.dir, env=readme.env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (line, server.stderr.read() if server.poll() is not None else "")
        port = line.split("127.0.0.1:")[1].split()[0]
        for client in RUN[RUN.index(cmd) + 1:]:
            if runner_for(client) != "curl":
                break
            request = re.sub(r"(localhost|127\.0\.0\.1):\d+", f"127.0.0.1:{port}", client.text)
            readme.memo[client] = readme.shell(request + " --noproxy '*' --write-out '\n%{http_code}'")
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0 and "nmt serve: stopped" in err, err[-2500:]


def run_curl(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """A request the `nmt serve` before it answered: HTTP 200 and a translation per sentence."""
    proc = readme.memo[cmd]
    body, status = proc.stdout.rsplit("\n", 1)
    assert proc.returncode == 0 and status == "200", tail(proc)
    sent = json.loads(re.search(r"-d '([^']*)'", cmd.text)[1])["sentences"]
    translations = json.loads(body)["translations"]
    assert len(translations) == len(sent) and all(isinstance(t, str) and t for t in translations)


def run_import(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """`nmt import` of a Marian model as OPUS-MT ships one (random weights, SentencePiece models of the test
    corpus, built offline: in the Hub cache for a Hub id of HUB_MODELS, else where the command names it) writes an
    nmt model directory that translates."""
    from helpers import marian_directory

    from nmt.synthetic import generate_pairs

    _, argv = split_env(cmd.text)
    hf_dir, out = readme.dir / argv[2], readme.dir / argv[3]
    if argv[2] not in HUB_MODELS:
        hf_dir.mkdir()
        marian_directory(hf_dir, generate_pairs(300, seed=7))
    proc = readme.shell(cmd.text)
    assert proc.returncode == 0, tail(proc)
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}, tail(proc)
    translated = readme.shell(f"echo 'a b c' | nmt translate {shlex.quote(str(out))} --beam 1")
    assert translated.returncode == 0 and len(translated.stdout.splitlines()) == 1, tail(translated)


def run_export(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """`nmt export --to transformers`: transformers' Auto classes load what it wrote."""
    import transformers

    _, argv = split_env(cmd.text)
    proc = readme.shell(cmd.text)
    assert proc.returncode == 0, tail(proc)
    out = readme.dir / argv[-1]
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(["a b c"], return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=5).shape[0] == 1


AFTER = {  # what statements of README's Python must have done, beyond not raising (by the statement's start)
    "result = train(cfg)": lambda ns: (ns["result"].model_dir / "training.json").is_file(),
    "Translator.from_pretrained(result.model_dir).translate(": lambda ns: [type(s) for s in ns["_"]] == [str],
}


def run_python(readme: Readme, cmd: Cmd, monkeypatch) -> None:
    """A Python block, statement by statement (like a notebook), in the scratch directory; load_config gets FAST."""
    import nmt
    import nmt.config
    from nmt.compat import reset_accelerate_state

    real = nmt.config.load_config
    fast = [f"{k[2:]}={v}" for k, v in zip(readme.fast[::2], readme.fast[1::2])]
    monkeypatch.setattr(nmt.config, "load_config", lambda path=None, overrides=None: real(path, [*overrides, *fast]))
    monkeypatch.setattr(nmt, "load_config", nmt.config.load_config)
    monkeypatch.chdir(readme.dir)
    monkeypatch.setenv("HOME", readme.env["HOME"])
    ns: dict = {"__name__": "__readme__"}
    checked = set()
    try:
        for stmt in ast.parse(cmd.text).body:
            source = ast.get_source_segment(cmd.text, stmt)
            if isinstance(stmt, ast.Expr):
                ns["_"] = eval(compile(ast.Expression(stmt.value), cmd.id, "eval"), ns)
            else:
                exec(compile(ast.Module([stmt], []), cmd.id, "exec"), ns)
            for start, check in AFTER.items():
                if source.startswith(start):
                    assert check(ns), f"{cmd.id}: {source}"
                    checked.add(start)
    finally:
        reset_accelerate_state()
    assert checked == set(AFTER), f"README's Python no longer shows {set(AFTER) - checked}"


RUNNERS = {"run.sh": run_sh, "run.sh test": run_sh_test, "pip": run_pip, "own corpus": run_own_corpus,
           "train": run_training, "check": run_check, "resolve": run_resolved, "decode": run_decode,
           "serve": run_serve, "curl": run_curl, "python": run_python, "import": run_import, "export": run_export}


@pytest.fixture(scope="module")
def readme(corpus_dir, tmp_path_factory) -> Readme:
    return Readme(tmp_path_factory.mktemp("readme"), corpus_dir)


def marks(cmd: Cmd) -> list:
    """README's commands are one end-to-end run of the guide (its decoding commands need its trainings): slow, and
    multi-process where a launch starts two processes; the quick subset checks the pages without running them."""
    if "cpu_2proc" in cmd.text and runner_for(cmd) == "train":
        return [pytest.mark.multiprocess]
    return [pytest.mark.slow]


def test_every_readme_command_runs():
    unknown = [f"{c.id}: {c.text}" for c in RUN if runner_for(c) is None]
    assert not unknown, "README commands no rule of tests/test_readme.py runs (teach runner_for):\n" + "\n".join(unknown)


def test_the_own_corpus_section_starts_with_the_budget_command():
    """The section's first block is the command a user copies: its flags, in this order, placeholders as written."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Train on your own corpus"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    assert [" ".join(line.split()) for line in block.replace("\\\n", " ").splitlines()] == [
        "nmt train --data.train D/train --data.valid D/valid --data.test D/test --data.src_lang en "
        "--data.tgt_lang de --max_minutes 25 --output_dir runs/mine",
        "nmt evaluate runs/mine/model --src D/test.en --ref D/test.de"]


@pytest.mark.parametrize("cmd", [pytest.param(c, id=c.id, marks=marks(c)) for c in RUN])
def test_readme_command(cmd: Cmd, readme: Readme, monkeypatch):
    readme.run(cmd, monkeypatch)


# --- README's inline commands and the docs pages: checked without running ---------------------------------------


USAGE = re.compile(r"\.\.\.|\[|<\w+>|(?<![\w/.=-])[A-Z][A-Z_]*(?![\w=])")  # placeholders: ..., [opt], <x>, DIR, X.yaml


def nmt_subcommands() -> dict:
    from nmt.cli import build_parser

    return next(a for a in build_parser()._actions if a.choices and "train" in a.choices).choices


def config_keys() -> set[str]:
    from nmt.config import config_fields

    return {row[0] for row in config_fields()}


def check_nmt(argv: list[str], text: str) -> None:
    """A subcommand that exists; with placeholders every flag exists (an option, or a config key of train and
    check); else the line parses and, for train and check, its config file and keys load."""
    from nmt.cli import build_parser, overrides_from_flags
    from nmt.config import load_config

    words, _ = without_redirections(argv)
    if {"-h", "--help"} & set(words):  # cheap to run: the help is printed and nmt exits 0
        with pytest.raises(SystemExit) as exited, contextlib.redirect_stdout(io.StringIO()) as shown:
            build_parser().parse_args(words[1:])
        assert exited.value.code == 0 and shown.getvalue().startswith("usage: nmt"), shown.getvalue()[:500]
        return
    subs = nmt_subcommands()
    assert words[1] in subs, f"no `nmt {words[1]}`: {sorted(subs)}"
    if len(words) == 2:
        return  # a command's name in the prose
    sub, trains = subs[words[1]], words[1] in ("train", "check")
    if USAGE.search(re.sub(r"'[^']*'", "''", text)):  # a placeholder outside quotes ('[a, b]' is a YAML list)
        flags = [w.split("=")[0] for w in words[2:] if w.startswith("-") and w != "..."]
        unknown = [f for f in flags if f not in sub._option_string_actions
                   and not (trains and f[2:].replace("-", "_") in config_keys())]
        assert not unknown, f"flags that nmt {words[1]} does not know: {unknown}"
        return
    args, extra = build_parser().parse_known_args(words[1:])
    if not trains:
        assert not extra, f"flags that nmt {words[1]} does not know: {extra}"
        return
    config = ROOT / args.config if args.config and (ROOT / args.config).is_file() else None  # yours: keys only
    load_config(config, overrides_from_flags(extra))


def check_launch(argv: list[str], monkeypatch) -> None:
    """`accelerate launch [flags] run.py ...`: accelerate resolves it (each profile a <profile> stands for) into
    the processes of its profile, and run.py's config and keys load."""
    from nmt.cli import overrides_from_flags
    from nmt.config import load_config

    script = argv.index("run.py")
    template = argv[argv.index("--config_file") + 1]
    profiles = sorted(ROOT.glob(re.sub(r"<\w+>", "*", template)))
    assert profiles, f"no profile {template}"
    for profile in profiles:
        name = str(profile.relative_to(ROOT))
        ns = resolve_launch([w.replace(template, name) for w in argv[2:script + 1]], monkeypatch)
        given = yaml.safe_load(profile.read_text(encoding="utf-8"))
        processes = int(argv[argv.index("--num_processes") + 1]) if "--num_processes" in argv else given["num_processes"]
        assert ns.num_processes == processes, name
    rest = argv[script + 1:]
    load_config(ROOT / rest[1], overrides_from_flags(rest[2:]))


def check_accelerate(argv: list[str], monkeypatch) -> None:
    if argv[1] == "launch" and len(argv) > 2:
        return check_launch(argv, monkeypatch)
    import argparse

    from accelerate.commands import accelerate_cli as cli

    sub = argparse.ArgumentParser().add_subparsers()
    for name in dir(cli):
        if name.endswith("_parser"):  # get_config_parser, launch_command_parser, ... as accelerate's main() uses them
            getattr(cli, name)(subparsers=sub)
    assert argv[1] in sub.choices, sorted(sub.choices)


def check_run_sh(env: dict, argv: list[str]) -> None:
    """The variables are ones run.sh reads, the files they name exist, and extra arguments are config overrides."""
    from nmt.cli import overrides_from_flags
    from nmt.config import load_config

    source = (ROOT / "run.sh").read_text(encoding="utf-8")
    for name, value in env.items():
        assert f"${{{name}:-" in source and (ROOT / value).is_file(), f"{name}={value}"
    if argv[2:3] != ["test"]:
        load_config(ROOT / env.get("CONFIG", "configs/default.yaml"), overrides_from_flags(argv[2:]))


def check_pip(argv: list[str]) -> None:
    """`pip install -e ".[a,b]"`: extras pyproject.toml defines; a package by name: one an extra or a profile needs."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for word in argv[2:]:
        if m := re.fullmatch(r"\.\[([\w,]+)\]", word):
            assert set(m[1].split(",")) <= set(extras), word
        elif not word.startswith("-"):
            needed = {re.split(r"[<>=\[]", d)[0] for deps in extras.values() for d in deps}
            assert word in needed, word


def check_python_script(argv: list[str]) -> None:
    """`python benchmarks/x.py --flag ...`: the script exists and defines every flag shown (those after a lone `--`
    are the nmt settings it passes on, checked as `nmt train` flags); `python -m m`: m exists."""
    if argv[1] == "-m":
        assert importlib.util.find_spec(argv[2]), argv[2]
        return
    own, passed = (argv[2:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv[2:], [])
    if passed:
        check_nmt(["nmt", "train", *passed], " ".join(["nmt", "train", *passed]))
    source = (ROOT / argv[1]).read_text(encoding="utf-8")
    missing = [w for w in own if w.startswith("--") and f'"{w}"' not in source]
    assert not missing, f"{argv[1]} defines no {missing}"


def check_curl(text: str) -> None:
    """A request to an endpoint nmt serve routes."""
    path = re.search(r"localhost:\d+(/\w+)", text)[1]
    assert f'"{path}"' in (ROOT / "nmt" / "tools" / "serve.py").read_text(encoding="utf-8"), path


EXECUTED = {"docs/configuration.md"}  # pages whose Python only builds configs: cheap enough to run, from the checkout


def check_python_block(cmd: Cmd, monkeypatch) -> None:
    """The block compiles and every name it imports from nmt exists; on the EXECUTED pages it runs."""
    tree = ast.parse(cmd.text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "nmt":
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            assert not missing, f"{node.module} has no {missing}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
    if cmd.page in EXECUTED:
        monkeypatch.chdir(ROOT)
        exec(compile(tree, cmd.id, "exec"), {"__name__": "__docs__"})


def check_slurm(text: str, tmp: Path, monkeypatch) -> None:
    """Under fake srun/scontrol/accelerate on 2 nodes: each node's launch gets its own --machine_rank, all 16
    processes and the first host as rendezvous; the script requeues the job after a new checkpoint, ends after
    the final model and fails without either. In double quotes instead, both nodes would claim rank 0."""
    calls, log = run_slurm_script(text, tmp / "layout", status=1)
    assert "scontrol show hostnames gpu-[01-02]" in log and "requeue" not in log
    assert [c[0] for c in calls] == ["launch", "launch"], calls
    for node, call in enumerate(calls):
        ns = resolve_launch(call[1:call.index("run.py") + 1], monkeypatch)
        assert (ns.machine_rank, ns.num_processes, ns.num_machines) == (node, 16, 2)
        assert (ns.main_process_ip, ns.main_process_port) == ("gpu-01", 29500)
    _, log = run_slurm_script(text, tmp / "checkpoint", makes="checkpoints/step_40/model.safetensors")
    assert "scontrol requeue 77" in log
    _, log = run_slurm_script(text, tmp / "done", makes="checkpoints/step_90/x model/training.json")
    assert "requeue" not in log
    quoted, n = re.subn(r"bash -c '([^']*)'", r'bash -c "\1"', text)
    assert n == 1, "the script passes the per-node command to srun in single quotes"
    calls, _ = run_slurm_script(quoted, tmp / "quoted", status=1)
    assert [c[c.index("--machine_rank") + 1] for c in calls] == ["0", "0"]  # the trap the quotes avoid


def check_command(cmd: Cmd, tmp: Path, monkeypatch) -> None:
    if cmd.kind == "python":
        return check_python_block(cmd, monkeypatch)
    if cmd.kind == "script":
        return check_slurm(cmd.text, tmp, monkeypatch)
    env, argv = split_env(cmd.text)
    if argv[:1] == ["taskset"]:  # pinned to a core: the command after `taskset -c N`
        argv = argv[3:]
    if argv[0] == "nmt":
        return check_nmt(argv, cmd.text)
    if argv[0] == "accelerate":
        return check_accelerate(argv, monkeypatch)
    if argv[:2] == ["bash", "run.sh"]:
        return check_run_sh(env, argv)
    if argv[:2] == ["pip", "install"]:
        return check_pip(argv)
    if argv[0] == "python":
        return check_python_script(argv)
    if argv[0] == "curl":
        return check_curl(cmd.text)
    pytest.fail(f"no rule of tests/test_readme.py checks `{cmd.text}`")


def test_the_executed_pages_show_python():
    assert all(any(c.page == page and c.kind == "python" for c in DOCS) for page in EXECUTED)


@pytest.mark.parametrize("cmd", [pytest.param(c, id=c.id) for c in CHECKED])
def test_documented_command(cmd: Cmd, tmp_path, monkeypatch):
    check_command(cmd, tmp_path, monkeypatch)


YAML_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.M | re.S)


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))])
def test_yaml_blocks_load_as_configs(page, tmp_path):
    from nmt.config import load_config

    for i, block in enumerate(YAML_BLOCK.findall((ROOT / page).read_text(encoding="utf-8"))):
        (tmp_path / f"{i}.yaml").write_text(block, encoding="utf-8")
        load_config(tmp_path / f"{i}.yaml")


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))])
def test_links_lead_to_files(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    missing = [t for t in targets if not ((ROOT / page).parent / t).exists()]
    assert not missing, f"{page} links to missing files: {missing}"


SHIPPED = ["README.md", "run.sh", "run.py", "pyproject.toml", ".ci/run",
           *(str(p.relative_to(ROOT)) for folder in ("docs", "configs", "accelerate_configs", "benchmarks", "examples",
                                                     "nmt") for p in sorted((ROOT / folder).rglob("*"))
             if p.is_file() and p.suffix in {".md", ".py", ".yaml", ".sh", ".ipynb", ".html"})]
# a path into the checkout as a file names it: a top folder, then a file name with its extension
NAMED_PATH = re.compile(r"(?<![\w./-])((?:docs|configs|accelerate_configs|benchmarks|examples|nmt|tests|\.ci)"
                        r"/[\w./-]*\.(?:md|py|yaml|sh|ipynb|html|json|toml))\b")


def named_paths(text: str) -> list[str]:
    """The checkout's files `text` names (`tests/test_x.py::case` names tests/test_x.py)."""
    return NAMED_PATH.findall(text)


@pytest.mark.parametrize("shipped", SHIPPED)
def test_every_path_a_shipped_file_names_exists(shipped):
    """README, docs, profiles, configs, benchmarks and the package name only files that are there."""
    missing = [t for t in named_paths((ROOT / shipped).read_text(encoding="utf-8")) if not (ROOT / t).exists()]
    assert not missing, f"{shipped} names missing files: {missing}"


def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch):
    """Negative controls: a misspelt flag or config key, a bad value and an unknown command are each refused."""
    bad = ["nmt train --config configs/default.yaml --modle.d_model 8", "nmt translate m --bem 4 < a.en",
           "nmt train --config configs/default.yaml --optim.lr 7", "nmt info MODEL_DIR --jsno",
           "python benchmarks/decode_speed.py --roundz 3", "pip install -e .[nope]", "torchrun train.py"]
    for text in bad:
        try:
            check_command(Cmd("P.md", 1, "shell", text, False), tmp_path, monkeypatch)
        except (Exception, SystemExit, pytest.fail.Exception):
            continue
        pytest.fail(f"accepted: {text}")
    assert named_paths("see docs/nope.md, `tests/test_x.py::case`") == ["docs/nope.md", "tests/test_x.py"]
