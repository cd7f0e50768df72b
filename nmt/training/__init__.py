"""Training, one chapter per part of a run: `run` (`train(cfg)` from start to finish, and the jobs before the
first step), `loop` (the loop and the optimizer step it takes), `evaluation` (validation, the kept model),
`state` (what a run carries, which run it continues, and what it writes) and `fsdp` (FSDP2's shards gathered
into those files and back).

Import the modules themselves; this package imports nothing.
"""
