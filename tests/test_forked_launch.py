"""The suite's forked launches (harness/fsdp_harness/forked_launch.py) give the ranks what a real
``accelerate launch`` gives them: the same environment, argv, module name, import path, working
directory, streams, signal handlers and session, a real gloo group, the same exit statuses when a
rank fails, and atexit handlers that run as they do in a new interpreter; and a recipe run forked
is bit for bit the same run launched for real. What differs (each real rank's str hash salt) is
recorded here too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO, WORKERS, accelerate_config
from recipe_helpers import CAUSAL_LM, FSDP2_CONFIG, causal_lm_args, checkpoint, tiny_llama, tree_digest
from fsdp_harness import forked_launch
from fsdp_harness.launch import read_rank_results, run_launch
from fsdp_presets.checkpoint.layout import FINAL, MANIFEST, METRICS

FACTS = WORKERS / "launch_facts.py"

# Values that differ between two launches of the same command, whichever kind: the port the
# launch picked and the error file torchrun puts in a fresh temporary folder.
DIFFER_PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}

pytestmark = pytest.mark.skipif(not forked_launch.available(), reason="forked launches need os.fork (Linux)")


def _launch(tmp_path, name: str, *args, forked: bool, config=None, timeout: float = 300):
    folder = tmp_path / name
    folder.mkdir()
    config = config or accelerate_config(tmp_path, "ddp", distributed_type="MULTI_GPU")
    result = run_launch(config, FACTS, [folder, *args], num_processes=2, forked=forked, cwd=REPO,
                        timeout=timeout)
    assert result.forked is forked
    return result, read_rank_results(folder), folder


def masked(words: list[str]) -> list[str]:
    """A command line without what differs per launch: the port and the result folder."""
    return ["PORT" if before == "--main_process_port" else "FOLDER" if word.startswith(("real", "forked"))
            or "/real" in word or "/forked" in word else word for before, word in zip(["", *words], words)]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """One launch of each kind, made while this process ignores SIGUSR1 (a program started from
    here inherits that; the ranks must too)."""
    tmp_path = tmp_path_factory.mktemp("forked-launch")
    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        return {kind: _launch(tmp_path, kind, forked=kind == "forked") for kind in ("real", "forked")}
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_ranks_see_what_a_real_launch_gives_them(both):
    (real, real_ranks, real_folder), (forked, forked_ranks, forked_folder) = both["real"], both["forked"]
    assert real.returncode == forked.returncode == 0, real.stderr[-3000:] + forked.stderr[-3000:]
    assert sorted(real_ranks) == sorted(forked_ranks) == [0, 1]
    for rank in (0, 1):
        seen_real, seen_forked = real_ranks[rank], forked_ranks[rank]
        assert seen_forked["all_reduce"] == seen_real["all_reduce"] == 1.0
        assert seen_forked["pid"] != seen_real["pid"]
        for fact in ("name", "file", "path0", "cwd", "session_leader", "threads", "world_size", "stdout",
                     "stderr", "signals", "main_module_is_script"):
            assert seen_forked[fact] == seen_real[fact], (rank, fact)
        assert seen_forked["config_file"] == seen_real["config_file"] is not None
        for fact in ("command_line", "launcher_command_line"):
            assert masked(seen_forked[fact]) == masked(seen_real[fact]), fact
        assert seen_forked["argv"][:1] == seen_real["argv"][:1]
        assert seen_forked["argv"][2:] == seen_real["argv"][2:]  # argv[1]: each launch's own folder
        env_real, env_forked = seen_real["env"], seen_forked["env"]
        assert set(env_forked) == set(env_real), set(env_forked) ^ set(env_real)
        differing = {key for key in env_real if env_real[key] != env_forked[key]}
        assert differing <= DIFFER_PER_LAUNCH, {key: (env_real[key], env_forked[key]) for key in differing}
        assert (real_folder / f"atexit-{rank}").exists() and (forked_folder / f"atexit-{rank}").exists()
    # What a fork cannot give: real ranks salt their str hashes differently (so a bug that depends on
    # a rank's set or dict order shows only in real launches, which the user-facing proofs use);
    # forked ranks share the server's salt.
    assert "PYTHONHASHSEED" not in real_ranks[0]["env"]
    assert real_ranks[0]["str_hash"] != real_ranks[1]["str_hash"]
    assert forked_ranks[0]["str_hash"] == forked_ranks[1]["str_hash"]
    assert real_ranks[0]["env"]["RANK"] == "0" and forked_ranks[1]["env"]["RANK"] == "1"
    assert forked_ranks[0]["signals"]["SIGUSR1"] == "<Handlers.SIG_IGN: 1>"
    assert forked_ranks[0]["signals"]["SIGINT"] == "<built-in function default_int_handler>"
    for result in (real, forked):
        assert "rank 0 of 2: all-reduce 1" in result.stdout and "rank 1 of 2: all-reduce 1" in result.stdout


def test_a_failing_rank_stops_the_launch_the_same_way(tmp_path):
    outcomes = {}
    for kind in ("real", "forked"):
        result, ranks, folder = _launch(tmp_path, kind, "--fail-rank", "1", "--sleep", "120",
                                        forked=kind == "forked")
        assert "rank 1 fails on purpose" in result.stderr
        assert "exitcode  : 3" in result.stderr, result.stderr[-3000:]
        # rank 0 was stopped by the launcher's SIGTERM (no atexit); rank 1 exited (atexit ran)
        outcomes[kind] = (result.returncode, sorted(path.name for path in folder.glob("atexit-*")))
    assert outcomes["forked"] == outcomes["real"] == (1, ["atexit-1"])


def test_a_forked_launch_past_its_timeout_stops_its_ranks(tmp_path):
    folder = tmp_path / "timeout"
    folder.mkdir()
    config = accelerate_config(tmp_path, "ddp", distributed_type="MULTI_GPU")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_launch(config, FACTS, [folder, "--fail-rank", "5", "--sleep", "300"], num_processes=2,
                   forked=True, cwd=REPO, timeout=8)
    assert time.monotonic() - started < 45
    pids = [facts["pid"] for facts in read_rank_results(folder).values()]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_server_serves_only_its_own_import_time_environment():
    base = {"PATH": "/bin", "HF_HOME": "/a", "FSDP_PRESETS_FAULT": "x"}
    same = forked_launch.import_time_environment({**base, "FSDP_PRESETS_FAULT": "y", "RANK_HINT": "1"})
    assert forked_launch.import_time_environment(base) == same
    assert forked_launch.import_time_environment({**base, "HF_HOME": "/b"}) != same
    assert forked_launch.import_time_environment({**base, "OMP_NUM_THREADS": "2"}) != same


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    """The causal-LM recipe under the FSDP2 demo config, launched once for real and once forked:
    4 optimizer steps, a checkpoint every 2, the final export."""
    root = tmp_path_factory.mktemp("forked-recipe")
    model = tiny_llama(root / "model")
    runs = {}
    for kind in ("real", "forked"):
        run_dir = root / kind
        result = run_launch(FSDP2_CONFIG, CAUSAL_LM, causal_lm_args(model, run_dir, "--max-steps", 4, "--save-every", 2),
                            num_processes=2, forked=kind == "forked", cwd=REPO, timeout=300).check()
        assert result.forked is (kind == "forked")
        runs[kind] = run_dir
    return runs


def _trained(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields (step time, throughput) and the save lines
    (their wall time, and a size that moves with the manifest's timestamps)."""
    timing = {"tokens_per_s", "step_time_s"}
    return [{key: value for key, value in record.items() if key not in timing}
            for record in map(json.loads, (run_dir / METRICS).read_text().splitlines()) if record["kind"] != "save"]


def test_a_forked_recipe_run_is_bitwise_the_real_one(recipe_runs):
    """The suite's forked launches run the recipes as real ones do: the same metrics (losses, grad
    norms, learning rates, evaluation), the same checkpoint shards byte for byte, the same export."""
    real, forked = recipe_runs["real"], recipe_runs["forked"]
    assert _trained(real) == _trained(forked)
    for step in (2, 4):
        manifests = [json.loads((checkpoint(run, step) / MANIFEST).read_text()) for run in (real, forked)]
        assert manifests[0]["step"] == manifests[1]["step"] == step
        shards = [{name: entry["sha256"] for name, entry in manifest["files"].items() if name.endswith(".distcp")}
                  for manifest in manifests]
        assert shards[0] and shards[0] == shards[1]
    assert tree_digest(real / FINAL) == tree_digest(forked / FINAL)
