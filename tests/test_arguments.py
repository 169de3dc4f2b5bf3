"""The command line's shared flags: every flag that two commands have means the same thing in
both (same destination, type check, default, choices), and refuses the same bad value with the
same words. Parses each subcommand's real parser, so a flag redefined by hand in one command
fails here."""

from __future__ import annotations

import argparse

import pytest

from fsdp_presets.plan import limits
from fsdp_presets.cli import build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags() -> dict[str, dict[str, argparse.Action]]:
    """``{option string: {command: action}}`` over every subcommand."""
    flags: dict[str, dict[str, argparse.Action]] = {}
    for command, parser in _subparsers().items():
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    flags.setdefault(option, {})[command] = action
    return flags


# Flags that two commands spell alike on purpose with another meaning, each with its reason.
DIFFERENT_ON_PURPOSE = {
    ("--gpus", "launcher"): "GPUs per machine (what SLURM and torchrun count), not in the whole job",
    ("--launcher", "launcher"): "the command exists to write a script, so it defaults to slurm; generate "
                                "writes one only when asked",
    ("-o", "launcher"): "the launch script, not a config", ("--output", "launcher"): "the launch script",
    ("--output", "export"): "a Hugging Face folder", ("--output", "import"): "a checkpoint folder",
    ("--baseline", "converge"): "the baseline's accelerate config to launch, not the kind of baseline to write",
}
# Flags whose value goes to a launched recipe: unset, the recipe's own default applies (same check).
RECIPE_DEFAULT = {("--seq-len", "converge")}


def _signature(action: argparse.Action) -> tuple:
    # ``required`` is left out: a flag may be required where a command has no other source for it
    # (plan --gpus), and optional where a preset file can give it (generate --from, rehearse).
    return (action.dest, action.type, action.default, action.choices, action.const, type(action).__name__)


def test_every_shared_flag_has_one_type_default_and_choices():
    drift = []
    for option, by_command in sorted(_flags().items()):
        compared = {command: action for command, action in by_command.items()
                    if (option, command) not in DIFFERENT_ON_PURPOSE}
        if option == "--gpus":  # inspect-checkpoint repeats it (one count per question), plan takes a list
            # (a scaling table): each count the same check
            compared = {command: action for command, action in compared.items()
                        if command not in ("inspect-checkpoint", "plan")}
            assert by_command["inspect-checkpoint"].type is limits.gpu_count
            assert by_command["plan"].type is limits.gpu_counts
        signatures = {command: _signature(action) for command, action in compared.items()}
        if len(set(signatures.values())) > 1:
            drift.append(f"{option}: {signatures}")
    assert not drift, "shared flags differ between commands:\n" + "\n".join(drift)


@pytest.mark.parametrize("option, commands", [
    ("--gpus", {"plan", "generate", "rehearse", "check", "inspect-checkpoint"}),
    ("--nodes", {"plan", "generate", "rehearse", "launcher"}),
    ("--gpu-memory", {"plan", "generate", "rehearse", "check"}),
    ("--precision", {"plan", "generate", "rehearse"}),
    ("--seq-len", {"plan", "generate", "rehearse", "check"}),
    ("--micro-batch", {"plan", "generate", "rehearse"}),
    ("--grad-accum", {"plan", "rehearse"}),
    ("--activation-checkpointing", {"plan", "generate", "rehearse"}),
    ("--method", {"plan", "generate", "rehearse", "check"}),
    ("--lora-r", {"plan", "generate", "rehearse", "check"}),
    ("--trust-remote-code", {"inspect", "plan", "generate", "rehearse", "check"}),
])
def test_shared_flags_are_where_they_belong(option, commands):
    assert commands <= set(_flags()[option]), f"{option} missing from {sorted(commands - set(_flags()[option]))}"


def test_shared_defaults_are_the_documented_ones():
    flags = _flags()
    assert flags["--precision"]["plan"].type is limits.precision
    assert flags["--precision"]["plan"].metavar == "auto|bf16|fp16|fp32"
    assert flags["--gpu-memory"]["plan"].required is False  # default 80 GiB everywhere, said in the help
    for command, action in flags["--gpu-memory"].items():
        assert f"default {limits.DEFAULT_GPU_MEMORY_GIB:g}" in action.help, command
    for command, action in flags["--seq-len"].items():
        expected = "recipe default" if ("--seq-len", command) in RECIPE_DEFAULT else f"default {limits.DEFAULT_SEQ_LEN}"
        assert expected in action.help, command


def _status(argv: list[str]) -> int:
    """The exit status of ``fsdp-presets ARGV`` (argparse's own refusals exit from inside)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


# One bad value, every command that takes the flag: the same one-line refusal, exit 2, before any
# model or file is read.
@pytest.mark.parametrize("flag, value, message", [
    ("--gpu-memory", "0", "--gpu-memory must be a number of GiB more than 0"),
    ("--gpus", "0", "--gpus must be at least 1"),
    ("--seq-len", "1.5", "--seq-len must be a whole number"),
    ("--precision", "bf61", "unknown --precision value 'bf61'; did you mean 'bf16'"),
    ("--activation-checkpointing", "yes", "unknown --activation-checkpointing value 'yes'"),
    ("--micro-batch", "-1", "--micro-batch must be at least 1"),
    ("--lora-r", "8.5", "--lora-r must be a whole number, got '8.5'"),
    ("--lora-alpha", "-2", "--lora-alpha must be a number more than 0, got '-2'"),
    ("--lora-dropout", "1", "--lora-dropout must be a number from 0 up to (not including) 1, got '1'"),
])
def test_one_bad_value_one_message_in_every_command(capsys, flag, value, message):
    start = {"plan": ["plan", "llama", "--gpus", "2"], "generate": ["generate", "llama", "--gpus", "2", "-o", "x.yaml"],
             "rehearse": ["rehearse", "llama", "--gpus", "2"], "check": ["check", "x.yaml"]}
    ran = 0
    for command, argv in start.items():
        if command not in _flags()[flag]:
            continue
        argv = [word for word in argv if word != flag]
        if flag == "--gpus":
            argv = argv[:2]
        assert _status([*argv, flag, value]) == 2, command
        assert message in capsys.readouterr().err, command
        ran += 1
    assert ran >= 2


def test_grad_accum_is_bounded_like_the_other_counts():
    with pytest.raises(Exception, match="--grad-accum must be at least 1"):
        limits.grad_accum("0")
    assert limits.grad_accum("4") == 4


def test_commands_import_no_private_helper_and_scripts_import_library_code():
    """Commands parse and print: what they compute lives in the library, where another command or a
    script imports it. No module imports a private name of a command module, and the preset
    catalogue script imports no command at all."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    offenders = []
    for path in [*repo.glob("fsdp_presets/**/*.py"), *repo.glob("scripts/*.py"), *repo.glob("tests/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_presets.commands."):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                if private or path.name == "make_presets.py":
                    offenders.append(f"{path.relative_to(repo)}: from {node.module} import "
                                     f"{', '.join(alias.name for alias in node.names)}")
    assert not offenders, offenders
