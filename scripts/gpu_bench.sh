#!/usr/bin/env bash
# Single-GPU benchmark of recipes/causal_lm.py on a ~1B Llama (TinyLlama-1.1B shape, random
# weights): tokens/s, model FLOPs utilisation against the GPU's datasheet bf16 peak, and peak
# memory (torch.cuda.max_memory_allocated) against the planner. Rewrites the gpu-bench section of
# docs/benchmarks.md. Runs unchanged on any CUDA machine with this repository set up:
#
#   bash scripts/gpu_bench.sh                       # 30 steps, micro-batch 4, sequence 2048, bf16
#   bash scripts/gpu_bench.sh --steps 50 --micro-batch 8 --peak-tflops 989
#   bash scripts/gpu_bench.sh --dry-run             # check arguments and plan; no GPU needed
#
# Arguments go to `scripts/gpu_bench.py prepare` (see --help there). GPU_BENCH_WORK_DIR (default
# runs/gpu_bench) holds the model, the run folder and the raw figures; PYTHON picks the
# interpreter (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
if [[ ! -x "$PYTHON" ]]; then PYTHON="$(command -v python3)"; fi
if ! "$PYTHON" scripts/gpu_bench.py --help >/dev/null 2>&1; then  # imports the installed package
  echo "gpu_bench.sh: error: $PYTHON cannot import fsdp_presets; set up this repository first" \
       "(scripts/setup.sh, or pip install -e . into the environment PYTHON names)" >&2
  exit 2
fi
WORK_DIR="${GPU_BENCH_WORK_DIR:-runs/gpu_bench}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

dry_run=0
for argument in "$@"; do
  if [[ "$argument" == "--dry-run" ]]; then dry_run=1; fi
done

"$PYTHON" scripts/gpu_bench.py prepare --work-dir "$WORK_DIR" "$@"
if [[ "$dry_run" == 1 ]]; then
  exit 0
fi

rm -rf "$WORK_DIR/run"
"$PYTHON" -m accelerate.commands.launch --config_file "$WORK_DIR/single_gpu.yaml" \
  scripts/gpu_bench.py train --work-dir "$WORK_DIR"
"$PYTHON" scripts/gpu_bench.py report --work-dir "$WORK_DIR"
