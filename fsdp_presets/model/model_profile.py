"""The contract the planner, the preset generator and the checker read: a :class:`ModelProfile`
(with its :class:`ModelDims` and FSDP :class:`Unit` s), made by
:func:`fsdp_presets.model.profile.profile_model`. Standard library only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fsdp_presets.fileio import format_count, text_table


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The shape numbers the planner's activation and communication formulas need."""

    hidden_size: int
    """Width of the residual stream (d_model)."""
    num_layers: int
    """Number of repeated transformer blocks (encoder + decoder for encoder-decoders)."""
    num_attention_heads: int
    """Query heads per attention layer."""
    num_key_value_heads: int
    """Key/value heads (== num_attention_heads without grouped-query attention)."""
    intermediate_size: int
    """Width of the MLP hidden layer (per expert for mixture-of-experts)."""
    vocab_size: int
    """Rows of the input embedding / columns of the output head (0 for a vision model)."""
    max_position_embeddings: int | None = None
    """Longest sequence the model's positions allow, when the config says (for a vision
    transformer: patches per image plus the class token)."""
    num_experts: int = 0
    """Experts per MoE layer (0 for dense models)."""
    num_experts_per_token: int = 0
    """Experts each token is routed to (0 for dense models)."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "num_experts", "num_experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.append(f"{name} must be a non-negative int, got {value!r}")
        if not problems:
            if self.num_key_value_heads > self.num_attention_heads:
                problems.append(
                    f"num_key_value_heads {self.num_key_value_heads} > num_attention_heads "
                    f"{self.num_attention_heads}"
                )
            if self.num_experts_per_token > self.num_experts:
                problems.append(
                    f"num_experts_per_token {self.num_experts_per_token} > num_experts {self.num_experts}"
                )
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            problems.append(f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        if problems:
            raise ValueError("invalid ModelDims: " + "; ".join(problems))


@dataclass(frozen=True, kw_only=True)
class Unit:
    """A group of identical repeated blocks: one FSDP unit each."""

    cls: str
    """Class name of the block, e.g. ``LlamaDecoderLayer`` (``"class"`` in JSON)."""
    count: int
    """How many of these blocks the model holds."""
    params_each: int
    """Parameters in one block."""

    def __post_init__(self) -> None:
        if self.count < 1 or self.params_each < 0:
            raise ValueError(f"invalid Unit {self.cls}: count {self.count} must be >= 1 and "
                             f"params_each {self.params_each} >= 0")

    def to_json(self) -> dict:
        return {"class": self.cls, "count": self.count, "params_each": self.params_each}


@dataclass(kw_only=True)
class ModelProfile:
    """The FSDP anatomy of one model."""

    model_type: str
    """The Hugging Face ``model_type`` (``llama``, ``t5``, ...)."""
    architecture: str
    """The model class that was built (``LlamaForCausalLM``)."""
    total_params: int
    """Exact parameter count, tied weights counted once."""
    units: list[Unit]
    """Repeated blocks, each an FSDP unit; the rest of the parameters live in the root unit.
    Blocks of one class but different sizes (T5's first block holds the relative position bias,
    DeepSeek-V3 keeps its first layers dense) are separate entries of the same class."""
    wrap_classes: list[str]
    """Class names to give ``fsdp_transformer_layer_cls_to_wrap``."""
    embeddings: list[dict]
    """Input/position embeddings: ``{"name", "class", "params", "role"}`` each, ``role`` one of
    ``input``, ``position``, ``token_type``, ``other``."""
    norm_classes: list[str]
    """Class names of normalisation layers found in the model."""
    output_head: str | None
    """Module path of the output head (``lm_head``), None when the model has none."""
    tied_embeddings: bool
    """Whether the input embedding and the output head share storage."""
    dims: ModelDims
    """Shape numbers for the planner."""
    structure: dict = field(default_factory=dict)
    """Extra facts: ``is_encoder_decoder``, ``moe``, ``no_split_modules``, ``missing_no_split``,
    ``stacks`` (where the blocks live), ``warnings`` (see :func:`profile_module`)."""

    def __post_init__(self) -> None:
        problems = []
        if self.total_params < 0:
            problems.append(f"total_params {self.total_params} < 0")
        if self.unit_params > self.total_params:
            problems.append(f"blocks hold {self.unit_params} parameters, more than the total "
                            f"{self.total_params}")
        if problems:
            raise ValueError(f"invalid ModelProfile for {self.architecture}: " + "; ".join(problems))

    @property
    def unit_params(self) -> int:
        """Parameters inside the repeated blocks."""
        return sum(unit.count * unit.params_each for unit in self.units)

    @property
    def root_params(self) -> int:
        """Parameters outside every block (embeddings, final norm, untied head): the root unit."""
        return self.total_params - self.unit_params

    @property
    def largest_unit_params(self) -> int:
        """The largest FSDP unit, the root unit included (it is all-gathered whole too)."""
        return max([unit.params_each for unit in self.units] + [self.root_params])

    @property
    def num_blocks(self) -> int:
        """How many blocks (FSDP units besides the root) the model holds."""
        return sum(unit.count for unit in self.units)

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(self.structure.get("is_encoder_decoder", False))

    @property
    def is_moe(self) -> bool:
        return self.dims.num_experts > 0

    @property
    def missing_no_split(self) -> list[str]:
        """Names in the model's ``_no_split_modules`` that it does not contain."""
        return list(self.structure.get("missing_no_split", []))

    def to_json(self) -> dict:
        """The ``inspect --json`` contract."""
        return {
            "model_type": self.model_type,
            "architecture": self.architecture,
            "total_params": self.total_params,
            "wrap_classes": list(self.wrap_classes),
            "units": [unit.to_json() for unit in self.units],
            "embeddings": list(self.embeddings),
            "norm_classes": list(self.norm_classes),
            "output_head": self.output_head,
            "tied_embeddings": self.tied_embeddings,
            "largest_unit_params": self.largest_unit_params,
            "root_params": self.root_params,
            "dims": asdict(self.dims),
            "structure": dict(self.structure),
        }


def profile_from_json(data: dict) -> ModelProfile:
    """The :class:`ModelProfile` that :meth:`ModelProfile.to_json` wrote (its derived fields ignored)."""
    return ModelProfile(
        model_type=data["model_type"], architecture=data["architecture"], total_params=int(data["total_params"]),
        units=[Unit(cls=unit["class"], count=int(unit["count"]), params_each=int(unit["params_each"]))
               for unit in data["units"]],
        wrap_classes=list(data["wrap_classes"]), embeddings=list(data["embeddings"]),
        norm_classes=list(data["norm_classes"]), output_head=data["output_head"],
        tied_embeddings=bool(data["tied_embeddings"]), dims=ModelDims(**data["dims"]),
        structure=dict(data["structure"]))


def _styles(plan: dict) -> str:
    """``q_proj, k_proj, v_proj colwise; o_proj rowwise``: a plan's module names grouped by style."""
    by_style: dict[str, list[str]] = {}
    for key, style in plan.items():
        by_style.setdefault(style, []).append(key.rsplit(".", 1)[-1] if "*" in key else key)
    return "; ".join(f"{', '.join(dict.fromkeys(names))} {style}" for style, names in by_style.items())


def _sizes(sizes: list[int], limits: dict) -> str:
    limit = ", ".join(f"{name} {value}" for name, value in limits.items())
    return f"sizes {', '.join(map(str, sizes)) or 'none but 1'} (dividing {limit})"


def _parallel_lines(parallel: dict) -> list[str]:
    """What ``inspect`` says of the tensor/expert/FSDP plans the model ships."""
    if not parallel:
        return []
    lines = []
    if parallel.get("tp_plan"):
        lines.append(f"tensor parallel   {_styles(parallel['tp_plan'])}; "
                     f"{_sizes(parallel['tp_sizes'], parallel['tp_limits'])}")
    else:
        lines.append("tensor parallel   no plan in transformers: FSDP/HSDP only")
    if parallel.get("ep_plan"):
        lines.append(f"expert parallel   {_styles(parallel['ep_plan'])}; "
                     f"{_sizes(parallel['ep_sizes'], parallel['ep_limits'])}")
    if parallel.get("fsdp_plan"):
        lines.append(f"FSDP plan         {_styles(parallel['fsdp_plan'])}")
    return lines


def format_profile(profile, *, source: str = "") -> str:
    """The readable form of a :class:`ModelProfile` (``fsdp-presets inspect``)."""
    dims = profile.dims
    structure = profile.structure
    total = profile.total_params or 1
    out = [
        f"model          {source}" if source else None,
        f"architecture   {profile.architecture} (model_type {profile.model_type})",
        f"parameters     {profile.total_params:,} ({format_count(profile.total_params)}), "
        f"tied embeddings: {'yes' if profile.tied_embeddings else 'no'}",
        "dims           " + " | ".join(
            part for part in (
                f"hidden {dims.hidden_size}",
                f"layers {dims.num_layers}",
                f"heads {dims.num_attention_heads} (kv {dims.num_key_value_heads})"
                if dims.num_attention_heads else None,
                f"mlp {dims.intermediate_size}" + (" per expert" if dims.num_experts else "")
                if dims.intermediate_size else None,
                f"vocab {dims.vocab_size}" if dims.vocab_size else None,
                f"positions {dims.max_position_embeddings}" if dims.max_position_embeddings else None,
            ) if part
        ),
    ]
    if structure.get("is_encoder_decoder"):
        out.append(f"encoder-decoder {structure.get('encoder_layers', '?')} encoder + "
                   f"{structure.get('decoder_layers', '?')} decoder blocks")
    moe = structure.get("moe")
    if moe:
        out.append(
            f"mixture of experts  {moe['num_experts']} experts, {moe['experts_per_token']} per token, "
            f"{moe['moe_layers']} MoE + {moe['dense_layers']} dense blocks"
            f"{', shared expert' if moe['shared_experts'] else ''}; "
            f"active per token {moe['active_params']:,} ({format_count(moe['active_params'])})"
        )
    out.append("")
    rows = [
        [unit.cls, str(unit.count), f"{unit.params_each:,}",
         format_count(unit.count * unit.params_each),
         f"{100 * unit.count * unit.params_each / total:.1f}%"]
        for unit in profile.units
    ]
    rows.append(["root (embeddings, norms, head)", "1", f"{profile.root_params:,}",
                 format_count(profile.root_params), f"{100 * profile.root_params / total:.1f}%"])
    out += text_table(["FSDP unit", "count", "params each", "total", "share"], rows, right={1, 2, 3, 4})
    largest = max(profile.units, key=lambda unit: unit.params_each, default=None)
    largest_name = (
        "root" if largest is None or profile.root_params >= largest.params_each else largest.cls
    )
    out.append(f"largest unit   {largest_name}, {profile.largest_unit_params:,} parameters "
               "(all-gathered whole in forward and backward)")
    out.append("")
    out.append(f"wrap classes   {', '.join(profile.wrap_classes) or '(none found)'}")
    stacks = structure.get("stacks") or []
    if stacks:
        out.append("blocks in      " + ", ".join(
            f"{stack['path'] or '(root)'} ({stack['count']})" for stack in stacks))
    for index, embedding in enumerate(profile.embeddings):
        label = "embeddings     " if index == 0 else "               "
        out.append(f"{label}{embedding['name']} ({embedding['class']}, "
                   f"{embedding['params']:,}, {embedding.get('role', '?')})")
    out.append(f"norm classes   {', '.join(profile.norm_classes) or '(none)'}")
    head = profile.output_head or "(none)"
    if profile.output_head:
        head += " (tied to the input embedding)" if profile.tied_embeddings else " (untied)"
    out.append(f"output head    {head}")
    out += _parallel_lines(structure.get("parallel") or {})
    no_split = structure.get("no_split_modules") or []
    out.append(f"_no_split_modules  {', '.join(no_split) or '(not declared)'}")
    for warning in structure.get("warnings", []):
        out.append(f"warning: {warning}")
    return "\n".join(line for line in out if line is not None)
