"""Training curves as one picture: loss, validation BLEU/chrF, learning rate and throughput against steps.

The one home of matplotlib, used through the Agg canvas only (no display, no pyplot, no global backend
switch). Reads each run's metrics.jsonl, as `nmt.train` writes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nmt.errors import NmtError
from nmt.textfiles import atomic_path, refuse_overwrite

METRICS_FILE = "metrics.jsonl"
FIGSIZE = (12.0, 8.0)  # inches: 1440 x 960 pixels at DPI
DPI = 120
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]


@dataclass
class RunCurves:
    """One run's metrics.jsonl split into training-log rows and validation rows."""

    label: str
    train: list[dict] = field(default_factory=list)  # {"step", "loss", "nll", "lr", "tokens_per_s", ...}
    valid: list[dict] = field(default_factory=list)  # {"step", "valid_nll", "bleu", "chrf", ...}
    best: tuple[float, int] | None = None  # (best validation BLEU, its step), set when drawn

    def series(self, rows: str, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` over the rows that have it."""
        pairs = [(r["step"], r[key]) for r in getattr(self, rows) if isinstance(r.get(key), (int, float))]
        return [s for s, _ in pairs], [v for _, v in pairs]


def read_metrics(run_dir: str | Path, label: str | None = None) -> RunCurves:
    """Parse `run_dir/metrics.jsonl`; NmtError names the file (and line) when it is missing or corrupt."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NmtError(f"{run_dir}: no such run directory")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise NmtError(f"{path}: missing; is {run_dir} the output_dir of a training run?")
    curves = RunCurves(label or run_dir.name)
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                row = _parse_row(line, f"{path}:{i}")
                (curves.valid if "valid_nll" in row or "bleu" in row else curves.train).append(row)
    if not curves.train and not curves.valid:
        raise NmtError(f"{path}: empty; the run logs every log_every steps, so nothing has been logged yet")
    return curves


def _parse_row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise NmtError(f"{where}: not valid JSON ({e.msg}); fix or delete the line") from None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        raise NmtError(f"{where}: expected a JSON object with an integer 'step'")
    return row


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Legend labels: each directory's name, with as many parent folders as it takes to tell them apart
    (one run: the path as given, since its name alone is often just "run")."""
    if len(run_dirs) == 1:
        return [str(Path(run_dirs[0]))]
    parts = [Path(d).resolve().parts for d in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(d) for d in run_dirs]


def make_figure(run_dirs: Sequence[str | Path]):
    """A 2x2 matplotlib Figure (Agg canvas) of the runs in `run_dirs`, overlaid; one colour per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not run_dirs:
        raise NmtError("give at least one run directory")
    runs = [read_metrics(d, label) for d, label in zip(run_dirs, run_labels(run_dirs))]
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True)
    for i, run in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        _loss(axes[0, 0], run, color)
        _scores(axes[0, 1], run, color)
        _learning_rate(axes[1, 0], run, color)
        _throughput(axes[1, 1], run, color)
    _finish_axes(axes, runs)
    _run_legend(fig, runs)
    return fig


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Draw the curves of one or more runs into `out` (default: first run's curves.png); returns the path."""
    out = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    refuse_overwrite([("--output", out)], [("the input", Path(d) / METRICS_FILE) for d in run_dirs])
    return save_figure(make_figure(run_dirs), out, DPI)


def save_figure(fig, out: str | Path, dpi: int) -> Path:
    """Write a matplotlib figure, all or nothing; the format follows the suffix. An unknown suffix is a user error."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp, dpi=dpi)
    except ValueError as e:  # an unknown extension
        raise NmtError(f"{out}: cannot write this format ({e}); use .png, .svg or .pdf") from None
    return out


# --- the four panels ------------------------------------------------------------------------------


def _marker_size(n_points: int) -> float:
    return 5.0 if n_points <= 40 else 2.5  # dense validation points would merge into a thick line


def _loss(ax, run: RunCurves, color: str) -> None:
    steps, nll = run.series("train", "nll")
    ax.plot(steps, nll, color=color, lw=1.6)
    steps, valid = run.series("valid", "valid_nll")
    ax.plot(steps, valid, color=color, lw=1.0, ls="--", marker="o", ms=_marker_size(len(steps)))


def _scores(ax, run: RunCurves, color: str) -> None:
    steps, bleu = run.series("valid", "bleu")
    ax.plot(steps, bleu, color=color, lw=1.6, marker="o", ms=_marker_size(len(steps)))
    c_steps, chrf = run.series("valid", "chrf")
    ax.plot(c_steps, chrf, color=color, lw=1.0, ls=":", marker="s", ms=_marker_size(len(steps)) - 1, mfc="white")
    if bleu:
        best = max(range(len(bleu)), key=lambda i: (bleu[i], -steps[i]))  # the first of equal bests
        ax.plot([steps[best]], [bleu[best]], marker="*", ms=16, color=color, mec="black", mew=0.6, zorder=5)
        run.best = (bleu[best], steps[best])


def _learning_rate(ax, run: RunCurves, color: str) -> None:
    steps, lr = run.series("train", "lr")
    ax.plot(steps, lr, color=color, lw=1.6)


def _throughput(ax, run: RunCurves, color: str) -> None:
    steps, tps = run.series("train", "tokens_per_s")
    ax.plot(steps, tps, color=color, lw=1.6)


def _finish_axes(axes, runs: list[RunCurves]) -> None:
    from matplotlib.ticker import EngFormatter

    titles = [["Loss", "Validation BLEU and chrF"], ["Learning rate", "Training throughput"]]
    ylabels = [["NLL (nats per target token)", "score (0-100)"],
               ["learning rate (log scale)", "target tokens per second"]]
    for r in range(2):
        for c in range(2):
            ax = axes[r, c]
            ax.set_title(titles[r][c], fontsize=12, fontweight="bold", loc="left")
            ax.set_ylabel(ylabels[r][c], fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=9, labelbottom=True)
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
            ax.set_xlabel("optimizer step", fontsize=10)
    if any(run.series("train", "lr")[1] for run in runs):
        axes[1, 0].set_yscale("log")
    axes[1, 1].yaxis.set_major_formatter(EngFormatter(sep=""))
    axes[1, 1].set_ylim(bottom=0)
    _style_legend(axes[0, 0], [("training", dict(lw=1.6)), ("validation", dict(lw=1.0, ls="--", marker="o", ms=5))])
    _style_legend(axes[0, 1], [("BLEU", dict(lw=1.6, marker="o", ms=5)),
                               ("chrF", dict(lw=1.0, ls=":", marker="s", ms=4, mfc="white"))])
    _best_bleu_text(axes[0, 1], runs)


def _style_legend(ax, styles: list[tuple[str, dict]]) -> None:
    """A black-and-white key of line styles (colours are the runs)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="black", label=label, **kw) for label, kw in styles]
    ax.legend(handles=handles, loc="upper right", fontsize=9, framealpha=0.85)


def _best_bleu_text(ax, runs: list[RunCurves]) -> None:
    """The best BLEU of each run (starred on its curve) written in the free upper-left corner."""
    if not any(run.valid for run in runs):
        ax.text(0.5, 0.5, "no validation yet", transform=ax.transAxes, ha="center", color="gray", fontsize=11)
        return
    top = max((max(run.series("valid", k)[1], default=0) for run in runs for k in ("bleu", "chrf")), default=0)
    ax.set_ylim(0, max(top, 1) * 1.35)  # headroom for the text and the key
    y = 0.97
    for i, run in enumerate(runs):
        if run.best is not None:
            name = f"{run.label}: " if len(runs) > 1 else ""
            ax.text(0.02, y, f"\u2605 {name}best BLEU {run.best[0]:.1f} at step {run.best[1]}", transform=ax.transAxes,
                    ha="left", va="top", fontsize=10, fontweight="bold", color=COLORS[i % len(COLORS)])
            y -= 0.07


def _run_legend(fig, runs: list[RunCurves]) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=COLORS[i % len(COLORS)], lw=3, label=run.label) for i, run in enumerate(runs)]
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(runs), 4), fontsize=11, frameon=False)
