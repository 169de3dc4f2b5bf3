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
        from fsdp_presets.model.families import families_table

        print(families_table())
        return 0
    if not args.model:
        raise UsageError("give a MODEL: a family name, a model folder or a config.json path "
                         "(`fsdp-presets inspect --list` lists the families)")

    from fsdp_presets.model.model_profile import format_profile
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
