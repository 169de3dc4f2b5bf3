"""What a Hugging Face model is made of, as FSDP sees it (a ``ModelProfile``).

The model is built on the meta device from its config: no weights, no RAM, so a 70B config
profiles in about a second. Everything is read off the built model, not typed in by hand:

* blocks (FSDP units) are the model-defined modules held in ``nn.ModuleList``/``nn.Sequential``
  containers that no other block contains, cross-checked against ``_no_split_modules``;
* parameters are counted over ``model.parameters()``, which yields a shared (tied) parameter once;
* tied embeddings mean the input embedding and the output head hold the same parameter.

The types are the contract the planner, preset generator and checker read
(:mod:`fsdp_presets.model.model_profile`); loading a config and building it on the meta device:
:mod:`fsdp_presets.model.model_loading`::

    profile = profile_model("llama")                    # a registry family (tiny debug config)
    profile = profile_model("path/to/model_folder")     # or a folder with config.json
    profile = profile_model("path/to/config.json")      # or the config file itself
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from fsdp_presets.errors import UsageError
from fsdp_presets.model.model_loading import build_meta_model, load_config
from fsdp_presets.model.model_profile import ModelDims, ModelProfile, Unit
from fsdp_presets.schema import K

if TYPE_CHECKING:  # heavy imports stay out of module import time (the CLI imports us lazily)
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["profile_model", "profile_module"]


# --------------------------------------------------------------------------- reading the model

# Normalisation layers torch ships; model-defined ones (LlamaRMSNorm, T5LayerNorm) are found by
# name because they subclass nn.Module directly.
def _is_norm(module: "nn.Module") -> bool:
    from torch import nn

    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._BatchNorm)):
        return True
    name = type(module).__name__
    return "Norm" in name and "Normaliz" not in name


def _is_model_defined(module: "nn.Module") -> bool:
    """A block is a class the model defines, not a torch building block such as ``nn.Linear``."""
    return not type(module).__module__.startswith("torch.")


def _inside(path: str, roots: set[str]) -> bool:
    """Whether module ``path`` is one of ``roots`` or lies below one (a walk up its prefixes)."""
    while path:
        if path in roots:
            return True
        path = path.rpartition(".")[0]
    return False


def _has_params(module: "nn.Module") -> bool:
    return any(True for _ in module.parameters())


@dataclass(kw_only=True)
class _Blocks:
    """The model's blocks: where they live and how they group into units."""

    units: list[Unit]
    paths: set[str]
    stacks: list[dict]


def _group_units(blocks: list[tuple[str, "nn.Module"]]) -> list[Unit]:
    """Blocks grouped by (class, size) in the order met. A parameter shared between blocks is
    counted in the first block that holds it, so the units never count it twice."""
    seen: set[int] = set()
    counts: dict[tuple[str, int], int] = {}
    for _, block in blocks:
        size = 0
        for param in block.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                size += param.numel()
        key = (type(block).__name__, size)
        counts[key] = counts.get(key, 0) + 1
    return [Unit(cls=cls, count=count, params_each=size) for (cls, size), count in counts.items()]


def _find_blocks(model: "nn.Module", declared: list[str]) -> _Blocks:
    """The FSDP units of ``model``.

    A block is a child of an ``nn.ModuleList`` (or of an ``nn.Sequential`` holding two or more)
    whose class the model defines and which holds parameters; containers inside a block already
    found (T5Block.layer, MoE expert lists) belong to that block. A model that keeps its blocks in
    no container falls back to the outermost instances of its ``_no_split_modules`` classes.
    """
    from torch import nn

    blocks: list[tuple[str, nn.Module]] = []
    stacks: list[dict] = []
    paths: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or _inside(path, paths):
            continue
        children = [
            (f"{path}.{name}" if path else name, child)
            for name, child in module.named_children()
            if _is_model_defined(child) and _has_params(child)
        ]
        if not children or (isinstance(module, nn.Sequential) and len(children) < 2):
            continue
        classes = list(dict.fromkeys(type(child).__name__ for _, child in children))
        stacks.append({"path": path, "class": ", ".join(classes), "count": len(children)})
        blocks += children
        paths.update(child_path for child_path, _ in children)
    if not blocks and declared:
        for path, module in model.named_modules():
            if type(module).__name__ in declared and _has_params(module) and not _inside(path, paths):
                blocks.append((path, module))
                paths.add(path)
                stacks.append({"path": path, "class": type(module).__name__, "count": 1})
    return _Blocks(units=_group_units(blocks), paths=paths, stacks=stacks)


def _module_paths(model: "nn.Module") -> dict[int, str]:
    return {id(module): path for path, module in model.named_modules()}


def _config_int(config: Any, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``config`` sets, as an int.

    Per-stage values (Swin's ``num_heads = [3, 6, 12, 24]``) give their largest entry; a config
    that refuses a global value (per-layer attributes raise on access) counts as unset.
    """
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError
            continue
        if isinstance(value, (list, tuple)):
            numbers = [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
            value = max(numbers) if numbers else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        return int(value)
    return None


def _dims(config: "PretrainedConfig", num_layers: int) -> ModelDims:
    """Shape numbers, from the text config of a multimodal model."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hidden = _config_int(text, ("hidden_size", "d_model", "n_embd", "dim", "embed_dim")) or 0
    heads = _config_int(text, ("num_attention_heads", "n_head", "num_heads",
                               "encoder_attention_heads", "decoder_attention_heads")) or 0
    kv_heads = _config_int(text, ("num_key_value_heads", "num_kv_heads", "n_head_kv")) or heads
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1  # multi-query attention (Falcon-7B, StarCoder 1): one shared K/V head
    num_experts = _config_int(text, ("num_local_experts", "num_experts", "n_routed_experts",
                                     "moe_num_experts")) or 0
    per_token = _config_int(text, ("num_experts_per_tok", "num_experts_per_token", "moe_topk",
                                   "top_k")) or 0
    intermediate = None
    if num_experts:
        intermediate = _config_int(text, ("moe_intermediate_size", "expert_intermediate_size"))
    if intermediate is None:
        intermediate = _config_int(text, ("intermediate_size", "ffn_dim", "n_inner", "d_ff",
                                          "encoder_ffn_dim", "ffn_hidden_size"))
    if intermediate is None:
        intermediate = 4 * hidden  # GPT-2, BLOOM, GPT-J: the MLP is 4x wide when unset
    positions = _config_int(text, ("max_position_embeddings", "n_positions", "n_ctx",
                                   "max_target_positions", "max_sequence_length"))
    image, patch = getattr(text, "image_size", None), getattr(text, "patch_size", None)
    if positions is None and image and patch:
        height, width = (image, image) if isinstance(image, int) else tuple(image)[:2]
        patch_h, patch_w = (patch, patch) if isinstance(patch, int) else tuple(patch)[:2]
        positions = (height // patch_h) * (width // patch_w) + 1  # patches + class token (ViT)
    return ModelDims(
        hidden_size=max(hidden, 0),
        num_layers=num_layers,
        num_attention_heads=max(heads, 0),
        num_key_value_heads=max(min(kv_heads, heads) if heads else kv_heads, 0),
        intermediate_size=max(intermediate, 0),
        vocab_size=max(_config_int(text, ("vocab_size",)) or 0, 0),
        max_position_embeddings=positions if positions and positions > 0 else None,
        num_experts=max(num_experts, 0),
        num_experts_per_token=min(max(per_token, 0), num_experts) if num_experts else 0,
    )


def _embedding_role(name: str, module: Any, input_module: Any) -> str:
    if module is input_module:
        return "input"
    lowered = name.lower()
    if "token_type" in lowered:
        return "token_type"
    if any(key in lowered for key in ("position", "pos_emb", "wpe", "rel_embeddings", "relative")):
        return "position"
    return "other"


def _call(model: "nn.Module", method_name: str):
    """``model.get_input_embeddings()`` and friends, None where the model has no such thing."""
    method = getattr(model, method_name, None)
    try:
        return method() if method is not None else None
    except (NotImplementedError, AttributeError, TypeError):
        return None


def _embedding_entries(model: "nn.Module", input_module: Any, block_paths: set[str]) -> list[dict]:
    """Embeddings outside the blocks, each weight listed once (T5's ``shared``,
    ``encoder.embed_tokens`` and ``decoder.embed_tokens`` are one table)."""
    from torch import nn

    paths = _module_paths(model)
    candidates = [(paths[id(input_module)], input_module)] if id(input_module) in paths else []
    candidates += [(path, module) for path, module in model.named_modules() if isinstance(module, nn.Embedding)]
    entries: list[dict] = []
    listed: set[int] = set()
    for path, module in candidates:
        weight = getattr(module, "weight", None)
        key = id(weight) if weight is not None else id(module)
        if key in listed or _inside(path, block_paths):
            continue
        listed.add(key)
        entries.append({
            "name": path,
            "class": type(module).__name__,
            "params": sum(param.numel() for param in module.parameters()),
            "role": _embedding_role(path, module, input_module),
        })
    # Learned positions kept as a bare parameter (ViT's position_embeddings).
    for path, module in model.named_modules():
        if _inside(path, block_paths):
            continue
        for name, param in module.named_parameters(recurse=False):
            if "position" in name and id(param) not in listed:
                listed.add(id(param))
                entries.append({"name": f"{path}.{name}" if path else name, "class": "Parameter",
                                "params": param.numel(), "role": "position"})
    return entries


def profile_module(model: "PreTrainedModel", *, model_type: str | None = None) -> ModelProfile:
    """The profile of an already built model, on the meta device or with real weights."""
    from torch import nn

    config = getattr(model, "config", None)
    model_type = model_type or getattr(config, "model_type", None) or type(model).__name__

    # Blocks, cross-checked with _no_split_modules (a set on transformers 5, a list before).
    present = {type(module).__name__ for module in model.modules()}
    no_split = sorted(getattr(model, "_no_split_modules", None) or [])
    blocks = _find_blocks(model, [name for name in no_split if name in present])
    units = blocks.units
    wrap_classes = list(dict.fromkeys(unit.cls for unit in units))
    missing_no_split = [name for name in no_split if name not in present]
    warnings: list[str] = []
    if missing_no_split:
        warnings.append(
            f"_no_split_modules names {', '.join(missing_no_split)}, which this model does not "
            f"contain: never copy those names into {K.transformer_layer_cls_to_wrap} (accelerate "
            "raises 'Could not find the transformer layer class')"
        )
    undeclared = [name for name in wrap_classes if no_split and name not in no_split]
    if undeclared:
        warnings.append(f"blocks {', '.join(undeclared)} are not in _no_split_modules")
    if not units:
        warnings.append("no repeated blocks found: FSDP would shard the whole model as one unit")

    total_params = sum(param.numel() for param in model.parameters())  # a shared param once

    # Tied embeddings: the head holds the input embedding's own parameter (on meta tensors there
    # is no storage to compare, so identity is the test; real tensors may also share storage).
    input_module = _call(model, "get_input_embeddings")
    output_module = _call(model, "get_output_embeddings")
    input_weight = getattr(input_module, "weight", None)
    output_weight = getattr(output_module, "weight", None)
    tied = input_weight is not None and output_weight is not None and (
        input_weight is output_weight or _same_storage(input_weight, output_weight)
    )
    output_head = _module_paths(model).get(id(output_module)) if output_module is not None else None

    dims = _dims(config, num_layers=sum(unit.count for unit in units)) if config is not None else \
        ModelDims(hidden_size=0, num_layers=sum(unit.count for unit in units), num_attention_heads=0,
                  num_key_value_heads=0, intermediate_size=0, vocab_size=0)
    if not units and config is not None:
        layers = _config_int(config, ("num_hidden_layers", "num_layers", "n_layer")) or 0
        dims = ModelDims(**{**asdict(dims), "num_layers": layers})
    if isinstance(input_module, nn.Embedding) and not (dims.hidden_size and dims.vocab_size):
        # A config with its own key names (remote code): the token embedding's shape tells.
        dims = ModelDims(**{
            **asdict(dims),
            "hidden_size": dims.hidden_size or input_module.embedding_dim,
            "vocab_size": dims.vocab_size or input_module.num_embeddings,
        })

    is_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    structure: dict[str, Any] = {
        "is_encoder_decoder": is_encoder_decoder,
        "stacks": blocks.stacks,
        "no_split_modules": no_split,
        "missing_no_split": missing_no_split,
        "no_split_not_blocks": [name for name in no_split if name in present and name not in wrap_classes],
        "moe": _moe(model, dims, total_params, num_blocks=sum(unit.count for unit in units)),
        "config_dtype": _config_dtype(config),
        "block_linears": _block_linears(model, wrap_classes),
        "parallel": _parallel_plans(model, config, dims),
        "warnings": warnings,
    }
    if is_encoder_decoder:
        for side in ("encoder", "decoder"):
            structure[f"{side}_layers"] = sum(
                stack["count"] for stack in blocks.stacks if side in stack["path"].split(".")
            )
    return ModelProfile(
        model_type=model_type,
        architecture=type(model).__name__,
        total_params=total_params,
        units=units,
        wrap_classes=wrap_classes,
        embeddings=_embedding_entries(model, input_module, blocks.paths),
        norm_classes=list(dict.fromkeys(type(m).__name__ for m in model.modules() if _is_norm(m))),
        output_head=output_head or _classifier_head(model),
        tied_embeddings=bool(tied),
        dims=dims,
        structure=structure,
    )


def _block_linears(model: "nn.Module", wrap_classes: list[str]) -> dict[str, list[list]]:
    """Per block class, the ``nn.Linear`` layers of its first block: ``[name, in_features,
    out_features, has_bias]`` each, ``name`` the module's last path component (``q_proj``), as
    LoRA target names and the 4-bit quantization of QLoRA see them (the planner's LoRA terms)."""
    from torch import nn

    found: dict[str, list[list]] = {}
    for module in model.modules():
        name = type(module).__name__
        if name not in wrap_classes or name in found:
            continue
        found[name] = [[path.rsplit(".", 1)[-1], child.in_features, child.out_features, child.bias is not None]
                       for path, child in module.named_modules() if isinstance(child, nn.Linear)]
    return found


def _same_storage(a, b) -> bool:
    """Real tensors sharing memory (meta tensors have no storage to compare)."""
    if a.is_meta or b.is_meta:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.shape == b.shape


def _classifier_head(model: "nn.Module") -> str | None:
    """The head of a model with no output embedding: its last parameterised top-level child
    other than the base model (``classifier`` of ViTForImageClassification)."""
    base = getattr(model, "base_model", model)
    if base is model:
        return None
    head = None
    for name, child in model.named_children():
        if child is not base and any(True for _ in child.parameters()):
            head = name
    return head


def _moe(model: "nn.Module", dims: ModelDims, total_params: int, *, num_blocks: int) -> dict | None:
    """Mixture-of-experts structure: routed expert modules found inside blocks."""
    if not dims.num_experts:
        return None
    expert_modules = [
        (path, module) for path, module in model.named_modules()
        if path.rsplit(".", 1)[-1] == "experts" or type(module).__name__.endswith("Experts")
    ]
    # Keep the outermost expert container of each block (an Experts class inside "experts").
    outer = [
        (path, module) for path, module in expert_modules
        if not any(path.startswith(other + ".") for other, _ in expert_modules)
    ]
    expert_params = sum(sum(p.numel() for p in module.parameters()) for _, module in outer)
    # Each token runs k of E routed experts: the rest of the expert weights sit idle for it.
    active = total_params - expert_params + expert_params * dims.num_experts_per_token // dims.num_experts
    shared = [path for path, _ in model.named_modules() if path.rsplit(".", 1)[-1] in
              ("shared_expert", "shared_experts", "shared_mlp")]
    return {
        "num_experts": dims.num_experts,
        "experts_per_token": dims.num_experts_per_token,
        "moe_layers": len(outer),
        "dense_layers": max(num_blocks - len(outer), 0),
        "shared_experts": bool(shared),
        "routed_expert_params": expert_params,
        "active_params": active,
    }


MAX_LISTED_SIZE = 128
"""Parallel sizes listed up to this (larger ones are not run: a TP group lives inside a node)."""


def _plan(value) -> dict[str, str] | None:
    return {str(key): str(style) for key, style in value.items()} if isinstance(value, dict) and value else None


def _divisors_of_all(numbers: list[int]) -> list[int]:
    numbers = [number for number in numbers if number > 0]
    if not numbers:
        return []
    return [size for size in range(1, MAX_LISTED_SIZE + 1) if all(number % size == 0 for number in numbers)]


def _parallel_plans(model: "nn.Module", config: Any, dims: ModelDims) -> dict[str, Any]:
    """The tensor-, expert- and FSDP plans the model ships (transformers' ``base_model_tp_plan`` and
    ``base_model_ep_plan`` on its config, ``_tp_plan`` and ``_fsdp_plan`` on its class), and the sizes
    each allows: a TP size must divide the attention heads and the key/value heads (transformers issue
    48307: more TP ranks than key/value heads loads, then fails mid-forward), the MLP width, and the
    vocabulary when the head is split by columns; an EP size must divide the experts. Sizes up to
    :data:`MAX_LISTED_SIZE`; no plan, no sizes."""
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    base_tp = _plan(getattr(text, "base_model_tp_plan", None))
    head_tp = _plan(getattr(type(model), "_tp_plan", None))
    ep = _plan(getattr(text, "base_model_ep_plan", None))
    fsdp = _plan(getattr(type(model), "_fsdp_plan", None))
    tp_plan = {**(base_tp or {}), **(head_tp or {})} or None
    split_head = any(style.startswith("colwise") for key, style in (head_tp or {}).items())
    split = " ".join((base_tp or {}).keys())
    tp_limits = {"attention heads": dims.num_attention_heads, "key/value heads": dims.num_key_value_heads}
    if any(name in split for name in ("mlp", "gate_proj", "up_proj", "down_proj", "fc1", "dense_h_to_4h")):
        tp_limits["MLP width"] = dims.intermediate_size  # only where the plan splits the MLP
    if split_head:
        tp_limits["vocabulary"] = dims.vocab_size
    ep_limits = {"experts": dims.num_experts} if ep and dims.num_experts else {}
    in_blocks, outside = _tp_sharded_params(model, tp_plan) if tp_plan else (0, 0)
    return {
        "tp_plan": tp_plan,
        "ep_plan": ep,
        "fsdp_plan": fsdp,
        "tp_sizes": _divisors_of_all(list(tp_limits.values())) if tp_plan else [],
        "tp_limits": {name: value for name, value in tp_limits.items() if value} if tp_plan else {},
        "ep_sizes": _divisors_of_all(list(ep_limits.values())) if ep_limits else [],
        "ep_limits": ep_limits,
        "tp_block_params": in_blocks,
        "tp_root_params": outside,
    }


def _tp_sharded_params(model: "nn.Module", tp_plan: dict[str, str]) -> tuple[int, int]:
    """``(in blocks, outside them)``: the parameters of the modules ``tp_plan`` names (a key such as
    ``layers.*.self_attn.q_proj`` matches ``model.layers.3.self_attn.q_proj``), which tensor
    parallelism divides; the rest (norms, routers, experts a plan leaves out: Mixtral's) stays whole
    on every TP rank. A model with a plan also splits its token embedding on the vocabulary
    (transformers adds ``embedding_rowwise``)."""
    import re

    from torch import nn

    patterns = [re.compile(r"(?:.*\.)?" + re.escape(key).replace(r"\*", r"\d+")) for key in tp_plan]
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    seen: set[int] = set()
    in_blocks = outside = 0
    for path, module in model.named_modules():
        if not path or not (any(pattern.fullmatch(path) for pattern in patterns) or
                            (module is embedding and isinstance(module, nn.Embedding))):
            continue
        for param in module.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            if any(part.isdigit() for part in path.split(".")):
                in_blocks += param.numel()
            else:
                outside += param.numel()
    return in_blocks, outside


def _config_dtype(config: Any) -> str | None:
    # ``dtype`` (``torch_dtype`` before transformers 4.56, which still maps it to ``dtype``).
    dtype = getattr(config, "dtype", None)
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def profile_model(source: str, *, trust_remote_code: bool = False, config: Any = None) -> ModelProfile:
    """The profile of ``source`` (family name, model folder or config.json; or its ``config``,
    already loaded), built on meta."""
    if config is None:
        config = load_config(source, trust_remote_code=trust_remote_code)
    model = build_meta_model(config, trust_remote_code=trust_remote_code)
    try:
        return profile_module(model)
    except ValueError as error:  # ModelDims, Unit, ModelProfile checks: numbers the config gave
        raise UsageError(f"{source}: the model built from this config has impossible numbers ({error}); "
                         "check its sizes and layer counts against the model's published config.json") from None
