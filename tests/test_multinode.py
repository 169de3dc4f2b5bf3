"""Multi-node: launch scripts (SLURM, torchrun, per-node accelerate) run against fake cluster tools,
the two-node rehearsal on one host, and the node-join timeout."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import yaml

from conftest import REPO, WORKERS, accelerate_config
from fsdp_presets import cli
from fsdp_presets.errors import UsageError
from fsdp_presets.launching.launchers import (Job, accelerate_environment, accelerate_node_command, concrete,
                                    job_from_config, render_slurm)
from fsdp_harness.launch import launch_env, read_rank_results
from fsdp_harness.scripts import script_module
from fsdp_presets.launching.local import free_port

TRAIN_COMMAND = "recipes/causal_lm.py --model runs/models/llama --data 'my data/train.jsonl' --output-dir runs/x"
SLURM_NODES = ["gpu07", "gpu08"]

# Fake cluster tools: each records what it was asked to run, one file per node, NUL-separated.
SRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$RECORD/srun.args"
while [[ "$1" == -* ]]; do shift; done          # srun's own options, up to the command
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" || exit $?
done
"""
SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" && "$3" == "$SLURM_JOB_NODELIST" ]] || { echo "unexpected: $*" >&2; exit 1; }
printf '%s\\n' """ + " ".join(SLURM_NODES) + "\n"
RECORDER = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$RECORD/$(basename "$0")-node-${SLURM_NODEID:-$NODE_RANK_SEEN}.args"
env > "$RECORD/$(basename "$0")-node-${SLURM_NODEID:-$NODE_RANK_SEEN}.env"
"""


def fake_tools(directory: Path, names) -> Path:
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        script = {"srun": SRUN, "scontrol": SCONTROL}.get(name, RECORDER)
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def recorded(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def run_script(script: Path, *arguments, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *arguments], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=60)


@pytest.fixture
def hsdp_2x8(tmp_path) -> Path:
    """The HSDP preset of 2 nodes x 8 GPUs (accelerate schema, as `accelerate config` writes it)."""
    return accelerate_config(tmp_path, "hsdp_2x8", num_processes=16,
                             parallelism={"dp_replicate_size": 2, "dp_shard_size": 8})


def write_with_cli(config: Path, launcher: str, output: Path, *extra, command: str = TRAIN_COMMAND) -> Path:
    """``fsdp-presets launcher`` run in this process, from the config's folder, with the argv of
    the command line (the script's ``# Made by:`` line); tests/test_hostile_input.py runs it in a
    child process."""
    argv = ["launcher", config.name, "--launcher", launcher, "-o", str(output), "--command", command, *extra]
    errors = io.StringIO()
    with contextlib.chdir(config.parent), mock.patch.object(sys, "argv", ["fsdp-presets", *argv]), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
        code = cli.main(argv)
    assert code == 0, errors.getvalue()
    return output


# ---- SLURM ----
def test_slurm_script_starts_one_accelerate_launch_per_node_with_its_rank(tmp_path, hsdp_2x8):
    script = write_with_cli(hsdp_2x8, "slurm", tmp_path / "job.slurm.sh", "--time", "2:00:00")
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=2:00:00"):
        assert line in text.splitlines()
    assert "scontrol show hostnames" in text and "29500" in text

    record = tmp_path / "record"
    record.mkdir()
    bin_dir = fake_tools(tmp_path, ["srun", "scontrol", "accelerate"])
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(record),
               SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
               MAIN_PROCESS_PORT="31337", HF_TOKEN="secret-from-the-environment")
    completed = run_script(script, env=env, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr

    srun_options = recorded(record / "srun.args")
    assert "--nodes=2" in srun_options and "--ntasks-per-node=1" in srun_options
    assert "--export=ALL" in srun_options and "--kill-on-bad-exit=1" in srun_options
    for node in (0, 1):
        command = recorded(record / f"accelerate-node-{node}.args")
        assert command[0] == "launch"
        assert flag(command, "--machine_rank") == str(node)
        assert flag(command, "--num_machines") == "2"
        assert flag(command, "--num_processes") == "16"
        assert flag(command, "--main_process_ip") == SLURM_NODES[0]  # the allocation's first node
        assert flag(command, "--main_process_port") == "31337"  # from the environment at run time
        assert flag(command, "--rdzv_conf") == "timeout=600"
        assert flag(command, "--config_file") == hsdp_2x8.name
        assert command[command.index("recipes/causal_lm.py"):] == [
            "recipes/causal_lm.py", "--model", "runs/models/llama", "--data", "my data/train.jsonl",
            "--output-dir", "runs/x"]
        node_env = (record / f"accelerate-node-{node}.env").read_text()
        assert "HF_TOKEN=secret-from-the-environment" in node_env  # secrets travel in the environment
    assert "secret-from-the-environment" not in text and "gpu07" not in text


def test_slurm_script_refuses_an_allocation_of_another_size(tmp_path, hsdp_2x8):
    script = write_with_cli(hsdp_2x8, "slurm", tmp_path / "job.slurm.sh")
    bin_dir = fake_tools(tmp_path, ["srun", "scontrol", "accelerate"])
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(tmp_path),
               SLURM_JOB_NODELIST="gpu[07-09]", SLURM_JOB_NUM_NODES="3", SLURM_NNODES="3")
    completed = run_script(script, env=env, cwd=tmp_path)
    assert completed.returncode == 2
    assert "for 2 nodes, the allocation has 3" in completed.stderr
    assert not list(tmp_path.glob("accelerate-node-*"))
    outside = run_script(script, env=dict(os.environ), cwd=tmp_path)
    assert outside.returncode != 0 and "submit this script with sbatch" in outside.stderr


# ---- per-node scripts ----
@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_per_node_script_runs_the_node_it_is_given(tmp_path, hsdp_2x8, launcher):
    script = write_with_cli(hsdp_2x8, launcher, tmp_path / f"job.{launcher}.sh", "--join-timeout", "90")
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir = fake_tools(tmp_path, [launcher])
    base = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RECORD=str(tmp_path))
    for node in (0, 1):
        env = dict(base, MAIN_PROCESS_IP="10.1.2.3", NODE_RANK_SEEN=str(node))
        completed = run_script(script, str(node), env=env, cwd=tmp_path)
        assert completed.returncode == 0, completed.stderr
        command = recorded(tmp_path / f"{launcher}-node-{node}.args")
        if launcher == "accelerate":
            assert [flag(command, name) for name in ("--machine_rank", "--num_machines", "--num_processes",
                                                      "--main_process_ip", "--main_process_port", "--rdzv_conf")] \
                == [str(node), "2", "16", "10.1.2.3", "29500", "timeout=90"]
        else:
            assert [flag(command, name) for name in ("--node-rank", "--nnodes", "--nproc-per-node",
                                                      "--rdzv-backend", "--master-addr", "--master-port",
                                                      "--rdzv-conf")] \
                == [str(node), "2", "8", "static", "10.1.2.3", "29500", "timeout=90"]
            node_env = (tmp_path / f"torchrun-node-{node}.env").read_text().splitlines()
            for setting in ("ACCELERATE_USE_FSDP=true", "FSDP_VERSION=2", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE=2",
                            "PARALLELISM_CONFIG_DP_SHARD_SIZE=8", "FSDP_TRANSFORMER_CLS_TO_WRAP=LlamaDecoderLayer"):
                assert setting in node_env
        assert command[-7:] == ["recipes/causal_lm.py", "--model", "runs/models/llama", "--data",
                                "my data/train.jsonl", "--output-dir", "runs/x"]
    no_rank = run_script(script, env=dict(base, MAIN_PROCESS_IP="10.1.2.3"), cwd=tmp_path)
    assert no_rank.returncode == 2 and "usage:" in no_rank.stderr
    out_of_range = run_script(script, "2", env=dict(base, MAIN_PROCESS_IP="10.1.2.3"), cwd=tmp_path)
    assert out_of_range.returncode == 2
    no_address = run_script(script, "0", env=base, cwd=tmp_path)
    assert no_address.returncode != 0 and "MAIN_PROCESS_IP" in no_address.stderr


def test_generate_writes_the_launch_script_next_to_the_hsdp_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # in this process: torch and transformers are imported once per test run
    code = cli.main(["generate", "llama", "--device", "cpu", "--gpus", "4", "--nodes", "2", "--seq-len", "32",
                     "--global-batch", "8", "-o", "configs/llama_2x2.yaml", "--launcher", "slurm", "--time", "1:00:00"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    script = tmp_path / "configs" / "llama_2x2.slurm.sh"
    assert "wrote configs/llama_2x2.slurm.sh" in captured.out
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=2" in text
    assert "--num_machines 2" in text and "--num_processes 4" in text
    # Without --command, the training command is the one the preset's header names.
    assert "recipes/causal_lm.py --model MODEL_DIR" in text and "--micro-batch 2" in text


# ---- the job and its checks ----
def test_job_from_config_reads_the_mesh_and_refuses_a_mismatch(tmp_path, hsdp_2x8):
    job = job_from_config(hsdp_2x8, command=["train.py"])
    assert (job.nodes, job.gpus_per_node, job.num_processes) == (2, 8, 16)
    with pytest.raises(UsageError, match="does not fill 4 nodes x 8 GPUs"):
        job_from_config(hsdp_2x8, command=["train.py"], nodes=4, gpus_per_node=8)
    with pytest.raises(UsageError, match="no such accelerate config"):
        job_from_config(tmp_path / "missing.yaml", command=["train.py"])


@pytest.mark.parametrize("argument", ["--hf-token=abc", "--wandb_api_key", "hf_" + "a" * 30])
def test_secrets_in_the_command_are_refused(argument):
    with pytest.raises(UsageError, match="secrets"):
        Job(config_file="c.yaml", nodes=2, gpus_per_node=8, command=("train.py", argument))


def test_rendering_is_pure_and_bakes_no_address():
    job = Job(config_file="c.yaml", nodes=2, gpus_per_node=4, command=("train.py",))
    first = render_slurm(job, script_name="a.sh", generated_by="test")
    assert first == render_slurm(job, script_name="a.sh", generated_by="test")
    assert '--main_process_ip "$MAIN_PROCESS_IP"' in first and '--machine_rank "$SLURM_NODEID"' in first
    with pytest.raises(ValueError, match="MAIN_PROCESS_IP"):
        concrete(accelerate_node_command(job, 0))
    with pytest.raises(UsageError, match="outside 0..1"):
        accelerate_node_command(job, 2)


def test_accelerate_environment_is_what_accelerate_launch_sets(hsdp_2x8):
    environment = accelerate_environment(hsdp_2x8)
    assert environment["ACCELERATE_USE_FSDP"] == "true"
    assert environment["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] == "2"
    assert environment["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert not any(key.startswith(("MASTER_", "WORLD_", "RANK")) for key in environment)


# ---- real launches ----
@pytest.mark.slow
def test_torchrun_scripts_start_a_real_two_node_fsdp_job(tmp_path):
    """The rendered torchrun scripts, run for real: 2 "nodes" x 1 process, FSDP2. The ranks hold
    half the parameters each only if the FSDP settings reached accelerate through the environment
    the script exports (plain torchrun reads no accelerate config), and they train together only if
    the two nodes met at the rendezvous. (HSDP needs 2 or more processes per node: accelerate
    refuses a mesh with dp_shard_size 1; the HSDP variables are checked with the fake torchrun.)"""
    config = accelerate_config(tmp_path, "fsdp2_2x1", num_processes=2)
    worker_command = f"{WORKERS / 'tiny_train.py'} --steps 2 --global-batch 4 --result-dir {tmp_path / 'out'}"
    script = write_with_cli(config, "torchrun", tmp_path / "job.torchrun.sh", "--join-timeout", "120",
                            "--nodes", "2", "--gpus", "1", command=worker_command)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f'#!/usr/bin/env bash\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    env = launch_env({"PATH": f"{bin_dir}:{os.environ['PATH']}", "MAIN_PROCESS_IP": "127.0.0.1",
                      "MAIN_PROCESS_PORT": str(free_port())})
    nodes = [subprocess.Popen(["bash", str(script), str(node)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    results = read_rank_results(tmp_path / "out")
    assert sorted(results) == [0, 1]
    for result in results.values():
        assert result["distributed_type"] == "FSDP" and result["world_size"] == 2
        assert 0 < result["sharded"]["local"] < result["sharded"]["total"]
    assert results[0]["sharded"]["local"] + results[1]["sharded"]["local"] == results[0]["sharded"]["total"]
    assert results[0]["losses"] == results[1]["losses"]


def rehearse_multinode(monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    """``scripts/rehearse_multinode.py ARGV`` run in this process (which has imported what it
    imports; its launches are real processes as anywhere): (exit status, what it printed)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", ["rehearse_multinode.py", *argv])
    code = script_module(REPO / "scripts" / "rehearse_multinode.py").main()
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_two_node_rehearsal_matches_one_node_and_resumes_on_the_node_left(tmp_path, monkeypatch, capsys):
    code, out = rehearse_multinode(monkeypatch, capsys, "--work-dir", str(tmp_path / "r"))
    summary_path = tmp_path / "r" / "summary.json"
    assert code == 0, out[-4000:]
    summary = json.loads(summary_path.read_text())
    baseline = {int(step): loss for step, loss in summary["baseline"].items()}
    two_nodes = {int(step): loss for step, loss in summary["two_nodes"].items()}
    resumed = {int(step): loss for step, loss in summary["resumed"].items()}
    # Two launches of 2 processes = one launch of 4: same losses (in practice bitwise).
    assert sorted(two_nodes) == [1, 2, 3, 4]
    assert max(abs(two_nodes[step] - baseline[step]) for step in two_nodes) <= 1e-6
    # Node 1 died while step 4 was being saved: the run resumes from step 2 on 2 processes and
    # steps 3-6 continue the uninterrupted run (another process count: rounding only).
    assert summary["resume_message"].startswith("resumed from") and "step 2," in summary["resume_message"]
    assert "saved by 4 processes, now 2" in summary["resume_message"]
    assert max(abs(resumed[step] - baseline[step]) for step in range(3, 7)) <= 1e-5
    assert resumed[3] < baseline[1] - 0.3  # not a fresh start: the loss carries on from step 2
    assert summary["checkpoint_mesh"] == {"world_size": 4, "hsdp_mesh": {
        "dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 1, "cp_size": 1}}
    # The two "nodes" ran the per-node script `generate --launcher accelerate` wrote for the HSDP
    # 2x2 preset; node 1 held global ranks 2 and 3 (machine rank 1), so the fault hit it.
    configs, logs = tmp_path / "r" / "configs", tmp_path / "r" / "logs"
    preset = yaml.safe_load((configs / "hsdp_2x2.yaml").read_text())
    assert preset["num_machines"] == 2 and preset["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}
    script = (configs / "hsdp_2x2.accelerate.sh").read_text()
    assert '--num_machines 2' in script and '--machine_rank "$NODE_RANK"' in script
    for node in (0, 1):
        first_line = (logs / f"node-{node}.log").read_text().splitlines()[0]
        assert "MAIN_PROCESS_IP=127.0.0.1" in first_line and first_line.endswith(f"hsdp_2x2.accelerate.sh {node}")
    assert "[fault] kill at during-save, step 4, rank 2" in (logs / "node-1.log").read_text()
    # Only the main process of the whole job writes shared files: one run.json, one metrics file,
    # a manifest per committed checkpoint, and no leftover of the save that node 1 interrupted.
    run = tmp_path / "r" / "run"
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]
    assert all((folder / "manifest.json").is_file() for folder in (run / "checkpoints").iterdir())
    assert (run / "run.json").is_file() and not list(run.glob("*.tmp*"))


@pytest.mark.slow
def test_a_node_that_never_joins_fails_the_first_within_the_timeout(tmp_path, monkeypatch, capsys):
    join_timeout = 3  # seconds: the wait is the cost of this test; start-up is outside it
    started = time.monotonic()
    code, out = rehearse_multinode(monkeypatch, capsys, "--work-dir", str(tmp_path / "j"), "--drill", "missing-node",
                                   "--join-timeout", str(join_timeout))
    elapsed = time.monotonic() - started
    assert code == 0, out[-4000:]
    summary = json.loads((tmp_path / "j" / "summary.json").read_text())
    assert summary["exit_code"] != 0
    assert "1/2 clients joined" in summary["reason"]
    assert "node 1 never joined" in out
    # It waited for the timeout (not an unrelated early failure) and not much longer (start-up only).
    assert join_timeout <= summary["elapsed_s"] <= join_timeout + 90 and elapsed < join_timeout + 120
