"""``fsdp-presets inspect MODEL``: what a model is made of and how FSDP would cut it.

    fsdp-presets inspect llama                          # a registry family (tiny debug config)
    fsdp-presets inspect path/to/model_folder --json    # a local folder with config.json
    fsdp-presets inspect path/to/config.json

The model is built on the meta device (no weights are read or allocated).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HELP = "show a model's FSDP anatomy: blocks to wrap, unit sizes, embeddings, tied weights"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fsdp_presets import arguments

    arguments.add_model(parser, optional=True)
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    arguments.add_trust_remote_code(parser)
    parser.add_argument("--list", action="store_true", help="list the registry families and exit")


def run(args: argparse.Namespace) -> int:
    import json

    from fsdp_presets.errors import UsageError

    if args.list:
        print(_families_table())
        return 0
    if not args.model:
        raise UsageError("give a MODEL: a family name, a model folder or a config.json path "
                         "(`fsdp-presets inspect --list` lists the families)")

    from fsdp_presets.model.profile import profile_model

    # transformers' advisory warnings (token ids, deprecated keys) are noise for an inspection.
    # The variable is read when transformers is first imported, which bad input never reaches.
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    profile = profile_model(args.model, trust_remote_code=args.trust_remote_code)
    if args.json:
        print(json.dumps(profile.to_json(), indent=2))
        return 0
    source = args.model
    if not Path(args.model).expanduser().exists():
        source += " (registry family: its tiny debug config)"
    print(format_profile(profile, source=source))
    return 0


# --------------------------------------------------------------------------- human output

def format_profile(profile, *, source: str = "") -> str:
    """The readable form of a :class:`~fsdp_presets.model.profile.ModelProfile`."""
    from fsdp_presets.fileio import format_count
    from fsdp_presets.plan.tables import text_table

    dims = profile.dims
    structure = profile.structure
    total = profile.total_params or 1
    out = [
        f"model          {source}" if source else None,
        f"architecture   {profile.architecture} (model_type {profile.model_type})",
        f"parameters     {profile.total_params:,} ({format_count(profile.total_params)}), "
        f"tied embeddings: {'yes' if profile.tied_embeddings else 'no'}",
        "dims           " + " | ".join(
            part for part in (
                f"hidden {dims.hidden_size}",
                f"layers {dims.num_layers}",
                f"heads {dims.num_attention_heads} (kv {dims.num_key_value_heads})"
                if dims.num_attention_heads else None,
                f"mlp {dims.intermediate_size}" + (" per expert" if dims.num_experts else "")
                if dims.intermediate_size else None,
                f"vocab {dims.vocab_size}" if dims.vocab_size else None,
                f"positions {dims.max_position_embeddings}" if dims.max_position_embeddings else None,
            ) if part
        ),
    ]
    if structure.get("is_encoder_decoder"):
        out.append(f"encoder-decoder {structure.get('encoder_layers', '?')} encoder + "
                   f"{structure.get('decoder_layers', '?')} decoder blocks")
    moe = structure.get("moe")
    if moe:
        out.append(
            f"mixture of experts  {moe['num_experts']} experts, {moe['experts_per_token']} per token, "
            f"{moe['moe_layers']} MoE + {moe['dense_layers']} dense blocks"
            f"{', shared expert' if moe['shared_experts'] else ''}; "
            f"active per token {moe['active_params']:,} ({format_count(moe['active_params'])})"
        )
    out.append("")
    rows = [
        [unit.cls, str(unit.count), f"{unit.params_each:,}",
         format_count(unit.count * unit.params_each),
         f"{100 * unit.count * unit.params_each / total:.1f}%"]
        for unit in profile.units
    ]
    rows.append(["root (embeddings, norms, head)", "1", f"{profile.root_params:,}",
                 format_count(profile.root_params), f"{100 * profile.root_params / total:.1f}%"])
    out += text_table(["FSDP unit", "count", "params each", "total", "share"], rows, right={1, 2, 3, 4})
    largest = max(profile.units, key=lambda unit: unit.params_each, default=None)
    largest_name = (
        "root" if largest is None or profile.root_params >= largest.params_each else largest.cls
    )
    out.append(f"largest unit   {largest_name}, {profile.largest_unit_params:,} parameters "
               "(all-gathered whole in forward and backward)")
    out.append("")
    out.append(f"wrap classes   {', '.join(profile.wrap_classes) or '(none found)'}")
    stacks = structure.get("stacks") or []
    if stacks:
        out.append("blocks in      " + ", ".join(
            f"{stack['path'] or '(root)'} ({stack['count']})" for stack in stacks))
    for index, embedding in enumerate(profile.embeddings):
        label = "embeddings     " if index == 0 else "               "
        out.append(f"{label}{embedding['name']} ({embedding['class']}, "
                   f"{embedding['params']:,}, {embedding.get('role', '?')})")
    out.append(f"norm classes   {', '.join(profile.norm_classes) or '(none)'}")
    head = profile.output_head or "(none)"
    if profile.output_head:
        head += " (tied to the input embedding)" if profile.tied_embeddings else " (untied)"
    out.append(f"output head    {head}")
    no_split = structure.get("no_split_modules") or []
    out.append(f"_no_split_modules  {', '.join(no_split) or '(not declared)'}")
    for warning in structure.get("warnings", []):
        out.append(f"warning: {warning}")
    return "\n".join(line for line in out if line is not None)


def _families_table() -> str:
    from fsdp_presets.model.families import FAMILIES
    from fsdp_presets.plan.tables import text_table

    rows = [[family.name, family.model_type, family.kind, family.note] for family in FAMILIES]
    return "\n".join(text_table(["family", "model_type", "kind", "covers"], rows, right=set()))
