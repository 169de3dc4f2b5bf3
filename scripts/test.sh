#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, multi-process FSDP tests included; the
# 15 slowest tests are listed at the end.
#
#   scripts/test.sh [pytest args]          (the fast part only: scripts/test.sh -m "not slow")
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest --durations=15 "$@"
