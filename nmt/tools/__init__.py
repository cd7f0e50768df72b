"""The commands around a model, one module each: `serve` (an HTTP JSON API, with its `request_batcher`), `plot`,
`info`, `check` (the pre-flight check of a training config) and `backtranslate`.

Import the modules themselves; this package imports nothing, so that `nmt --help` and `nmt info` stay cheap.
"""
