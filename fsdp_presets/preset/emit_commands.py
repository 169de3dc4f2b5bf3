"""The commands a generated file names: the ``fsdp-presets generate`` command that makes it again
and the ``accelerate launch`` command that runs it (words, quoted for the shell by
:mod:`fsdp_presets.launching.quoting`). Pure: a request or preset in, words out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from fsdp_presets import flags
from fsdp_presets.preset.choices import Preset
from fsdp_presets.preset.request import PresetRequest
from fsdp_presets.launching.quoting import shell_join, shell_word

RECIPE = "recipes/causal_lm.py"
"""The recipe the launch command runs for causal language models."""
TRAINER_RECIPE = "recipes/sft_trainer.py"
"""The Trainer (TRL SFTTrainer) recipe a TP/EP preset's ``NAME.trainer.yaml`` launches."""
# The variables the multi-node launch command reads (the names of launchers.py's scripts): the
# only words of a command that are not quoted.
_NODE_RANK, _MAIN_PROCESS_IP, _MAIN_PROCESS_PORT = "$NODE_RANK", "$MAIN_PROCESS_IP", "$MAIN_PROCESS_PORT"
SHELL_VARIABLES = frozenset((_NODE_RANK, _MAIN_PROCESS_IP, _MAIN_PROCESS_PORT))


@dataclass(frozen=True, kw_only=True)
class LaunchHints:
    """What the header's launch command names besides the config (not decisions: just text)."""

    model: str | None = None
    """Model folder with weights and tokenizer that the recipe loads (default ``MODEL_DIR``)."""
    data: str | None = None
    """Training data file (default ``DATA.jsonl``)."""

    def to_json(self) -> dict:
        return {key: value for key, value in (("model", self.model), ("data", self.data)) if value is not None}


def generate_command(request: PresetRequest, *, output: str, baseline_output: str | None = None,
                     launch: LaunchHints = LaunchHints()) -> str:
    """The ``fsdp-presets generate`` command that makes these files again (non-default flags only),
    as one line of shell (:func:`~fsdp_presets.launching.quoting.shell_word` each word)."""
    return shell_join(generate_words(request, output=output, baseline_output=baseline_output, launch=launch))


def generate_words(request: PresetRequest, *, output: str, baseline_output: str | None = None,
                   launch: LaunchHints = LaunchHints()) -> list[str]:
    """The words of :func:`generate_command`."""
    words = ["fsdp-presets", "generate", request.model, "--gpus", str(request.gpus)]
    optional = [
        ("--nodes", request.nodes, 1),
        ("--device", request.device, "gpu"),
        ("--gpu", request.gpu, None),
        ("--gpu-memory", request.gpu_memory_gib, None),
        ("--inter-node-gbps", request.inter_node_gbps, None),
        ("--host-memory", request.host_memory_gib, None),
        ("--precision", request.precision, "auto"),
        ("--strategy", request.strategy, "auto"),
        ("--fsdp-version", request.fsdp_version, 2),
        ("--state-dict", request.state_dict, "sharded"),
        ("--activation-checkpointing", request.activation_checkpointing, "auto"),
        ("--offload", request.offload, "auto"),
        (flags.SEQ_LEN.name, request.seq_len, None),
        ("--global-batch", request.global_batch, None),
        (flags.MICRO_BATCH.name, request.micro_batch, None),
        (flags.METHOD.name, request.method, "full"),
        (flags.LORA_R.name, request.lora_r, None),
        (flags.LORA_ALPHA.name, request.lora_alpha, None),
        (flags.LORA_DROPOUT.name, request.lora_dropout, None),
        (flags.LORA_TARGET_MODULES.name, request.lora_target_modules, None),
        (flags.TP.name, request.tp, 1),
        (flags.EP.name, request.ep, 1),
        ("--launch-model", launch.model, None),
        ("--launch-data", launch.data, None),
    ]
    for flag, value, default in optional:
        if value != default:
            words += [flag, number_text(value)]
    if baseline_output is not None:
        words += ["--baseline", "ddp"]
        if baseline_output != default_baseline_path(output):
            words += ["--baseline-output", baseline_output]
    words += ["-o", output]
    return words


def default_baseline_path(output: str) -> str:
    """``x.yaml`` -> ``x.ddp.yaml`` (next to it)."""
    path = PurePosixPath(output)
    return str(path.with_name(f"{path.stem}.ddp{path.suffix or '.yaml'}"))


def launch_words(preset: Preset, *, config_file: str, launch: LaunchHints, baseline: bool = False,
                 trainer_config: str | None = None) -> list[str]:
    """``accelerate launch --config_file FILE recipes/causal_lm.py --model ... --micro-batch M ...``;
    with ``--async-save`` where the preset turned it on (never for the DDP ``baseline``, which the
    recipe saves synchronously); a TP/EP preset's recipe with ``--distributed-config``, the file
    beside ``config_file`` (its DDP baseline: one process per TP group, the same micro-batches).
    ``trainer_config``: the Trainer recipe launched with that config (a TP/EP preset's
    ``NAME.trainer.yaml``) on the same mesh, which checkpoints nothing (no ``--async-save``) and reduces
    gradients as transformers' Trainer does (no ``--reduce-every-micro-batch``: the recipe refuses it)."""
    from fsdp_presets.preset.emit_distributed import distributed_config_path

    model = launch.model or "MODEL_DIR"
    causal = preset.profile.architecture.endswith("ForCausalLM")
    script = (TRAINER_RECIPE if trainer_config else RECIPE) if causal else "YOUR_TRAINING_SCRIPT.py"
    run_name = PurePosixPath(trainer_config or config_file).name.removesuffix(".yaml").replace(".", "_")
    words = ["accelerate", "launch", "--config_file", trainer_config or config_file]
    if preset.parallelism.num_machines > 1:
        # The same variable names as the scripts `generate --launcher` writes (launchers.py).
        words += ["--machine_rank", _NODE_RANK, "--main_process_ip", _MAIN_PROCESS_IP,
                  "--main_process_port", _MAIN_PROCESS_PORT]
    words.append(script)
    if preset.parallelism.is_nd and not baseline:
        words += [flags.DISTRIBUTED_CONFIG.name, distributed_config_path(config_file)]
    return words + [
        flags.MODEL.name, model, flags.DATA.name, launch.data or "DATA.jsonl",
        flags.OUTPUT_DIR.name, f"runs/{run_name}", flags.SEQ_LEN.name, str(preset.batch.seq_len),
        flags.MICRO_BATCH.name, str(preset.batch.micro_batch), flags.GRAD_ACCUM.name, str(preset.batch.accumulation),
    ] + ([flags.REDUCE_EVERY_MICRO_BATCH.name] if preset.batch.reduce_every_micro_batch and not trainer_config
         else []) \
        + lora_recipe_words(preset) + ([flags.ASYNC_SAVE.name] if preset.state_dict.async_save and not baseline
                                       and not trainer_config else [])


def lora_recipe_words(preset: Preset) -> list[str]:
    """The recipe flags of the preset's LoRA/QLoRA (the settings accelerate YAML cannot hold)."""
    lora = preset.request.lora_shape
    if lora is None:
        return []
    words = [flags.METHOD.name, lora.method, flags.LORA_R.name, str(lora.r), flags.LORA_ALPHA.name,
             number_text(lora.lora_alpha)]
    if lora.dropout:
        words += [flags.LORA_DROPOUT.name, number_text(lora.dropout)]
    if lora.target_modules is not None:
        words += [flags.LORA_TARGET_MODULES.name, ",".join(lora.target_modules)]
    return words


def command_text(words: list[str]) -> str:
    """A command of :func:`launch_words` or :func:`generate_words` as one line of shell: every
    word quoted except the launch variables (``$NODE_RANK``...)."""
    return " ".join(word if word in SHELL_VARIABLES else shell_word(word) for word in words)


def number_text(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)
