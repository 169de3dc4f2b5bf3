#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, multi-process FSDP tests included; the
# 15 slowest tests are listed at the end.
#
#   scripts/test.sh [pytest args]          (the fast part only: scripts/test.sh -m "not slow")
#   FSDP_PRESETS_TEST_WORKERS=0 scripts/test.sh -m wall_time   (the wall-time test, not in the default run:
#                                                               it needs the host to itself)
#
# The tests run on one pytest-xdist worker per CPU core, at most 4 (FSDP_PRESETS_TEST_WORKERS=N to
# choose; 0 runs them in this process). Each test module runs whole on one worker, the longest first
# (tests/conftest.py orders them; --no-loadscope-reorder keeps xdist from reordering them by size).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
workers="${FSDP_PRESETS_TEST_WORKERS:-$(.venv/bin/python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
