#!/usr/bin/env bash
# The main job, from a fresh clone, on CPU: set up, fine-tune a real pretrained small model with
# FSDP on 2 processes, run the DDP baseline, compare them, export, and say where everything is.
#
#   scripts/demo.sh [--output-dir runs/demo]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python scripts/demo.py "$@"
