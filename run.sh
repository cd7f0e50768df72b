#!/usr/bin/env bash
# The one-command main job.
#   bash run.sh            make .venv if missing, install, train on the embedded corpus, print test BLEU
#                          and a few translations
#   bash run.sh test       run the test suite (what CI runs)
# Variables: PROFILE (an accelerate_configs/ file, default cpu.yaml), CONFIG (default configs/default.yaml),
#            PYTHON (the interpreter used to create .venv), and any extra arguments are config overrides,
#            e.g. bash run.sh --max_steps 200
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PROFILE=${PROFILE:-accelerate_configs/cpu.yaml}
CONFIG=${CONFIG:-configs/default.yaml}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import nmt, pytest, hypothesis" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: its CPU wheel lies on the build machines; an unpinned torch pulls a CUDA build
  .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q "torch<=2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch .venv/.installed
fi
# TOKENIZERS_PARALLELISM is left to nmt: its threads while preparing data, off afterwards (docs/data.md)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ "${1:-}" = "test" ]; then
  shift
  exec .venv/bin/python -m pytest "$@"
fi

# extra arguments are flags (--max_steps 300) or key=value, as for nmt train
OUT=$(.venv/bin/python -c "import sys; from nmt.cli import overrides_from_flags as o; from nmt.config import load_config
print(load_config(sys.argv[1], o(sys.argv[2:])).output_dir)" "$CONFIG" "$@")
start=$(date +%s)
.venv/bin/accelerate launch --config_file "$PROFILE" run.py --config "$CONFIG" "$@"
echo "training took $(( $(date +%s) - start )) s"
SRC=$(mktemp) REF=$(mktemp)
.venv/bin/python - "$CONFIG" "$SRC" "$REF" "$@" <<'PY'
import sys
from nmt.cli import overrides_from_flags
from nmt.config import load_config
from nmt.data import prepare
cfg = load_config(sys.argv[1], overrides_from_flags(sys.argv[4:]))
test = prepare(cfg.data, cfg.tokenizer).splits["test"]
open(sys.argv[2], "w").write("".join(s + "\n" for s in test["src"]))
open(sys.argv[3], "w").write("".join(s + "\n" for s in test["tgt"]))
PY
echo "== test set: $(wc -l < "$SRC") sentences, beam 4"
.venv/bin/nmt evaluate "$OUT/model" --src "$SRC" --ref "$REF" --output "$OUT/test.hyp"
echo "== a few translations"
head -n 5 "$SRC" | .venv/bin/nmt translate "$OUT/model" | paste <(head -n 5 "$SRC") - | sed 's/\t/  =>  /'
rm -f "$SRC" "$REF"
