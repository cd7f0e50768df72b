"""The machinery of tests/test_readme.py: the commands of a Markdown page, a scratch directory to type them in,
and a fake 2-node SLURM allocation. The rules (which command runs how, what it must have made) are the test
file's; this module only reads and runs things.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)  # the environment running the tests is the one the pages' commands get


@dataclass(frozen=True)
class Cmd:
    page: str
    line: int
    kind: str  # "shell": one command line; "script": a whole #! script; "python": a code block
    text: str  # comments and extra blanks removed (Python: the block as it is)
    fenced: bool  # in a fenced block (False: an inline span of the prose)

    @property
    def id(self) -> str:
        words = shlex.split(self.text)[:2] if self.kind == "shell" else [self.kind]
        return f"{self.page}:{self.line}:{' '.join(words)}"


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # an inline span may wrap onto the next line
COMMAND = re.compile(r"(?:[A-Z][A-Z0-9_]*=\S+ )*(?:nmt|accelerate|bash|pip|python) \S")
SHELL = ("bash", "sh", "shell", "console")


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
    """The commands of one page in page order: each line of a fenced shell block (backslash continuations
    joined), a shell block starting with #! as one script, a Python block whole, and the inline spans of the
    prose that start like a command line."""
    out, prose = [], markdown
    for m in FENCE.finditer(markdown):
        prose = prose[: m.start()] + re.sub(r"[^\n]", " ", m[0]) + prose[m.end():]  # same offsets, no fences
        lang, body, first = m[1], m[2], markdown.count("\n", 0, m.start(2)) + 1
        if lang == "python":
            out.append(Cmd(page, first, "python", body, True))
        elif lang in SHELL and body.startswith("#!"):
            out.append(Cmd(page, first, "script", body, True))
        elif lang in SHELL:
            pending, start = "", first
            for i, raw in enumerate(body.splitlines()):
                pending, start = pending + raw, start if pending else first + i
                if pending.endswith("\\"):
                    pending = pending[:-1] + " "
                    continue
                if text := " ".join(strip_comment(pending).split()):
                    out.append(Cmd(page, start, "shell", text, True))
                pending = ""
    for m in SPAN.finditer(prose):
        text = " ".join(m[1].split())
        if COMMAND.match(text):
            out.append(Cmd(page, prose.count("\n", 0, m.start()) + 1, "shell", text, False))
    return sorted(out, key=lambda c: c.line)


def split_env(text: str) -> tuple[dict[str, str], list[str]]:
    """`A=1 B=2 cmd args` -> ({"A": "1", "B": "2"}, ["cmd", "args"])."""
    words = shlex.split(text)
    env = {}
    while words and re.fullmatch(r"[A-Z][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def without_redirections(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """`nmt translate m < a.en > b.de` -> (["nmt", "translate", "m"], {"<": "a.en", ">": "b.de"})."""
    words, redirect, it = [], {}, iter(argv)
    for w in it:
        if w in ("<", ">"):
            redirect[w] = next(it)
        else:
            words.append(w)
    return words, redirect


def tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-2500:]}\n--- stderr\n{proc.stderr[-2500:]}"


def link_venv(d: Path) -> None:
    """The test environment as d/.venv, marked installed so that run.sh uses it as it is."""
    venv = d / ".venv"
    venv.mkdir()
    for entry in VENV.iterdir():
        if entry.name != ".installed":
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed").touch()


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
    # records its arguments, then makes what $MAKES names in the run directory (a checkpoint, the model)
    "accelerate": '#!/bin/bash\nprintf "%s\\0" "$@" > "$RECORD/accelerate-$SLURM_PROCID-$$"\n'
                  'for path in $MAKES; do mkdir -p "$(dirname "$RUN/$path")"; touch "$RUN/$path"; done\n',
}


def run_slurm_script(script: str, tmp: Path, makes: str = "", status: int = 0) -> tuple[list[list[str]], str]:
    """The script under the fakes, as sbatch starts it on the first node: the `accelerate` calls by task, and
    the fakes' calls of srun and scontrol."""
    (tmp / "bin").mkdir(parents=True)
    (tmp / "record").mkdir()
    for name, body in FAKES.items():
        (tmp / "bin" / name).write_text(body)
        (tmp / "bin" / name).chmod(0o755)
    (tmp / "job.sh").write_text(script)
    env = {**os.environ, "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}", "RECORD": str(tmp / "record"),
           "SLURM_JOB_NODELIST": "gpu-[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
           "SLURM_JOB_ID": "77", "MAKES": makes}
    proc = subprocess.run(["bash", str(tmp / "job.sh")], cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, tail(proc)
    calls = sorted((tmp / "record").glob("accelerate-*"), key=lambda p: int(p.name.split("-")[1]))
    return [p.read_text().split("\0")[:-1] for p in calls], (tmp / "record" / "calls").read_text()
