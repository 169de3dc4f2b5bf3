"""Helpers of the recipe and checkpoint tests: tiny model folders, recipe command lines, a
hand-written FSDP2 config, recipe launches and runs made once per session, running a recipe's
main once per case in one process, file snapshots, and finding the rank processes of a launch
(to SIGKILL one)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from fsdp_harness.launch import launch_env, run_launch
from fsdp_presets.checkpoint.layout import CHECKPOINTS, step_folder

from conftest import GLOO_EXIT_ABORT

REPO = Path(__file__).resolve().parent.parent
CAUSAL_LM = REPO / "recipes" / "causal_lm.py"
CLASSIFICATION = REPO / "recipes" / "sequence_classification.py"
SFT_TRAINER = REPO / "recipes" / "sft_trainer.py"
SFT_TRAIN = REPO / "data" / "kjv_sft" / "train.jsonl"
SFT_EVAL = REPO / "data" / "kjv_sft" / "eval.jsonl"
GENRES_TRAIN = REPO / "data" / "kjv_genres" / "train.jsonl"
GENRES_EVAL = REPO / "data" / "kjv_genres" / "eval.jsonl"
FSDP2_CONFIG = REPO / "accelerate_configs" / "cpu_fsdp2_demo.yaml"
DDP_CONFIG = REPO / "accelerate_configs" / "cpu_ddp_demo.yaml"


def tiny_llama(folder: Path, *, tied: bool = True) -> Path:
    from fsdp_harness.tiny_model import write_tiny_model

    return write_tiny_model(folder, kind="llama-tied" if tied else "llama",
                            text=SFT_TRAIN.read_text(), max_positions=128)


def tiny_bert(folder: Path) -> Path:
    from fsdp_harness.tiny_model import write_tiny_model

    return write_tiny_model(folder, kind="bert", text=GENRES_TRAIN.read_text(), max_positions=128, num_labels=4)


def causal_lm_args(model: Path, output_dir: Path, *extra) -> list[str]:
    """A short, fast causal LM run on the shipped SFT data (packed 32-token blocks)."""
    return ["--model", str(model), "--data", str(SFT_TRAIN), "--eval-data", str(SFT_EVAL),
            "--max-eval-samples", "16", "--output-dir", str(output_dir), "--seq-len", "32",
            "--micro-batch", "2", "--grad-accum", "2", "--learning-rate", "3e-3",
            "--warmup-steps", "2", "--weight-decay", "0.1", *map(str, extra)]


def session_folder(tmp_path_factory, name: str) -> Path:
    """``NAME/`` in the folder every xdist worker of this pytest session shares (the session's base
    temp folder without xdist): runs there are shared by every test module, whichever worker runs it."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


def launch_recipe(config: Path, recipe: Path, args: list[str], *, processes: int):
    """One recipe launch that must succeed and exit cleanly (no gloo abort at exit)."""
    result = run_launch(config, recipe, args, num_processes=processes, cwd=REPO).check()
    assert GLOO_EXIT_ABORT not in result.stderr
    return result


def made_once(path: Path, make) -> Path:
    """``path`` after ``make()`` has run once per pytest session: a ``PATH.done`` marker, written
    when ``make`` returned, tells a later caller (another module, on any worker) that it is complete;
    a caller that comes while another worker makes it waits for it (``PATH.lock``)."""
    from filelock import FileLock

    done = path.with_name(path.name + ".done")
    with FileLock(str(path.with_name(path.name + ".lock"))):
        if not done.exists():
            make()
            done.write_text("ok\n")
    return path


def checkpoint(run_dir: Path, step: int) -> Path:
    """The committed checkpoint of ``step`` in a run folder."""
    return step_folder(run_dir / CHECKPOINTS, step)


def tree_digest(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``folder`` (to prove nothing changed)."""
    if not folder.exists():
        return {}
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def python() -> str:
    return sys.executable


def offline_env(**extra: str) -> dict[str, str]:
    """The launched jobs' environment (offline, one thread per process) plus ``extra``."""
    return launch_env(extra)


HAND_WRITTEN_FSDP2 = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 2
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
rdzv_backend: static
same_network: true
use_cpu: false
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
"""
"""An FSDP2 config as a user writes it by hand, without the block class to wrap (for a BERT
classifier accelerate's preparation then crashes: tests/test_check_probe.py)."""
BERT_FSDP2 = HAND_WRITTEN_FSDP2 + "  fsdp_transformer_layer_cls_to_wrap: BertLayer\n"
"""The same config with the block class, which check proposes and the recipe trains with."""

RECIPE_DRIVER = """
import json, runpy, sys
from fsdp_presets.train.loop import run_recipe
mains, codes = {}, []
for script, argv in json.loads(sys.argv[1]):
    if script not in mains:
        mains[script] = runpy.run_path(script, run_name="recipe")["main"]
    print("=== case", file=sys.stderr, flush=True)
    print("=== case", flush=True)
    sys.argv = [script.rsplit("/", 1)[-1], *argv]
    codes.append(run_recipe(mains[script]))
print(json.dumps(codes))
"""
"""Runs a recipe's ``main`` once per case in one process (torch imported once), through
``run_recipe``, which turns an error into the exit status a real run would have."""


def drive_recipe(recipe: Path, cases: list[list[str]], *, timeout: float = 600):
    """The recipe's main once per case in one process: ``(exit codes, stderr parts, stdout parts)``,
    one part per case."""
    return drive_recipes([(recipe, argv) for argv in cases], timeout=timeout)


def drive_recipes(cases: list[tuple[Path, list[str]]], *, timeout: float = 600):
    """:func:`drive_recipe` for cases of several recipes, ``(recipe, argv)`` each, in one process."""
    cases = [[str(recipe), [str(arg) for arg in argv]] for recipe, argv in cases]
    driven = subprocess.run([sys.executable, "-c", RECIPE_DRIVER, json.dumps(cases)],
                            capture_output=True, text=True, env=offline_env(), cwd=REPO, timeout=timeout)
    assert driven.returncode == 0, driven.stderr[-4000:]
    codes = json.loads(driven.stdout.strip().splitlines()[-1])
    return codes, driven.stderr.split("=== case")[1:], driven.stdout.split("=== case")[1:]


def recipe_error(result, recipe: str = "causal_lm.py") -> str:
    """The one ``<recipe>: error: ...`` line a refused launch printed (asserts there is exactly one)."""
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"{recipe}: error:")]
    assert len(lines) == 1, result.stderr[-4000:]
    return lines[0]


@contextlib.contextmanager
def file_size_limit(limit: int):
    """``ulimit -f`` for this process while inside (Python ignores SIGXFSZ: a write past it is EFBIG)."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
