"""Every script in benchmarks/ runs end to end, in a tiny setting, so the commands the docs show cannot rot.

The figures themselves are measured by running the scripts alone on a quiet machine (docs/results.md);
here only that each script works on this checkout and prints the lines its figures come from. The HF and
CTranslate2 systems need the `bench` extra; the scripts skip them when it is not installed.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--ffn", "64", "--vocab", "300", "--max-tokens", "256",
        "--batches", "2", "--threads", "1"]

pytestmark = pytest.mark.slow


def run(script: str, *args: str, cwd: Path = ROOT, home: Path | None = None) -> str:
    """Runs a benchmark script; `home` stands in for the user's home (nmt's default data cache is under it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **({"HOME": str(home)} if home else {})}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_train_speed():
    out = run("train_speed.py", *TINY, "--rounds", "2", "--systems", "nmt,seed")
    assert "fp32: non-pad target tokens/s over 2 rounds" in out
    assert [line.split()[0] for line in out.splitlines() if line.startswith("  nmt ") or line.startswith("  seed ")][-2:] \
        == ["nmt", "seed"]


def test_peak():
    out = run("peak.py", *TINY, "--rounds", "1", "--ceiling-size", "256", "--no-bf16", "--systems", "nmt,hf")
    lines = out.splitlines()
    assert "GEMM ceiling" in out and [line.split()[0] for line in lines[-3:-1]] == ["nmt", "hf"]
    assert "MFU" in lines[-2] and "the most a model of these FLOPs can be over HF here" in lines[-1]


@pytest.mark.multiprocess
def test_fsdp_checkpoint():
    out = run("fsdp_checkpoint.py", "--scale", "0.05")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["gathered"], ["sharded"])]
    assert [r[0] for r in rows] == ["gathered", "sharded"] and all("exact True" in " ".join(r) for r in rows)


def test_padding(corpus_dir):
    out = run("padding.py", str(corpus_dir), "--tgt-lang", "xx", "--vocab", "300", "--max-tokens", "256")
    assert "cache hit" in out
    rows = {line[:38].strip(): line.split() for line in out.splitlines() if line.startswith("  ") and "%" in line}
    nmt, shuffled = rows["nmt: length buckets, ties by source"], rows["random batches, same budget"]
    assert float(nmt[-1].rstrip("%")) < float(shuffled[-1].rstrip("%"))  # bucketing pads less than random batches


def test_decode_speed():
    out = run("decode_speed.py", "--sentences", "8", "--batch", "4", "--rounds", "1", "--only", "nmt,CT2 float32",
              "--ensemble")
    for system in ("nmt greedy", "nmt beam4", "nmt sample", "nmt ens2 beam4", "CT2 float32 beam4"):
        assert f"\n{system} " in out, system
    assert "nmt beam4 / CT2 float32 beam4: " in out and "WARNING" not in out  # same tokens for every system


def readme_own_corpus_command() -> list[str]:
    """README's own-corpus `nmt train` command, as its words."""
    import shlex

    text = (ROOT / "README.md").read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.strip().startswith("nmt train --data.train"))
    return shlex.split(line.split("#")[0])


def test_the_benchmarks_run_the_readme_own_corpus_command():
    """benchmarks/quality.py and recipe.py's budget system build README's command, with the corpus, budget and
    output folder put in for README's placeholders, and nothing added."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quality import user_command

    readme = readme_own_corpus_command()
    ours = user_command(Path("/data/x"), "en", "de", 25, Path("runs/mine"))
    assert ours == [w.replace("D/", "/data/x/") for w in readme]


def test_quality_with_baseline_side_by_side(corpus_dir, tmp_path):
    """README's own-corpus command as quality.py runs it, and the two HF peers trained beside it (the published
    recipe, and the Marian given nmt's own plan), one table."""
    pytest.importorskip("transformers", reason="the HF baseline needs the hf extra")
    out = run("quality.py", "--data", str(corpus_dir), "--tgt", "xx", "--minutes", "0.05", "--output",
              str(tmp_path / "run"), "--baseline", cwd=tmp_path, home=tmp_path)
    assert f"$ nmt train --data.train {corpus_dir}/train" in out and "--max_minutes 0.05 --output_dir" in out
    assert "nmt: plan: chosen for the 0.05-minute budget" in out  # the plan nmt printed
    assert "training " in out and " of 0.05 min (" in out and "test BLEU" in out
    assert "hf baseline: step" in out and "valid nll" in out
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())["chosen"]  # what nmt chose, given to the peer
    peer = out[out.index("HF MarianMTModel (hf + plan: "):].splitlines()[0]
    precision = re.search(r"nmt: 1 process\(es\) on \w+, precision (\w+);", out)[1]  # the one nmt trained in
    assert f"lr {plan['optim.lr']:g}, warmup sized to its steps, precision {precision})" in peer
    assert f"{plan['max_tokens']:,}-token batches" in peer and f"vocabulary {plan['tokenizer.vocab_size']:,}" in peer
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quality import given_nmts_plan
    given = given_nmts_plan(tmp_path / "run")  # Marian's own dropout placement, nmt's rate on the rest
    assert (given.attention_dropout, given.activation_dropout, given.precision) == (0.0, 0.0, precision)
    assert given.dropout == plan.get("model.dropout", given.dropout) and given.warmup_share > 0
    table = out[out.index("system"):].splitlines()
    assert [row[:11].strip() for row in table[1:4]] == ["nmt", "hf recipe", "hf + plan"]
    assert table[4].startswith("nmt - hf recipe: BLEU ") and table[5].startswith("nmt - hf + plan: BLEU ")


def test_quality_side_by_side_one_core_each(corpus_dir, tmp_path):
    """--side-by-side: nmt's command (with --seed added) and the Marian given its plan at once, one table."""
    pytest.importorskip("transformers", reason="the HF baseline needs the hf extra")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores")
    out = run("quality.py", "--data", str(corpus_dir), "--tgt", "xx", "--minutes", "0.05", "--output",
              str(tmp_path / "run"), "--side-by-side", "--seed", "3", cwd=tmp_path, home=tmp_path)
    assert "--max_minutes 0.05 --output_dir" in out and out.split("$ ", 1)[1].splitlines()[0].endswith(" --seed 3")
    assert "HF MarianMTModel (hf + plan: " in out and "hf recipe" not in out
    table = out[out.index("system"):].splitlines()
    assert [row[:11].strip() for row in table[1:3]] == ["nmt", "hf + plan"]
    assert table[3].startswith("nmt - hf + plan: BLEU ")


def test_bible_corpus_holds_out_whole_chapters(tmp_path):
    """benchmarks/bible_corpus.py on a bible.db of the package's schema: lines aligned verse by verse, the psalms'
    verse numbers taken out, validation and test whole chapters (none in two splits), an existing folder kept."""
    db = tmp_path / "bible.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE bible (id INTEGER NOT NULL, bbName TEXT NOT NULL, bNumber INTEGER NOT NULL, "
                "cNumber INTEGER NOT NULL, vNumber INTEGER NOT NULL, vText TEXT NOT NULL)")
    rows = [(name, b, c, v, f"(3:{v}) {lang} {b}.{c}.{v}  end" if lang == "fr" else f"{lang} {b}.{c}.{v}")
            for lang, name in (("en", "4"), ("fr", "l"), ("xx", "k")) for b in (1, 2) for c in range(1, 9)
            for v in range(1, 6)]
    rows.append(("4", 3, 1, 1, "a verse with no French"))
    con.executemany("INSERT INTO bible VALUES (0, ?, ?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    out = tmp_path / "corpus"
    printed = run("bible_corpus.py", "--db", str(db), "--output", str(out), "--held-out", "12")
    assert "test 12, valid 12, train 50 pairs" in printed
    chapters = {}
    for split in ("train", "valid", "test"):
        en, fr = ((out / f"{split}.{lang}").read_text().splitlines() for lang in ("en", "fr"))
        assert [e.replace("en", "fr") + " end" for e in en] == fr  # aligned, "(3:v)" gone, spaces collapsed
        chapters[split] = {e.rsplit(".", 1)[0] for e in en}
    assert not chapters["train"] & chapters["valid"] and not chapters["train"] & chapters["test"]
    assert not chapters["valid"] & chapters["test"]
    before = (out / "train.en").read_text()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bible_corpus.py"), "--db", str(db),
                           "--output", str(out), "--held-out", "12", "--seed", "2"], capture_output=True, text=True)
    assert proc.returncode == 1 and "exists; choose a new --output" in proc.stderr
    assert (out / "train.en").read_text() == before


def test_language_id(tmp_path):
    """benchmarks/language_id.py prints a row of accuracies and speed per library installed (py3langid, nmt's)."""
    pytest.importorskip("py3langid")
    db = tmp_path / "bible.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE bible (bbName TEXT, bNumber INTEGER, cNumber INTEGER, vNumber INTEGER, vText TEXT)")
    con.executemany("INSERT INTO bible VALUES (?, 1, 1, ?, ?)", [
        ("4", 1, "In the beginning God created the heavens and the earth."),
        ("4", 2, "God said, let there be light, and there was light."),
        ("l", 1, "Au commencement, Dieu créa les cieux et la terre."),
        ("l", 2, "Dieu dit: Que la lumière soit! Et la lumière fut.")])
    con.commit()
    con.close()
    out = run("language_id.py", "--db", str(db), "--per-language", "2")
    assert "4 sentences: up to 2 verses in each of 2 languages" in out
    row = next(line for line in out.splitlines() if line.startswith("| py3langid |")).split("|")
    assert row[4].strip() == "100.0%" and float(row[6].replace(",", "")) > 0  # whole verses, sentences/s


def test_scale(corpus_dir, tmp_path):
    out = run("scale.py", str(corpus_dir), "--sizes", "1k,3k", "--work", str(tmp_path), "--vocab", "300",
              "--tgt-lang", "xx")
    assert "3,000 pairs" in out and "nmt train start -> first optimizer step: cold" in out
    assert "limit: tokenizers alone" in out and "linearity" in out and "bytes per added pair" in out
    assert not list(corpus_dir.glob("pairs-*"))  # the corpora are written to --work only


def test_ensemble(corpus_dir, tmp_path):
    out = run("ensemble.py", "--data", str(corpus_dir), "--tgt", "xx", "--minutes", "0.05", "--output",
              str(tmp_path / "runs"), "--config", str(ROOT / "configs" / "default.yaml"),
              f"data.cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300", "model.d_model=32",
              "model.n_heads=2", "model.n_encoder_layers=1", "model.n_decoder_layers=1", "model.d_ff=64",
              "max_tokens=400", "max_steps=20", "eval_every=10", "eval_max_sentences=8", "average_last=0", cwd=tmp_path)
    table = out[out.index("system"):].splitlines()
    assert [row.split()[0] for row in table[1:4]] == ["seed", "seed", "ensemble"]
    assert all(float(row.split()[-3]) >= 0 for row in table[1:4]) and "nrefs:1" in table[-1]


def test_startup():
    out = run("startup.py", "--runs", "1")
    rows = {line[:24].strip(): line[24:].split(None, 1) for line in out.splitlines() if line.startswith("  ")}
    assert list(rows) == ["python -c pass", "import nmt", "nmt --help", "nmt train --help", "nmt info MODEL_DIR"]
    assert all(float(row[0]) > 0 for row in rows.values())
    assert rows["import nmt"][1] == "[]" and "torch" not in rows["nmt info MODEL_DIR"][1]



def test_config_path_traces_a_training():
    """The trace counts what it says: train's own modules take the config, and no lower layer calls back into
    training.run (before issue 44 the loop's schedule read the config through `lambda: run.cfg`)."""
    out = run("config_path.py", "--steps", "1")
    [row] = [line.split() for line in out.splitlines() if line.startswith(str(ROOT)[-40:]) and ": " not in line]
    modules, calls, up, sites = map(int, row[-4:])
    assert modules >= 5 and calls > modules and up >= sites == out.count("  up: "), out
    named = out.split(f"{ROOT}: ")[1].split("\n")[0].split(", ")
    assert {"training.run", "training.loop", "plan", "validate"} <= set(named), named
    assert "-> training.run." not in out, out

def test_recipe(corpus_dir, tmp_path):
    """The budget recipe (README's command) against the fixed defaults, the corpus and a subset of it, in one run and
    one table each; a tiny vocabulary for the fixed system so that it takes seconds."""
    tiny = [f"data.cache_dir={tmp_path / 'cache'}", "tokenizer.vocab_size=300", "eval_max_sentences=8"]
    out = run("recipe.py", "--data", str(corpus_dir), "--tgt", "xx", "--minutes", "0.05", "--subset", "300",
              "--systems", "budget,fixed-fp32", "--output", str(tmp_path / "runs"), "--beam", "1", *tiny, cwd=tmp_path,
              home=tmp_path)
    assert out.count("=== ") == 2 and "first 300 pairs, 0.05 min" in out
    tables = [out[i:].splitlines()[1:3] for i in range(len(out)) if out.startswith("system ", i)]
    assert len(tables) == 2 and all([row.split()[0] for row in t] == ["budget", "fixed-fp32"] for t in tables)
    commands = [line for line in out.splitlines() if line.startswith("$ nmt train")]
    assert len(commands) == 2 and all("cache" not in c and "vocab" not in c for c in commands)  # the user's command
    assert f"--data.train {tmp_path / 'runs'}/data-first-300/train" in commands[1]  # the subset: files of its own
    fixed_cfg = (tmp_path / "runs" / "all-0.05min-fixed-fp32" / "config.yaml").read_text()
    assert "warmup_steps: 1000" in fixed_cfg and "max_tokens: 4096" in fixed_cfg  # the old fixed defaults
    assert len(json.loads((tmp_path / "runs" / "recipe.json").read_text())) == 2


def test_recipe_with_the_baseline(corpus_dir, tmp_path):
    pytest.importorskip("transformers", reason="the HF baseline needs the bench extra")
    out = run("recipe.py", "--data", str(corpus_dir), "--tgt", "xx", "--minutes", "0.05", "--systems",
              "budget,baseline", "--tiny-baseline", "--subset", "300", "--subset-only",
              "--output", str(tmp_path / "runs"), "--beam", "1", cwd=tmp_path, home=tmp_path)
    table = out[out.index("system "):].splitlines()
    assert [row.split()[0] for row in table[1:3]] == ["budget", "baseline"]
    assert out.count("=== ") == 1 and "first 300 pairs" in out  # --subset-only: not the whole corpus


def test_serve_load(corpus_dir, tmp_path):
    pytest.importorskip("uvicorn", reason="nmt serve needs the serve extra")
    from nmt import train
    from nmt.cli import main
    from nmt.compat import reset_accelerate_state
    from tests.conftest import tiny_config

    model_dir = train(tiny_config(corpus_dir, tmp_path, max_steps=6, eval_every=6, save_every=6)).model_dir
    reset_accelerate_state()
    assert main(["export", str(model_dir), "--to", "ctranslate2", str(tmp_path / "ct2"), "--quantization", "int8"]) == 0
    out = run("serve_load.py", str(model_dir), "--clients", "4", "--requests", "3", "--beam", "1", "--threads", "1",
              "--max-wait-ms", "20", "--hostile", "6", "--ct2", str(tmp_path / "ct2"))
    rows = {line.split()[1]: line.split()[2:] for line in out.splitlines() if line.startswith("batching o")
            and "/" not in line}
    assert set(rows) == {"on", "off"}, out
    assert rows["off"][-1] == "1" and int(rows["on"][-1]) > 1, out  # max requests/batch: only batching shares
    assert rows["on"][5] == rows["off"][5] == "0", out  # no errors
    assert "batching on / off:" in out
    hostile = next(line for line in out.splitlines() if line.startswith("hostile"))
    assert hostile.split()[6] == "0", out  # the normal clients beside hostile ones: no errors
    assert "slow body: cut off" in out and "slow headers: cut off" in out, out  # after --request-timeout
    assert "over the cost limit: 413" in out and "normal clients, quiet -> with hostile clients: p50" in out, out
    engines = {line[:20].strip(): line[20:].split() for line in out.splitlines()
               if line.startswith(("nmt serve --ct2 ", "raw CT2")) and ":" not in line}
    assert set(engines) == {"nmt serve --ct2", "raw CT2, per request", "raw CT2, batched"}, out
    assert {e[5] for e in engines.values()} == {"0"}, out  # no errors
    assert "nmt serve --ct2 / raw CTranslate2 on batches of " in out and "(floor 0.9x)" in out, out


def test_multilingual_against_one_model_per_direction(corpus_dir, tmp_path):
    """One model trained on both directions of the corpus beside one per direction at half the minutes each."""
    out = run("multilingual.py", "--data", str(corpus_dir), "--tgt", "xx", "--minutes", "0.1", "--output",
              str(tmp_path / "runs"), cwd=tmp_path, home=tmp_path)
    assert f"$ nmt train --config {tmp_path / 'runs' / 'both.yaml'} --max_minutes 0.1" in out
    assert f"$ nmt train --data.train {corpus_dir}/train" in out and "--data.src_lang xx --data.tgt_lang en" in out
    table = out[out.index("setup"):].splitlines()
    assert table[0].split()[:5] == ["setup", "en-xx", "BLEU", "en-xx", "chrF"]
    assert table[1].startswith("one model, both (0.1 min)") and table[2].startswith("one model per direction (0.05 min")
    scores = [[w for w in row.split() if re.fullmatch(r"\d+\.\d\d", w)] for row in table[1:3]]
    assert [len(s) for s in scores] == [6, 6]  # BLEU and chrF of each direction, and their means


def test_memory_samples_a_users_run(corpus_dir, tmp_path):
    out = run("memory.py", "--data", str(corpus_dir), "--tgt", "xx", "--minutes", "0.3", "--precision", "no",
              "--every", "0.2", "--", "--max_steps", "300", "--max_tokens", "400", "--eval_every", "100",
              "--data.cache_dir", str(tmp_path / "cache"), home=tmp_path)
    assert "--max_minutes 0.3 --output_dir" in out and "--max_steps 300" in out  # the user's command, then the extras
    fp32 = next(line.split() for line in out.splitlines()[::-1] if line.startswith("fp32"))
    assert int(fp32[1].replace(",", "")) > 0 and float(fp32[5]) > 0, out  # steps sampled, RSS read at the end


def test_gpu_script_runs_on_a_cpu():
    """benchmarks/gpu.py, the GPU check, runs on a CPU at small sizes without pytest: the real loop (nmt.train)
    beside OneDevice steps, the fused and the plain loss, decoding; the datasheet tells H100 parts apart."""
    out = run("gpu.py", "--steps", "2", "--sentences", "16", "--no-compile")
    lines = out.splitlines()
    for kind in ("fused loss", "plain loss"):
        line = next(x for x in lines if x.startswith(f"train OneDevice, {kind}: "))
        assert "target tok/s" in line and "of the GEMM" in line and "host syncs a step n/a on a CPU" in line
    loop = next(x for x in lines if x.startswith("train real loop (nmt.train"))
    assert re.search(r"real loop / OneDevice fused loss \d+\.\d\d$", loop), loop
    assert "train DDP: one device here" in out and re.search(r"decode fp32 beam4: [\d,]+ tok/s", out)
    probe = "import sys; sys.path.insert(0, 'benchmarks'); import gpu; assert 'pytest' not in sys.modules; " \
            "print([gpu.datasheet(n) for n in ('NVIDIA H100 80GB HBM3', 'NVIDIA H100 PCIe', 'NVIDIA H100 NVL', " \
            "'NVIDIA H200', 'Tesla T4')])"
    answer = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert answer.stdout.strip() == "[('H100 SXM', 989000000000000.0), ('H100 PCIe', 756000000000000.0), " \
        "('H100 NVL', 835000000000000.0), ('H200 SXM', 989000000000000.0), None]"


def test_confidence(corpus_dir, tmp_path):
    from helpers import model_dir

    model = model_dir(tmp_path / "model")  # a random tiny model: the script's figures, not their values
    out = run("confidence.py", "--data", str(corpus_dir), "--tgt", "xx", "--model", str(model), "--beam", "2",
              "--output", str(tmp_path / "out"), "--json", str(tmp_path / "figures.json"))
    assert "$ nmt translate " in out and "--scores" in out and "Spearman(confidence, sentence chrF)" in out
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert [q["sentences"] for q in figures["by_confidence"]] == [10, 10, 10, 10]
    confidence = [q["confidence"] for q in figures["by_confidence"]]
    assert confidence == sorted(confidence) and 0 < confidence[0] <= confidence[-1] < 1


def test_markup(corpus_dir, tmp_path):
    from helpers import model_dir

    model = model_dir(tmp_path / "model")  # a random tiny model: the tags are kept whatever it translates
    out = run("markup.py", "--data", str(corpus_dir), "--model", str(model), "--sentences", "30", "--beam", "2",
              "--output", str(tmp_path / "out"))
    assert "--format html" in out and "--format xml" in out
    for format in ("html", "xml"):
        assert f"  {format}: parse 30/30, same tags and nesting 30/30, text as the plain translation 30/30" in out


def test_finetune_adapts_an_opus_mt_style_hub_model_three_ways(corpus_dir, tmp_path):
    """finetune.py: the two domains under --work, the OPUS-MT-style start as a Hub cache entry, README's fine-tuning
    command (as its words) with and without LoRA and its own-corpus command from scratch, one table and the floors."""
    pytest.importorskip("sentencepiece", reason="the OPUS-MT-style start needs the hf extra")
    import shlex

    work = tmp_path / "work"
    out = run("finetune.py", "--data", str(corpus_dir), "--work", str(work), "--tgt", "xx", "--words", "the",
              "--held-out", "30", "--minutes", "0.05", "--base-minutes", "0.05", "--spm-vocab", "200",
              "--base-size", "32,1,2,64", "--threads", "1", cwd=tmp_path, home=tmp_path)
    assert sorted(p.name for p in corpus_dir.iterdir()) == sorted(f"{s}.{x}" for s in ("train", "valid", "test")
                                                                  for x in ("en", "xx"))  # the corpus untouched
    b_train = (work / "domains" / "b" / "train.en").read_text().splitlines()
    a_train = (work / "domains" / "a" / "train.en").read_text().splitlines()
    assert b_train and a_train and all(re.search(r"\bthe\b", s) for s in b_train)
    assert not any(re.search(r"\bthe\b", s) for s in a_train)
    repo = work / "hub" / "models--nmt-bench--opus-mt-en-de"
    snapshot = repo / "snapshots" / (repo / "refs" / "main").read_text()
    assert {"source.spm", "target.spm", "vocab.json", "model.safetensors"} <= {p.name for p in snapshot.iterdir()}
    assert "$ nmt import nmt-bench/opus-mt-en-de " in out
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    words = shlex.split(next(x for x in readme.splitlines() if x.startswith("nmt train --init_from")).split("#")[0])
    b, opus = work / "domains" / "b", work / "runs" / "opus"
    put_in = {"runs/opus": str(opus), "runs/opus-mine": str(work / "runs" / "ft"), "D/train": f"{b}/train",
              "D/valid": f"{b}/valid", "10": "0.05", "de": "xx"}  # README's placeholders, as the test fills them
    readme_line = " ".join(put_in.get(w, w) for w in words)
    commands = [line[2:] for line in out.splitlines() if line.startswith("$ nmt train")]
    assert commands[:2] == [readme_line, readme_line.replace("/runs/ft", "/runs/lora") + " --finetune.lora_r 8"]
    assert commands[2].startswith(f"nmt train --data.train {b}/train")  # from scratch: the own-corpus command
    table = out[out.index("system "):].splitlines()
    assert [row[:18].strip() for row in table[1:5]] == ["start (imported)", "(a) fine-tuned", "(b) LoRA r8",
                                                        "(c) from scratch"]
    assert all(len(row[18:].split()) == 5 for row in table[1:5])  # new BLEU/chrF, old BLEU/chrF, minutes
    assert table[5].startswith("floor 1, (a) - (c) on the new domain: ")
    assert table[6].startswith("floor 2, (a) - start on the old domain: ")


def test_guard_on_a_model_of_both_directions(corpus_dir, tmp_path):
    """benchmarks/guard.py trains a two-direction model, then translates each direction with and without --guard
    (the user's commands) and compares the fallbacks on what the guard flagged."""
    out = run("guard.py", "--data", str(corpus_dir), "--tgt", "xx", "--minutes", "0.1", "--beam", "2", "--output",
              str(tmp_path / "runs"), cwd=tmp_path, home=tmp_path)
    assert f"$ nmt train --config {tmp_path / 'runs' / 'both.yaml'} --max_minutes 0.1" in out
    assert "--tgt-lang xx --beam 2 --scores --guard" in out and "--tgt-lang en --beam 2 --scores" in out
    table = out[out.index("setting"):].splitlines()
    assert [row.split()[:2] for row in table if row.startswith(("en-xx ", "xx-en "))] == [
        ["en-xx", "plain"], ["en-xx", "--guard"], ["xx-en", "plain"], ["xx-en", "--guard"]]
    assert sum(re.match(r"(en-xx|xx-en): 40 sentences, \d+ flagged", row) is not None for row in table) == 2


def test_attention_path(corpus_dir):
    """Each dropout placement's step on torch's attention kernel, the math one and nmt's choice, in one table."""
    out = run("attention_path.py", "--data", str(corpus_dir), "--tgt", "xx", "--rounds", "1", "--steps", "1",
              "--max-tokens", "128", "--models", "nmt", "--precisions", "fp32")
    table = out[out.index("model, dropout"):].splitlines()
    assert [row[:24].strip() for row in table[1:3]] == ["nmt, nmt's dropout", "nmt, Marian's dropout"]
    assert all(row.rstrip().endswith("x") for row in table[1:3])
    assert "nmt, Marian's dropout, fp32: torch's choice" in out  # fp32 keeps torch's kernels


def test_quickstart_screens_a_candidate_beside_the_default(tmp_path):
    """run.sh's config, the default and a candidate side by side, scored as run.sh scores the test set, with the
    translations that repeat a word counted."""
    out = run("quickstart.py", "--config", str(ROOT / "configs" / "default.yaml"), "--output", str(tmp_path / "q"),
              "--candidate", "xavier=--model.init_std 0", "--sentences", "20", "max_steps=2", "eval_every=2",
              "save_every=2", "eval_max_sentences=8", cwd=tmp_path)
    rows = json.loads((tmp_path / "q" / "quickstart.json").read_text())
    assert [r["name"] for r in rows] == ["default", "xavier"]
    assert all(r["steps"] == 2 and r["sentences"] == 20 for r in rows)
    assert "--model.init_std 0 max_steps=2" in out and out.count("[core ") == 2
    table = out[out.index("run  "):].splitlines()
    assert table[1].startswith("default") and table[2].startswith("xavier")
