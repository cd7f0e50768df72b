"""Training end to end in-process on a tiny model (nmt.train, nmt.training.run): everything a run writes, and a
model that translates; a model of one's own that keeps the contract, and one that breaks it named; the trackers.
The chapters of a run have their own modules: test_training_loop, test_training_evaluation, test_training_timing and
test_training_state (resume and run folders)."""

import json
from pathlib import Path

import pytest
import torch
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)

from nmt import Translator, train
from nmt.checkpoint import list_checkpoints
from nmt.errors import NmtError

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_train_writes_everything_and_translates(tiny_cfg):
    result = train(tiny_cfg)
    run = Path(tiny_cfg.output_dir)
    assert result.steps == 12
    assert sorted(p.name for p in result.model_dir.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "training.json"]
    assert [p.name for p in list_checkpoints(run)] == ["step_6", "step_12"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows, valid_rows = [r for r in rows if "loss" in r], [r for r in rows if "bleu" in r]
    assert [r["step"] for r in train_rows] == [3, 6, 9, 12]
    assert [r["step"] for r in valid_rows] == [6, 12]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]  # it learns
    assert (run / "config.yaml").is_file()
    out = Translator.from_pretrained(result.model_dir).translate(["The dog sleeps.", "I am young."], beam_size=2)
    assert len(out) == 2 and all(isinstance(s, str) for s in out)
    summary = json.loads((result.model_dir / "training.json").read_text())
    assert summary["step"] in (6, 12) and "bleu" in summary["metrics"]


class SeedStyleModel(torch.nn.Module):
    """A user's own model in the DataParallel question's spirit, rewritten to take ids only and derive its masks."""

    def __init__(self, vocab: int, d: int = 32):
        super().__init__()
        self.pad_id, self.bos_id, self.eos_id = 0, 2, 3
        self.embed = torch.nn.Embedding(vocab, d)
        self.transformer = torch.nn.Transformer(d, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.out = torch.nn.Linear(d, vocab)

    def forward(self, src_ids, tgt_in_ids):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt_in_ids.shape[1], device=src_ids.device)
        h = self.transformer(self.embed(src_ids), self.embed(tgt_in_ids), tgt_mask=causal, tgt_is_causal=True,
                             src_key_padding_mask=src_ids.eq(self.pad_id),
                             memory_key_padding_mask=src_ids.eq(self.pad_id))
        return self.out(h)


def test_bring_your_own_model(tiny_cfg):
    tiny_cfg.max_steps = 4
    result = train(tiny_cfg, model=SeedStyleModel(vocab=300))
    assert (result.model_dir / "model.safetensors").is_file()
    assert result.steps == 4


class MaskTakingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, src, tgt, tgt_mask, src_pad_mask):
        return src


def test_model_breaking_the_contract_is_named(tiny_cfg):
    with pytest.raises(NmtError, match=r"MaskTakingModel.forward must take exactly \(src_ids, tgt_in_ids\)"):
        train(tiny_cfg, model=MaskTakingModel())
    with pytest.raises(NmtError, match="predicts 17 classes but the target vocabulary has 300"):
        train(tiny_cfg, model=SeedStyleModel(vocab=17))


def test_coming_from_dataparallel_doc_model_trains(tiny_cfg):
    doc = (Path(__file__).parent.parent / "docs" / "coming-from-dataparallel.md").read_text()
    model_code = doc.split("```python\n")[2].split("```")[0]  # the rewritten seed model
    scope: dict = {}
    exec(model_code, scope)
    model = scope["SeedTransformer"](300, 300, dim_model=32, num_heads=2, num_encoder_layers=1,
                                     num_decoder_layers=1, dropout_p=0.0)
    tiny_cfg.max_steps = 3
    result = train(tiny_cfg, model=model)
    summary = json.loads((result.model_dir / "training.json").read_text())
    assert "bleu" in summary["metrics"]  # encode/decode present: validation decoded with beam search
    dp = torch.nn.DataParallel(model.eval())
    src, tgt = torch.tensor([[5, 6, 3, 0], [7, 8, 9, 3]]), torch.tensor([[2, 5, 0], [2, 7, 8]])
    assert torch.allclose(dp(src, tgt), model(src, tgt), atol=1e-6)


def test_trackers_get_the_config_and_the_metrics_file_rows(tiny_cfg):
    """log_with goes through Accelerate's trackers: init with the flattened config, every metrics.jsonl row
    logged at its step, finished at the end (a GeneralTracker object stands in for tensorboard/wandb/...)."""
    import json

    from accelerate.tracking import GeneralTracker

    class Recorder(GeneralTracker):
        name, requires_logging_directory = "recorder", False

        def __init__(self):
            super().__init__()
            self.config, self.rows, self.finished = None, [], False

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            self.config = values

        def log(self, values, step=None, **kwargs):
            self.rows.append({"step": step, **values})

        def finish(self):
            self.finished = True

    recorder = Recorder()
    tiny_cfg.max_steps, tiny_cfg.log_every, tiny_cfg.eval_every = 4, 2, 4
    tiny_cfg.log_with = [recorder]
    train(tiny_cfg)
    assert recorder.config["max_steps"] == 4 and recorder.config["model.d_model"] == tiny_cfg.model.d_model
    rows = [json.loads(line) for line in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in recorder.rows] and [2, 4] == sorted({r["step"] for r in rows})
    assert all(r.items() <= t.items() for r, t in zip(rows, recorder.rows) if "loss" in r)
    assert recorder.finished


@pytest.mark.parametrize("name, needle", [("tensorbored", "unknown tracker 'tensorbored'"),
                                          ("aim", "tracker 'aim' is not installed; pip install aim")])
def test_tracker_that_cannot_log_is_named_before_training(tiny_cfg, name, needle):
    import importlib.util

    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    tiny_cfg.log_with = [name]
    with pytest.raises(NmtError, match=needle):
        train(tiny_cfg)
    assert not (Path(tiny_cfg.output_dir) / "metrics.jsonl").exists()


def test_a_run_refused_before_it_starts_leaves_its_output_dir_unused(tiny_cfg):
    """The plan is saved only once the run starts: a model breaking the contract leaves nothing to refuse the
    next try for."""
    with pytest.raises(NmtError, match="must take exactly"):
        train(tiny_cfg, model=MaskTakingModel())
    out = Path(tiny_cfg.output_dir)
    assert not out.exists() or not any(out.iterdir())
