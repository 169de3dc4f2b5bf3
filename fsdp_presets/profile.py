"""What a Hugging Face model is made of, as FSDP sees it (a ``ModelProfile``).

The model is built on the meta device from its config: no weights, no RAM.
The types below are the contract the planner, preset generator and checker read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    """Rows of the input embedding / columns of the output head."""
    max_position_embeddings: int | None = None
    """Longest sequence the model's positions allow, when the config says."""
    num_experts: int = 0
    """Experts per MoE layer (0 for dense models)."""
    num_experts_per_token: int = 0
    """Experts each token is routed to (0 for dense models)."""


@dataclass(frozen=True, kw_only=True)
class Unit:
    """A group of identical repeated blocks: one FSDP unit each."""

    cls: str
    """Class name of the block, e.g. ``LlamaDecoderLayer`` (``"class"`` in JSON)."""
    count: int
    """How many of these blocks the model holds."""
    params_each: int
    """Parameters in one block."""

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
    """Repeated blocks, each an FSDP unit; the rest of the parameters live in the root unit."""
    wrap_classes: list[str]
    """Class names to give ``fsdp_transformer_layer_cls_to_wrap``."""
    embeddings: list[dict]
    """Input/position embeddings: ``{"name", "class", "params"}`` each."""
    norm_classes: list[str]
    """Class names of normalisation layers found in the model."""
    output_head: str | None
    """Module path of the output head (``lm_head``), None when the model has none."""
    tied_embeddings: bool
    """Whether the input embedding and the output head share storage."""
    dims: ModelDims
    """Shape numbers for the planner."""
    structure: dict = field(default_factory=dict)
    """Extra facts: ``is_encoder_decoder``, ``moe``, ``no_split_modules``, ``missing_no_split``."""

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
