"""LoRA and QLoRA in the recipes: flags, the peft model, the order FSDP1 and FSDP2 both train
right, trainable-only checkpoints, and adapter / merged exports.

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml recipes/causal_lm.py \
        --model MODEL --data DATA --output-dir runs/lora --lora-r 8 [--load-in-4bit] [--export-merged]

What each piece settles (measured on 2 CPU processes, see docs/recipes.md):

- **Wrapping.** FSDP2 keeps the accelerate config's ``TRANSFORMER_BASED_WRAP`` on the decoder
  layer (accelerate's FSDP2 path ignores peft's wrap policy); every unit then holds frozen and
  trainable weights, which FSDP2 allows. FSDP1 gets peft's ``fsdp_auto_wrap_policy`` on the plugin
  before ``prepare`` (else every flat parameter gets a full-size gradient and all adapters land on
  one rank) and needs ``use_orig_params: true`` (else "Must flatten tensors with uniform
  requires_grad").
- **Optimizer order.** FSDP1: the model is prepared first and the optimizer is built over its
  wrapped parameters (built before, the LoRA weights silently never update). FSDP2 and DDP: model
  and optimizer are prepared together (accelerate swaps the optimizer's parameters for the shards).
- **QLoRA.** transformers' ``BitsAndBytesConfig`` (nf4, ``bnb_4bit_quant_storage=bfloat16``): FSDP2
  shards bf16-stored 4-bit weights; in uint8 storage accelerate leaves them replicated and FSDP1
  cannot flatten them, so uint8 is never used.
- **Checkpoints.** Only the trainable weights and their optimizer state are saved (DCP, every rank
  its shard: ``adapter_model_0/`` and ``adapter_optimizer_0/``), with accelerate's scheduler and
  random states; the frozen base is reloaded from ``--model`` (``accelerate load_state`` cannot read
  4-bit quantization-state keys anyway). DCP reshards on load, so a run resumes at another process
  count, and even under another strategy. Read back through the safe DCP reader.
- **Export.** The trainable weights are gathered with torch's ``get_model_state_dict(full_state_dict
  =True, ignore_frozen_params=True)`` (``cpu_offload`` off under FSDP1, where it fails on rank 1) and
  written by peft's ``save_pretrained(state_dict=...)``: peft would otherwise build key names from
  the FSDP1-wrapped module tree and write zeros. The merged folder merges into the base reloaded in
  fp32 (QLoRA: into the dequantized 4-bit base; merging into the 4-bit weights re-quantizes them).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Callable

from fsdp_presets.plan.limits import MAX_LORA_R
from fsdp_presets.errors import UsageError
from fsdp_presets.schema import K

from fsdp_presets.checkpoint.layout import (ADAPTER_KEYS, ADAPTER_MODEL, ADAPTER_OPTIMIZER, ADAPTER_WEIGHTS,
                                            DCP_METADATA, MODEL_CONFIG)


# ---- flags ----
def add_arguments(parser) -> None:
    add = parser.add_argument
    add("--lora-r", type=int, help="train a LoRA adapter of this rank instead of every weight (peft's r); "
        "default: full fine-tuning, or 16 with --load-in-4bit")
    add("--lora-alpha", type=float, help="LoRA scaling numerator (peft's lora_alpha; default 2 x --lora-r)")
    add("--lora-dropout", type=float, default=0.0, help="dropout on the LoRA path (default 0)")
    add("--lora-target-modules", help="comma-separated module names to adapt, or all-linear (default: the "
        "attention and MLP projections of the model's decoder block)")
    add("--load-in-4bit", action="store_true", help="QLoRA: the frozen base in 4 bits (bitsandbytes nf4, "
        "stored as bfloat16 so FSDP shards it); implies LoRA")
    add("--export-merged", action="store_true", help="LoRA: also write OUTPUT_DIR/merged, the base with the "
        "adapter merged in, a plain Hugging Face folder (QLoRA: merged into the dequantized base)")


def settings(args) -> dict[str, Any] | None:
    """The training method and LoRA shape (for run.json and checkpoint manifests), None for full
    fine-tuning; :class:`UsageError` for bad values."""
    lora_flags = [flag for flag, value in (("--lora-alpha", args.lora_alpha),
                                           ("--lora-target-modules", args.lora_target_modules),
                                           ("--export-merged", args.export_merged or None),
                                           ("--lora-dropout", args.lora_dropout or None)) if value is not None]
    if args.lora_r is None and not args.load_in_4bit:
        if lora_flags:
            raise UsageError(f"{', '.join(lora_flags)} set without LoRA; add --lora-r R (e.g. 16) or --load-in-4bit")
        return None
    r = 16 if args.lora_r is None else args.lora_r
    problems = []
    if not 1 <= r <= MAX_LORA_R:  # the bound `plan` and `generate` apply (fsdp_presets.plan.limits.lora_rank)
        problems.append(f"--lora-r {r} is out of range; give a whole number from 1 to {MAX_LORA_R}, such as 16")
    alpha = float(2 * r if args.lora_alpha is None else args.lora_alpha)
    if not alpha > 0:
        problems.append(f"--lora-alpha {alpha} must be > 0")
    if not 0 <= args.lora_dropout < 1:
        problems.append(f"--lora-dropout {args.lora_dropout} must be in [0, 1)")
    targets = None
    if args.lora_target_modules is not None:
        targets = [name.strip() for name in args.lora_target_modules.split(",") if name.strip()]
        if not targets or any(not re.fullmatch(r"[A-Za-z0-9_.\-]+", name) for name in targets):
            problems.append(f"--lora-target-modules {args.lora_target_modules!r}: give module names such as "
                            "q_proj,v_proj or all-linear")
    if problems:
        raise UsageError("; ".join(problems))
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise UsageError("--lora-r and --load-in-4bit need peft: pip install -e '.[lora]' (scripts/setup.sh does)")
    if args.load_in_4bit:

        if importlib.util.find_spec("bitsandbytes") is None:
            raise UsageError("--load-in-4bit needs bitsandbytes: pip install -e '.[lora]' (scripts/setup.sh does)")
    record = {"method": "qlora" if args.load_in_4bit else "lora", "r": r, "alpha": alpha,
              "dropout": float(args.lora_dropout), "target_modules": targets}
    if args.load_in_4bit:
        record["quantization"] = {"backend": "bitsandbytes", "quant_type": "nf4", "quant_storage": "bfloat16",
                                  "compute_dtype": "float32", "double_quant": False}
    return record


# ---- model ----
def default_targets(model) -> list[str]:
    """The names of the linear layers inside the model's decoder block (attention and MLP
    projections), e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""
    import torch

    block_classes = set(getattr(model, "_no_split_modules", None) or [])
    names: list[str] = []
    for module in model.modules():
        if type(module).__name__ not in block_classes:
            continue
        for name, child in module.named_modules():
            if isinstance(child, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in names:
                names.append(name.rsplit(".", 1)[-1])
        if names:  # the first block with Linear layers (_no_split_modules may also name embeddings)
            break
    return names or ["all-linear"]


def unmatched_targets(model, targets: list[str]) -> list[str]:
    """The names of ``targets`` that no module name of ``model`` ends with (peft's rule: the name, or
    a dotted suffix of it); none for ``all-linear``."""
    if targets == ["all-linear"]:
        return []
    names = [name for name, _ in model.named_modules()]
    return [target for target in targets
            if not any(name == target or name.endswith(f".{target}") for name in names)]


def load_model(model_class, path: str, lora: dict[str, Any] | None, *, task_type: str, mixed_precision: str = "no",
               **kwargs):
    """The model to train: ``model_class.from_pretrained(path)`` wrapped by peft when ``lora`` (its
    4-bit base for QLoRA). Records the chosen target modules in ``lora``.

    Trained weights are fp32. Under LoRA with ``mixed_precision: bf16`` the frozen base is loaded
    in bf16: it is only ever computed with in bf16, accelerate's FSDP2 preparation upcasts only
    weights that train, and the planner counts a frozen base at 2 bytes per parameter (in fp32 an
    8B base alone would take 32 GB of a 24 GB GPU). Without mixed precision everything is fp32."""
    import torch

    quantized = lora is not None and lora["method"] == "qlora"
    if quantized:
        kwargs["quantization_config"] = quantization_config()
    base_dtype = torch.bfloat16 if lora is not None and mixed_precision == "bf16" else torch.float32
    # use_kernels=False: transformers (5.x, with the `kernels` package it requires) otherwise swaps
    # layers for kernels downloaded from the Hub on a GPU at the first train()/eval(): code from the
    # network, like trust_remote_code, and on an offline host a crash (nothing is cached to load).
    model = model_class.from_pretrained(path, dtype=base_dtype, trust_remote_code=False, use_kernels=False,
                                        **kwargs)
    if quantized:
        keep_4bit_layout(model)
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    targets = lora["target_modules"] or default_targets(model)
    lora["target_modules"] = targets
    unmatched = unmatched_targets(model, targets)
    if unmatched:  # peft adapts the names that match and ignores the others: a typo would train less
        raise UsageError(f"--lora-target-modules: {', '.join(unmatched)} match no module of the model (its linear "
                         f"layers: {', '.join(default_targets(model))}); correct the names or leave them out")
    config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules="all-linear" if targets == ["all-linear"] else targets,
                        task_type=task_type, bias="none")
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    except ValueError as error:
        raise UsageError(f"--lora-target-modules {','.join(targets)}: {str(error).splitlines()[0][:300]}; name "
                         "linear layers of the model (e.g. q_proj,v_proj) or give all-linear") from None
    # Adapters in fp32 like every trained weight here (FSDP2 wants one dtype among trainable weights).
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    return peft_model


def keep_4bit_layout(model) -> None:
    """bitsandbytes repacks a 4-bit weight for its CPU inference kernel the first time the layer
    runs in eval mode without gradients (on CPUs with AVX512-BF16): the weight's data is replaced
    by another layout, under FSDP the gathered copy of a shard, and training afterwards fails ("a
    view of a leaf Variable ... in-place"). Keep the layout the weights were sharded in."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantization_config():
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                              bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_use_double_quant=False)


def adapter_key_map(model) -> dict[str, str]:
    """Trainable parameter name -> its key in a PEFT ``adapter_model.safetensors`` (peft's own
    renaming, done once on the unwrapped model)."""
    from peft import get_peft_model_state_dict

    trainable = {name: param for name, param in model.named_parameters() if param.requires_grad}
    renamed = get_peft_model_state_dict(model, state_dict=dict(trainable))
    by_id = {id(tensor): key for key, tensor in renamed.items()}
    return {name: by_id[id(param)] for name, param in trainable.items() if id(param) in by_id}


def check_wrap_classes(plugin, model) -> None:
    """The block classes the accelerate config wraps must be in the model (accelerate raises
    "Could not find the transformer layer class" deep in ``prepare`` otherwise): refused on every
    rank naming both, before anything is wrapped."""
    wanted = getattr(plugin, "transformer_cls_names_to_wrap", None) if plugin is not None else None
    policy = str(getattr(plugin, "auto_wrap_policy", "") or "").lower()
    if not wanted or "size" in policy or "no_wrap" in policy:  # the classes are used by transformer wrapping only
        return
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in wanted if name not in present]
    if missing:
        blocks = [name for name in getattr(model, "_no_split_modules", None) or [] if name in present]
        raise UsageError(f"the accelerate config wraps {', '.join(missing)}, which {type(model).__name__} does not "
                         f"have (its block class: {', '.join(blocks) or 'unknown'}); the config was made for another "
                         "model: regenerate it for this one (fsdp-presets generate MODEL ...), or set "
                         f"{K.transformer_layer_cls_to_wrap} to its block class")


def prepare(accelerator, model, build_optimizer: Callable[[Any], tuple[Any, Any]], *, lora: dict[str, Any] | None):
    """``accelerator.prepare`` in the order that trains right on FSDP1, FSDP2 and DDP; returns
    ``(model, optimizer, scheduler)``. ``build_optimizer(model)`` returns (optimizer, scheduler).
    Without ``lora`` (full fine-tuning): built first, prepared together, as always."""
    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type.value == "FSDP" else None
    check_wrap_classes(plugin, model)
    if lora is not None and lora["method"] == "qlora" and plugin is not None and plugin.fsdp_version == 1:
        raise UsageError(f"--load-in-4bit needs FSDP2 ({K.version}: 2 in the accelerate config): FSDP1 flattens each "
                         "unit into one tensor of one dtype, and the 4-bit base (stored as bfloat16) shares its units "
                         "with fp32 norms and adapters (\"Must flatten tensors with uniform dtype\"); or train LoRA "
                         "without --load-in-4bit under FSDP1")
    if lora is not None and plugin is not None and plugin.fsdp_version == 1:
        if not plugin.use_orig_params:
            raise UsageError(f"LoRA under FSDP1 needs {K.use_orig_params}: true in the accelerate config (else FSDP "
                             "fails with \"Must flatten tensors with uniform requires_grad\"); set it, or use "
                             f"{K.version}: 2")
        from peft.utils.other import fsdp_auto_wrap_policy

        plugin.auto_wrap_policy = fsdp_auto_wrap_policy(model)
        model = accelerator.prepare(model)
        optimizer, scheduler = build_optimizer(model)  # after wrapping: over the parameters FSDP1 trains
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        return model, optimizer, scheduler
    optimizer, scheduler = build_optimizer(model)
    return accelerator.prepare(model, optimizer, scheduler)


def local_bytes(model) -> dict[str, int]:
    """Bytes of this rank's share of the frozen, the 4-bit (in their storage dtype; part of the
    frozen) and the trainable parameters."""
    quantized_ids = {id(module.weight) for module in model.modules() if type(module).__name__ == "Linear4bit"}
    frozen = trainable = quantized = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        size = local.numel() * local.element_size()
        if param.requires_grad:
            trainable += size
        else:
            frozen += size
        if id(param) in quantized_ids:
            quantized += size
    return {"frozen": frozen, "trainable": trainable, "quantized": quantized}


def memory_record(accelerator, model) -> dict[str, list[int]]:
    """Every rank's :func:`local_bytes` (collective), for run.json."""
    from accelerate.utils import gather_object

    mine = [local_bytes(model)]
    ranks = gather_object(mine) if accelerator.num_processes > 1 else mine
    return {f"{kind}_bytes_per_rank": [entry[kind] for entry in ranks] for kind in ("frozen", "quantized", "trainable")}


# ---- checkpoints ----
def _trainable_names(model) -> set[str]:
    from torch.distributed.checkpoint.state_dict import _get_fqns

    names: set[str] = set()
    for name, param in model.named_parameters():
        if param.requires_grad:
            names.update(_get_fqns(model, name))
    return names


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def _trainable_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, _inner(optimizer), options=_options())
    keep = _trainable_names(model)
    return {name: value for name, value in model_state.items() if name in keep}, optimizer_state


class TrainableState:
    """What a LoRA checkpoint saves and loads in place of ``accelerator.save_state``: trainable
    weights and their optimizer state as DCP, plus accelerate's scheduler and random states."""

    def __init__(self, accelerator, model, optimizer) -> None:
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def _without_model_and_optimizer(self, action: Callable[[], Any]) -> None:
        accelerator = self.accelerator
        models, optimizers = accelerator._models, accelerator._optimizers
        accelerator._models, accelerator._optimizers = [], []
        try:
            action()
        finally:
            accelerator._models, accelerator._optimizers = models, optimizers

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        model_state, optimizer_state = _trainable_state(self.model, self.optimizer)
        for name, state in ((ADAPTER_MODEL, {"model": model_state}), (ADAPTER_OPTIMIZER, {"optimizer": optimizer_state})):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(Path(folder) / name)),
                     no_dist=self.accelerator.num_processes == 1)
        self._without_model_and_optimizer(lambda: self.accelerator.save_state(str(folder)))

    def load(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from fsdp_presets.checkpoint.safe_unpickle import safe_dcp_load, safe_dcp_loading

        folder = Path(folder)
        for name in (ADAPTER_MODEL, ADAPTER_OPTIMIZER):
            if not (folder / name / DCP_METADATA).is_file():
                raise UsageError(f"--resume {folder}: no {name}/ in it, so it is not a LoRA checkpoint; give a "
                                 "checkpoint of a LoRA run with the same --lora-* flags, or train without them")
        model_state, optimizer_state = _trainable_state(self.model, self.optimizer)
        saved = _saved_shapes(folder / ADAPTER_MODEL)
        if set(saved) != set(model_state):
            missing, extra = sorted(set(model_state) - set(saved)), sorted(set(saved) - set(model_state))
            raise UsageError(f"--resume {folder}: its adapter does not match this run's (missing {missing[:3]}, "
                             f"extra {extra[:3]}); resume with the --lora-* flags of the run that saved it")
        other = sorted(name for name, value in model_state.items() if tuple(value.shape) != saved[name])
        if other:
            raise UsageError(f"--resume {folder}: its adapter has other shapes ({other[0]}: {saved[other[0]]} there, "
                             f"{tuple(model_state[other[0]].shape)} now); resume with the --lora-r of the run that "
                             "saved it")
        single = self.accelerator.num_processes == 1
        safe_dcp_load({"model": model_state}, folder / ADAPTER_MODEL, no_dist=single)
        safe_dcp_load({"optimizer": optimizer_state}, folder / ADAPTER_OPTIMIZER, no_dist=single)
        set_state_dict(self.model, _inner(self.optimizer), model_state_dict=model_state,
                       optim_state_dict=optimizer_state, options=_options(strict=False))
        with safe_dcp_loading():
            self._without_model_and_optimizer(lambda: self.accelerator.load_state(str(folder)))


def _saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    from fsdp_presets.checkpoint.files import DcpReader

    return {name: tuple(info.shape) for name, info in DcpReader(folder).entries().items()}


def write_checkpoint_extra(folder: Path, lora: dict[str, Any], key_map: dict[str, str], adapter_config) -> None:
    """Into a checkpoint's model_config/ (main process): adapter_config.json and the key map, so
    ``fsdp-presets export`` writes a PEFT folder from the checkpoint alone."""
    target = Path(folder) / MODEL_CONFIG
    target.mkdir(parents=True, exist_ok=True)
    adapter_config.save_pretrained(str(target))
    (target / ADAPTER_KEYS).write_text(json.dumps({"lora": lora, "keys": key_map}, indent=1, sort_keys=True))


# ---- export ----
def gather_trainable(accelerator, model) -> dict[str, Any]:
    """Full (unsharded) trainable weights on every rank, on the CPU (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    fsdp1 = accelerator.distributed_type.value == "FSDP" and accelerator.state.fsdp_plugin.fsdp_version == 1
    state = get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=not fsdp1))
    keep = _trainable_names(model)
    return {name: value.detach().cpu().contiguous() for name, value in state.items() if name in keep}


def write_adapter_folder(folder: Path, state: dict[str, Any], key_map: dict[str, str], adapter_config) -> None:
    """adapter_model.safetensors under peft's key names (from :func:`adapter_key_map`, taken on the
    unwrapped model: peft's own ``save_pretrained`` on an FSDP1-wrapped model writes nothing or
    zeros) and adapter_config.json."""
    import copy

    from safetensors.torch import save_file

    missing = sorted(set(state) - set(key_map))
    if missing:
        raise RuntimeError(f"trainable weights without a PEFT name: {missing[:3]}")
    folder.mkdir(parents=True, exist_ok=True)
    save_file({key_map[name]: tensor for name, tensor in state.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config = copy.deepcopy(adapter_config)
    config.inference_mode = True
    config.save_pretrained(str(folder))


def export_adapter(accelerator, model, tokenizer, output_dir: Path, *, key_map: dict[str, str],
                   merged_dir: Path | None = None, merge: bool = False,
                   model_class=None, base_path: str | None = None, lora: dict[str, Any] | None = None) -> None:
    """Write ``output_dir`` as a PEFT folder (adapter_config.json + adapter_model.safetensors +
    tokenizer; ``merge``: its files beside what ``output_dir`` holds) and, with ``merged_dir``, the
    merged model as a Hugging Face folder. Collective."""
    from fsdp_presets.errors import Finding

    state = gather_trainable(accelerator, model)
    problem = None
    if accelerator.is_main_process:
        from fsdp_presets.train.final_model import write_model_folder

        output_dir = Path(output_dir)
        adapter_config = accelerator.unwrap_model(model).peft_config["default"]
        write_model_folder(output_dir, functools.partial(write_adapter_folder, state=state, key_map=key_map,
                                                         adapter_config=adapter_config), tokenizer=tokenizer,
                           merge=merge)
        if merged_dir is not None:
            try:
                export_merged(output_dir, Path(merged_dir), model_class=model_class, base_path=base_path,
                              quantized=lora is not None and lora["method"] == "qlora", tokenizer=tokenizer)
            except (OSError, ValueError, RuntimeError) as error:
                problem = f"writing the merged model to {merged_dir} failed ({type(error).__name__}: {error}); " \
                          f"the adapter in {output_dir} is complete"
    del state
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem], from_process=0)[0]
    if problem:
        raise Finding(problem)
    accelerator.wait_for_everyone()


def export_merged(adapter_dir: Path, merged_dir: Path, *, model_class, base_path: str, quantized: bool,
                  tokenizer=None) -> None:
    """The base reloaded (QLoRA: 4-bit, then dequantized) with the adapter merged in, written as a
    plain Hugging Face folder (one process)."""
    import torch
    from peft import PeftModel

    kwargs = {"quantization_config": quantization_config()} if quantized else {}
    base = model_class.from_pretrained(base_path, dtype=torch.float32, trust_remote_code=False, use_kernels=False,
                                       **kwargs)
    if quantized:
        keep_4bit_layout(base)
        base = base.dequantize()  # merging into 4-bit weights would re-quantize them
        base = base.to(torch.float32)
        for attribute in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(base.config, attribute):
                delattr(base.config, attribute)
    from fsdp_presets.train.final_model import write_model_folder

    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    write_model_folder(merged_dir, lambda staging: merged.save_pretrained(str(staging), safe_serialization=True),
                       tokenizer=tokenizer)


# ---- `fsdp-presets export` of a LoRA checkpoint: fsdp_presets.checkpoint.adapter ----
