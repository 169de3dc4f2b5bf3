"""The planner against rehearsals of real FSDP2 training steps at full size (fake tensors, a fake
process group, torch's FSDP memory tracker, accelerate's own preparation): within 10% or the test
fails. One small case runs in the normal suite; the 70B, the per-family and the shipped-preset
checks are marked slow (they still run in CI). The Must-show cases of the sharding guide (8B and
70B grids) were measured with the same code: docs/sharding.md, "How the numbers are checked"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_presets.cli import main

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 0.10
"""Largest relative difference between the planner's per-GPU total and the rehearsed peak."""


def _env() -> dict[str, str]:
    """A worker's environment: no accelerate launch settings, the suite's planner settings
    (``FSDP_PRESETS_*``: no plan rehearsals, never the user's cache; tests/conftest.py)."""
    env = {key: value for key, value in os.environ.items()
           if key.startswith("FSDP_PRESETS_") or not key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_"))}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
                "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    return env


def rehearse_cli(*argv: str) -> tuple[int, dict | None, str]:
    """``fsdp-presets rehearse ... --json`` in this process (a rehearsal restores the process-wide
    state it takes: the process group, accelerate's state): (exit status, document, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["rehearse", *argv, "--json"])
    printed = out.getvalue()
    return code, json.loads(printed) if printed.strip().startswith("{") else None, err.getvalue()


def rehearse_cases(*cases: dict, timeout: float = 1800) -> list[dict]:
    done = subprocess.run([sys.executable, str(REPO / "tests/workers/rehearse_cases.py"),
                           *(json.dumps(case) for case in cases)], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def assert_agrees(planned: int, rehearsed: int, what: str) -> None:
    difference = (planned - rehearsed) / rehearsed
    assert abs(difference) <= TOLERANCE, (
        f"{what}: the planner says {planned / 2**30:.2f} GiB per GPU, the rehearsal measured "
        f"{rehearsed / 2**30:.2f} GiB ({difference:+.1%}, more than {TOLERANCE:.0%})")


# --------------------------------------------------------------------------- normal suite


@pytest.fixture(scope="module")
def llama_1b() -> dict:
    code, document, stderr = rehearse_cli("model_configs/llama-3.2-1b", "--gpus", "2", "--seq-len", "4096")
    assert code == 0 and document is not None, stderr[-3000:]
    return document


@pytest.mark.slow
def test_rehearsal_of_llama_1b_agrees_with_the_planner(llama_1b):
    rehearsal, planner = llama_1b["rehearsal"], llama_1b["planner"]
    assert_agrees(planner["total"], rehearsal["per_gpu_peak_bytes"], "Llama-3.2-1B, 2 GPUs, seq 4096")
    # Parameter and optimizer shards are byte-exact (fp32 shards; AdamW's two moments + step counters).
    assert rehearsal["peak_by_category"]["params"] == planner["params"]
    assert abs(rehearsal["peak_by_category"]["optimizer"] - planner["optimizer"]) < 4096
    assert rehearsal["peak_by_category"]["grads"] == planner["grads"] == 0  # the peak is the start of backward
    assert "backward" in rehearsal["peak_where"]
    assert rehearsal["iterations"] == 2 and rehearsal["fsdp_units"] > 16
    assert llama_1b["fits"] is True and "not rehearsed" in llama_1b["not_rehearsed"]


def test_planner_disagreement_fails_the_check():
    """The comparison used by every test here fails on a planner 11% off."""
    with pytest.raises(AssertionError, match="more than 10%"):
        assert_agrees(111, 100, "made-up")
    assert_agrees(109, 100, "made-up")


@pytest.mark.parametrize("argv, message", [
    (["rehearse", "model_configs/llama-3.2-1b"], "--gpus is required"),
    (["rehearse", "model_configs/llama-3.2-1b", "--gpus", "2", "--grad-accum", "0"], "--grad-accum must be at least 1"),
    (["rehearse", "accelerate_configs/llama-3.1-8b_1x8.yaml", "--gpus", "4"], "a preset file fixes these"),
    (["rehearse", "accelerate_configs/no-such.yaml"], "no such preset file"),
    (["rehearse", "accelerate_configs/llama-3.1-8b_1x8.ddp.yaml"], "not an FSDP preset"),
    (["rehearse", "lama", "--gpus", "2"], "did you mean"),
])
def test_bad_input_exits_2_with_the_fix(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_every_shipped_gpu_preset_has_a_current_rehearsal_that_fits():
    """Each shipped GPU preset's header states its rehearsed peak (fsdp_presets.preset.rehearsed_presets),
    below its GPU memory, and the planner agrees with it within 10%."""
    from fsdp_presets.preset.emit import read_metadata
    from fsdp_presets.preset.rehearsed_presets import NOT_REHEARSED, recorded_rehearsal

    checked = 0
    for path in sorted((REPO / "accelerate_configs").glob("*.yaml")):
        metadata = read_metadata(path.read_text())
        if not metadata or metadata["kind"] != "fsdp" or metadata["request"]["device"] != "gpu":
            continue
        if path.name in NOT_REHEARSED:
            assert "not rehearsed: " in path.read_text() and metadata["summary"]["processes"] >= 8
            checked += 1
            continue
        record = recorded_rehearsal(path.name, metadata["summary"])
        assert record is not None, f"{path.name}: no rehearsal recorded for its settings; rehearse it and record it"
        gpu_bytes = (metadata["request"]["gpu_memory_gib"] or 80) * 2**30
        assert record["peak_bytes"] <= gpu_bytes, f"{path.name}: rehearsed peak over the GPU's memory"
        assert_agrees(record["planner_bytes"], record["peak_bytes"], path.name)
        assert "rehearsed peak per GPU" in path.read_text()
        checked += 1
    assert checked == 21


def test_the_records_are_a_data_file_written_whole(tmp_path):
    """The records ship as JSON beside the loader; writing them back gives the same tables, and a
    ``same_as`` entry that names no rehearsed run is refused before anything is written."""
    from fsdp_presets.preset import rehearsed_presets as records

    runs, same_as, not_rehearsed = records.read_records()
    assert (runs, same_as, not_rehearsed) == (records.REHEARSED_RUNS, records.SAME_AS, records.NOT_REHEARSED)
    target = tmp_path / records.DATA_FILE
    records.write_records(target, runs=runs, same_as=same_as, not_rehearsed=not_rehearsed)
    assert records.read_records(target.read_text()) == (runs, same_as, not_rehearsed)
    with pytest.raises(ValueError, match="is not a rehearsed run"):
        records.write_records(target, runs={}, same_as=same_as, not_rehearsed={})
    assert records.read_records(target.read_text()) == (runs, same_as, not_rehearsed)
    assert list(tmp_path.iterdir()) == [target]
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+: the file is package data, installed with the package
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert records.DATA_FILE in project["tool"]["setuptools"]["package-data"]["fsdp_presets.preset"]


# --------------------------------------------------------------------------- slow: full size


@pytest.mark.slow
def test_llama_70b_at_64_gpus_agrees_with_the_planner():
    code, document, stderr = rehearse_cli("model_configs/llama-3.1-70b", "--gpus", "64", "--seq-len", "4096")
    assert document is not None, stderr[-3000:]
    assert code == 1  # 153 GiB per GPU: does not fit 80 GiB, and says so
    assert_agrees(document["planner"]["total"], document["rehearsal"]["per_gpu_peak_bytes"], "Llama-3.1-70B, 64 GPUs")


@pytest.mark.slow
def test_each_family_agrees_with_the_planner():
    """Every family with measured constants, truncated to 4 blocks (the constants are per block;
    the embedding, head and logits stay full size), and Llama under checkpointing and no_sync
    accumulation."""
    from fsdp_presets.plan.activations import BLOCK_ACTIVATIONS

    folders = {"llama": "llama-3.1-8b", "mistral": "mistral-7b-v0.3", "qwen2": "qwen2.5-7b", "phi3": "phi-3-mini-4k",
               "gemma2": "gemma-2-9b", "mixtral": "mixtral-8x7b"}
    assert set(folders) == set(BLOCK_ACTIVATIONS)
    cases = [{"model": f"model_configs/{folder}", "gpus": 8, "seq_len": 4096, "layers": 4} for folder in folders.values()]
    cases += [{"model": "model_configs/llama-3.1-8b", "gpus": 8, "seq_len": 4096, "layers": 4, "ac": True},
              {"model": "model_configs/llama-3.1-8b", "gpus": 8, "seq_len": 4096, "layers": 4, "micro_batch": 2,
               "grad_accum": 4}]
    # The rehearsal keeps only the rank's peak; torch's tracker keeps each module's too: same peak.
    small = {"model": "model_configs/llama-3.1-8b", "gpus": 8, "seq_len": 512, "layers": 2}
    results = rehearse_cases(*cases, small, {**small, "torch_peaks": True})
    assert len(results) == len(cases) + 2
    torchs, ours = results.pop(), results.pop()
    assert (ours["peak_bytes"], ours["by_category"], ours["where"]) == \
        (torchs["peak_bytes"], torchs["by_category"], torchs["where"])
    for result in results:
        assert_agrees(result["planner_bytes"], result["peak_bytes"], json.dumps(result["case"]))


@pytest.mark.slow
def test_shipped_8b_preset_rehearses_as_recorded():
    from fsdp_presets.preset.rehearsed_presets import REHEARSED

    code, document, stderr = rehearse_cli("accelerate_configs/llama-3.1-8b_1x8.yaml")
    assert code == 0 and document is not None, stderr[-3000:]
    peak = document["rehearsal"]["per_gpu_peak_bytes"]
    assert peak < 80 * 2**30
    assert abs(peak - REHEARSED["llama-3.1-8b_1x8.yaml"]["peak_bytes"]) <= 0.01 * peak
    assert_agrees(document["planner"]["total"], peak, "accelerate_configs/llama-3.1-8b_1x8.yaml")


def test_request_from_flags_fills_the_defaults_and_refuses_what_is_not_rehearsed():
    from fsdp_presets.plan.limits import DEFAULT_SEQ_LEN
    from fsdp_presets.errors import UsageError
    from fsdp_presets.preset.rehearse_request import request_from_flags

    request = request_from_flags("llama", gpus=16, nodes=2, grad_accum=4)
    assert (request.strategy, request.precision, request.seq_len, request.micro_batch, request.global_batch) == \
        ("hybrid", "bf16", DEFAULT_SEQ_LEN, 1, "64")
    assert request_from_flags("llama", gpus=8, strategy="auto", precision="auto").strategy == "full"
    with pytest.raises(UsageError, match="--gpus is required"):
        request_from_flags("llama", gpus=None)
    with pytest.raises(UsageError, match="no-shard: FSDP1 and DDP are not rehearsed"):
        request_from_flags("llama", gpus=8, strategy="no-shard")
