"""``fsdp-presets inspect-checkpoint CHECKPOINT``: position, sharding, files, integrity, resumability.

    fsdp-presets inspect-checkpoint runs/sft/checkpoints/step-00000020 --gpus 1 --gpus 4
    fsdp-presets inspect-checkpoint runs/sft/checkpoints/step-00000020 --json

Reads the manifest and the DCP metadata only (no tensor data), checks every file against its
SHA-256 and gives the recipes' verdict: a link, a path out of the folder, an unlisted file or a
pickle that could run code (never loaded: read through an allow-list) makes it DAMAGED or
REFUSED. Exit 0 intact (and resumable at every --gpus asked), 1 damaged, refused or not resumable
there, 2 not a checkpoint.
"""

from __future__ import annotations

import argparse

NAME = "inspect-checkpoint"
HELP = "show a checkpoint's step, sharding, per-rank files, checksums and whether it resumes at N GPUs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder: OUTPUT_DIR/checkpoints/step-NNNNNNNN")
    from fsdp_presets.plan.limits import gpu_count

    parser.add_argument("--gpus", type=gpu_count, action="append", metavar="N",
                        help="say whether it resumes on N processes, and with which accumulation (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from fsdp_presets.checkpoint import inspect as checkpoint_inspect

    summary = checkpoint_inspect.summarize_checkpoint(args.checkpoint, args.gpus)
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        print("\n".join(checkpoint_inspect.summary_lines(summary)))
    problems = summary.integrity["ok"] is False or any(not answer.possible for answer in summary.resume)
    return 1 if problems else 0
