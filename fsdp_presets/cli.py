"""The ``fsdp-presets`` command line: one subcommand per module in :mod:`fsdp_presets.commands`.

Exit codes: 0 success, 1 a check or comparison that found problems, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fsdp_presets import __version__
from fsdp_presets.commands import COMMANDS
from fsdp_presets.errors import UsageError
from fsdp_presets.fileio import printable


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-presets",
        description="Profile Hugging Face models, plan FSDP memory, generate and check Accelerate "
        "FSDP configs, train with sharded checkpoints, and prove FSDP trains like DDP.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp-presets {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"fsdp_presets.commands.{name}")
        command_name = getattr(module, "NAME", name.replace("_", "-"))
        sub = subparsers.add_parser(command_name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as error:  # a bad number (fsdp_presets.arguments): one line, like any bad input
        words = sys.argv[1:] if argv is None else argv
        command = next((word for word in words if not word.startswith("-")), "")
        print(f"fsdp-presets {command}: error: {error}", file=sys.stderr)
        return 2
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except UsageError as error:
        print(f"fsdp-presets {args.command}: error: {printable(str(error))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`fsdp-presets plan ... --json | head`): not an error of ours.
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
