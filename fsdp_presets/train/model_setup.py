"""The model every run trains (full fine-tuning, LoRA or QLoRA), from the model folder to
``accelerator.prepare``.

- **Loading** (:func:`load_model`): no code from the model folder, no Hub kernels, trained weights
  in fp32; under LoRA with ``mixed_precision: bf16`` the frozen base in bf16; the peft adapter and
  the 4-bit base from :mod:`fsdp_presets.train.lora`.
- **Wrapping** (:func:`check_wrap_classes`): the block classes the accelerate config wraps must be
  in the model. FSDP2 keeps the config's ``TRANSFORMER_BASED_WRAP`` on the decoder layer
  (accelerate's FSDP2 path ignores peft's wrap policy); every unit then holds frozen and trainable
  weights, which FSDP2 allows. FSDP1 with LoRA gets peft's ``fsdp_auto_wrap_policy`` on the plugin
  before ``prepare`` (else every flat parameter gets a full-size gradient and all adapters land on
  one rank) and needs ``use_orig_params: true`` (else "Must flatten tensors with uniform
  requires_grad").
- **A mesh** (``--distributed-config``): transformers shards the model at load time
  (:mod:`fsdp_presets.train.model_mesh`); ``prepare`` registers it without wrapping it again.
- **Optimizer order** (:func:`prepare`). FSDP1 with LoRA: the model is prepared first and the
  optimizer is built over its wrapped parameters (built before, the LoRA weights silently never
  update). Otherwise model and optimizer are prepared together (accelerate swaps the optimizer's
  parameters for the shards).
"""

from __future__ import annotations

from typing import Any, Callable

from fsdp_presets.errors import UsageError
from fsdp_presets.schema import K
from fsdp_presets.train import lora as peft_lora
from fsdp_presets.train.model_mesh import (initialize_new_weights_as_unsharded, is_sharded_by_transformers,
                                           prepare_sharded)


def load_model(model_class, path: str, lora: dict[str, Any] | None, *, task_type: str, mixed_precision: str = "no",
               mesh=None, **kwargs):
    """The model to train: ``model_class.from_pretrained(path)`` wrapped by peft when ``lora`` (its
    4-bit base for QLoRA), sharded over ``mesh`` (a :class:`fsdp_presets.train.model_mesh.ModelMesh`)
    when given. Records the chosen target modules in ``lora``.

    Trained weights are fp32. Under LoRA with ``mixed_precision: bf16`` the frozen base is loaded
    in bf16: it is only ever computed with in bf16, accelerate's FSDP2 preparation upcasts only
    weights that train, and the planner counts a frozen base at 2 bytes per parameter (in fp32 an
    8B base alone would take 32 GB of a 24 GB GPU). Without mixed precision everything is fp32."""
    import torch

    quantized = lora is not None and lora["method"] == "qlora"
    if mesh is not None:  # full fine-tuning only (load_model_mesh refuses LoRA/QLoRA)
        kwargs["distributed_config"] = mesh.config
    if quantized:
        kwargs["quantization_config"] = peft_lora.quantization_config()
    base_dtype = torch.bfloat16 if lora is not None and mixed_precision == "bf16" else torch.float32
    # use_kernels=False: transformers (5.x, with the `kernels` package it requires) otherwise swaps
    # layers for kernels downloaded from the Hub on a GPU at the first train()/eval(): code from the
    # network, like trust_remote_code, and on an offline host a crash (nothing is cached to load).
    if mesh is not None:
        rng = torch.get_rng_state()  # where a load without the mesh initialises the weights the folder lacks
        model, loading = model_class.from_pretrained(path, dtype=base_dtype, trust_remote_code=False, use_kernels=False,
                                                     output_loading_info=True, **kwargs)
        initialize_new_weights_as_unsharded(model, loading, rng)
        return model
    model = model_class.from_pretrained(path, dtype=base_dtype, trust_remote_code=False, use_kernels=False,
                                        **kwargs)
    if quantized:
        peft_lora.keep_4bit_layout(model)
    return model if lora is None else peft_lora.wrap(model, lora, task_type=task_type)


def router_balance_weight(model) -> float | None:
    """The weight of a mixture of experts' router load-balancing loss in the training objective:
    its config's ``router_aux_loss_coef`` when the config asks the model for the loss
    (``output_router_logits: true``; transformers adds it so when it computes the loss itself), None
    otherwise. A recipe computes its own token loss, so without this the loss would be dropped."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None
    weight = getattr(config, "router_aux_loss_coef", None)
    if weight is None:
        raise UsageError(f"{type(model).__name__}'s config sets output_router_logits: true but has no "
                         "router_aux_loss_coef, the weight the recipes give its load-balancing loss: set "
                         "router_aux_loss_coef in its config.json, or output_router_logits: false to train "
                         "without that loss")
    return float(weight)


def check_wrap_classes(plugin, model) -> None:
    """The block classes the accelerate config wraps must be in the model (accelerate raises
    "Could not find the transformer layer class" deep in ``prepare`` otherwise): refused on every
    rank naming both, before anything is wrapped."""
    if is_sharded_by_transformers(model):  # --distributed-config: FSDP2 applied already, by the model's own plan
        return
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
    if is_sharded_by_transformers(model):  # --distributed-config: sharded at load time, registered as it is
        prepare_sharded(accelerator, model)
        optimizer, scheduler = build_optimizer(model)
        return accelerator.prepare(model, optimizer, scheduler)
    check_wrap_classes(plugin, model)
    if lora is not None and lora["method"] == "qlora" and plugin is not None and plugin.fsdp_version == 1:
        raise UsageError(f"--method qlora needs FSDP2 ({K.version}: 2 in the accelerate config): FSDP1 flattens each "
                         "unit into one tensor of one dtype, and the 4-bit base (stored as bfloat16) shares its units "
                         "with fp32 norms and adapters (\"Must flatten tensors with uniform dtype\"); or train "
                         "--method lora under FSDP1")
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
