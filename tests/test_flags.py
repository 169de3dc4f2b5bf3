"""One spelling per training setting (:mod:`fsdp_presets.flags`): the recipes' own parsers read
every launch line the shipped presets print (and those of a LoRA and a QLoRA preset), every setting
``fsdp-presets`` and the recipes share is spelled and stored alike in both, and an earlier spelling
still parses, with its one-line note."""

from __future__ import annotations

import argparse
import contextlib
import io
import runpy
import shlex
from pathlib import Path

import pytest

from fsdp_presets import flags
from fsdp_presets.preset.emit import read_metadata

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
RECIPES = ("recipes/causal_lm.py", "recipes/sequence_classification.py", "recipes/sft_trainer.py")


def launch_words(text: str) -> list[str]:
    """The words of the ``accelerate launch`` command a generated file's header prints."""
    lines = [line.removeprefix("#").strip() for line in text.splitlines() if line.startswith("#")]
    start = next(index for index, line in enumerate(lines) if line.startswith("accelerate launch"))
    command = []
    for line in lines[start:]:
        command.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(command).replace("$", "\\$"))


def recipe_args(words: list[str]) -> tuple[str, list[str]]:
    """The recipe a launch command runs and the words after it."""
    index = next(index for index, word in enumerate(words) if word.endswith(".py"))
    return words[index], words[index + 1:]


@pytest.fixture(scope="module")
def recipe_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each recipe's own parser, as its ``parse_args`` builds it (the recipe is not run)."""
    parsers = {}
    original = argparse.ArgumentParser.parse_args

    def grab(self, *args, **kwargs):
        raise _Parser(self)

    argparse.ArgumentParser.parse_args = grab
    try:
        for script in RECIPES:
            namespace = runpy.run_path(str(REPO / script), run_name="recipe")
            try:
                namespace["parse_args"]()
            except _Parser as found:
                parsers[script] = found.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    assert set(parsers) == set(RECIPES)
    return parsers


class _Parser(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def parse_quietly(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.Namespace, str]:
    """``parser.parse_args(words)`` and what it printed on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        args = parser.parse_args([str(word) for word in words])
    return args, err.getvalue()


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every ``fsdp-presets`` subcommand's parser."""
    from fsdp_presets import cli

    parser = cli.build_parser()
    return next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction)).choices


def cli_parser(command: str) -> argparse.ArgumentParser:
    return cli_parsers()[command]


def option_dests(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {option: action.dest for action in parser._actions for option in action.option_strings}


# ---- the shipped presets' launch lines ----
@pytest.mark.parametrize("preset", PRESETS, ids=[path.name for path in PRESETS])
def test_every_shipped_launch_line_parses_with_the_recipes_parser(preset, recipe_parsers):
    text = preset.read_text()
    summary = read_metadata(text)["summary"]
    script, words = recipe_args(launch_words(text))
    if script not in recipe_parsers:  # a model that is not a causal LM: the user's own script
        assert script == "YOUR_TRAINING_SCRIPT.py"
        script = "recipes/causal_lm.py"
    args, printed = parse_quietly(recipe_parsers[script], words)
    assert printed == ""  # one spelling: no note about an earlier one
    assert (args.seq_len, args.micro_batch, args.grad_accum) == (
        summary["seq_len"], summary["micro_batch"], summary["gradient_accumulation"])
    assert args.reduce_every_micro_batch == summary["reduce_every_micro_batch"]
    assert args.async_save == (summary["async_save"] and ".ddp." not in preset.name)
    assert (args.method or "full") == "full"


def test_the_launch_line_reader_sees_every_word():
    """The reader itself can fail: a header's wrapped launch command comes back whole."""
    text = ("# Launch:\n#   accelerate launch --config_file a.yaml recipes/causal_lm.py \\\n"
            "#       --model M --micro-batch \\\n#       2 --grad-accum 4\n# DDP baseline: b.yaml\nx: 1\n")
    assert recipe_args(launch_words(text)) == ("recipes/causal_lm.py",
                                               ["--model", "M", "--micro-batch", "2", "--grad-accum", "4"])


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_lora_preset_launch_line_parses_to_its_method_and_shape(method, tmp_path, recipe_parsers):
    from fsdp_presets import cli

    output = tmp_path / "p.yaml"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = cli.main(["generate", str(REPO / "model_configs" / "llama-3.1-8b"), "--gpus", "2", "--gpu-memory",
                           "40", "--method", method, "--lora-r", "8", "--lora-dropout", "0.1",
                           "--lora-target-modules", "q_proj,v_proj", "--baseline", "ddp", "-o", str(output)])
    assert status == 0
    for path in (output, tmp_path / "p.ddp.yaml"):
        script, words = recipe_args(launch_words(path.read_text()))
        args, printed = parse_quietly(recipe_parsers[script], ["--data", "d", *words])
        assert printed == ""
        assert (args.method, args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules) == (
            method, 8, 16.0, 0.1, "q_proj,v_proj")


# ---- one spelling in the command line and the recipes ----
def spellings(parser: argparse.ArgumentParser, dest: str) -> set[str]:
    return {option for option, stored in option_dests(parser).items() if stored == dest}


def test_every_shared_setting_is_spelled_and_stored_alike_in_the_cli_and_the_recipes(recipe_parsers):
    """Each setting has the registry's spellings (its one name and the earlier ones) in every
    command that takes it and in the recipes, and lands in the same attribute."""
    commands = cli_parsers()
    for flag in flags.SHARED:
        expected = {flag.name, *flag.old_names}
        taking = {command for command, parser in commands.items() if spellings(parser, flag.dest)}
        assert {"plan"} <= taking, flag.name
        for command in taking:
            assert spellings(commands[command], flag.dest) == expected, (command, flag.name)
        extra = {flags.LOAD_IN_4BIT} if flag is flags.METHOD else set()
        assert spellings(recipe_parsers["recipes/causal_lm.py"], flag.dest) == expected | extra, flag.name
    for command in ("generate", "rehearse", "check", "converge"):
        assert flags.MICRO_BATCH.name in option_dests(commands[command]), command


def test_every_registered_setting_is_a_recipe_flag_and_the_recipes_agree(recipe_parsers):
    dests = [option_dests(parser) for parser in recipe_parsers.values()]
    for flag in flags.TRAINING:
        assert all(found.get(flag.name) == flag.dest for found in dests), flag.name
    assert len({flag.name for flag in flags.TRAINING}) == len(flags.TRAINING)


def test_the_registry_spells_flags_as_flags():
    for flag in flags.TRAINING:
        assert flag.name.startswith("--") and flag.name == flag.name.lower() and "_" not in flag.name
        assert flag.help and not set(flag.old_names) & {other.name for other in flags.TRAINING}


# ---- earlier spellings ----
BASE = ["--model", "m", "--data", "d", "--output-dir", "o"]


@pytest.mark.parametrize("old, new, dest, value", [
    (["--micro-batch-size", "4"], ["--micro-batch", "4"], "micro_batch", 4),
    (["--gradient-accumulation-steps", "3"], ["--grad-accum", "3"], "grad_accum", 3),
    (["--load-in-4bit"], ["--method", "qlora"], "method", "qlora"),
], ids=["micro-batch", "grad-accum", "qlora"])
def test_an_earlier_spelling_parses_alike_with_a_note(recipe_parsers, monkeypatch, old, new, dest, value):
    monkeypatch.delenv("RANK", raising=False)
    for parser in recipe_parsers.values():
        args, printed = parse_quietly(parser, BASE + old)
        fresh, quiet = parse_quietly(parser, BASE + new)
        assert getattr(args, dest) == getattr(fresh, dest) == value and quiet == ""
        named = " ".join(new) if old == [flags.LOAD_IN_4BIT] else new[0]
        assert printed == f"note: {old[0]} is now spelled {named}; the old spelling still works\n"
    monkeypatch.setenv("RANK", "1")  # one note per launch: the first process says it
    assert parse_quietly(recipe_parsers["recipes/causal_lm.py"], BASE + old)[1] == ""


def test_the_commands_take_the_recipes_earlier_spelling_too():
    args, printed = parse_quietly(cli_parser("plan"), ["llama", "--gpus", "8", "--micro-batch-size", "2"])
    assert args.micro_batch == 2 and "now spelled --micro-batch" in printed
    # `fsdp-presets converge` had the recipes' spellings: they still parse, into the new names.
    words = ["--model", "m", "--data", "d", "--config", "c.yaml", "--micro-batch-size", "4",
             "--gradient-accumulation-steps", "2"]
    args, printed = parse_quietly(cli_parser("converge"), words)
    assert (args.micro_batch, args.grad_accum) == (4, 2) and printed.count("note: ") == 2


def test_lora_r_alone_still_means_lora_and_an_explicit_full_refuses_it(recipe_parsers):
    from fsdp_presets.errors import UsageError
    from fsdp_presets.train import lora

    parser = recipe_parsers["recipes/causal_lm.py"]
    args, _ = parse_quietly(parser, BASE + ["--lora-r", "8"])
    assert args.method is None and lora.settings(args)["method"] == "lora"
    args, _ = parse_quietly(parser, BASE + ["--method", "full", "--lora-r", "8"])
    with pytest.raises(UsageError, match="--lora-r set without LoRA; add --method lora or --method qlora"):
        lora.settings(args)
    args, _ = parse_quietly(parser, BASE + ["--method", "lora"])
    assert args.lora_r is None and lora.settings(args)["r"] == flags.DEFAULT_LORA_R


def test_one_target_module_check():
    from fsdp_presets.errors import UsageError

    assert flags.target_modules(" q_proj, v_proj ,") == ("q_proj", "v_proj")
    for bad in ("", ",", "q_proj;rm", "x" * 201):
        with pytest.raises(UsageError, match="--lora-target-modules"):
            flags.target_modules(bad)


def test_no_flag_of_the_registry_is_typed_again_where_it_is_used():
    """emit_commands and converge name the recipe flags through the registry, never as strings."""
    for module in ("fsdp_presets/preset/emit_commands.py", "fsdp_presets/compare/converge.py"):
        source = (REPO / module).read_text()
        typed = [flag.name for flag in flags.TRAINING if f'"{flag.name}"' in source]
        typed += [old for flag in flags.TRAINING for old in flag.old_names if old in source]
        assert typed == [] and flags.LOAD_IN_4BIT not in source, (module, typed)
