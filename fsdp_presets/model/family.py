"""One entry of the model-family registry (:class:`Family`) and the tiny shapes entries share.
The registry itself: :mod:`fsdp_presets.model.families`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Mapping

Kind = Literal["decoder", "moe-decoder", "encoder", "encoder-decoder", "vision", "multimodal"]
KINDS: tuple[str, ...] = ("decoder", "moe-decoder", "encoder", "encoder-decoder", "vision", "multimodal")


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: the Hugging Face ``model_type`` it covers and a tiny debug config."""

    name: str
    """Registry name, what users type (``fsdp-presets inspect llama``)."""
    model_type: str
    """The Hugging Face ``model_type`` in ``config.json`` that this family covers."""
    kind: Kind
    """Broad shape of the model, for humans and for grouping in tests and docs."""
    tiny: Mapping[str, Any]
    """Keyword arguments of the tiny debug config (``model_type`` excluded). They name the model
    class in ``architectures``, as a real ``config.json`` does."""
    note: str
    """What the family covers (example checkpoints on the Hugging Face Hub) and anything odd."""

    def __post_init__(self) -> None:
        problems = []
        if not self.name or self.name != self.name.strip().lower():
            problems.append(f"name {self.name!r} must be non-empty, lower case, no spaces")
        if self.kind not in KINDS:
            problems.append(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if "model_type" in self.tiny:
            problems.append("tiny must not repeat model_type (it is the entry's own field)")
        if not self.tiny.get("architectures"):
            problems.append("tiny must name the model class in 'architectures'")
        if problems:
            raise ValueError(f"family {self.name!r}: " + "; ".join(problems))
        # Freeze the dict so an entry cannot be edited through a caller's reference.
        object.__setattr__(self, "tiny", MappingProxyType(dict(self.tiny)))


# Shared tiny shapes. Token ids are set inside the 128-token vocabulary so that transformers does
# not warn about them; 4 heads of width 8 keep every attention variant (GQA, MQA, MLA) valid.
DECODER_TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
MOE_TINY = {"num_experts_per_tok": 2}
ENCODER_TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
SEQ2SEQ_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}
TINY_IDS = {"vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2}
"""The vocabulary and token ids of tiny configs that name their sizes their own way (GPT-2's ``n_embd``)."""


def _entry_of_kind(kind: Kind):
    def entry(name: str, architecture: str, /, *, note: str, base: Mapping[str, Any], model_type: str | None = None,
              **tiny: Any) -> Family:
        return Family(name=name, model_type=model_type or name, kind=kind,
                      tiny={**base, **tiny, "architectures": [architecture]}, note=note)

    entry.__name__ = kind.replace("-", "_")
    entry.__doc__ = (f"A {kind} entry: ``model_type`` is ``name`` unless given, the tiny config is ``base`` "
                     "with the keywords over it, ``architecture`` the model class it names.")
    return entry


decoder = _entry_of_kind("decoder")
moe_decoder = _entry_of_kind("moe-decoder")
encoder = _entry_of_kind("encoder")
seq2seq = _entry_of_kind("encoder-decoder")
vision = _entry_of_kind("vision")
multimodal = _entry_of_kind("multimodal")
