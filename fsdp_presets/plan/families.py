"""The model-family registry: one plain-data entry per family, each with a tiny debug config.

A family names the Hugging Face ``model_type`` it covers and a tiny config of that type
(hidden 32, 2 layers, vocabulary 128) that builds a real model in milliseconds, for tests and
for ``fsdp-presets inspect llama``. Nothing else is typed in by hand: block classes, tied
weights, norms and parameter counts are read off the model by :mod:`fsdp_presets.plan.profile`.
A ``model_type`` that is not listed here still profiles through that structural detection.

Adding a family is adding one ``Family(...)`` to ``FAMILIES``; ``tests/test_profile.py``
builds every entry for real.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Mapping

from fsdp_presets.errors import UsageError, unknown_name_message

if TYPE_CHECKING:  # transformers is imported only when a config is built
    from transformers import PretrainedConfig

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
_DECODER = {
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
_MOE = {"num_experts_per_tok": 2}
_ENCODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}
_SEQ2SEQ_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}


FAMILIES: tuple[Family, ...] = (
    # ---------------------------------------------------------------- dense decoders
    Family(
        name="llama",
        model_type="llama",
        kind="decoder",
        tiny={**_DECODER, "architectures": ["LlamaForCausalLM"]},
        note="Llama 2/3.x (meta-llama/Llama-3.1-8B); also SmolLM2, TinyLlama, Vicuna.",
    ),
    Family(
        name="mistral",
        model_type="mistral",
        kind="decoder",
        tiny={**_DECODER, "sliding_window": 32, "architectures": ["MistralForCausalLM"]},
        note="Mistral 7B and NeMo (mistralai/Mistral-7B-v0.3).",
    ),
    Family(
        name="qwen2",
        model_type="qwen2",
        kind="decoder",
        tiny={**_DECODER, "architectures": ["Qwen2ForCausalLM"]},
        note="Qwen2 and Qwen2.5 (Qwen/Qwen2.5-7B): Llama layout with q/k/v biases.",
    ),
    Family(
        name="qwen3",
        model_type="qwen3",
        kind="decoder",
        tiny={**_DECODER, "head_dim": 8, "architectures": ["Qwen3ForCausalLM"]},
        note="Qwen3 dense (Qwen/Qwen3-8B): q/k norms, explicit head_dim.",
    ),
    Family(
        name="gemma",
        model_type="gemma",
        kind="decoder",
        tiny={**_DECODER, "head_dim": 8, "architectures": ["GemmaForCausalLM"]},
        note="Gemma 1 (google/gemma-7b): tied embeddings, explicit head_dim.",
    ),
    Family(
        name="gemma2",
        model_type="gemma2",
        kind="decoder",
        tiny={
            **_DECODER,
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": 32,
            "architectures": ["Gemma2ForCausalLM"],
        },
        note="Gemma 2 (google/gemma-2-9b): four norms per layer, alternating sliding attention.",
    ),
    Family(
        name="gemma3",
        model_type="gemma3",
        kind="multimodal",
        tiny={
            "text_config": {
                **_DECODER,
                "head_dim": 8,
                "query_pre_attn_scalar": 8,
                "sliding_window": 32,
            },
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "image_size": 28,
                "patch_size": 14,
                "vision_use_head": False,  # as in the released Gemma 3 configs
            },
            # (28 / 14)^2 = 4 patches pooled to 4 image tokens; special ids inside the vocabulary.
            "mm_tokens_per_image": 4,
            "boi_token_index": 125,
            "eoi_token_index": 126,
            "image_token_index": 127,
            "architectures": ["Gemma3ForConditionalGeneration"],
        },
        note="Gemma 3 4B-27B (google/gemma-3-4b-it): SigLIP vision tower plus Gemma 3 text "
        "decoder, so two kinds of FSDP unit.",
    ),
    Family(
        name="gemma3_text",
        model_type="gemma3_text",
        kind="decoder",
        tiny={
            **_DECODER,
            "head_dim": 8,
            "query_pre_attn_scalar": 8,
            "sliding_window": 32,
            "architectures": ["Gemma3ForCausalLM"],
        },
        note="Gemma 3 text-only (google/gemma-3-1b-it).",
    ),
    Family(
        name="phi",
        model_type="phi",
        kind="decoder",
        tiny={**_DECODER, "partial_rotary_factor": 0.5, "architectures": ["PhiForCausalLM"]},
        note="Phi-1/1.5/2 (microsoft/phi-2): parallel attention and MLP, LayerNorm, biased head.",
    ),
    Family(
        name="phi3",
        model_type="phi3",
        kind="decoder",
        tiny={**_DECODER, "architectures": ["Phi3ForCausalLM"]},
        note="Phi-3 and Phi-4 (microsoft/phi-4): fused qkv and gate_up projections.",
    ),
    Family(
        name="gpt2",
        model_type="gpt2",
        kind="decoder",
        tiny={
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "vocab_size": 128,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "architectures": ["GPT2LMHeadModel"],
        },
        note="GPT-2 (openai-community/gpt2) and DistilGPT2: Conv1D layers, learned positions, "
        "tied head.",
    ),
    Family(
        name="gpt_neox",
        model_type="gpt_neox",
        kind="decoder",
        tiny={**_DECODER, "rotary_pct": 0.25, "architectures": ["GPTNeoXForCausalLM"]},
        note="GPT-NeoX and Pythia (EleutherAI/pythia-1b): untied 'embed_out' head.",
    ),
    Family(
        name="gptj",
        model_type="gptj",
        kind="decoder",
        tiny={
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "rotary_dim": 4,
            "vocab_size": 128,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "architectures": ["GPTJForCausalLM"],
        },
        note="GPT-J (EleutherAI/gpt-j-6b).",
    ),
    Family(
        name="falcon",
        model_type="falcon",
        kind="decoder",
        tiny={
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 128,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "architectures": ["FalconForCausalLM"],
        },
        note="Falcon 7B layout (tiiuae/falcon-7b): multi-query attention, parallel attention/MLP.",
    ),
    Family(
        name="opt",
        model_type="opt",
        kind="decoder",
        tiny={
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 32,
            "vocab_size": 128,
            "max_position_embeddings": 64,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "architectures": ["OPTForCausalLM"],
        },
        note="OPT (facebook/opt-1.3b): learned positions, tied head.",
    ),
    Family(
        name="bloom",
        model_type="bloom",
        kind="decoder",
        tiny={
            "hidden_size": 32,
            "n_layer": 2,
            "n_head": 4,
            "vocab_size": 128,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "architectures": ["BloomForCausalLM"],
        },
        note="BLOOM (bigscience/bloom-7b1): ALiBi, embedding LayerNorm, tied head.",
    ),
    Family(
        name="olmo2",
        model_type="olmo2",
        kind="decoder",
        tiny={**_DECODER, "architectures": ["Olmo2ForCausalLM"]},
        note="OLMo 2 (allenai/OLMo-2-1124-7B): post-norm layers, q/k norms.",
    ),
    Family(
        name="granite",
        model_type="granite",
        kind="decoder",
        tiny={**_DECODER, "architectures": ["GraniteForCausalLM"]},
        note="IBM Granite 3.x dense (ibm-granite/granite-3.3-8b-instruct).",
    ),
    Family(
        name="starcoder2",
        model_type="starcoder2",
        kind="decoder",
        tiny={**_DECODER, "sliding_window": 32, "architectures": ["Starcoder2ForCausalLM"]},
        note="StarCoder2 (bigcode/starcoder2-7b): LayerNorm, biased projections.",
    ),
    Family(
        name="gpt_bigcode",
        model_type="gpt_bigcode",
        kind="decoder",
        tiny={
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "vocab_size": 128,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "architectures": ["GPTBigCodeForCausalLM"],
        },
        note="StarCoder 1 and SantaCoder (bigcode/starcoderbase-1b): multi-query attention.",
    ),
    Family(
        name="cohere",
        model_type="cohere",
        kind="decoder",
        tiny={**_DECODER, "architectures": ["CohereForCausalLM"]},
        note="Command-R (CohereForAI/c4ai-command-r-v01): parallel blocks, tied head.",
    ),
    Family(
        name="stablelm",
        model_type="stablelm",
        kind="decoder",
        tiny={**_DECODER, "architectures": ["StableLmForCausalLM"]},
        note="StableLM 2 (stabilityai/stablelm-2-1_6b): partial rotary, LayerNorm.",
    ),
    # ---------------------------------------------------------------- mixture-of-experts decoders
    Family(
        name="mixtral",
        model_type="mixtral",
        kind="moe-decoder",
        tiny={**_DECODER, **_MOE, "num_local_experts": 4, "architectures": ["MixtralForCausalLM"]},
        note="Mixtral 8x7B/8x22B (mistralai/Mixtral-8x7B-v0.1): 8 experts, top-2.",
    ),
    Family(
        name="qwen2_moe",
        model_type="qwen2_moe",
        kind="moe-decoder",
        tiny={
            **_DECODER,
            **_MOE,
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "architectures": ["Qwen2MoeForCausalLM"],
        },
        note="Qwen1.5-MoE and Qwen2-MoE (Qwen/Qwen2-57B-A14B): routed plus gated shared expert.",
    ),
    Family(
        name="qwen3_moe",
        model_type="qwen3_moe",
        kind="moe-decoder",
        tiny={
            **_DECODER,
            **_MOE,
            "head_dim": 8,
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "architectures": ["Qwen3MoeForCausalLM"],
        },
        note="Qwen3 MoE (Qwen/Qwen3-30B-A3B): 128 experts, top-8.",
    ),
    Family(
        name="deepseek_v3",
        model_type="deepseek_v3",
        kind="moe-decoder",
        tiny={
            **_DECODER,
            **_MOE,
            "num_key_value_heads": 4,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            # The first layer stays dense as in the real model (which keeps 3 of 61 dense), so the
            # same layer class appears at two sizes.
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4,
            "v_head_dim": 8,
            "architectures": ["DeepseekV3ForCausalLM"],
        },
        note="DeepSeek-V3/R1 (deepseek-ai/DeepSeek-V3): multi-head latent attention, 256 routed "
        "experts top-8 plus a shared one, first 3 layers dense.",
    ),
    Family(
        name="olmoe",
        model_type="olmoe",
        kind="moe-decoder",
        tiny={**_DECODER, **_MOE, "num_experts": 4, "architectures": ["OlmoeForCausalLM"]},
        note="OLMoE (allenai/OLMoE-1B-7B-0924): 64 experts, top-8.",
    ),
    Family(
        name="granitemoe",
        model_type="granitemoe",
        kind="moe-decoder",
        tiny={**_DECODER, **_MOE, "num_local_experts": 4, "architectures": ["GraniteMoeForCausalLM"]},
        note="IBM Granite 3.x MoE (ibm-granite/granite-3.1-3b-a800m-instruct).",
    ),
    Family(
        name="gpt_oss",
        model_type="gpt_oss",
        kind="moe-decoder",
        tiny={
            **_DECODER,
            "num_experts_per_tok": 2,
            "num_local_experts": 4,
            "head_dim": 8,
            "sliding_window": 32,
            # YaRN as released (factor 32), scaled to the tiny context so that
            # max_position_embeddings / original_max_position_embeddings == factor.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 2,
            },
            "architectures": ["GptOssForCausalLM"],
        },
        note="gpt-oss (openai/gpt-oss-20b): attention sinks, 32 experts top-4.",
    ),
    # ---------------------------------------------------------------- encoders
    Family(
        name="bert",
        model_type="bert",
        kind="encoder",
        tiny={**_ENCODER, "architectures": ["BertForMaskedLM"]},
        note="BERT (google-bert/bert-base-uncased) and sentence encoders such as all-MiniLM-L6-v2.",
    ),
    Family(
        name="roberta",
        model_type="roberta",
        kind="encoder",
        # RoBERTa offsets positions by pad_token_id + 1, hence 2 extra rows.
        tiny={**_ENCODER, "pad_token_id": 1, "max_position_embeddings": 66,
              "architectures": ["RobertaForMaskedLM"]},
        note="RoBERTa (FacebookAI/roberta-base).",
    ),
    Family(
        name="deberta-v2",
        model_type="deberta-v2",
        kind="encoder",
        tiny={
            **_ENCODER,
            "relative_attention": True,
            "position_buckets": 16,
            "max_relative_positions": 64,
            "pos_att_type": ["p2c", "c2p"],
            "position_biased_input": False,
            "architectures": ["DebertaV2ForMaskedLM"],
        },
        note="DeBERTa v2/v3 (microsoft/deberta-v3-base): disentangled relative attention.",
    ),
    Family(
        name="modernbert",
        model_type="modernbert",
        kind="encoder",
        tiny={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 128,
            "max_position_embeddings": 64,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "cls_token_id": 1,
            "sep_token_id": 2,
            "architectures": ["ModernBertForMaskedLM"],
        },
        note="ModernBERT (answerdotai/ModernBERT-base): rotary, alternating local attention.",
    ),
    # ---------------------------------------------------------------- encoder-decoders
    Family(
        name="t5",
        model_type="t5",
        kind="encoder-decoder",
        tiny={
            "d_model": 32,
            "d_ff": 64,
            "d_kv": 8,
            "num_layers": 2,
            "num_heads": 4,
            "vocab_size": 128,
            "relative_attention_num_buckets": 8,
            **_SEQ2SEQ_IDS,
            "architectures": ["T5ForConditionalGeneration"],
        },
        note="T5 and Flan-T5 (google/flan-t5-base): shared embedding, relative position bias in "
        "the first block of each stack (so that block is larger).",
    ),
    Family(
        name="bart",
        model_type="bart",
        kind="encoder-decoder",
        tiny={
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "vocab_size": 128,
            "max_position_embeddings": 64,
            **_SEQ2SEQ_IDS,
            "forced_eos_token_id": 2,
            "architectures": ["BartForConditionalGeneration"],
        },
        note="BART (facebook/bart-large): separate encoder and decoder layer classes.",
    ),
    Family(
        name="whisper",
        model_type="whisper",
        kind="encoder-decoder",
        tiny={
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "vocab_size": 128,
            "num_mel_bins": 16,
            "max_source_positions": 32,
            "max_target_positions": 32,
            **_SEQ2SEQ_IDS,
            "suppress_tokens": [],
            "begin_suppress_tokens": [],
            "architectures": ["WhisperForConditionalGeneration"],
        },
        note="Whisper speech recognition (openai/whisper-large-v3): convolutional audio stem.",
    ),
    # ---------------------------------------------------------------- vision
    Family(
        name="vit",
        model_type="vit",
        kind="vision",
        tiny={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
            "num_labels": 10,
            "architectures": ["ViTForImageClassification"],
        },
        note="Vision Transformer (google/vit-base-patch16-224): patch embedding, classifier head.",
    ),
)

_BY_NAME: dict[str, Family] = {family.name: family for family in FAMILIES}
if len(_BY_NAME) != len(FAMILIES):  # a duplicate would silently shadow an entry
    raise ValueError("duplicate family names in FAMILIES")

FAMILY_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def get_family(name: str) -> Family:
    """The registry entry called ``name``; UsageError with the closest names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UsageError(unknown_name_message("family", name, FAMILY_NAMES)) from None


def family_for_model_type(model_type: str) -> Family | None:
    """The family covering a Hugging Face ``model_type``, None when the registry lacks it."""
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    return None


def tiny_config(name: str) -> "PretrainedConfig":
    """A fresh transformers config object of the family's tiny debug model."""
    from transformers import AutoConfig

    family = get_family(name)
    # Deep-copy nested dicts (text_config, vision_config) so the registry stays untouched.
    import copy

    return AutoConfig.for_model(family.model_type, **copy.deepcopy(dict(family.tiny)))


__all__ = [
    "FAMILIES",
    "FAMILY_NAMES",
    "Family",
    "family_for_model_type",
    "get_family",
    "tiny_config",
]
