"""LoRA and QLoRA: the flags, the method's settings, the peft wrapping, the 4-bit base, and the
names and bytes of the trainable weights.

    accelerate launch --config_file accelerate_configs/cpu_fsdp2_demo.yaml recipes/causal_lm.py \
        --model MODEL --data DATA --output-dir runs/lora --method lora|qlora [--lora-r 8] [--export-merged]

The rest of a LoRA run is where every run's is: the model is loaded, checked and prepared in the
order FSDP1 and FSDP2 both train right by :mod:`fsdp_presets.train.model_setup`; its checkpoints
(trainable weights only) are :mod:`fsdp_presets.checkpoint.adapter`'s; its adapter and merged exports
are :mod:`fsdp_presets.train.final_adapter`'s (measured on 2 CPU processes, see docs/recipes.md).

- **Targets.** Without ``--lora-target-modules``, the linear layers of the model's decoder block; a
  name that matches no module is refused (peft would adapt the others and train less).
- **Dtypes.** Adapters train in fp32 like every trained weight here (FSDP2 wants one dtype among
  trainable weights).
- **QLoRA.** transformers' ``BitsAndBytesConfig`` (nf4, ``bnb_4bit_quant_storage=bfloat16``): FSDP2
  shards bf16-stored 4-bit weights; in uint8 storage accelerate leaves them replicated and FSDP1
  cannot flatten them, so uint8 is never used.
"""

from __future__ import annotations

from typing import Any

from fsdp_presets import flags
from fsdp_presets.errors import UsageError, note
from fsdp_presets.flags import DEFAULT_LORA_DROPOUT, DEFAULT_LORA_R, METHODS
from fsdp_presets.plan import limits


# ---- flags ----
def add_arguments(parser) -> None:
    """``--method`` and the LoRA shape, spelled and checked as ``fsdp-presets plan|generate`` take
    them (:mod:`fsdp_presets.flags`); ``--lora-r`` without ``--method`` means ``--method lora``, and
    ``--load-in-4bit`` still means ``--method qlora`` (with a note)."""
    flags.add(parser, flags.METHOD, choices=METHODS)
    flags.add(parser, flags.LORA_R, type=limits.lora_rank, metavar="R",
              help_suffix=f"; given without {flags.METHOD.name}, it means {flags.METHOD.name} lora")
    flags.add(parser, flags.LORA_ALPHA, type=limits.lora_alpha)
    flags.add(parser, flags.LORA_DROPOUT, type=limits.lora_dropout, default=DEFAULT_LORA_DROPOUT)
    flags.add(parser, flags.LORA_TARGET_MODULES, metavar="NAMES")
    flags.add_load_in_4bit(parser)
    parser.add_argument("--export-merged", action="store_true", help="LoRA: also write OUTPUT_DIR/merged, the base "
                        "with the adapter merged in, a plain Hugging Face folder (QLoRA: merged into the dequantized "
                        "base)")


def settings(args) -> dict[str, Any] | None:
    """The training method and LoRA shape (for run.json and checkpoint manifests), None for full
    fine-tuning; :class:`UsageError` for bad values."""
    method = args.method or ("full" if args.lora_r is None else "lora")
    lora_flags = [flag for flag, value in ((flags.LORA_R.name, args.lora_r), (flags.LORA_ALPHA.name, args.lora_alpha),
                                           (flags.LORA_TARGET_MODULES.name, args.lora_target_modules),
                                           ("--export-merged", args.export_merged or None),
                                           (flags.LORA_DROPOUT.name, args.lora_dropout or None)) if value is not None]
    if method == "full":
        if lora_flags:
            raise UsageError(f"{', '.join(lora_flags)} set without LoRA; add {flags.METHOD.name} lora or "
                             f"{flags.METHOD.name} qlora")
        return None
    r = DEFAULT_LORA_R if args.lora_r is None else args.lora_r
    alpha = float(2 * r if args.lora_alpha is None else args.lora_alpha)
    # The parser checked what was typed; the same checks again for a namespace built in code.
    problems = [problem for problem in (limits.value_problem(r, limits.lora_rank, flag=flags.LORA_R.name),
                                        limits.value_problem(alpha, limits.lora_alpha, flag=flags.LORA_ALPHA.name),
                                        limits.value_problem(args.lora_dropout, limits.lora_dropout,
                                                             flag=flags.LORA_DROPOUT.name)) if problem]
    targets = None
    if args.lora_target_modules is not None:
        try:
            targets = list(flags.target_modules(args.lora_target_modules))
        except UsageError as error:
            problems.append(str(error))
    if problems:
        raise UsageError("; ".join(problems))
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise UsageError(f"{flags.METHOD.name} {method} needs peft: pip install -e '.[lora]' (scripts/setup.sh does)")
    if method == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError(f"{flags.METHOD.name} qlora needs bitsandbytes: pip install -e '.[lora]' "
                         "(scripts/setup.sh does)")
    record = {"method": method, "r": r, "alpha": alpha, "dropout": float(args.lora_dropout), "target_modules": targets}
    if method == "qlora":
        record["quantization"] = {"backend": "bitsandbytes", "quant_type": "nf4", "quant_storage": "bfloat16",
                                  "compute_dtype": "float32", "double_quant": False}
    return record


def settings_of(model) -> dict[str, Any] | None:
    """The method and LoRA shape of a peft model built elsewhere (a user's Trainer script), as
    :func:`settings` records them; None for a model without an adapter."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    config = peft_config.get("default") or next(iter(peft_config.values()))
    targets = getattr(config, "target_modules", None)
    quantized = bool(getattr(getattr(model, "config", None), "quantization_config", None))
    return {"method": "qlora" if quantized else "lora", "r": getattr(config, "r", None),
            "alpha": float(getattr(config, "lora_alpha", 0) or 0), "dropout": float(getattr(config, "lora_dropout", 0)),
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets}


# ---- the peft model ----
def _first_block(model):
    """The first module of a block class (``_no_split_modules``) that holds Linear layers (the list
    may also name embeddings), None when there is none."""
    import torch

    block_classes = set(getattr(model, "_no_split_modules", None) or [])
    return next((module for module in model.modules() if type(module).__name__ in block_classes
                 and any(isinstance(child, torch.nn.Linear) for child in module.modules())), None)


def default_targets(model) -> list[str]:
    """The names of the linear layers inside the model's decoder block (attention and MLP
    projections), e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""
    import torch

    block = _first_block(model)
    names: list[str] = []
    for name, child in block.named_modules() if block is not None else ():
        if isinstance(child, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in names:
            names.append(name.rsplit(".", 1)[-1])
    return names or ["all-linear"]


def frozen_outside_linear(model) -> list[str]:
    """The modules of the decoder block whose weights are not in Linear layers (norms aside), so
    that no target name adapts them, largest first, each with its share of the block's weights: a
    mixture of experts' fused expert tensors and its router, e.g. ``mlp.experts (MixtralExperts:
    89% of the block's weights)``."""
    import torch

    block = _first_block(model)
    if block is None:
        return []
    total = sum(param.numel() for param in block.parameters())
    found = []
    for name, module in block.named_modules():
        own = sum(param.numel() for param in module.parameters(recurse=False))
        if own and not isinstance(module, torch.nn.Linear) and "norm" not in type(module).__name__.lower():
            found.append((own / total, name, type(module).__name__))
    return [f"{name} ({kind}: {share:.{0 if share >= 0.01 else 1}%} of the block's weights)"
            for share, name, kind in sorted(found, reverse=True)]


def unmatched_targets(model, targets: list[str]) -> list[str]:
    """The names of ``targets`` that no module name of ``model`` ends with (peft's rule: the name, or
    a dotted suffix of it); none for ``all-linear``."""
    if targets == ["all-linear"]:
        return []
    names = [name for name, _ in model.named_modules()]
    return [target for target in targets
            if not any(name == target or name.endswith(f".{target}") for name in names)]


def wrap(model, lora: dict[str, Any], *, task_type: str):
    """``model`` wrapped by peft with the adapter ``lora`` describes (its target modules, when not
    given, the linear layers of the decoder block: recorded in ``lora``), adapters in fp32."""
    import torch

    from peft import LoraConfig, get_peft_model

    if not lora["target_modules"]:
        frozen = frozen_outside_linear(model)
        if frozen:  # a mixture of experts: the experts are not Linear layers, and peft adapts only those
            note(f"LoRA adapts the block's Linear layers ({', '.join(default_targets(model))}); {' and '.join(frozen)} "
                 "hold no Linear layer and stay frozen (peft adapts Linear layers by name)")
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



# ---- bytes per rank ----
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
