"""Training, one chapter per part of a run: `run` (`train(cfg)` from start to finish, and the jobs before the
first step), `timing` (the one timing probe, and the config resolved with it; `nmt check` calls it too), `loop`
(the loop and the optimizer step it takes), `evaluation` (validation, the kept model), `state` (what a run
carries, which run it continues, and what it writes) and `fsdp` (FSDP2's shards gathered into those files and
back).

Import the modules themselves; this package imports nothing.
"""
