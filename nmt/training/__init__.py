"""Training, split by job: `step` (one optimizer step), `loop`, `evaluation`, `artifacts` (run directory,
checkpoints, model directories), `setup` (accelerator, data, model, resume) and `run` (`train`).

Import the modules themselves; this package imports nothing, so `nmt.check` can use `step` cheaply.
"""
