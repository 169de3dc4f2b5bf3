"""Checkpoints written in the background (``--async-save``), with real 2-process FSDP2 launches.

One chain of launches is shared: the causal LM of tests/checkpoint_runs.py (steps 1-10, a save every
2 steps) with ``--async-save``, SIGKILLed at the end of step 5 while the save of step 4 is in flight,
then resumed by the same command. The synchronous, uninterrupted reference run of
tests/checkpoint_runs.py (shared with the convert and reshard tests) is what it must equal.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

import checkpoint_runs as runs
from fsdp_harness.launch import launch_env, run_launch
from fsdp_presets.launching.local import launch_command
from fsdp_presets.checkpoint.async_save import async_save_problem
from fsdp_presets.checkpoint.layout import CHECKPOINTS, DCP_METADATA, MANIFEST, temporary_step_folder
from fsdp_presets.checkpoint.manager import committed_checkpoints
from fsdp_presets.checkpoint.verify import checkpoint_verdict
from fsdp_presets.compare.records import load_run
from fsdp_presets.faults import FAULT_ENV
from fsdp_presets.train.metrics import read_metrics, train_losses
from recipe_helpers import CAUSAL_LM, FSDP2_CONFIG, REPO, causal_lm_args, launch_recipe, tree_digest

KILLED_AT = 5  # the end of step 5: the save of step 4 is in flight, step 2 is the last committed


def error_lines(text: str) -> list[str]:
    return [line[line.index("causal_lm.py: error:"):] for line in text.splitlines() if "causal_lm.py: error:" in line]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return runs.base(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(root):
    return runs.reference_run(root)


@pytest.fixture(scope="module")
def chain(root):
    """The async run: leg 1 killed while a background write is in flight (what it left), leg 2 resumed."""
    run_dir = root / "async-killed-resumed"
    config = runs.fsdp_config(root, 2)
    args = causal_lm_args(runs.tiny_model(root), run_dir, *runs.SCHEDULE, "--max-steps", runs.REFERENCE_STEPS,
                          "--async-save")
    killed = run_launch(config, CAUSAL_LM, args, num_processes=2, cwd=REPO,
                        env={FAULT_ENV: f"kill-save-in-flight:step={KILLED_AT}"})
    checkpoints = run_dir / CHECKPOINTS
    left = SimpleNamespace(result=killed, folders=sorted(os.listdir(checkpoints)),
                           metrics=read_metrics(run_dir / "metrics.jsonl"),
                           unfinished=tree_digest(temporary_step_folder(checkpoints, 4)))
    resumed = launch_recipe(config, CAUSAL_LM, args, processes=2)
    return SimpleNamespace(run_dir=run_dir, killed=left, resumed=resumed)


@pytest.mark.slow
def test_a_kill_during_a_background_write_resumes_from_the_previous_committed_checkpoint(chain):
    killed = chain.killed
    assert killed.result.returncode != 0 and f"[fault] kill at save-in-flight, step {KILLED_AT}" in killed.result.stdout
    # Step 4's folder was left without a manifest (written or not): never a checkpoint --resume auto picks.
    assert killed.folders == sorted([temporary_step_folder(chain.run_dir / CHECKPOINTS, 4).name, "step-00000002"])
    assert MANIFEST not in killed.unfinished and "scheduler.bin" in killed.unfinished
    assert [(line["step"], line["async"]) for line in killed.metrics if line["kind"] == "save"] == [(2, True)]
    checkpoints = chain.run_dir / CHECKPOINTS
    assert f"checkpoint: ignoring {temporary_step_folder(checkpoints, 4)}" in chain.resumed.stdout
    assert f"resumed from {checkpoints / 'step-00000002'}: step 2," in chain.resumed.stdout
    assert [step for step, _ in committed_checkpoints(checkpoints)] == [2, 4, 6, 8, 10]
    assert not [name for name in os.listdir(checkpoints) if name.startswith(".")]


@pytest.mark.slow
def test_async_losses_are_bitwise_those_of_the_synchronous_uninterrupted_run(chain, reference):
    expected = train_losses(reference / "metrics.jsonl")
    assert sorted(expected) == list(range(1, runs.REFERENCE_STEPS + 1))
    before_kill = {line["step"]: line["loss"] for line in chain.killed.metrics if line["kind"] == "train"}
    assert sorted(before_kill) == list(range(1, KILLED_AT + 1))
    assert before_kill == {step: expected[step] for step in before_kill}  # while saves were in flight
    assert train_losses(chain.run_dir / "metrics.jsonl") == expected  # across the kill and the resume
    assert [line["async"] for line in read_metrics(reference / "metrics.jsonl") if line["kind"] == "save"] == [False] * 5


@pytest.mark.slow
def test_each_async_checkpoint_holds_its_steps_state_although_training_moved_on(chain, reference):
    lines = read_metrics(chain.run_dir / "metrics.jsonl")
    position = {(line["kind"], line["step"]): index for index, line in enumerate(lines)}
    for step in (2, 4, 6, 8, 10):
        name = f"step-{step:08d}"
        saved, synchronous = chain.run_dir / CHECKPOINTS / name, reference / CHECKPOINTS / name
        assert checkpoint_verdict(saved).ok
        # Shards, scheduler, random states and model config byte for byte those of the synchronous
        # save of the same step (DCP's .metadata and the manifest record other bookkeeping).
        differ = {relative for relative in tree_digest(synchronous)
                  if relative != MANIFEST and not relative.endswith(DCP_METADATA)}
        assert {relative: digest for relative, digest in tree_digest(saved).items() if relative in differ} == \
            {relative: digest for relative, digest in tree_digest(synchronous).items() if relative in differ}
        assert any(relative.endswith(".distcp") for relative in differ)
        record = next(line for line in lines if line["kind"] == "save" and line["step"] == step)
        assert record["async"] is True and 0 < record["blocked_s"] <= record["total_s"]
        assert record["bytes"] == sum(entry["bytes"] for entry in
                                      json.loads((saved / MANIFEST).read_text())["files"].values())
        if step < runs.REFERENCE_STEPS:  # committed only after the next step had trained (the final save waits)
            order = position if step > 2 else {(line["kind"], line["step"]): index  # step 2: leg 1 (the resume
                                               for index, line in enumerate(chain.killed.metrics)}  # kept its line)
            assert order[("save", step)] > order[("train", step + 1)]
    assert "saves: 4 in the background (--async-save)" in chain.resumed.stdout
    # and its throughput over the whole run (a CPU preset predicts none: measured only)
    assert re.search(r"^throughput: [\d,]+ tokens/s per process measured \(median after step 1\)$",
                     chain.resumed.stdout, re.MULTILINE), chain.resumed.stdout[-2000:]
    assert load_run(chain.run_dir).series["loss"] == load_run(reference).series["loss"]  # save lines are skipped


@pytest.mark.slow
def test_a_failed_background_write_stops_the_run_in_one_line_naming_the_last_checkpoint(root, tmp_path):
    output = tmp_path / "run"
    args = causal_lm_args(runs.tiny_model(root), output, "--max-steps", 6, "--save-every", 2, "--async-save")
    # Rank 1's background write of step 4 hits a full disk (the kernel's ENOSPC through DCP's writer).
    result = run_launch(FSDP2_CONFIG, CAUSAL_LM, args, num_processes=2, cwd=REPO,
                        env={FAULT_ENV: "full-async-save:step=4:rank=1"})
    assert result.returncode == 1, result.stderr[-3000:]
    step_2 = output / CHECKPOINTS / "step-00000002"
    assert error_lines(result.stderr) == [
        f"causal_lm.py: error: disk full (ENOSPC) while writing the checkpoint of step 4 in the background in "
        f"{output / CHECKPOINTS}: no space left on that file system. The last committed checkpoint, {step_2}, is "
        "intact and --resume auto continues from it. Free space there (delete old runs or checkpoints, lower "
        "--keep-last) or give an --output-dir on a larger disk, then run the same command again"]
    assert os.listdir(output / CHECKPOINTS) == ["step-00000002"] and checkpoint_verdict(step_2).ok
    assert not (output / "final").exists() and "Traceback" not in result.stdout


@pytest.mark.slow
def test_ctrl_c_during_an_in_flight_save_ends_with_it_committed(root, tmp_path):
    output = tmp_path / "run"
    args = causal_lm_args(runs.tiny_model(root), output, "--max-steps", 40, "--save-every", 1, "--keep-last", 2,
                          "--async-save")
    launcher = subprocess.Popen(launch_command(FSDP2_CONFIG, CAUSAL_LM, args), cwd=REPO, env=launch_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        if any(line["kind"] == "save" for line in read_metrics(output / "metrics.jsonl")):
            break  # a save every step: from here on one is always in flight between steps
        time.sleep(0.05)
    os.killpg(launcher.pid, signal.SIGINT)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr[-3000:]
    [line] = error_lines(stderr)
    step = int(line.split("after step ")[1].split(":")[0])
    checkpoints = output / CHECKPOINTS
    assert f"saved {checkpoints / f'step-{step:08d}'}; --resume auto continues from it" in line
    assert sorted(os.listdir(checkpoints)) == [f"step-{saved:08d}" for saved in (step - 1, step)]  # nothing half-written
    assert all(checkpoint_verdict(folder).ok for _, folder in committed_checkpoints(checkpoints))
    saves = [line["step"] for line in read_metrics(output / "metrics.jsonl") if line["kind"] == "save"]
    assert saves == list(range(1, step + 1))  # every save it began was committed, the in-flight one included


def test_async_save_is_refused_where_dcp_cannot_write_in_the_background():
    def accelerator(kind, version=2, state_dict_type="SHARDED_STATE_DICT"):
        plugin = SimpleNamespace(fsdp_version=version, state_dict_type=state_dict_type) if kind == "FSDP" else None
        return SimpleNamespace(distributed_type=SimpleNamespace(value=kind), state=SimpleNamespace(fsdp_plugin=plugin))

    assert async_save_problem(accelerator("FSDP"), lora=False) is None
    assert async_save_problem(accelerator("MULTI_CPU"), lora=False).startswith("--async-save needs an FSDP")
    assert "FSDP1 with FULL_STATE_DICT" in async_save_problem(accelerator("FSDP", 1, "FULL_STATE_DICT"), lora=False)
    assert "LoRA" in async_save_problem(accelerator("FSDP"), lora=True)
    # a Trainer's model sharded at load time launches DDP-type: "launch with an FSDP2 config" is no fix there
    mesh = async_save_problem(accelerator("MULTI_CPU"), lora=False, sharded_at_load=True)
    assert "drop --async-save" in mesh and "FSDP2 config" not in mesh


def test_the_background_writer_thread_yields_to_training_and_the_caller_keeps_its_priority():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from fsdp_presets.checkpoint import async_save

    def own_priority():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = own_priority()
    with ThreadPoolExecutor(max_workers=1, initializer=async_save._yield_to_training) as worker:
        assert worker.submit(own_priority).result() == max(before, async_save.BACKGROUND_NICE) == 19
    assert own_priority() == before  # per thread: training keeps its priority



@pytest.mark.parametrize("direct", [True, False], ids=["o-direct", "page-cache"])
def test_shard_files_hashed_as_written_are_byte_for_byte_dcps_own_with_their_digests(tmp_path, monkeypatch, direct):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from fsdp_presets.checkpoint import direct_write
    from fsdp_presets.checkpoint.direct_write import CHUNK_BYTES, HashingFileSystem, HashingWriter
    from fsdp_presets.fileio import sha256_file

    if not direct:  # a file system that refuses O_DIRECT
        monkeypatch.setattr(direct_write, "_set_direct", lambda descriptor, on: False)

    # Tensors of odd sizes around one aligned chunk: whole chunks, a partial tail, small records.
    state = {"big": torch.arange(CHUNK_BYTES // 4 + 1001, dtype=torch.float32),
             **{f"small.{index}": torch.full((index * 7 + 3,), float(index)) for index in range(5)},
             "step": torch.tensor(3.0)}
    file_system = HashingFileSystem()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group: a single process" note
        dcp.save(state, storage_writer=HashingWriter(tmp_path / "hashed", file_system), no_dist=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "plain"), no_dist=True)
        loaded = {key: torch.zeros_like(value) for key, value in state.items()}
        dcp.load(loaded, checkpoint_id=tmp_path / "hashed", no_dist=True)
    [(path, (digest, size))] = file_system.digests.items()
    assert path == tmp_path / "hashed" / "__0_0.distcp" and size > CHUNK_BYTES
    assert path.read_bytes() == (tmp_path / "plain" / path.name).read_bytes()  # exact size, same bytes
    assert digest == sha256_file(path)
    assert all(torch.equal(loaded[key], value) for key, value in state.items())


def test_each_rank_hashes_its_own_shard_files_and_a_share_of_the_rest_once(tmp_path):
    from fsdp_presets.checkpoint.manager import hash_share
    from fsdp_presets.fileio import sha256_file

    names = ["optimizer_0/__0_0.distcp", "optimizer_0/__1_0.distcp", "optimizer_0/.metadata",
             "pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
             "pytorch_model_fsdp_0/.metadata", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
    for index, name in enumerate(names):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(bytes([index]) * (index + 1))
    written = {"optimizer_0/__1_0.distcp": ("digest recorded while writing", 2)}
    shares = [hash_share(tmp_path, rank=rank, world_size=2, written=written if rank == 1 else None) for rank in (0, 1)]
    assert sorted(name for share in shares for name, _, _ in share) == sorted(names)  # every file, once
    assert {name for name, _, _ in shares[1] if name.endswith(".distcp")} == {
        "optimizer_0/__1_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"}  # a rank's own shard files
    assert ("optimizer_0/__1_0.distcp", "digest recorded while writing", 2) in shares[1]  # not read again
    assert all(digest == sha256_file(tmp_path / name) and size == (tmp_path / name).stat().st_size
               for share in shares for name, digest, size in share if name not in written)
