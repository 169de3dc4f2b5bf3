"""Bad and hostile input to the planning commands and the files they generate, built the way a
careless or hostile user would: values with newlines, ``$(...)``, backticks, quotes and YAML
syntax; hand-written files in the way of an output; absurd numbers and broken config.json files;
runs whose losses are NaN.

What must hold: a generated script run by bash executes nothing it was not meant to (a marker
file that any injected ``touch`` would create never appears) and passes every value through as
exactly one word; a generated config loads back with exactly the generated keys and values; a
file the tool did not write is never replaced without ``--force``; every bad input is one line,
exit status 2, no traceback, no hang, nothing written.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, accelerate_config
from fsdp_presets import cli
from fsdp_presets.compare.records import load_run
from fsdp_presets.compare.runs import compare_runs
from fsdp_presets.preset.emit import read_metadata
from test_compare import reference_losses, write_run
from test_multinode import fake_tools, recorded

MARKER = "PWNED"
"""The file every injected command below would create (relative: scripts run in tmp_path)."""
HOSTILE_MODEL = "m\nmain_process_ip: 6.6.6.6\n#"
HOSTILE_DATA = f"d $(touch {MARKER}) `touch {MARKER}` '\"; touch {MARKER}; echo \"\n$(touch {MARKER})\u2028x"
HOSTILE_FOLDER = f"c$(touch {MARKER})'q\n`touch {MARKER}`"
HOSTILE_WORDS = ["train.py", "--note", f"x\n touch {MARKER} #", "--tag", f"$(touch {MARKER})",
                 "--q", f"`touch {MARKER}`", "--yaml", "a: b\n#c"]
TOKEN = "hf_" + "Zx9" * 10


def offline_env(**extra) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                PYTHONPATH=str(REPO), **extra)


def fsdp_presets(*argv, cwd: Path) -> subprocess.CompletedProcess:
    """The real command line in a child process (the scripts' ``# Made by:`` line is its argv)."""
    return subprocess.run([sys.executable, "-m", "fsdp_presets.cli", *map(str, argv)], capture_output=True,
                          text=True, cwd=cwd, env=offline_env(), timeout=300)


def header_lines(text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            break
        lines.append(line)
    return lines


def assert_nothing_ran(folder: Path) -> None:
    assert not [path for path in folder.rglob("*") if path.name == MARKER], "an injected command ran"


# --------------------------------------------------------------------------- quoting


NASTY = [HOSTILE_MODEL, HOSTILE_DATA, "it's", "a\rb", "tab\there", "\\'\"", "é日本😀", "x\u2028y\x85z",
         os.fsdecode(b"not utf-8 \xff\xfe"), "$HOME ${HOME} !! *", "-n"]


def test_shell_words_read_back_by_bash_as_exactly_the_value_on_one_line(tmp_path):
    from fsdp_presets.launching.quoting import comment_text, is_one_line, shell_word

    for value in NASTY:
        word = shell_word(value)
        assert is_one_line(word) and is_one_line(comment_text(value)), repr(value)
        echoed = subprocess.run(["bash", "-c", f"printf '%s' {word}"], capture_output=True, cwd=tmp_path,
                                timeout=30).stdout
        assert echoed == os.fsencode(value), repr(value)
    assert_nothing_ran(tmp_path)


# --------------------------------------------------------------------------- generate


@pytest.fixture(scope="module")
def hostile_generate(tmp_path_factory):
    """``generate`` (2 nodes, DDP baseline, per-node accelerate script) with a hostile output folder,
    launch model and data; and the same request with plain values, for the exact comparison."""
    root = tmp_path_factory.mktemp("hostile_generate")
    common = ["generate", "llama", "--device", "cpu", "--gpus", "4", "--nodes", "2", "--seq-len", "32",
              "--global-batch", "8", "--baseline", "ddp", "--launcher", "accelerate"]
    output = f"{HOSTILE_FOLDER}/x.yaml"
    previous = os.getcwd()
    os.chdir(root)
    try:
        assert cli.main([*common, "--launch-model", HOSTILE_MODEL, "--launch-data", HOSTILE_DATA, "-o", output]) == 0
        assert cli.main([*common, "-o", "plain/x.yaml"]) == 0
    finally:
        os.chdir(previous)
    return root, output


def test_generated_configs_load_back_as_exactly_the_generated_values(hostile_generate):
    root, output = hostile_generate
    assert_nothing_ran(root)
    for name in ("x.yaml", "x.ddp.yaml"):
        text = (root / HOSTILE_FOLDER / name).read_text()
        # Exactly the keys and values of the same request with plain names: nothing injected.
        assert yaml.safe_load(text) == yaml.safe_load((root / "plain" / name).read_text())
        assert "main_process_ip" not in yaml.safe_load(text)
        header = header_lines(text)
        assert all(line.startswith("#") for line in header)
        assert len(text.splitlines()) == len(header) + len(yaml.safe_dump(yaml.safe_load(text)).splitlines())
        metadata = read_metadata(text)
        assert metadata["launch"] == {"model": HOSTILE_MODEL, "data": HOSTILE_DATA}
        assert metadata["outputs"]["config"] == output


def test_header_commands_rerun_with_exactly_the_values_given(hostile_generate, tmp_path):
    """The header's ``fsdp-presets generate`` command, run by bash, passes every value as one word."""
    root, output = hostile_generate
    text = (root / HOSTILE_FOLDER / "x.yaml").read_text()
    lines = text.splitlines()
    start = lines.index("# Generated; regenerate rather than edit (the same command rewrites this file):") + 1
    command = []
    for line in lines[start:]:
        if line == "#":
            break
        command.append(line[1:].lstrip())
    bin_dir = fake_tools(tmp_path, ["fsdp-presets"])
    completed = subprocess.run(["bash", "-c", "\n".join(command)], cwd=tmp_path, capture_output=True, text=True,
                               env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(tmp_path),
                                        NODE_RANK_SEEN="x"), timeout=60)
    assert completed.returncode == 0, completed.stderr
    argv = recorded(tmp_path / "fsdp-presets-node-x.args")
    assert argv[argv.index("--launch-model") + 1] == HOSTILE_MODEL
    assert argv[argv.index("--launch-data") + 1] == HOSTILE_DATA
    assert argv[argv.index("-o") + 1] == output
    assert_nothing_ran(tmp_path)


def test_generated_launch_script_runs_nothing_and_passes_every_value(hostile_generate, tmp_path):
    root, output = hostile_generate
    script = root / HOSTILE_FOLDER / "x.accelerate.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir = fake_tools(tmp_path, ["accelerate"])
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(tmp_path), NODE_RANK_SEEN="1",
               MAIN_PROCESS_IP="10.0.0.1")
    completed = subprocess.run(["bash", str(script), "1"], cwd=root, env=env, capture_output=True, text=True,
                               timeout=60)
    assert completed.returncode == 0, completed.stderr
    argv = recorded(tmp_path / "accelerate-node-1.args")
    assert argv[argv.index("--config_file") + 1] == output
    assert argv[argv.index("--model") + 1] == HOSTILE_MODEL
    assert argv[argv.index("--data") + 1] == HOSTILE_DATA
    assert argv[argv.index("--machine_rank") + 1] == "1"
    # From another folder the config is missing: the message names the path as it is, runs nothing.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = subprocess.run(["bash", str(script), "0"], cwd=elsewhere, env=env, capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and f"{output}: no such accelerate config" in missing.stderr
    assert_nothing_ran(root)
    assert_nothing_ran(tmp_path)


# --------------------------------------------------------------------------- launcher


@pytest.fixture
def hostile_config(tmp_path) -> Path:
    """An HSDP 2 x 2 accelerate config whose file name is hostile."""
    return accelerate_config(tmp_path, HOSTILE_FOLDER.replace("/", "_"), num_processes=4,
                             parallelism={"dp_replicate_size": 2, "dp_shard_size": 2})


@pytest.mark.parametrize("kind", ["slurm", "accelerate", "torchrun"])
def test_launcher_scripts_run_nothing_and_pass_every_word(tmp_path, hostile_config, kind):
    completed = fsdp_presets("launcher", hostile_config.name, "--launcher", kind, "-o", "job.sh",
                             "--command", shlex.join(HOSTILE_WORDS), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    script = tmp_path / "job.sh"
    made_by = [line for line in script.read_text().splitlines() if line.startswith("# Made by:")]
    assert len(made_by) == 1 and "\\n touch PWNED" in made_by[0], "the command line stays in its comment"
    program = {"slurm": "accelerate", "accelerate": "accelerate", "torchrun": "torchrun"}[kind]
    bin_dir = fake_tools(tmp_path, ["srun", "scontrol", program])
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(tmp_path), NODE_RANK_SEEN="0",
               MAIN_PROCESS_IP="10.0.0.1", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_NUM_NODES="2",
               SLURM_NNODES="2")
    ran = subprocess.run(["bash", str(script), *([] if kind == "slurm" else ["0"])], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    argv = recorded(tmp_path / f"{program}-node-0.args")
    assert argv[-len(HOSTILE_WORDS):] == HOSTILE_WORDS
    if kind != "torchrun":
        assert argv[argv.index("--config_file") + 1] == hostile_config.name
    assert_nothing_ran(tmp_path)


@pytest.mark.parametrize("secret", [f"--hf-token {TOKEN}", f"--auth={TOKEN}", f"--wandb_api_key {TOKEN}"])
def test_secrets_are_refused_without_being_repeated(tmp_path, hostile_config, capsys, monkeypatch, secret):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launcher", hostile_config.name, "--command", f"train.py {secret}", "-o", "job.sh"]) == 2
    captured = capsys.readouterr()
    assert "secrets" in captured.err and TOKEN not in captured.out + captured.err
    assert not (tmp_path / "job.sh").exists()


def test_a_token_anywhere_on_the_command_line_is_never_written(tmp_path, hostile_config, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fsdp-presets", "launcher", hostile_config.name, "--job-name", "x",
                                      "--time", "1:00:00", f"--note={TOKEN}"])
    assert cli.main(["launcher", hostile_config.name, "--command", "train.py", "-o", "job.sh"]) == 2
    assert not (tmp_path / "job.sh").exists()
    assert cli.main(GENERATE + ["--launch-data", TOKEN, "-o", "x.yaml"]) == 2
    captured = capsys.readouterr()
    assert "looks like an access token" in captured.err and TOKEN not in captured.out + captured.err
    assert not (tmp_path / "x.yaml").exists()


# --------------------------------------------------------------------------- nothing overwritten


def test_launcher_never_replaces_its_config_and_asks_before_a_foreign_file(tmp_path, hostile_config, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    config_text = hostile_config.read_text()
    for extra in ([], ["--force"]):
        assert cli.main(["launcher", hostile_config.name, "--command", "train.py", "-o", hostile_config.name,
                         *extra]) == 2
        assert "would replace the accelerate config" in capsys.readouterr().err
        assert hostile_config.read_text() == config_text
    mine = tmp_path / "mine.sh"
    mine.write_text("#!/bin/bash\necho my own script\n")
    assert cli.main(["launcher", hostile_config.name, "--command", "train.py", "-o", "mine.sh"]) == 2
    assert "pass --force" in capsys.readouterr().err and mine.read_text() == "#!/bin/bash\necho my own script\n"
    assert cli.main(["launcher", hostile_config.name, "--command", "train.py", "-o", "mine.sh", "--force"]) == 0
    assert "# Made by: fsdp-presets" in mine.read_text()
    # A script it wrote is its own to rewrite.
    assert cli.main(["launcher", hostile_config.name, "--command", "other.py", "-o", "mine.sh"]) == 0
    assert "other.py" in mine.read_text()


GENERATE = ["generate", "llama", "--device", "cpu", "--gpus", "2", "--seq-len", "16", "--global-batch", "8"]


@pytest.mark.parametrize("foreign", ["x.yaml", "x.ddp.yaml", "x.slurm.sh"])
def test_generate_refuses_every_foreign_output_before_writing_any(tmp_path, capsys, monkeypatch, foreign):
    monkeypatch.chdir(tmp_path)
    (tmp_path / foreign).write_text("# my own file\n")
    argv = GENERATE + ["--baseline", "ddp", "--launcher", "slurm", "-o", "x.yaml"]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert f"{foreign} exists and" in error and "--force" in error and error.count("\n") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == [foreign]
    assert (tmp_path / foreign).read_text() == "# my own file\n"
    assert cli.main(argv + ["--force"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["x.ddp.yaml", "x.slurm.sh", "x.yaml"]
    # Files it wrote are rewritten by the same command without --force (what their header says).
    assert cli.main(argv) == 0


def test_generate_launch_output_cannot_be_one_of_its_configs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(GENERATE + ["--baseline", "ddp", "--launcher", "slurm", "--launch-output", "x.ddp.yaml",
                                "-o", "x.yaml"]) == 2
    assert "is one of the configs" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- bad numbers and configs


def write_config(folder: Path, **changes) -> Path:
    config = json.loads((REPO / "tests/data/llama-3-70b/config.json").read_text())
    config.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


BAD_INPUT = [
    ("plan-memory-1e308", ["plan", "llama", "--gpus", "2", "--gpu-memory", "1e308"], "--gpu-memory must be a number"),
    ("generate-memory-inf", ["generate", "llama", "--gpus", "2", "--gpu-memory", "inf"], "--gpu-memory must be a number"),
    ("plan-gpus-1e20", ["plan", "llama", "--gpus", "1e20", "--gpu-memory", "80"], "--gpus must be a whole number"),
    ("plan-gpus-10^20", ["plan", "llama", "--gpus", str(10**20), "--gpu-memory", "80"], "--gpus must be at most"),
    ("generate-gpus-10^20", ["generate", "llama", "--gpus", str(10**20)], "--gpus must be at most"),
    ("generate-host-memory", GENERATE + ["--host-memory", "1e300"], "--host-memory must be a number"),
    ("plan-seq-len-past-positions", ["plan", "llama", "--gpus", "2", "--gpu-memory", "24", "--seq-len", "65"],
     "longer than the model's 64 positions"),
    ("plan-seq-len-absurd", ["plan", "llama", "--gpus", "2", "--gpu-memory", "24", "--seq-len", str(10**12)],
     "--seq-len must be at most"),
    ("plan-micro-batch", ["plan", "llama", "--gpus", "2", "--gpu-memory", "24", "--micro-batch", "-3"],
     "--micro-batch must be at least 1"),
    ("generate-global-batch", ["generate", "llama", "--gpus", "2", "--global-batch", "9" * 30], "more than 16777216"),
    ("generate-global-batch-overflow", ["generate", "llama", "--gpus", "2", "--global-batch", "9" * 400 + "M"],
     "more than 68719476736 tokens"),
    ("launcher-port", ["launcher", "x.yaml", "--port", "70000"], "--port must be at most 65535"),
    ("launcher-join-timeout", ["launcher", "x.yaml", "--join-timeout", "1e9"], "--join-timeout must be a whole"),
]


@pytest.mark.parametrize("argv, message", [case[1:] for case in BAD_INPUT], ids=[case[0] for case in BAD_INPUT])
def test_bad_numbers_are_one_line_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv + (["-o", "out.yaml"] if argv[0] == "generate" else [])) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.out == "" and not list(tmp_path.iterdir())


BAD_CONFIGS = {
    "negative-layers": ({"num_hidden_layers": -2}, "num_hidden_layers is -2, a negative number of blocks"),
    "ten-million-layers": ({"num_hidden_layers": 10**7}, "num_hidden_layers is 10000000, more blocks than any"),
    "layers-as-words": ({"num_hidden_layers": "two"}, 'num_hidden_layers is "two", not a whole number'),
    "negative-width": ({"hidden_size": -8192}, "hidden_size is -8192, a negative size"),
    "nested": ({"text_config": {"num_hidden_layers": -1}}, "text_config.num_hidden_layers is -1"),
}


@pytest.mark.parametrize("command", ["inspect", "plan", "generate"])
@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_impossible_config_numbers_are_refused_before_building(tmp_path, capsys, monkeypatch, command, case):
    changes, message = BAD_CONFIGS[case]
    folder = write_config(tmp_path / "model", **changes)
    monkeypatch.chdir(tmp_path)
    argv = {"inspect": ["inspect", str(folder)], "plan": ["plan", str(folder), "--gpus", "8", "--gpu-memory", "80"],
            "generate": ["generate", str(folder), "--gpus", "8", "-o", "out.yaml"]}[command]
    started = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - started < 30, "refused before building the model"
    captured = capsys.readouterr()
    assert message in captured.err and "fix these numbers in config.json" in captured.err
    assert captured.err.count("\n") == 1 and not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize("text", ['{"model_type": "llama", "hidden_size": 40', "", "\xff\xfe", "[1, 2]"],
                         ids=["truncated", "empty", "not-utf8", "not-an-object"])
@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_broken_config_json_is_one_line(tmp_path, capsys, text, command):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_bytes(text.encode("latin-1"))
    argv = ["inspect", str(folder)] if command == "inspect" else ["plan", str(folder), "--gpus", "8",
                                                                   "--gpu-memory", "80"]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert "config.json" in error and error.count("\n") == 1 and "Traceback" not in error


@pytest.mark.parametrize("metadata", [
    {"kind": "fsdp", "request": "llama", "summary": {"global_batch": 8}},
    {"kind": "fsdp", "request": {"model": "llama", "gpus": 2}, "summary": {}},
    {"kind": "fsdp", "request": {"model": "llama", "gpus": 2, "gpu_memory_gib": 1e308}, "summary": {"global_batch": 8}},
    {"kind": "fsdp", "request": {"model": "llama", "gpus": "two"}, "summary": {"global_batch": 8}},
], ids=["request-not-a-mapping", "no-global-batch", "memory-1e308", "gpus-as-word"])
def test_rescaling_a_tampered_preset_is_one_line(tmp_path, capsys, metadata):
    source = tmp_path / "tampered.yaml"
    source.write_text("# fsdp-presets: " + json.dumps(metadata) + "\ndistributed_type: FSDP\n")
    assert cli.main(["generate", "--from", str(source), "--gpus", "4", "-o", str(tmp_path / "out.yaml")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert not (tmp_path / "out.yaml").exists()


@pytest.mark.parametrize("value", ["two", "99999999999999999999999", "-4", "[4]"])
def test_launcher_refuses_a_config_with_an_impossible_process_count(tmp_path, capsys, value):
    config = tmp_path / "c.yaml"
    config.write_text(f"distributed_type: FSDP\nnum_machines: 2\nnum_processes: {value}\n")
    assert cli.main(["launcher", str(config), "--command", "train.py", "-o", str(tmp_path / "job.sh")]) == 2
    error = capsys.readouterr().err
    assert "num_processes must be a whole number" in error and error.count("\n") == 1
    assert not (tmp_path / "job.sh").exists()


def test_rescaling_ignores_launch_hints_that_are_not_text(tmp_path, capsys):
    source = tmp_path / "odd.yaml"
    metadata = {"kind": "fsdp", "request": {"model": "llama", "gpus": 2, "device": "cpu", "seq_len": 16,
                                            "global_batch": "8"},
                "launch": {"model": ["not", "text"], "data": HOSTILE_DATA}, "summary": {"global_batch": 8}}
    source.write_text("# fsdp-presets: " + json.dumps(metadata) + "\ndistributed_type: FSDP\n")
    assert cli.main(["generate", "--from", str(source), "--gpus", "4", "-o", str(tmp_path / "out.yaml")]) == 0
    assert read_metadata((tmp_path / "out.yaml").read_text())["launch"] == {"data": HOSTILE_DATA}


# --------------------------------------------------------------------------- remote code


def test_every_command_that_hints_trust_remote_code_takes_the_flag(tmp_path, capsys):
    folder = write_config(tmp_path / "remote", model_type="my-own-arch",
                          auto_map={"AutoConfig": "configuration_mine.MyConfig"})
    for argv in (["inspect", str(folder)], ["plan", str(folder), "--gpus", "8", "--gpu-memory", "80"],
                 ["generate", str(folder), "--gpus", "8", "-o", str(tmp_path / "o.yaml")],
                 ["check", str(REPO / "accelerate_configs/cpu_fsdp2_demo.yaml"), "--model", str(folder)]):
        assert cli.main(argv) == 2
        assert "--trust-remote-code" in capsys.readouterr().err, argv[0]
        assert cli.build_parser().parse_args(argv + ["--trust-remote-code"]).trust_remote_code is True


def test_recipes_never_trust_remote_code():
    """Every config, tokenizer and model the recipes load, in recipes/ or in the package's train/
    code they run (where the loading lives), is loaded with ``trust_remote_code=False`` spelled out.
    (peft's ``PeftModel.from_pretrained`` puts an adapter on a model already loaded: no code.)"""
    sources = sorted((REPO / "recipes").glob("*.py")) + sorted((REPO / "fsdp_presets" / "train").rglob("*.py"))
    loaders = set()
    for source in sources:
        calls = [node for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained"
                 and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "PeftModel")]
        for call in calls:
            values = {keyword.arg: keyword.value for keyword in call.keywords}
            assert "trust_remote_code" in values, f"{source.name}:{call.lineno}"
            assert isinstance(values["trust_remote_code"], ast.Constant) and values["trust_remote_code"].value is False
            loaders.add(source.relative_to(REPO).as_posix())
    # the tokenizer and config (train/recipe.py, train/loop.py) and the model (train/model_setup.py)
    assert {"fsdp_presets/train/recipe.py", "fsdp_presets/train/loop.py", "fsdp_presets/train/model_setup.py"} <= loaders



def test_recipes_load_models_without_hub_kernels(tmp_path):
    """transformers' ``from_pretrained`` turns Hub kernels on by default (with the ``kernels``
    package it requires): compiled code from the network at the first ``train()``/``eval()`` on a
    GPU, and on an offline GPU host a crash. The recipes' loader turns them off."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.import_utils import is_kernels_available

    from fsdp_harness.tiny_model import write_tiny_model
    from fsdp_presets.train import model_setup

    folder = write_tiny_model(tmp_path / "model", text="in the beginning was the word " * 20)
    assert model_setup.load_model(AutoModelForCausalLM, str(folder), None, task_type="CAUSAL_LM").use_kernels is False
    if is_kernels_available():  # what the loader guards against: the library default
        assert AutoModelForCausalLM.from_pretrained(folder).use_kernels is True

# --------------------------------------------------------------------------- compare


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_two_runs_with_the_same_non_finite_loss_diverge(tmp_path, capsys, bad):
    losses = reference_losses()
    losses[4:] = [bad] * (len(losses) - 4)
    base, cand = write_run(tmp_path / "a", losses=losses), write_run(tmp_path / "b", losses=losses)
    comparison = compare_runs(load_run(base), load_run(cand))
    assert comparison.verdict == "diverged" and comparison.first_divergent_step == 5
    assert "not a number (NaN or inf)" in comparison.diagnosis
    assert cli.main(["compare", str(base), str(cand)]) == 1
    assert capsys.readouterr().out.startswith("DIVERGED at step 5")


def test_equal_overflowing_gradient_norms_still_agree(tmp_path):
    norms = [2.0 / step for step in range(1, len(reference_losses()) + 1)]
    norms[3] = float("inf")  # an fp16 overflow step, skipped by both runs
    base, cand = write_run(tmp_path / "a", grad_norms=norms), write_run(tmp_path / "b", grad_norms=norms)
    assert compare_runs(load_run(base), load_run(cand)).verdict == "identical"


def test_recipes_refuse_a_model_that_needs_its_own_code_in_one_line(tmp_path):
    """A model folder whose config names its own code: one UsageError, nothing of the folder runs."""
    from fsdp_presets.train import loop
    from fsdp_presets.errors import UsageError

    marker = tmp_path / "RAN"
    (tmp_path / "configuration_x.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_in_transformers",
                                                      "auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    with pytest.raises(UsageError, match="never run code from a model folder"):
        loop.load_model_config(str(tmp_path))
    assert not marker.exists()
