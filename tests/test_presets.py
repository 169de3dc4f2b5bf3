"""The preset generator: decisions, YAML that accelerate loads as intended, the shipped catalogue,
rescaling, bad input, and real launches of generated presets on CPU."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import yaml

from fsdp_presets import cli
from fsdp_presets.preset.emit import predicted_time, read_metadata, render_preset
from fsdp_presets.errors import UsageError
from fsdp_presets.preset.request import PresetRequest, parse_global_batch
from fsdp_presets.preset.generate import decide_with_rehearsed_terms
from fsdp_presets.preset.fastest_fit import HEADROOM, Candidate, fastest_candidate
from fsdp_presets.preset.presets import decide
from fsdp_presets.model.profile import profile_model
from fsdp_harness.launch import read_rank_results, run_launch
from fsdp_harness.scripts import script_module
from fsdp_presets.launching.local import free_port

REPO = Path(__file__).resolve().parent.parent

CONFIGS = REPO / "accelerate_configs"
SHIPPED = sorted(path.name for path in CONFIGS.glob("*.yaml"))
WORKER = REPO / "tests" / "workers" / "preset_train.py"

_PROFILES: dict = {}


def profile(source: str):
    """Profiles are pure functions of the config: build each once per test session."""
    if source not in _PROFILES:
        _PROFILES[source] = profile_model(str(REPO / source) if source.startswith("model_configs") else source)
    return _PROFILES[source]


def real(name: str, **request):
    source = f"model_configs/{name}"
    return decide(profile(source), PresetRequest(model=source, **request))


# --------------------------------------------------------------------------- real-size model configs

PUBLISHED = {
    # folder: (exact count from the shapes, published size in billions as the Hub shows it)
    "llama-3.1-8b": (8_030_261_248, 8.03),
    "llama-3.1-70b": (70_553_706_496, 70.55),
    "llama-3.2-1b": (1_235_814_400, 1.24),
    "mistral-7b-v0.3": (7_248_023_552, 7.25),
    "qwen2.5-7b": (7_615_616_512, 7.62),
    "gemma-2-9b": (9_241_705_984, 9.24),
    "phi-3-mini-4k": (3_821_079_552, 3.82),
    "mixtral-8x7b": (46_702_792_704, 46.7),
    "smollm2-135m": (134_515_008, 0.135),
}


@pytest.mark.parametrize("folder", sorted(PUBLISHED))
def test_model_config_matches_published_size(folder):
    exact, billions = PUBLISHED[folder]
    counted = profile(f"model_configs/{folder}").total_params
    assert counted == exact
    assert abs(counted / 1e9 - billions) / billions < 0.005


def test_every_model_config_is_documented():
    readme = (REPO / "model_configs" / "README.md").read_text()
    folders = sorted(path.name for path in (REPO / "model_configs").iterdir() if path.is_dir())
    assert folders == sorted(PUBLISHED)
    for folder in folders:
        assert f"`{folder}`" in readme and f"{PUBLISHED[folder][0]:,}" in readme


# --------------------------------------------------------------------------- decisions


@pytest.mark.parametrize("text, expected", [
    ("256", (256, "samples")), ("1M", (2**20, "tokens")), ("512K", (2**19, "tokens")),
    ("524288tok", (524288, "tokens")), ("4 Mtokens", (4 * 2**20, "tokens")),
])
def test_global_batch_parses_samples_and_tokens(text, expected):
    assert parse_global_batch(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "1.5", "0", "-8", "1.0001K"])
def test_global_batch_rejects_nonsense(text):
    with pytest.raises(UsageError, match="global-batch"):
        parse_global_batch(text)


def test_one_node_takes_the_fastest_strategy_that_fits_with_headroom():
    # SHARD_GRAD_OP under no_sync keeps every block's gradient unsharded between micro-batches: 74 of
    # the 75 GiB usable, above the headroom; its configurations with room are no faster than FULL_SHARD's.
    preset = real("llama-3.1-8b", gpus=8, seq_len=4096, global_batch="1M")
    assert preset.parallelism.strategy == "FULL_SHARD" and preset.parallelism.label == "FULL_SHARD 8"
    reason = preset.parallelism.reason
    assert reason.startswith(f"FULL_SHARD (FSDP2) at micro-batch 1 x 32, activation checkpointing off: predicted "
                             f"{predicted_time(preset).step_s:.3g} s per optimizer step on H100-SXM against "
                             "SHARD_GRAD_OP (FSDP2)'s")
    assert "both fit" in reason and "--strategy full|grad-op" in reason
    assert "predicted" in preset.savers.reason and "with it at micro-batch" in preset.savers.reason
    assert not preset.savers.activation_checkpointing and not preset.savers.offload
    assert preset.precision.mixed_precision == "bf16"
    assert preset.batch.global_samples == 256  # 1M tokens / 4096
    assert 256 // 8 % preset.batch.micro_batch == 0
    assert preset.batch.micro_batch <= preset.row.max_micro_batch
    # the largest divisor of the rank's share that fits
    assert not any(256 // 8 % m == 0 for m in range(preset.batch.micro_batch + 1, preset.row.max_micro_batch + 1))
    assert preset.wrap.classes == ("LlamaDecoderLayer",)
    assert preset.state_dict.state_dict_type == "SHARDED_STATE_DICT" and preset.state_dict.cpu_ram_efficient_loading


def test_nodes_get_hsdp_inside_a_node_when_it_fits():
    preset = real("llama-3.1-8b", gpus=16, nodes=2, seq_len=4096, global_batch="1M")
    assert preset.parallelism.hsdp
    assert (preset.parallelism.replicate_size, preset.parallelism.shard_size) == (2, 8)
    assert preset.row.comm.inter_node < preset.memory_plan.get("FULL_SHARD", 2).comm.inter_node


def test_full_shard_across_nodes_when_hsdp_does_not_fit():
    # Llama-3.1-70B's model states (16 bytes x 70.6B / 8 = 131 GiB per GPU) do not fit one node's
    # shards. (Mixtral, once the example, now goes HSDP with offload: FSDP2 shards its fused expert
    # tensors by expert rows, so sharding over more than 8 GPUs does not lower rank 0's share.)
    preset = real("llama-3.1-70b", gpus=32, nodes=4, seq_len=4096, global_batch="1M")
    assert preset.parallelism.label == "FULL_SHARD 32"
    assert "the only strategy that fits (HYBRID_SHARD does not" in preset.parallelism.reason


def test_more_gpus_than_a_server_holds_on_one_machine_say_what_they_assume(capsys):
    """--gpus 16 without --nodes: one machine of 16 (accelerate's num_machines 1), as asked, and said:
    the plan and the preset's notes name the NVLink-only assumption and the --nodes that gives 8-GPU
    servers; none at 8 GPUs, with --nodes, or for CPU processes."""
    note = "16 GPUs on one machine (--nodes 1)"
    preset = real("smollm2-135m", gpus=16, seq_len=256)
    assert any(line.startswith(note) and line.endswith("give --nodes 2 for 2 such servers") for line in preset.notes)
    for request in (dict(gpus=16, nodes=2), dict(gpus=8), dict(gpus=16, device="cpu")):
        assert not any("on one machine" in line for line in real("smollm2-135m", seq_len=256, **request).notes), request
    for argv, said in ((["--gpus", "16"], True), (["--gpus", "16", "--nodes", "2"], False), (["--gpus", "8"], False)):
        assert cli.main(["plan", str(REPO / "model_configs/smollm2-135m"), "--seq-len", "256", *argv]) == 0
        assert (f"note: {note}" in capsys.readouterr().out) == said, argv


def test_one_gpu_per_node_shards_across_nodes():
    # An HSDP mesh of N x 1 has nothing to shard inside a node; accelerate refuses it.
    preset = real("llama-3.1-8b", gpus=2, nodes=2, seq_len=4096, global_batch="1M")
    assert not preset.parallelism.hsdp
    assert preset.parallelism.label == "FULL_SHARD 2"


def test_activation_checkpointing_only_when_needed_offload_only_when_nothing_else_fits():
    assert real("llama-3.1-70b", gpus=32, nodes=4, seq_len=4096, global_batch="1M").savers.activation_checkpointing
    assert not real("llama-3.1-70b", gpus=32, nodes=4, seq_len=4096, global_batch="1M").savers.offload
    mixtral = real("mixtral-8x7b", gpus=8, seq_len=4096, global_batch="1M")
    assert mixtral.savers.offload and "nothing fits on the GPUs otherwise" in mixtral.savers.reason
    # Offloaded, each micro-batch moves the shards over PCIe: checkpointing's larger micro-batch
    # (fewer of them) is predicted faster than no checkpointing at micro-batch 1, and the header says so.
    assert mixtral.savers.activation_checkpointing and mixtral.batch.micro_batch > 1
    assert "without it at micro-batch 1; both fit" in mixtral.savers.reason


def test_explicit_choices_are_kept_though_predicted_slower():
    fastest = predicted_time(real("llama-3.1-8b", gpus=8, seq_len=4096, global_batch="1M")).step_s
    grad_op = real("llama-3.1-8b", gpus=8, seq_len=4096, global_batch="1M", strategy="grad-op")
    assert grad_op.parallelism.strategy == "SHARD_GRAD_OP" and "as asked (--strategy grad-op)" in grad_op.parallelism.reason
    checkpointed = real("llama-3.1-8b", gpus=8, seq_len=4096, global_batch="1M", activation_checkpointing="on")
    assert checkpointed.savers.activation_checkpointing and "on as asked" in checkpointed.savers.reason
    micro = real("llama-3.1-8b", gpus=8, seq_len=4096, global_batch="1M", micro_batch=1, strategy="full",
                 activation_checkpointing="on")
    assert (micro.batch.micro_batch, micro.parallelism.strategy) == (1, "FULL_SHARD")
    for preset in (grad_op, checkpointed, micro):
        assert predicted_time(preset).step_s > fastest


def test_offload_only_when_nothing_fits_without_it_and_predicted_slower():
    auto = real("llama-3.1-8b", gpus=8, seq_len=4096, global_batch="1M")
    offloaded = real("llama-3.1-8b", gpus=8, seq_len=4096, global_batch="1M", offload="on")
    assert not auto.savers.offload and offloaded.savers.offload
    assert predicted_time(offloaded).step_s > 1.2 * predicted_time(auto).step_s  # PCIe every step


def test_across_nodes_the_choice_must_hold_on_a_slower_network():
    # FULL_SHARD 32 at micro-batch 2 is predicted 1.3% faster than HSDP at micro-batch 1 on the
    # GPU's own network, and slower at half of it: HSDP, which keeps the all-gathers in the node.
    preset = real("llama-3.1-8b", gpus=32, nodes=4, seq_len=4096, global_batch="1M")
    full = real("llama-3.1-8b", gpus=32, nodes=4, seq_len=4096, global_batch="1M", strategy="full")
    assert predicted_time(full).step_s < predicted_time(preset).step_s
    assert preset.parallelism.hsdp and "at 50% of its network" in preset.parallelism.reason
    assert "across nodes the slower of the two predictions decides" in preset.parallelism.reason


def test_fastest_takes_the_first_in_the_default_order_within_the_models_error_and_with_headroom():
    from types import SimpleNamespace

    def candidate(name, step_s, slow_network_s=None, memory_share=0.5):
        return Candidate(name=name, shape=None, memory_plan=SimpleNamespace(hardware=SimpleNamespace(usable_bytes=1.0)),
                         row=SimpleNamespace(per_gpu=SimpleNamespace(total=memory_share)), step_s=step_s,
                         slow_network_s=slow_network_s)

    first, close, best = candidate("first", 10.0), candidate("close", 9.9), candidate("best", 9.85)
    assert fastest_candidate([first, close]) is first  # 1% is a tie
    assert fastest_candidate([first, close, best]) is close  # within 1% of the fastest, before it
    assert fastest_candidate([first, candidate("faster", 9.0)]).name == "faster"
    # across nodes the slower prediction decides
    assert fastest_candidate([candidate("hsdp", 10.0, 10.1), candidate("full", 9.8, 10.4)]).name == "hsdp"
    # planned above the headroom: faster, but chosen only when nothing with room fits
    tight = candidate("tight", 8.0, memory_share=HEADROOM + 0.01)
    assert fastest_candidate([first, tight]) is first and fastest_candidate([tight]) is tight


def test_cpu_presets_keep_the_default_order_without_predictions():
    # A 4-process CPU host: FULL_SHARD, the only strategy, no checkpointing, as before any step
    # was predicted; the reasons quote no prediction.
    preset = real("llama-3.1-8b", gpus=4, device="cpu", seq_len=64, global_batch="4", host_memory_gib=1024.0)
    assert preset.parallelism.strategy == "FULL_SHARD" and not preset.savers.activation_checkpointing
    assert preset.batch.micro_batch == 1
    assert "predicted" not in preset.parallelism.reason + preset.savers.reason + preset.batch.reason
    assert "not needed to fit" in preset.savers.reason


def test_nothing_fits_raises_with_the_planner_suggestions():
    with pytest.raises(UsageError, match="does not fit.*the planner suggests"):
        real("llama-3.1-70b", gpus=2, seq_len=4096, global_batch="256", offload="off")


def test_offload_is_refused_when_host_memory_cannot_hold_it():
    with pytest.raises(UsageError, match="host RAM per node.*--host-memory"):
        real("llama-3.1-70b", gpus=8, seq_len=4096, global_batch="1M")
    assert real("llama-3.1-70b", gpus=8, seq_len=4096, global_batch="1M", host_memory_gib=2048).savers.offload


def test_sequence_length_is_capped_by_the_model_and_said():
    preset = real("phi-3-mini-4k", gpus=8, seq_len=8192, global_batch="256")
    assert preset.batch.seq_len == 4096
    assert any("capped to 4096" in note for note in preset.notes)


def test_token_batch_is_rounded_to_whole_sequences_per_rank_and_said():
    preset = decide(profile("llama"), PresetRequest(model="llama", gpus=3, device="cpu", seq_len=10,
                                                    global_batch="100tok"))
    assert preset.batch.global_samples == 9 and any("rounded down to 9" in note for note in preset.notes)


def test_cpu_default_global_batch_is_a_few_sequences_per_process_not_half_a_million_tokens():
    # a tiny model fits thousands of sequences per process; a CPU step must still take seconds
    preset = decide(profile("llama"), PresetRequest(model="llama", gpus=2, device="cpu", seq_len=64))
    assert preset.batch.global_samples == 16 and preset.batch.micro_batch <= 8
    assert "default 8 sequences per process on a CPU" in preset.batch.reason
    gpu = decide(profile("llama"), PresetRequest(model="llama", gpus=2, seq_len=64))
    assert gpu.batch.global_samples * 64 == 2**19  # GPUs keep the 0.5M-token default


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(gpus=6, nodes=4), "does not divide --gpus 6"),
    (dict(gpus=8, strategy="hybrid"), "needs --nodes > 1"),
    (dict(gpus=8, strategy="no-shard"), "FSDP1 only"),
    (dict(gpus=2, nodes=2, strategy="hybrid"), "one GPU per node"),
    (dict(gpus=2, device="cpu", offload="on"), "nowhere to offload"),
    (dict(gpus=0), "--gpus must be"),
    (dict(gpus=8, precision="fp8"), "unknown --precision value"),
], ids=["gpus-not-divisible-by-nodes", "hybrid-on-one-node", "no-shard-fsdp2", "hybrid-one-gpu-per-node", "offload-on-cpu", "zero-gpus",
        "unknown-precision"])
def test_impossible_requests_are_refused_before_any_model_is_built(request_kwargs, message):
    with pytest.raises(UsageError, match=message):
        PresetRequest(model="llama", **request_kwargs)


def test_micro_batch_must_divide_the_rank_share():
    with pytest.raises(UsageError, match="does not divide each rank's share"):
        real("llama-3.1-8b", gpus=8, global_batch="256", micro_batch=3)


def test_samples_must_divide_over_ranks():
    with pytest.raises(UsageError, match="use 248 or 256"):
        real("llama-3.1-8b", gpus=8, global_batch="250")


# --------------------------------------------------------------------------- what accelerate makes of it


def _expected(metadata: dict) -> dict:
    summary, request = metadata["summary"], metadata["request"]
    sharding = summary["sharding"]
    return {
        "processes": summary["processes"], "machines": summary["machines"], "version": summary["fsdp_version"],
        "reshard": not sharding.startswith("SHARD_GRAD_OP"), "hsdp": sharding.startswith("HSDP"),
        "sharding": sharding, "cpu": request["device"] == "cpu",
    }


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_file_loads_in_accelerate_with_the_intended_settings(name):
    from fsdp_presets.preset.accelerate_view import accelerate_view

    path = CONFIGS / name
    metadata = read_metadata(path.read_text())
    assert metadata is not None, "every shipped file carries its request"
    expected = _expected(metadata)
    summary = metadata["summary"]
    view = accelerate_view(path)
    assert (view.num_processes, view.num_machines) == (expected["processes"], expected["machines"])
    assert view.mixed_precision == summary["precision"]
    if metadata["kind"] == "ddp-baseline":
        assert view.distributed_type == "MULTI_GPU" and view.fsdp_plugin is None
        return
    settings = view.fsdp_settings()
    profile_classes = profile(metadata["request"]["model"]).wrap_classes
    assert settings["fsdp_version"] == expected["version"]
    assert settings["transformer_cls_names_to_wrap"] == profile_classes
    assert settings["auto_wrap_policy"] == "transformer_auto_wrap_policy"
    assert settings["state_dict_type"] == summary["state_dict"]
    assert settings["activation_checkpointing"] == summary["activation_checkpointing"]
    assert settings["offload_params"] == summary["offload"]
    assert settings["cpu_ram_efficient_loading"] == (not expected["cpu"])
    assert settings["ignored_modules"] is None
    if expected["version"] == 2:
        assert settings["reshard_after_forward"] == expected["reshard"]
    if expected["hsdp"]:
        replicate, shard = map(int, expected["sharding"].split()[1].split("x"))
        assert view.parallelism_sizes() == {"dp_replicate_size": replicate, "dp_shard_size": shard}
        assert replicate * shard == expected["processes"] and shard == expected["processes"] // expected["machines"]
    else:
        assert view.parallelism_sizes() is None


def test_fsdp1_preset_loads_as_fsdp1_with_its_extras(tmp_path):
    from fsdp_presets.preset.accelerate_view import accelerate_view

    assert cli.main(["generate", "qwen2", "--device", "cpu", "--gpus", "2", "--fsdp-version", "1", "--strategy",
                     "grad-op", "--seq-len", "16", "--global-batch", "8", "-o", str(tmp_path / "f1.yaml")]) == 0
    settings = accelerate_view(tmp_path / "f1.yaml").fsdp_settings()
    assert settings["fsdp_version"] == 1 and settings["sharding_strategy"] == "SHARD_GRAD_OP"
    assert settings["use_orig_params"] is True and settings["sync_module_states"] is True
    assert settings["backward_prefetch"] == "BACKWARD_PRE" and settings["forward_prefetch"] is False
    assert "fsdp_reshard_after_forward" not in yaml.safe_load((tmp_path / "f1.yaml").read_text())["fsdp_config"]


# --------------------------------------------------------------------------- the shipped catalogue


def test_regenerating_the_catalogue_gives_the_checked_in_files(tmp_path, capsys):
    make_presets = script_module(REPO / "scripts" / "make_presets.py")
    assert make_presets.main(["--output-dir", str(tmp_path)]) == 0, capsys.readouterr().out[-3000:]
    texts = {path.name: path.read_text() for path in tmp_path.iterdir()}
    assert sorted(texts) == SHIPPED, "accelerate_configs/ holds exactly the catalogue of scripts/make_presets.py"
    different = [name for name, text in texts.items() if (CONFIGS / name).read_text() != text]
    assert not different, f"stale presets (run python scripts/make_presets.py): {different}"


def test_catalogue_covers_six_families_three_shapes_with_baselines_and_the_cpu_demo():
    families = {name.split("_")[0] for name in SHIPPED if "_" in name and not name.startswith("cpu_")}
    assert len(families) >= 6
    for family in families:
        for shape in ("1x8", "2x8", "4x8"):
            assert f"{family}_{shape}.yaml" in SHIPPED and f"{family}_{shape}.ddp.yaml" in SHIPPED
    assert {"cpu_fsdp2_demo.yaml", "cpu_ddp_demo.yaml"} <= set(SHIPPED)


def test_headers_are_reproducible_and_say_how_to_run():
    for name in SHIPPED:
        text = (CONFIGS / name).read_text()
        header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
        assert not re.search(r"/(work|tmp|home|root|Users)/|\d{4}-\d\d-\d\d|\d\d:\d\d:\d\d", header), name
        assert "fsdp-presets generate" in header and "accelerate launch --config_file" in header
        assert f"accelerate_configs/{name}" in header


def test_cpu_demo_keeps_the_distributed_settings_the_recipes_rely_on():
    # 2 CPU processes: SHARD_GRAD_OP (reshard_after_forward false), measured faster there (presets.py)
    fsdp = yaml.safe_load((CONFIGS / "cpu_fsdp2_demo.yaml").read_text())
    ddp = yaml.safe_load((CONFIGS / "cpu_ddp_demo.yaml").read_text())
    common = {"compute_environment": "LOCAL_MACHINE", "num_processes": 2, "num_machines": 1, "machine_rank": 0,
              "mixed_precision": "no", "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    assert fsdp == {**common, "distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_reshard_after_forward": False,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False,
        "fsdp_offload_params": False, "fsdp_activation_checkpointing": False}}
    assert ddp == {**common, "distributed_type": "MULTI_GPU"}


def _header(text: str) -> str:
    """The header's prose as one line (it is wrapped at 100 columns)."""
    return " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))


def test_header_explains_embeddings_norms_head_and_no_ignored_modules():
    text = _header((CONFIGS / "gemma-2-9b_1x8.yaml").read_text())
    assert "share one weight (tied)" in text and "exactly one FSDP unit" in text
    assert "Gemma2RMSNorm upcasts to fp32" in text
    assert "excludes norms, biases and embeddings" in text
    assert "no ignored modules" in text
    assert "fsdp_ignored_modules" not in yaml.safe_load((CONFIGS / "gemma-2-9b_1x8.yaml").read_text())["fsdp_config"]
    untied = _header((CONFIGS / "llama-3.1-8b_1x8.yaml").read_text())
    assert "its own FSDP unit" in untied and "tail unit" in untied


def test_metadata_request_decides_the_same_preset_again():
    text = (CONFIGS / "llama-3.1-8b_2x8.yaml").read_text()
    metadata = read_metadata(text)
    request = PresetRequest.from_json(metadata["request"])
    preset = decide_with_rehearsed_terms(profile(request.model), request)  # as generate decides
    assert preset.summary() == metadata["summary"]
    assert render_preset(preset, output="accelerate_configs/llama-3.1-8b_2x8.yaml",
                         baseline_output="accelerate_configs/llama-3.1-8b_2x8.ddp.yaml") == text


# --------------------------------------------------------------------------- the command


def test_generate_writes_preset_and_default_baseline(tmp_path, capsys):
    output = tmp_path / "tiny.yaml"
    assert cli.main(["generate", "gpt2", "--device", "cpu", "--gpus", "2", "--seq-len", "16", "--global-batch",
                     "8", "--micro-batch", "2", "--baseline", "ddp", "-o", str(output)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {output}" in out and "launch: accelerate launch" in out
    baseline = tmp_path / "tiny.ddp.yaml"
    assert yaml.safe_load(baseline.read_text())["distributed_type"] == "MULTI_GPU"
    assert read_metadata(output.read_text())["summary"]["gradient_accumulation"] == 2
    assert not list(tmp_path.glob(".*tmp")), "no temporary files left behind"


def test_rescale_keeps_the_global_batch_and_says_what_changed(tmp_path, capsys):
    source = CONFIGS / "llama-3.1-8b_2x8.yaml"
    output = tmp_path / "rescaled.yaml"
    assert cli.main(["generate", "--from", str(source), "--gpus", "8", "-o", str(output)]) == 0
    out = capsys.readouterr().out
    assert "global batch 256 sequences kept" in out
    assert "sharding HSDP 2x8 -> FULL_SHARD 8" in out and "gradient accumulation 16 -> 32" in out
    assert "machines 2 -> 1" in out
    old, new = read_metadata(source.read_text())["summary"], read_metadata(output.read_text())["summary"]
    assert new["micro_batch"] * new["gradient_accumulation"] * new["data_parallel_size"] == old["global_batch"]
    # the new file says how to make it again without --from
    assert "fsdp-presets generate model_configs/llama-3.1-8b --gpus 8" in output.read_text()


def test_rescale_from_another_folder_finds_the_headers_model_above_the_preset(tmp_path, monkeypatch, capsys):
    # the shipped presets name model_configs/... from the repository's root
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", "--from", str(CONFIGS / "llama-3.1-8b_2x8.yaml"), "--gpus", "8",
                     "-o", "rescaled.yaml"]) == 0, capsys.readouterr().err
    model = read_metadata((tmp_path / "rescaled.yaml").read_text())["request"]["model"]
    assert model == str(CONFIGS.parent / "model_configs" / "llama-3.1-8b")


def test_rescale_to_a_count_that_cannot_keep_the_batch_is_refused(tmp_path, capsys):
    assert cli.main(["generate", "--from", str(CONFIGS / "llama-3.1-8b_2x8.yaml"), "--gpus", "24",
                     "-o", str(tmp_path / "x.yaml")]) == 2
    assert "does not divide over 24" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("argv, message", [
    (["generate", "lama", "--gpus", "8"], "unknown family 'lama'; did you mean 'llama'"),
    (["generate", "llama", "--gpus", "6", "--nodes", "4"], "does not divide --gpus 6"),
    (["generate", "model_configs/llama-3.1-70b", "--gpus", "8", "--strategy", "grad-op", "--offload", "off",
      "--seq-len", "4096"], "does not fit 8 GPUs"),
    (["generate", "--from", "accelerate_configs/cpu_ddp_demo.yaml", "--gpus", "4"], "only files written by"),
], ids=["unknown-model", "impossible-layout", "strategy-cannot-fit", "rescale-a-baseline"])
def test_bad_input_exits_2_and_leaves_the_existing_file_untouched(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    existing = tmp_path / "existing.yaml"
    existing.write_text("# my own config, keep me\n")
    assert cli.main(argv + ["--baseline", "ddp", "-o", str(existing)]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, "one clear line"
    assert existing.read_text() == "# my own config, keep me\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["existing.yaml"]


def test_baseline_output_must_differ_from_output(tmp_path, capsys):
    path = str(tmp_path / "x.yaml")
    assert cli.main(["generate", "llama", "--gpus", "2", "--baseline", "ddp", "--baseline-output", path,
                     "-o", path]) == 2
    assert "same file" in capsys.readouterr().err


# --------------------------------------------------------------------------- real launches on CPU

LAUNCHES = [
    # (id, family, generate flags): 8 families, each launch a different preset shape
    ("llama-fsdp2-full", "llama", []),
    ("mistral-fsdp2-grad-op", "mistral", ["--strategy", "grad-op"]),
    ("qwen2-fsdp1-full", "qwen2", ["--fsdp-version", "1"]),
    ("mixtral-fsdp1-grad-op", "mixtral", ["--fsdp-version", "1", "--strategy", "grad-op"]),
    ("gemma2-tied-checkpointing-full-state-dict", "gemma2", ["--activation-checkpointing", "on", "--state-dict", "full"]),
    ("phi3-bf16", "phi3", ["--precision", "bf16"]),
    ("gpt2-accumulation", "gpt2", ["--micro-batch", "2"]),
    ("qwen3-hsdp-2-nodes", "qwen3", ["--gpus", "4", "--nodes", "2"]),
]


def _launch_preset(tmp_path, family, flags):
    config = tmp_path / f"{family}.yaml"
    argv = ["generate", family, "--device", "cpu", "--gpus", "2", "--seq-len", "16", "--global-batch", "8",
            *flags, "-o", str(config)]
    assert cli.main(argv) == 0
    summary = read_metadata(config.read_text())["summary"]
    results = tmp_path / "results"
    worker_args = ["--family", family, "--micro-batch-size", summary["micro_batch"], "--gradient-accumulation-steps",
                   summary["gradient_accumulation"], "--seq-len", 16, "--steps", 3, "--result-dir", results]
    if summary["machines"] == 1:
        run_launch(config, WORKER, worker_args, timeout=300).check()
    else:  # two "nodes" on this host over loopback, as a multi-node launch runs them
        port, launches = free_port(), {}

        def node(rank: int) -> None:
            launches[rank] = run_launch(config, WORKER, worker_args, timeout=300, launch_args=[
                "--machine_rank", rank, "--main_process_ip", "127.0.0.1", "--main_process_port", port])

        threads = [threading.Thread(target=node, args=(rank,)) for rank in range(summary["machines"])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for rank in sorted(launches):
            launches[rank].check()
    return summary, read_rank_results(results)


@pytest.mark.slow
@pytest.mark.parametrize("family, flags", [(family, flags) for _, family, flags in LAUNCHES],
                         ids=[name for name, _, _ in LAUNCHES])
def test_generated_preset_trains_for_real_on_cpu(tmp_path, family, flags):
    summary, ranks = _launch_preset(tmp_path, family, flags)
    assert sorted(ranks) == list(range(summary["processes"]))
    first = ranks[0]
    for result in ranks.values():
        assert result["distributed_type"] == "FSDP" and result["world_size"] == summary["processes"]
        assert result["fsdp_version"] == summary["fsdp_version"]
        assert result["losses"] == first["losses"], "every rank reports the same global loss"
        assert result["sharded"]["local"] < result["sharded"]["total"], "parameters are sharded"
        assert result["tied"] == result["config_tied"], "a tied embedding stays tied"
    losses = [first["losses"][str(step)] for step in (1, 2, 3)]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0], f"did not learn: {losses}"
    assert first["mixed_precision"] == summary["precision"]
    if summary["sharding"].startswith("HSDP"):
        assert first["mesh"]["shape"] == [2, 2], "replicate across the 2 nodes, shard inside each"
        # shard group of 2: each rank holds about half of the parameters, not a quarter
        assert first["sharded"]["local"] * 2 >= first["sharded"]["total"] * 0.9


def test_request_validation_is_the_command_lines_and_the_hardwares():
    """One validation of each input: a request refuses a bad count in the words of the flag's own
    check (fsdp_presets.plan.limits), and a cluster that cannot work in the words of the planner's
    Hardware, before any model is read."""
    from fsdp_presets.plan import limits
    from fsdp_presets.errors import UsageError
    from fsdp_presets.fileio import GiB
    from fsdp_presets.plan.shapes import Hardware

    with pytest.raises(UsageError) as from_flag:
        limits.gpu_count("0")
    with pytest.raises(UsageError) as from_request:
        PresetRequest(model="llama", gpus=0)
    assert str(from_flag.value) in str(from_request.value)
    with pytest.raises(UsageError) as from_hardware:
        Hardware(gpus=8, nodes=1, gpu_memory_bytes=int(0.5 * GiB))
    with pytest.raises(UsageError) as from_request:
        PresetRequest(model="llama", gpus=8, gpu_memory_gib=0.5)
    assert str(from_hardware.value) in str(from_request.value)
    with pytest.raises(UsageError, match="--seq-len must be a whole number"):
        PresetRequest(model="llama", gpus=8, seq_len=2.5)
    with pytest.raises(UsageError, match="--gpu-memory must be a number, got '80'"):
        PresetRequest(model="llama", gpus=8, gpu_memory_gib="80")
    assert PresetRequest(model="llama", gpus=8).hardware.gpu_memory_bytes == int(limits.DEFAULT_GPU_MEMORY_GIB * GiB)


@pytest.mark.slow
def test_cpu_two_processes_choose_shard_grad_op_when_it_fits_and_say_why():
    two = real("smollm2-135m", gpus=2, device="cpu", seq_len=64, global_batch="4")
    assert two.parallelism.strategy == "SHARD_GRAD_OP" and "less CPU time" in two.parallelism.reason
    tight = real("smollm2-135m", gpus=2, device="cpu", seq_len=64, global_batch="4", host_memory_gib=3.8)
    assert tight.parallelism.strategy == "FULL_SHARD"  # 1.4 GiB each: SHARD_GRAD_OP (1.5) does not fit
    four = real("smollm2-135m", gpus=4, device="cpu", seq_len=64, global_batch="4")
    assert four.parallelism.strategy == "FULL_SHARD"  # not measured at 4 processes
    gpu = real("smollm2-135m", gpus=2, seq_len=64, global_batch="4")  # GPUs: by predicted step, not this rule
    assert "predicted" in gpu.parallelism.reason and "less CPU time" not in gpu.parallelism.reason
