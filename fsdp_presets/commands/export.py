"""``fsdp-presets export CHECKPOINT --output HF_DIR``: a recipe checkpoint as a Hugging Face folder.

    fsdp-presets export runs/sft/checkpoints/step-00000020 --output runs/sft-hf --dtype bf16 --verify

Reads DCP shards (FSDP ``SHARDED_STATE_DICT``), ``pytorch_model_fsdp.bin`` (``FULL_STATE_DICT``) or
``model.safetensors`` (DDP) in one process (a LoRA checkpoint becomes a PEFT adapter folder), without a GPU, one output shard at a time, and writes
config, generation config, tokenizer and safetensors shards (tied weights once). Exit 0 written,
1 ``--verify`` found the logits differ beyond the dtype's tolerance (nothing written), 2 bad input
(nothing written). See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse

from fsdp_presets.commands import add_conversion_flags, print_conversion

NAME = "export"
HELP = "turn a recipe checkpoint (sharded or full) into a Hugging Face folder: config, tokenizer, safetensors"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder: OUTPUT_DIR/checkpoints/step-NNNNNNNN")
    parser.add_argument("--output", required=True, metavar="HF_DIR", help="new folder to write (must not exist or be empty; --force replaces an earlier export)")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="dtype of the written weights (default fp32: the recipes' master weights, lossless)")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors file, e.g. 5GB, 500MB (default 5GB); also about the peak memory")
    parser.add_argument("--model", metavar="MODEL_DIR",
                        help="model folder for config and tokenizer (default: the checkpoint's model_config/, "
                        "else the model in the run's run.json)")
    parser.add_argument("--keep-code-references", action="store_true",
                        help="keep auto_map (names of the model's Python files) in the written configs; by default "
                        "it is dropped, and no Python file is ever written")
    add_conversion_flags(parser, verb="export",
                         verify_help="load both sides, compare logits on a fixed batch; exit 1 beyond the dtype's tolerance")


def run(args: argparse.Namespace) -> int:
    from fsdp_presets.checkpoint.export import export_or_report
    from fsdp_presets.fileio import format_bytes

    report = export_or_report(args.checkpoint, args.output, dtype=args.dtype,
                                      max_shard_size=args.max_shard_size, model=args.model, verify=args.verify,
                                      force=args.force, keep_code_references=args.keep_code_references,
                                      log=(lambda message: None) if args.json else print)

    def written() -> list[str]:
        lines = [f"wrote {report.output}: {len(report.shards)} safetensors file(s), {report.tensors} tensors, "
                 f"{format_bytes(report.bytes)} as {report.dtype}"
                 + (f"; tied: {', '.join(report.tied)} (written once)" if report.tied else "")]
        if report.layout == "adapter":  # a LoRA checkpoint: a PEFT folder
            lines.append("  a PEFT adapter folder: PeftModel.from_pretrained(base_model, HF_DIR) loads it")
        else:
            lines.append("  read " + ("one output shard at a time" if report.streamed else "whole (weight conversion)")
                         + f": at most {format_bytes(report.largest_shard_bytes)} of tensors held at once")
        return lines

    return print_conversion(report, as_json=args.json, written=written,
                            mismatch="the export does not match the checkpoint")
