"""Training on a mesh of more than one dimension (``--distributed-config``, transformers'
``DistributedConfig``): FSDP 2 x TP 2 on 4 gloo processes (a tiny Llama) and FSDP 2 x EP 2 on 2
(a tiny Mixtral) through recipes/causal_lm.py, launched from the lines ``generate --tp/--ep``
prints, held to their DDP baselines by ``fsdp-presets converge``; killed and resumed bitwise on the
same mesh (TP and EP), resumed within tolerance on another one; exported equal to the gathered weights;
recipes/sequence_classification.py on the TP mesh held to DDP from its first evaluation (its new head
initialised as without the mesh); and the check failing each fault peculiar to these meshes.

Measured here (fp32, 20 steps, AdamW, clipping at 1.0): the TP run's losses within 8e-8 relative of
DDP's and its gradient norms within 1.1e-7, the EP run's within 1e-7 and 1.8e-7: tensor and expert
parallelism sum in another order, under one fp32 ulp (1.19e-7) from DDP, so the fp32 tolerance of
every comparison (loss 1e-6, grad_norm 1e-5; fsdp_presets/compare/tolerance.py) holds them with a
margin of about 10 and 50. Each planted fault below moves a metric by 5e-3 or more before step 2;
the loss counted tp_size times only the gradient norm (AdamW and clipping do not see the scale).

Launches are the cost: the baselines are shared, each planted fault is one short launch of the
recipe with the fault written into a copy of it (the mistake a user adapting the recipe, or an
upstream bug, makes), and the agreement of the TP run with DDP launches for real (the others fork).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fsdp_presets.checkpoint.manifest import Manifest
from fsdp_presets.cli import build_parser, main as cli
from fsdp_presets.commands import converge as converge_command
from fsdp_presets.compare import converge as check
from fsdp_presets.compare.records import load_run
from fsdp_presets.compare.report import summary_lines
from fsdp_presets.compare.runs import compare_runs
from fsdp_presets.train.metrics import read_metrics
from fsdp_harness.launch import run_launch, run_launch_logged
from fsdp_harness.tiny_model import write_tiny_model

from conftest import GLOO_EXIT_ABORT, REPO, accelerate_config, real_launches
from recipe_helpers import checkpoint, launch_recipe

DATA = REPO / "data" / "kjv_sft" / "train.jsonl"
RECIPE = REPO / "recipes" / "causal_lm.py"
MAX_STEPS = 20
RESUME_AT = 10  # killed in the save of step 20, resumed from step 10
FAULT_STEPS = 3  # a planted fault shows at step 1 or 2
# A constant learning rate: a short run (a planted fault) has the long run's schedule.
TRAINING = ["--seq-len", "32", "--micro-batch", "2", "--learning-rate", "1e-3", "--lr-scheduler", "constant_with_warmup"]


def converge(argv: list[str]) -> tuple[int, dict]:
    """``fsdp-presets converge ARGV`` in this process, each launch through the harness's runner
    (forked unless inside ``real_launches()``): (exit status, comparison JSON)."""
    argv = ["converge", *argv, "--", *TRAINING[-2:]]  # the recipe's schedule, for both runs
    request = converge_command.request_from(build_parser().parse_args(argv))
    comparison = check.converge(request, runner=run_launch_logged)
    print("\n".join(check.result_lines(comparison, request.output_dir)))
    for log in Path(request.output_dir).glob("*.log"):
        assert GLOO_EXIT_ABORT not in log.read_text(), log
    return (0 if comparison.agrees else 1), json.loads((Path(request.output_dir) / "comparison.json").read_text())


def common(model: Path, output: Path, steps: int = MAX_STEPS) -> list[str]:
    return ["--model", str(model), "--data", str(DATA), "--output-dir", str(output), "--max-steps", str(steps),
            "--seq-len", "32", "--micro-batch", "2", "--learning-rate", "1e-3", "--timeout", "600"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mesh-training")


def generated(workdir: Path, model: Path, name: str, *mesh: str, gpus: int) -> Path:
    """``generate --device cpu --gpus N --tp/--ep ... --baseline ddp`` for ``model``: the FSDP2
    config, beside it NAME.distributed.json and NAME.ddp.yaml."""
    output = workdir / f"{name}.yaml"
    assert cli(["generate", str(model), "--device", "cpu", "--gpus", str(gpus), *mesh, "--seq-len", "32",
                "--global-batch", "4", "--launch-model", str(model), "--launch-data", str(DATA),
                "--baseline", "ddp", "-o", str(output)]) == 0
    return output


@pytest.fixture(scope="module")
def llama(workdir) -> Path:
    return write_tiny_model(workdir / "tiny-llama", kind="llama", text=DATA.read_text())


@pytest.fixture(scope="module")
def tp_preset(workdir, llama) -> Path:
    return generated(workdir, llama, "tp2", "--tp", "2", gpus=4)


@pytest.fixture(scope="module")
def tp_check(workdir, llama, tp_preset) -> tuple[int, dict, Path]:
    """FSDP 2 x TP 2 on 4 processes against DDP on 2 (one per TP group), 20 steps, launched for real."""
    output = workdir / "tp-check"
    with real_launches():
        status, result = converge(["--config", str(tp_preset), *common(llama, output)])
    return status, result, output


def tiny_moe(folder: Path, *, router_loss: bool) -> Path:
    """A tiny Mixtral (4 experts, 2 per token); ``router_loss``: its config asks for the router's
    load-balancing loss (``output_router_logits``), weighted 0.1."""
    moe = write_tiny_model(folder, kind="mixtral", text=DATA.read_text())
    config = json.loads((moe / "config.json").read_text())
    config.update(output_router_logits=router_loss, router_aux_loss_coef=0.1)
    (moe / "config.json").write_text(json.dumps(config))
    return moe


@pytest.fixture(scope="module")
def ep_check(workdir) -> tuple[int, dict, Path]:
    """FSDP 2 x EP 2 (a tiny Mixtral, 4 experts, with its router loss) on 2 processes against DDP on
    2, 20 steps."""
    moe = tiny_moe(workdir / "tiny-moe", router_loss=True)
    output = workdir / "ep-check"
    status, result = converge(["--config", str(generated(workdir, moe, "ep2", "--ep", "2", gpus=2)),
                               *common(moe, output)])
    return status, result, output


# ---- the generated launch ----


def unwrapped(path: Path) -> str:
    """A generated file with its header's wrapped lines joined."""
    return " ".join(line.lstrip("# ").rstrip(" \\") for line in path.read_text().splitlines())


def test_generate_prints_the_recipe_launch_on_the_mesh_and_a_ddp_baseline_per_tp_group(tp_preset):
    header = unwrapped(tp_preset)
    assert f"recipes/causal_lm.py --distributed-config {tp_preset.with_suffix('')}.distributed.json" in header
    assert "num_processes: 4" in header and "distributed_type: FSDP" in header
    baseline = unwrapped(tp_preset.with_name("tp2.ddp.yaml"))
    assert "num_processes: 2" in baseline and "one per TP group" in baseline
    assert "--distributed-config" not in baseline


@pytest.mark.slow
def test_a_mesh_preset_launched_without_its_distributed_config_is_refused(workdir, llama, tp_preset):
    # Without --distributed-config the model would train as FSDP 4 alone: another memory per process
    # and another global batch than the header plans. One line, before anything is written.
    output = workdir / "no-mesh"
    result = run_launch(tp_preset, RECIPE, ["--model", str(llama), "--data", str(DATA), "--output-dir", str(output),
                                            "--max-steps", "1", "--seq-len", "32"], cwd=REPO)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("causal_lm.py: error: ")]
    assert len(set(said)) == 1 and f"launch the recipe with --distributed-config {tp_preset.with_suffix('')}" \
        ".distributed.json" in said[0], result.stderr[-3000:]
    assert not output.exists()


def test_a_mesh_without_data_parallel_ranks_is_refused_by_the_recipes_and_its_preset_says_so(workdir, llama):
    from fsdp_presets.errors import UsageError
    from fsdp_presets.train.model_mesh import load_model_mesh

    preset = generated(workdir, llama, "tp-only", "--tp", "2", gpus=2)
    assert "The recipes refuse this mesh: it has no data-parallel ranks" in unwrapped(preset)
    with pytest.raises(UsageError, match="no data-parallel ranks"):
        load_model_mesh(str(preset.with_name("tp-only.distributed.json")), rank=0, world_size=2)
    with pytest.raises(UsageError, match="lays out 2 ranks .* launched 4 processes"):
        load_model_mesh(str(preset.with_name("tp-only.distributed.json")), rank=0, world_size=4)
    with pytest.raises(UsageError, match="--method lora with --distributed-config"):
        load_model_mesh(str(preset.with_name("tp-only.distributed.json")), rank=0, world_size=2,
                        lora={"method": "lora"})


# ---- agreement, resume, export ----


@pytest.mark.slow
def test_a_classifier_on_a_tp_mesh_starts_from_the_head_ddp_starts_from_and_trains_like_it(workdir, llama, tp_preset):
    """recipes/sequence_classification.py on FSDP 2 x TP 2: the head the model folder lacks gets the
    values a load without the mesh gives it (transformers alone draws them from DTensor's random
    stream: another head, the evaluation before step 1 off by 6e-3), so the run holds to its DDP
    baseline from the first evaluation on."""
    output = workdir / "tp-classifier"
    genres = REPO / "data" / "kjv_genres" / "train.jsonl"
    status, result = converge(["--config", str(tp_preset), "--recipe", str(REPO / "recipes" / "sequence_classification.py"),
                               "--model", str(llama), "--data", str(genres), "--output-dir", str(output),
                               "--max-steps", "4", "--seq-len", "32", "--micro-batch", "2", "--learning-rate", "1e-3"])
    assert status == 0, result["diagnosis"]
    evaluation = next(m for m in result["metrics"] if m["metric"] == "eval_loss")
    assert evaluation["max_deviation"] < 1e-6 and evaluation["steps_compared"] >= 1


@pytest.mark.slow
def test_fsdp_x_tp_trains_like_ddp(tp_check):
    status, result, output = tp_check
    assert status == 0, result["diagnosis"]
    assert result["candidate"]["world_size"] == 4 and result["baseline"]["world_size"] == 2
    assert "mesh FSDP 2 x TP 2" in result["candidate"]["fsdp"]
    loss = next(m for m in result["metrics"] if m["metric"] == "loss")
    assert loss["steps_compared"] == MAX_STEPS
    record = json.loads((output / "candidate" / "run.json").read_text())
    assert record["model_mesh"]["tp_size"] == 2 and record["data_parallel_size"] == 2
    assert record["global_batch_samples"] == 4  # 2 x 1 x 2 data-parallel ranks: a TP group's ranks share one


@pytest.mark.slow
def test_fsdp_x_ep_trains_like_ddp(ep_check):
    status, result, output = ep_check
    assert status == 0, result["diagnosis"]
    assert "mesh FSDP 2 x EP 2" in result["candidate"]["fsdp"]
    assert json.loads((output / "candidate" / "run.json").read_text())["model_mesh"]["ep_size"] == 2
    router = [[record["router_aux_loss"] for record in read_metrics(output / run / "metrics.jsonl")
               if record["kind"] == "train"] for run in ("candidate", "baseline")]
    assert len(router[0]) == MAX_STEPS and router[0] == pytest.approx(router[1], rel=1e-5)


def test_a_moe_router_loss_its_config_asks_for_is_trained_as_transformers_weighs_it(workdir):
    """The recipe computes its own token loss; a Mixtral whose config sets output_router_logits
    also trains on its load-balancing loss (x router_aux_loss_coef): the same first loss, another
    gradient, and the loss in the metrics (dropped silently before)."""
    config = accelerate_config(workdir, "moe-fsdp", num_processes=1,
                               fsdp={"transformer_layer_cls_to_wrap": "MixtralDecoderLayer"})
    steps = {}
    for router_loss in (False, True):
        model = tiny_moe(workdir / f"tiny-moe-router-{router_loss}", router_loss=router_loss)
        output = workdir / f"router-loss-{router_loss}"
        launch_recipe(config, RECIPE, ["--model", str(model), "--data", str(DATA), "--output-dir", str(output),
                                       "--max-steps", "2", *TRAINING], processes=1)
        steps[router_loss] = [record for record in read_metrics(output / "metrics.jsonl") if record["kind"] == "train"]
    without, with_router = steps[False][0], steps[True][0]
    assert with_router["loss"] == without["loss"]  # the token loss: the same forward
    assert "router_aux_loss" not in without and with_router["router_aux_loss"] > 0
    # The balancing loss has its own gradient (on the routers): the step differs.
    assert with_router["grad_norm"] != pytest.approx(without["grad_norm"], rel=1e-4)


@pytest.fixture(scope="module")
def tp_resumed(workdir, llama, tp_preset, tp_check) -> tuple[int, dict, Path]:
    """The TP run killed (SIGKILL) in its save of step 20 and resumed from step 10 on the same mesh."""
    output = workdir / "tp-resumed"
    status, result = converge(["--config", str(tp_preset), *common(llama, output), "--resume-at", str(RESUME_AT),
                               "--baseline-run", str(tp_check[2] / "baseline")])
    return status, result, output


@pytest.mark.slow
def test_killed_and_resumed_on_the_same_mesh_is_the_uninterrupted_run_bit_for_bit(tp_check, tp_resumed):
    status, result, output = tp_resumed
    assert status == 0, result["diagnosis"]
    assert result["candidate"]["resumed_from"].endswith(f"step-{RESUME_AT:08d}")
    assert f"[fault] kill at during-save, step {MAX_STEPS}" in (output / "candidate-part1.log").read_text()
    uninterrupted = compare_runs(load_run(tp_check[2] / "candidate"), load_run(output / "candidate"))
    assert uninterrupted.verdict == "identical", summary_lines(uninterrupted)


@pytest.fixture(scope="module")
def ep_resumed(workdir, ep_check) -> tuple[int, dict, Path]:
    """The FSDP 2 x EP 2 run killed in the save of step 20 and resumed from step 10, by converge."""
    output = workdir / "ep-resumed"
    status, result = converge(["--config", str(workdir / "ep2.yaml"), *common(workdir / "tiny-moe", output),
                               "--resume-at", str(RESUME_AT), "--baseline-run", str(ep_check[2] / "baseline")])
    return status, result, output


@pytest.mark.slow
def test_an_expert_parallel_run_killed_and_resumed_is_the_uninterrupted_run_bit_for_bit(ep_check, ep_resumed):
    status, result, output = ep_resumed
    assert status == 0, result["diagnosis"]
    uninterrupted = compare_runs(load_run(ep_check[2] / "candidate"), load_run(output / "candidate"))
    assert uninterrupted.verdict == "identical", summary_lines(uninterrupted)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_under_fsdp_alone_on_one_process(workdir, ep_check, ep_resumed):
    # FSDP 2 x EP 2 -> FSDP2 on 1 process, what `inspect-checkpoint --gpus 1` answers yes to: DCP gathers
    # the experts each rank held; accumulation 2 keeps the global batch of 4.
    output = workdir / "fsdp1-from-ep"
    config = accelerate_config(workdir, "moe-fsdp", num_processes=1,
                               fsdp={"transformer_layer_cls_to_wrap": "MixtralDecoderLayer"})
    resume_from = checkpoint(ep_resumed[2] / "candidate", RESUME_AT)
    record = resumed_without_mesh(config, workdir / "tiny-moe", output, resume_from, processes=1)
    assert "model_mesh" not in record and record["gradient_accumulation_steps"] == 2
    assert_continues(ep_check[2] / "candidate", output)


def resumed_without_mesh(config: Path, model: Path, output: Path, resume_from: Path, *extra: str,
                         processes: int) -> dict:
    """The recipe resumed from ``resume_from`` under ``config`` without a mesh file: its run.json."""
    launch_recipe(config, RECIPE, ["--model", str(model), "--data", str(DATA), "--output-dir", str(output),
                                   "--max-steps", str(MAX_STEPS), *TRAINING, *extra, "--seed", str(check.DEFAULT_SEED),
                                   "--resume", str(resume_from)], processes=processes)
    return json.loads((output / "run.json").read_text())


def assert_continues(reference: Path, output: Path) -> None:
    """Every step of ``output`` after the resume within the tolerance of ``reference``'s."""
    comparison = compare_runs(load_run(reference), load_run(output))
    assert comparison.agrees, summary_lines(comparison)
    loss = next(metric for metric in comparison.metrics if metric.metric == "loss")
    assert loss.steps == list(range(RESUME_AT + 1, MAX_STEPS + 1))


@pytest.mark.slow
def test_resumed_on_another_mesh_continues_within_tolerance(workdir, llama, tp_check, tp_resumed):
    # FSDP 2 x TP 2 -> FSDP 4 (no TP): DCP reshards the 2-D DTensors onto 1-D ones; micro-batch 1 keeps
    # the global batch of 4 over 4 data-parallel ranks.
    output = workdir / "fsdp4-from-tp"
    config = accelerate_config(workdir, "fsdp4", num_processes=4)
    record = resumed_without_mesh(config, llama, output, checkpoint(tp_resumed[2] / "candidate", RESUME_AT),
                                  "--micro-batch", "1", processes=4)
    assert "model_mesh" not in record and record["data_parallel_size"] == 4
    assert_continues(tp_check[2] / "baseline", output)


@pytest.mark.slow
def test_export_of_a_2d_checkpoint_is_the_gathered_weights(workdir, tp_check):
    run = tp_check[2] / "candidate"
    exported = workdir / "exported"
    assert cli(["export", str(checkpoint(run, MAX_STEPS)), "--output", str(exported)]) == 0
    final, written = load_file(run / "final" / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(final) == sorted(written)
    assert all(final[name].equal(written[name]) for name in final)
    assert "distributed_config" not in json.loads((run / "final" / "config.json").read_text())
    assert Manifest.read(checkpoint(run, MAX_STEPS)).model_mesh["tp_size"] == 2  # inspect-checkpoint names the mesh


# ---- planted faults: each fails the check ----


def faulty_recipe(workdir: Path, name: str, replacements: list[tuple[str, str]]) -> Path:
    """recipes/causal_lm.py with a fault written in (each ``(old, new)`` must be found once)."""
    text = RECIPE.read_text()
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = workdir / f"{name}.py"
    path.write_text(text)
    return path


AFTER_START = "    accelerator, tokenizer = run.accelerator, run.tokenizer\n"
AFTER_MODEL = "    key_map = recipe_lora.adapter_key_map(model) if run.lora else None  # LoRA/QLoRA\n"
FAULTS = {
    # The loss counted tp_size times (transformers issues 45994, 39674): the gradient scaled by all the
    # ranks instead of the data-parallel ones.
    "loss-times-tp": ("tp", [("objective = loss * dp_size / max(global_targets, 1.0)",
                              "objective = loss * accelerator.num_processes / max(global_targets, 1.0)")]),
    # A TP rank that takes its own partial sums for the all-reduced ones (a row-parallel output, a
    # column-parallel input gradient): it takes part in the collective and drops its result.
    "tp-rank-skips-all-reduce": ("tp", [(AFTER_START, AFTER_START + (
        "    if accelerator.process_index % 2 == 1:\n"
        "        import torch.distributed._functional_collectives as funcol\n"
        "        reduce = funcol.all_reduce\n"
        "        funcol.all_reduce = lambda tensor, *a, **k: (reduce(tensor, *a, **k), tensor)[1]\n"))]),
    # Two TP ranks given different samples: the data split by all the ranks (accelerate's dataloader
    # does this) instead of the data-parallel ones.
    "data-split-by-every-rank": ("tp", [("for indices in run.micro_batches(stream)]", (
        "for indices in loop.rank_micro_batches(stream, samples_consumed=run.samples, micro_batch_size="
        "args.micro_batch, accumulation_steps=args.grad_accum, rank=run.rank, "
        "data_parallel_size=accelerator.num_processes)]"))]),
    # Experts that differ from the checkpoint after loading on one rank (transformers issue 45662:
    # every rank loading rank 0's experts).
    "experts-differ-after-load": ("ep", [(AFTER_MODEL, AFTER_MODEL + (
        "    if accelerator.process_index == 1:\n"
        "        with torch.no_grad():\n"
        "            for name, param in model.named_parameters():\n"
        "                if '.experts.' in name:\n"
        "                    param.to_local().mul_(0.5)\n"))]),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_planted_mesh_fault_fails_the_check(workdir, llama, tp_preset, tp_check, ep_check, fault):
    mesh, replacements = FAULTS[fault]
    reference = {"tp": tp_check, "ep": ep_check}[mesh][2]
    model = llama if mesh == "tp" else workdir / "tiny-moe"
    config = tp_preset if mesh == "tp" else workdir / "ep2.yaml"
    recipe = faulty_recipe(workdir, fault.replace("-", "_"), replacements)
    status, result = converge(["--config", str(config), *common(model, workdir / fault, FAULT_STEPS),
                               "--recipe", str(recipe), "--baseline-run", str(reference / "baseline")])
    assert status == 1, result
    assert result["first_divergent_step"] <= 1, result["metrics"]
    if fault == "loss-times-tp":  # the losses agree; the norm, doubled, does not
        assert result["first_divergent_metric"] == "grad_norm", result["metrics"]
