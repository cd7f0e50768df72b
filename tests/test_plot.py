"""`nmt plot`: the PNG of a real tiny run, two runs overlaid, and one clear error per broken input."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)
from matplotlib.image import imread

from nmt import train
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.errors import NmtError
from nmt.tools.plot import DPI, FIGSIZE, make_figure, plot_runs, read_metrics, run_labels
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A real tiny run ("run"), and a second run ("other") whose curves are the first one's, shifted."""
    out = tmp_path_factory.mktemp("plot")
    cfg = tiny_config(corpus_dir, out, max_steps=12, eval_every=4, log_every=2, save_every=100)
    try:
        train(cfg)
    finally:
        reset_accelerate_state()
    run, other = Path(cfg.output_dir), out / "other"
    other.mkdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    shifted = [{k: (v * 0.8 if k in ("loss", "nll", "valid_nll", "lr") else v + 1 if k == "bleu" else v)
                for k, v in row.items()} for row in rows]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shifted))
    return run, other


def test_png_of_two_runs_is_a_readable_picture(runs, tmp_path):
    out = plot_runs(list(runs), tmp_path / "sub" / "both.png")
    assert out == tmp_path / "sub" / "both.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(out)  # decodes the whole file
    assert pixels.shape[:2] == (round(FIGSIZE[1] * DPI), round(FIGSIZE[0] * DPI))
    ink = (pixels[..., :3] < 0.9).any(axis=-1).mean()
    assert 0.02 < ink < 0.5  # drawn on, not a blank or a solid image


def test_default_output_is_curves_png_in_the_first_run(runs):
    out = plot_runs([runs[0]])
    assert out == runs[0] / "curves.png" and out.stat().st_size > 10_000


def test_figure_overlays_runs_with_named_panels(runs):
    run, other = runs
    fig = make_figure([run, other])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["run", "other"]
    loss, scores, lr, speed = fig.axes
    assert [ax.get_title(loc="left") for ax in fig.axes] == [
        "Loss", "Validation BLEU and chrF", "Learning rate", "Training throughput"]
    assert all(ax.get_xlabel() == "optimizer step" and ax.get_ylabel() for ax in fig.axes)
    assert lr.get_yscale() == "log"
    train_rows = read_metrics(run).train
    assert len(lr.lines) == 2 and list(lr.lines[0].get_xdata()) == [r["step"] for r in train_rows]
    assert len({line.get_color() for line in speed.lines}) == 2  # one colour per run
    # validation points carry markers; each run's best BLEU is starred
    valid_nll = [line for line in loss.lines if line.get_linestyle() == "--"]
    assert len(valid_nll) == 2 and all(line.get_marker() == "o" for line in valid_nll)
    stars = [line for line in scores.lines if line.get_marker() == "*"]
    for star, r in zip(stars, (run, other)):
        bleu = [row["bleu"] for row in read_metrics(r).valid]
        assert star.get_ydata()[0] == max(bleu)
    assert any("best BLEU" in t.get_text() for t in scores.texts)


def test_labels_tell_runs_with_the_same_name_apart():
    assert run_labels(["exp/a/run", "exp/b/run"]) == ["a/run", "b/run"]
    assert run_labels(["runs/small", "runs/base"]) == ["small", "base"]
    assert run_labels(["runs/small/"]) == ["runs/small"]  # one run: its path


def test_validation_only_and_partial_logs_still_plot(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "valid_nll": 3.0, "valid_ppl": 20.0}\n\n')
    fig = make_figure([tmp_path])
    assert fig.axes[0].lines[1].get_ydata().tolist() == [3.0]  # no BLEU (a model without search): no crash


@pytest.mark.parametrize("content, needle", [
    (None, "metrics.jsonl: missing"),
    ("", "metrics.jsonl: empty"),
    ('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo\n', "metrics.jsonl:3: not valid JSON"),
    ('{"step": 1, "loss": 2.0}\n[1, 2]\n', "metrics.jsonl:2: expected a JSON object"),
])
def test_broken_metrics_name_the_file_and_line(tmp_path, content, needle):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(NmtError, match=needle):
        plot_runs([tmp_path])
    assert not (tmp_path / "curves.png").exists()


def test_missing_directory(tmp_path):
    with pytest.raises(NmtError, match="nope: no such run directory"):
        plot_runs([tmp_path / "nope"])


def test_cli_plot_writes_and_errors_in_one_line(runs, tmp_path, capsys):
    out = tmp_path / "c.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "-o", str(out)]) == 0
    assert out.is_file() and f"wrote {out}" in capsys.readouterr().out
    broken = tmp_path / "broken"
    shutil.copytree(runs[0], broken, ignore=shutil.ignore_patterns("checkpoints", "best", "model"))
    with open(broken / "metrics.jsonl", "a") as f:
        f.write("{oops\n")
    n_lines = len((broken / "metrics.jsonl").read_text().splitlines())
    assert main(["plot", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nmt plot: error:") and f"metrics.jsonl:{n_lines}:" in err[0]


def test_plot_never_writes_over_the_metrics_it_reads(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 2, "loss": 2.5, "nll": 2.4, "lr": 0.001}\n')
    before = (run / "metrics.jsonl").read_text()
    assert main(["plot", str(run), "-o", str(run / "metrics.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"--output {run / 'metrics.jsonl'} is the input {run / 'metrics.jsonl'}" in err, err
    assert (run / "metrics.jsonl").read_text() == before
