"""What a run leaves on disk: the run directory (config.yaml, data.json, metrics.jsonl), step_N checkpoints
(Accelerate's state and the run's tokenizer, written atomically) and inference-ready model directories (best/,
model/). Each records the fingerprints of the run's data and tokenizer (`nmt.checkpoint.FINGERPRINTS`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

from accelerate.utils import broadcast_object_list

from nmt import checkpoint as ckpt
from nmt.adapters import save_adapted
from nmt.checkpoint import LANGUAGES_FILE, SUMMARY_FILE, WEIGHTS_FILE, languages_record
from nmt.compat import is_fsdp, tied_embedding_notice_muted
from nmt.config import flat, save_yaml, to_dict
from nmt.data import corpora_line, overlap_line
from nmt.training.finetune import copy_tokenizer, segmentation
from nmt.training.state import Run


def start_run(run: Run) -> None:
    """The run directory: metrics.jsonl trimmed to the step the run starts at, config.yaml, data.json, trackers."""
    accelerator, cfg, stats = run.accelerator, run.cfg, run.corpus.stats
    if run.is_main:
        run.out.mkdir(parents=True, exist_ok=True)
        trim_metrics(run.out / "metrics.jsonl", run.state.step)
        save_yaml(cfg, run.out / "config.yaml")
        (run.out / "data.json").write_text(json.dumps({**stats, ckpt.FINGERPRINTS: fingerprints(run)}, indent=2))
        n_params = sum(p.numel() for p in run.model.parameters())
        n_trained = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        trained = f" ({n_trained / 1e6:.3f}M trained: finetune)" if n_trained < n_params else ""
        print(f"nmt: {accelerator.num_processes} process(es) on {accelerator.device}, "
              f"precision {accelerator.mixed_precision}; {n_params / 1e6:.2f}M parameters{trained}; "
              f"pairs {stats['pairs']}; cleaning dropped {stats['clean']['dropped']}", flush=True)
        for line in (overlap_line(stats), corpora_line(stats)):
            if line:
                print(f"nmt: {line}", flush=True)
    if cfg.log_with:
        accelerator.init_trackers("nmt", config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                   for k, v in flat(to_dict(cfg)).items()})


def fingerprints(run: Run, directory: Path | None = None) -> dict:
    """sha256 of the run's data (per split, `nmt.data.split_fingerprints`) and of its tokenizer file(s): those in
    `directory`, or (None) as the run's tokenizer writes them."""
    tok = run.corpus.tokenizer
    if directory is not None:
        tokenizer = ckpt.tokenizer_sha256(directory)
    else:  # the text tokenizers' save writes: to_str(pretty=True)
        files = [tok.src] if tok.one_file else [tok.src, tok.tgt]
        tokenizer = ckpt.sha256_parts(t.to_str(pretty=True).encode() for t in files)
    return {**(run.corpus.stats.get(ckpt.FINGERPRINTS) or {}), "tokenizer": tokenizer}


def trim_metrics(path: Path, step: int) -> None:
    """Keep the rows up to `step` (where this run starts): after a kill, rows past the checkpoint are
    trained again, and a line cut off mid-write is dropped."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)




def log_metrics(run: Run, metrics: dict) -> None:
    """Append to metrics.jsonl (always) and send to the trackers of `log_with`, at the run's current step."""
    if run.is_main:
        with open(run.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": run.state.step, **metrics}) + "\n")
    if run.cfg.log_with:
        run.accelerator.log(metrics, step=run.state.step)


def plain_weights(accelerator, objective) -> dict:
    """The model's full weights (gathered on the main process under FSDP/DeepSpeed), named as in the bare
    model: without the objective's `model.` prefix, which FSDP's state dicts keep."""
    weights = accelerator.get_state_dict(objective)
    return {k.removeprefix("model."): v for k, v in weights.items()} if is_fsdp(accelerator) else weights


def save_model_dir(run: Run, final: Path, metrics: dict) -> None:
    """An inference-ready model directory, written atomically: weights, config, tokenizer, summary."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    weights = plain_weights(accelerator, run.objective)  # every process takes part
    if run.is_main:
        tmp = ckpt.temp_dir_for(final)
        tmp.mkdir(parents=True, exist_ok=True)
        if run.cfg.finetune.lora_r:  # the base weights as they are, and the adapter beside them
            save_adapted(run.model, tmp, weights)
        else:
            _save_weights(run.model, weights, tmp)
        if run.cfg.init_from:  # fine-tuning: the very files of the model it started from, byte for byte
            copy_tokenizer(Path(run.cfg.init_from), tmp)
        else:
            run.corpus.tokenizer.save(tmp)
        summary = {"step": run.state.step, "metrics": metrics, "data": run.corpus.stats, "argv": sys.argv,
                   "segmentation": segmentation(run.corpus.splits["train"]),  # what init_from compares with
                   "num_processes": accelerator.num_processes, "config": to_dict(run.cfg),
                   ckpt.FINGERPRINTS: fingerprints(run, tmp)}  # what loading compares (checkpoint.check_fingerprint)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        data = run.cfg.data
        if data.is_multilingual:  # what translate and serve check a requested target language against
            record = languages_record(data.pairs(), data.target_languages(), data.tags())
            (tmp / LANGUAGES_FILE).write_text(json.dumps(record, indent=2))
        ckpt.publish(tmp, final)
    del weights
    accelerator.wait_for_everyone()


def _save_weights(model, weights: dict, directory: Path) -> None:
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(directory, state_dict=weights)
    else:
        from safetensors.torch import save_model

        save_model(model, str(directory / WEIGHTS_FILE))


def save_checkpoint(run: Run) -> None:
    """accelerator.save_state and the run's tokenizer (a resume encodes with it, never training another) into a
    temporary folder, renamed to step_N once complete."""
    accelerator, state = run.accelerator, run.state
    final = ckpt.checkpoints_dir(run.out) / f"step_{state.step}"
    tmp = [ckpt.temp_dir_for(final)]  # the main process's name, shared by every process writing into it
    if accelerator.num_processes > 1:
        broadcast_object_list(tmp)
    tmp = tmp[0]
    accelerator.wait_for_everyone()
    with tied_embedding_notice_muted():  # only around save_state: nmt leaves its host's logging alone
        accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if run.is_main:
        run.corpus.tokenizer.save(tmp)
        ckpt.mark_complete(tmp, {"step": state.step, "num_processes": accelerator.num_processes,
                                 "state": dataclasses.asdict(state), "config": to_dict(run.cfg),
                                 ckpt.FINGERPRINTS: fingerprints(run, tmp)})
        ckpt.publish(tmp, final)
        ckpt.prune(run.out, run.cfg.keep_last)
    accelerator.wait_for_everyone()


def publish_final(run: Run) -> Path:
    """model/ as a copy of best/ (the kept model); its path."""
    best, final = run.out / "best", run.out / "model"
    if run.is_main and best.is_dir():
        tmp = ckpt.temp_dir_for(final)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(best, tmp)
        ckpt.publish(tmp, final)
    run.accelerator.wait_for_everyone()
    return final
