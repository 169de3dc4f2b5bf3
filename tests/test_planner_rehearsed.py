"""The planner's activation terms read off a short rehearsal of the model's own config
(fsdp_presets/preset/measured_activations.py) against a full rehearsal of the same config, on
families the project keeps no constants for. Published configs, cut to 4 blocks and a 1024-token
sequence so the suite stays fast: the planner composes per-block terms, so a 4-block model tests
the composition as a 40-block one does (scripts/planner_accuracy.py runs full sizes). Each family
is composed for another point of the grid (GPUs, micro-batch, accumulation, checkpointing) than
the one its terms were rehearsed at, a point of the recorded grid (tests/data/planner_grid.json,
fsdp_harness/planner_grid.py): the live rehearsals, short and full, must equal what the table
recorded, so that tests/test_planner_grid.py, which plans every recorded point without
rehearsing, cannot pass on a stale table. Two families are rehearsed live here (LIVE: a dense and
a mixture-of-experts model; a change of torch or transformers that moves one family's figures
moves these); the other eight are held to their recorded full rehearsals by
tests/test_planner_grid.py alone."""

from __future__ import annotations

import pytest

from fsdp_harness import planner_grid
from fsdp_harness.published_configs import FAMILIES, config_hash, write_config
from fsdp_presets.plan.activations import BLOCK_ACTIVATIONS

LAYERS, SEQ = 4, 1024
COMPOSED = {
    # model_type: (GPUs, micro-batch, accumulation, activation checkpointing) planned and rehearsed
    "qwen3": (8, 1, 1, False), "starcoder2": (8, 1, 1, False), "olmo2": (8, 1, 1, False),
    "deepseek_v2": (8, 1, 1, False),
    "qwen3_moe": (64, 2, 1, True),  # mixture of experts (128), QK-norm
    "gemma3_text": (8, 2, 1, False),  # sliding and full attention, a 262k vocabulary tied to the embedding
    "cohere": (64, 1, 1, True),  # a 256k vocabulary, LayerNorm, attention and MLP in parallel
    "granite": (64, 1, 4, True),  # GQA, embedding/residual/logit multipliers, tied head
    "olmoe": (8, 1, 4, False),  # mixture of experts (64), QK-norm, under accumulation
    "glm4": (64, 2, 4, True),  # GQA with 2 KV heads, partial rotary, attention biases
}

LIVE = (
    "qwen3",  # QK-norm; generate and check say how their figures were obtained; the cache
    "qwen3_moe",  # 128 experts, QK-norm, activation checkpointing at 64 GPUs
)


def _model_folder(tmp_path, model_type):
    return write_config(tmp_path, model_type, layers=LAYERS)


@pytest.fixture(scope="module")
def recorded():
    return planner_grid.load(planner_grid.TABLE)


def test_every_published_family_is_tested(recorded):
    assert sorted(COMPOSED) == sorted(FAMILIES) and set(LIVE) <= set(FAMILIES)
    for model_type, (gpus, micro_batch, accumulation, checkpointing) in COMPOSED.items():
        point = planner_grid.find_point(recorded, model_type, gpus, micro_batch, accumulation, checkpointing)
        assert (point["layers"], point["seq_len"]) == (LAYERS, SEQ)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", LIVE)
def test_planned_full_shard_matches_a_full_rehearsal(rehearsal_cache, recorded, tmp_path, monkeypatch, model_type):
    from fsdp_presets.preset.measured_activations import with_rehearsed_terms
    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.shapes import Hardware, TrainingShape
    from fsdp_presets.plan.planner import plan
    from fsdp_presets.preset.rehearse_request import rehearse_request, request_from_flags

    assert model_type not in BLOCK_ACTIVATIONS  # a family the planner had no constants for
    source = _model_folder(tmp_path, model_type)
    gpus, micro_batch, accumulation, checkpointing = COMPOSED[model_type]
    shape, note = with_rehearsed_terms(source, TrainingShape(seq_len=SEQ, micro_batch=micro_batch,
                                                             grad_accum=accumulation,
                                                             activation_checkpointing=checkpointing))
    assert note["source"] == "composed from a rehearsal", note
    assert list((rehearsal_cache / "activations").glob("*.json"))  # cached under the chosen folder
    row = plan(_profile(source), Hardware(gpus=gpus, gpu_memory_bytes=80 * GiB), shape).get("FULL_SHARD", 2)
    assert row.source == "composed from a rehearsal"
    request = request_from_flags(source, gpus=gpus, seq_len=SEQ, micro_batch=micro_batch, gpu_memory_gib=80,
                                 activation_checkpointing="on" if checkpointing else "off")
    document, _, _ = rehearse_request(request, source=source, preset_file=False, grad_accum=accumulation)
    rehearsed = document["rehearsal"]["per_gpu_peak_bytes"]
    assert abs(row.per_gpu.total - rehearsed) / rehearsed < 0.10, (row.per_gpu, document["rehearsal"], shape.measured)
    assert (row.per_gpu.total <= 80 * GiB * 0.9) == (rehearsed <= 80 * GiB * 0.9)  # the same verdict
    _recorded_as_rehearsed(recorded, model_type, source, rehearsed)
    if model_type == "qwen3":
        _generate_and_check_say_how(source, tmp_path)
        _cache_is_used_and_can_be_turned_off(source, shape, monkeypatch)


def _recorded_as_rehearsed(recorded, model_type, source, rehearsed):
    """The recorded table holds what was rehearsed live: this point's full rehearsal (to 0.01%) and
    the short rehearsal the planner composed from (the same bytes at every moment of every run)."""
    import json

    from fsdp_presets.model.model_loading import load_config
    from fsdp_presets.preset.measured_activations import config_key
    from fsdp_presets.preset.model_cache import block_config_digest, cache_dir

    point = planner_grid.find_point(recorded, model_type, *COMPOSED[model_type])
    assert point["config_hash"] == config_hash(model_type, layers=LAYERS), "record the table again"
    assert abs(point["rehearsed_per_gpu_bytes"] - rehearsed) <= 1e-4 * rehearsed, \
        f"{model_type}: recorded {point['rehearsed_per_gpu_bytes']}, rehearsed {rehearsed}: record the table again"
    key = config_key(block_config_digest(load_config(source)), seq_len=SEQ, precision="bf16")
    cached = cache_dir() / "activations" / f"{key}.json"

    def measured(runs):  # what each run held at each moment (``where`` only names the op of a tie)
        return [{key: value for key, value in run.items() if key != "where"} for run in runs]

    live_runs = json.loads(cached.read_text(encoding="utf-8"))["runs"]
    assert measured(live_runs) == measured(recorded["families"][model_type]["short_rehearsal"]["runs"]), \
        "record the table again"


def _generate_and_check_say_how(source, tmp_path):
    """``generate`` decides with the cached terms and says so, in the header too; so does ``check``."""
    from fsdp_presets.check.findings import CheckContext
    from fsdp_presets.check.lint import check_file, model_facts
    from fsdp_presets.preset.emit_commands import LaunchHints
    from fsdp_presets.preset.generate import render_files, write_files
    from fsdp_presets.preset.request import PresetRequest

    output = tmp_path / "preset.yaml"
    files, preset = render_files(_profile(source), PresetRequest(model=source, gpus=8, seq_len=SEQ),
                                 output=str(output), baseline_output=None, launch=LaunchHints())
    assert preset.memory_figures.startswith("composed from a rehearsal; this config rehearsed"), preset.memory_figures
    assert preset.memory_plan.shape.measured is not None
    assert "#   memory figures: composed from a rehearsal" in files[str(output)]
    assert "cache:" not in files[str(output)]  # a shared file: the local cache folder is no part of it
    write_files({output: files[str(output)]})
    report, _ = check_file(output, context=CheckContext(model=model_facts(source)))
    assert report.memory_figures.startswith("composed from a rehearsal; this config rehearsed"), report.memory_figures


def _profile(source):
    from fsdp_presets.preset.generate import load_profile

    return load_profile(source)


def _cache_is_used_and_can_be_turned_off(source, shape, monkeypatch):
    """A second plan of the same config reads the cache; with the cache off it rehearses again;
    with rehearsals off it estimates, and says so."""
    from fsdp_presets.preset.measured_activations import with_rehearsed_terms
    from fsdp_presets.preset import measured_activations

    def refuse(*args, **kwargs):
        raise RuntimeError("rehearsed again")

    monkeypatch.setattr(measured_activations, "measure", refuse)
    again, note = with_rehearsed_terms(source, shape.replace(measured=None))
    assert again.measured == shape.measured and note["source"] == "composed from a rehearsal"
    monkeypatch.setenv("FSDP_PRESETS_CACHE", "off")
    _, note = with_rehearsed_terms(source, shape.replace(measured=None))
    assert note["source"] == "estimated" and "rehearsed again" in note["how"]
    monkeypatch.setenv("FSDP_PRESETS_PLAN_REHEARSAL", "off")
    _, note = with_rehearsed_terms(source, shape.replace(measured=None))
    assert note == {"source": "estimated", "how": "family constants (FSDP_PRESETS_PLAN_REHEARSAL=off)"}
