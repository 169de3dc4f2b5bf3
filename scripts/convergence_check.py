"""One-command convergence check: train a recipe under an FSDP config and under its DDP baseline
with the same seed, data and global batch, then compare the two runs step by step.

    python scripts/convergence_check.py --model MODEL_DIR --data DATA.jsonl \
        --config accelerate_configs/cpu_fsdp2_demo.yaml --output-dir runs/convergence

The same as ``fsdp-presets converge ...`` (the flags, the files it writes and the exit status are
that command's: docs/convergence.md); the check itself is :func:`fsdp_presets.compare.converge.converge`.
"""

from __future__ import annotations

import sys

from fsdp_presets.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["converge", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
