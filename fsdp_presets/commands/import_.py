"""``fsdp-presets import HF_DIR --output CHECKPOINT``: a Hugging Face model as a sharded checkpoint.

    fsdp-presets import runs/models/smollm2-135m-instruct --output runs/start/step-00000000 --verify
    accelerate launch --config_file CONFIG.yaml recipes/causal_lm.py --model runs/models/smollm2-135m-instruct \\
        --resume runs/start/step-00000000 ...

Writes the model weights (fp32) as DCP, which loads at any process count, plus the config and
tokenizer and a manifest: step 0, no optimizer state (a resumed run starts with a fresh optimizer).
Legacy ``pytorch_model.bin`` is loaded with ``weights_only=True``. Exit 0 written, 1 ``--verify``
found a difference (nothing written), 2 bad input (nothing written).
"""

from __future__ import annotations

import argparse

from fsdp_presets.commands import add_conversion_flags, print_conversion

NAME = "import"
HELP = "turn a Hugging Face model folder into a sharded (DCP) checkpoint a recipe resumes at any GPU count"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face model folder (safetensors or pytorch_model.bin)")
    parser.add_argument("--output", required=True, metavar="CHECKPOINT", help="new checkpoint folder to write")
    add_conversion_flags(parser, verb="import",
                         verify_help="load both sides, compare logits on a fixed batch; exit 1 beyond fp32 round-off")


def run(args: argparse.Namespace) -> int:
    from fsdp_presets.checkpoint.import_hf import import_or_report
    from fsdp_presets.fileio import format_bytes

    report = import_or_report(args.hf_dir, args.output, verify=args.verify, force=args.force,
                                      log=(lambda message: None) if args.json else print)

    def written() -> list[str]:
        return [f"wrote {report.output}: {report.tensors} tensors, {format_bytes(report.bytes)} fp32 as DCP"
                + ("" if report.tokenizer else "; no tokenizer found in the source folder"),
                *(f"  {note}" for note in report.notes)]

    return print_conversion(report, as_json=args.json, written=written,
                            mismatch="the checkpoint does not match the folder")
