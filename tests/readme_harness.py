"""The harness of tests/test_readme.py: reading commands out of Markdown pages, scratch virtual environments
whose programs only record how they were called, nmt's parser and main on a typed command line, and a fake
2-node SLURM cluster (`srun`, `scontrol`, `accelerate`) with accelerate's own launch-argument handling.

The rules (which command runs how, what it must have made) are the test file's; this module only runs things.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


# --- the commands of a page ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cmd:
    page: str
    line: int
    kind: str  # "shell": one command line; "script": a whole #! script; "python": a code block
    text: str  # comments and extra blanks removed (Python: the block as it is)
    block: int  # the fenced block of the page it is in; -1: inline in the prose

    @property
    def id(self) -> str:
        words = split_env(self.text)[1][:2] if self.kind == "shell" else [self.kind]
        return f"{self.page}:{self.line}:{' '.join(words)}"

    @property
    def key(self) -> str:
        """The text without comments and extra blanks, line by line (what NOT_RUN is keyed by)."""
        lines = (" ".join(strip_comment(line).split()) for line in self.text.splitlines())
        return "\n".join(line for line in lines if line)


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # an inline span may wrap onto the next line
COMMAND = re.compile(r"(?:[A-Z][A-Z0-9_]*=\S+ )*(?:nmt|accelerate|bash|pip|python|torchrun|srun|sbatch|deepspeed) \S")
USAGE = re.compile(r"\.\.\.|\[|<\w+>|(?<![\w/.=-])[A-Z][A-Z_]*(?![\w=])")  # placeholders: ..., [opt], <x>, RUN_DIR, X.yaml


def strip_comment(line: str) -> str:
    """A shell line without its `# comment` (a # outside quotes, at the start or after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def page_commands(page: str, markdown: str) -> list[Cmd]:
    """The commands of one page, in page order; an inline span repeating an earlier command is not repeated."""
    out, prose = [], markdown
    for block, m in enumerate(FENCE.finditer(markdown)):
        prose = prose[: m.start()] + re.sub(r"[^\n]", " ", m[0]) + prose[m.end():]  # same offsets, no fences
        lang, body, first = m[1], m[2], markdown.count("\n", 0, m.start(2)) + 1
        if lang == "python":
            out.append(Cmd(page, first, "python", body, block))
        elif lang in ("bash", "sh", "shell", "console") and body.startswith("#!"):
            out.append(Cmd(page, first, "script", body, block))
        elif lang in ("bash", "sh", "shell", "console"):
            pending, start = "", first
            for i, raw in enumerate(body.splitlines()):
                pending, start = pending + raw, start if pending else first + i
                if pending.endswith("\\"):
                    pending = pending[:-1] + " "
                    continue
                text = " ".join(strip_comment(pending).split())
                if text:
                    out.append(Cmd(page, start, "shell", text, block))
                pending = ""
    seen = {c.text for c in out}
    for m in SPAN.finditer(prose):
        text = " ".join(m[1].split())
        if COMMAND.match(text) and text not in seen:
            seen.add(text)
            out.append(Cmd(page, prose.count("\n", 0, m.start()) + 1, "shell", text, -1))
    return sorted(out, key=lambda c: c.line)


def split_env(text: str) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 cmd args` -> ({"A": "1", "B": "2"}, ["cmd", "args"])."""
    words = shlex.split(text)
    env = {}
    while words and re.fullmatch(r"[A-Z][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def profile_of(argv: list[str]) -> dict:
    """The accelerate config file named by `--config_file` of an `accelerate launch` command line."""
    return yaml.safe_load((ROOT / argv[argv.index("--config_file") + 1]).read_text(encoding="utf-8"))


# --- scratch directories and nmt on a typed command line -------------------------------------------------------


RECORDER = '#!/bin/bash\nn=$(ls "$RECORD" | wc -l)\nprintf "%s\\0" "$(basename "$0")" "$@" > "$RECORD/$n"\ncat > /dev/null\n'


def link_venv(d: Path, recorded: tuple[str, ...] = ()) -> None:
    """The checkout's venv in d, marked installed (run.sh must not reinstall it); the `recorded` programs of
    .venv/bin only write down how they were called."""
    venv = d / ".venv"
    venv.mkdir()
    for entry in (ROOT / ".venv").iterdir():
        if entry.name == "bin" and recorded:
            (venv / "bin").mkdir()
            for program in entry.iterdir():
                if program.name in recorded:
                    (venv / "bin" / program.name).write_text(RECORDER)
                    (venv / "bin" / program.name).chmod(0o755)
                else:
                    (venv / "bin" / program.name).symlink_to(program)
        elif entry.name != ".installed":
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed").touch()


def tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-2500:]}\n--- stderr\n{proc.stderr[-2500:]}"


def parse_nmt(argv: list[str]):
    """nmt's own parser on a command line: (args, the words without redirections, stdin file, stdout file)."""
    from nmt.cli import build_parser

    words, redirect = [], {}
    it = iter(argv[1:])
    for w in it:
        if w in ("<", ">"):
            redirect[w] = next(it)
        else:
            words.append(w)
    args, _ = build_parser().parse_known_args(words)
    return args, words, redirect.get("<"), redirect.get(">")


def nmt_in_process(words: list[str], wd: Path, stdin: str | None, stdout: str | None, monkeypatch) -> str:
    """`nmt WORDS < stdin > stdout` typed in wd, run by nmt.cli.main; returns what it printed."""
    import contextlib
    import io
    import sys

    from nmt.cli import main

    monkeypatch.chdir(wd)
    shown, before = io.StringIO(), sys.stdin
    with open(stdin or os.devnull, encoding="utf-8") as source, contextlib.redirect_stdout(shown):
        sys.stdin = source
        try:
            assert main(words) == 0, words
        finally:
            sys.stdin = before
    if stdout:
        (wd / stdout).write_text(shown.getvalue(), encoding="utf-8")
    return shown.getvalue()


# --- accelerate's launch handling and a fake 2-node SLURM cluster ----------------------------------------------


def resolve_launch(args: list[str], monkeypatch):
    """What `accelerate launch ARGS` starts on this node, by accelerate's own argument handling (no GPU needed)."""
    import accelerate.utils.launch as launch_utils
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    monkeypatch.setattr(launch_utils, "is_port_in_use", lambda port=None: False)
    ns = launch_command_parser().parse_args(args)
    ns.config_file = str(ROOT / ns.config_file)  # the pages' paths are relative to the checkout
    ns, _, _ = _validate_launch_command(ns)
    if ns.multi_gpu:
        launch_utils.prepare_multi_gpu_env(ns)
    return ns


FAKES = {  # a 2-node SLURM allocation, one task per node; each fake records how it was called
    "srun": '#!/bin/bash\necho "srun $*" >> "$RECORD/calls"\n'
            'for node in 0 1; do SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" || exit; done\n',
    "scontrol": '#!/bin/bash\necho "scontrol $*" >> "$RECORD/calls"\n'
                'if [ "$1 $2" = "show hostnames" ]; then printf "gpu-01\\ngpu-02\\n"; fi\n',
    "accelerate": '#!/bin/bash\nprintf "%s\\0" "$@" > "$RECORD/accelerate-$SLURM_PROCID-$$"\n',
}


def run_slurm_script(base_env: dict, script: str, tmp: Path, status: int = 0) -> list[list[str]]:
    """The script under the fakes, as sbatch starts it on the first node; the `accelerate` calls by task."""
    (tmp / "bin").mkdir()
    (tmp / "record").mkdir()
    for name, body in FAKES.items():
        (tmp / "bin" / name).write_text(body)
        (tmp / "bin" / name).chmod(0o755)
    (tmp / "job.sh").write_text(script)
    env = {**base_env, "PATH": f"{tmp / 'bin'}{os.pathsep}{base_env['PATH']}", "RECORD": str(tmp / "record"),
           "SLURM_JOB_NODELIST": "gpu-[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
           "SLURM_JOB_ID": "77"}
    proc = subprocess.run(["bash", str(tmp / "job.sh")], cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, tail(proc)
    assert "scontrol show hostnames gpu-[01-02]" in (tmp / "record" / "calls").read_text()
    calls = sorted((tmp / "record").glob("accelerate-*"), key=lambda p: int(p.name.split("-")[1]))
    return [p.read_text().split("\0")[:-1] for p in calls]


def accelerate_commands() -> dict:
    """The subcommands of the `accelerate` command line, by accelerate's own parsers."""
    import argparse

    from accelerate.commands import accelerate_cli as cli

    sub = argparse.ArgumentParser().add_subparsers()
    for name in dir(cli):
        if name.endswith("_parser"):  # get_config_parser, launch_command_parser, ... as accelerate's main() uses them
            getattr(cli, name)(subparsers=sub)
    return sub.choices
