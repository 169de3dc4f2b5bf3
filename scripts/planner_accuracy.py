"""The planner's FULL_SHARD FSDP2 per-GPU total against a full rehearsal of the same model, over a
grid: each published config in fsdp_harness/published_configs.py at 8 and 64 GPUs, micro-batch 1
and 2, accumulation 1 and 4, activation checkpointing off and on. Prints one line per case (planned,
rehearsed, difference, the fit verdicts) and the largest difference; exits 1 when a case is off by
10% or more or its verdict differs. Each full-size rehearsal takes 20-90 s of one core::

    python scripts/planner_accuracy.py                        # the whole grid (hours on one core)
    python scripts/planner_accuracy.py --families qwen3 --layers 4 --seq-len 1024 --doc docs/benchmarks.md

The planner's terms are cached under a temporary folder (never the user's cache). ``--doc`` writes
the table and its settings into that file's ``planner-accuracy`` section.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    from fsdp_harness.published_configs import FAMILIES, write_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=sorted(FAMILIES), choices=sorted(FAMILIES))
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: the published count)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--gpu-memory", type=float, default=80)
    parser.add_argument("--doc", help="write the table into this markdown file's planner-accuracy section")
    args = parser.parse_args(argv)
    started = time.monotonic()
    lines = []

    with tempfile.TemporaryDirectory(prefix="planner-accuracy-") as folder:
        os.environ["FSDP_PRESETS_CACHE"] = os.path.join(folder, "cache")
        os.environ["FSDP_PRESETS_PLAN_REHEARSAL"] = "on"
        from fsdp_presets.preset.measured_activations import with_rehearsed_terms
        from fsdp_presets.preset.generate import load_profile
        from fsdp_presets.fileio import GiB
        from fsdp_presets.plan.shapes import Hardware, TrainingShape
        from fsdp_presets.plan.planner import plan
        from fsdp_presets.preset.rehearse_request import rehearse_request, request_from_flags

        worst, failed = 0.0, 0
        for model_type in args.families:
            source = write_config(folder, model_type, layers=args.layers)
            profile = load_profile(source)
            for gpus, micro, accumulation, checkpointing in itertools.product((8, 64), (1, 2), (1, 4), (False, True)):
                shape = TrainingShape(seq_len=args.seq_len, micro_batch=micro, grad_accum=accumulation,
                                      activation_checkpointing=checkpointing)
                shape, _ = with_rehearsed_terms(source, shape)
                row = plan(profile, Hardware(gpus=gpus, gpu_memory_bytes=int(args.gpu_memory * GiB)),
                           shape).get("FULL_SHARD", 2)
                request = request_from_flags(source, gpus=gpus, seq_len=args.seq_len, micro_batch=micro,
                                             activation_checkpointing="on" if checkpointing else "off",
                                             gpu_memory_gib=args.gpu_memory)
                document, _, _ = rehearse_request(request, source=source, preset_file=False, grad_accum=accumulation)
                rehearsed = document["rehearsal"]["per_gpu_peak_bytes"]
                difference = (row.per_gpu.total - rehearsed) / rehearsed
                same_verdict = row.fits == document["fits"]
                worst = max(worst, abs(difference))
                failed += abs(difference) >= 0.10 or not same_verdict
                lines.append(f"{model_type:12} gpus {gpus:2} mb {micro} accum {accumulation} "
                             f"ac {'on ' if checkpointing else 'off'} planned {row.per_gpu.total / GiB:7.2f} GiB "
                             f"rehearsed {rehearsed / GiB:7.2f} GiB {difference:+7.2%} fits {row.fits}/{document['fits']}")
                print(lines[-1], flush=True)
        lines.append(f"largest difference {worst:.2%}; {failed} case(s) off by 10% or more or with another verdict")
        print(lines[-1])
    if args.doc:
        from fsdp_harness import doc_sections

        settings = (f"`python scripts/planner_accuracy.py --families {' '.join(args.families)}"
                    f"{f' --layers {args.layers}' if args.layers else ''} --seq-len {args.seq_len}"
                    f" --gpu-memory {args.gpu_memory:g}`, {(time.monotonic() - started) / 60:.0f} minutes")
        doc_sections.replace_in_file(args.doc, SECTION, doc_sections.wrap(SECTION, render(lines, settings)))
    return 1 if failed else 0


SECTION = "planner-accuracy"


def render(lines: list[str], settings: str) -> str:
    """The section: what was compared, how it was run, the table."""
    return "\n".join([
        "## Planner accuracy: composed from a short rehearsal vs a full one", "",
        "The planner's FULL_SHARD FSDP2 per-GPU total, its activation terms read off a short cached rehearsal of "
        "the model's own config (`fsdp_presets/preset/measured_activations.py`), against a full rehearsal of the "
        "same config (`fsdp-presets rehearse`), for published configs of families the planner keeps no constants "
        "for (`harness/fsdp_harness/published_configs.py`), over 8 and 64 GPUs, micro-batch 1 and 2, accumulation "
        f"1 and 4, activation checkpointing off and on, 80 GiB GPUs. Run: {settings}.", "",
        "```text", *lines, "```"])


if __name__ == "__main__":
    sys.exit(main())
