"""Published configs (each model's config.json on the Hub, the values that shape memory) of
transformers-native families the planner keeps no constants for, as plain dicts: what
``tests/test_planner_rehearsed.py`` and ``scripts/planner_accuracy.py`` compare the planner
against a rehearsal on. ``write_config`` puts one in a folder ``fsdp-presets`` can read."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FAMILIES = {
    # model_type: published config values (the model's config.json), without num_hidden_layers
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "max_position_embeddings": 40960, "rope_theta": 1000000, "tie_word_embeddings": False},
    "starcoder2": {"architectures": ["Starcoder2ForCausalLM"], "hidden_size": 6144, "intermediate_size": 24576,
                   "num_attention_heads": 48, "num_key_value_heads": 4, "vocab_size": 49152,
                   "max_position_embeddings": 16384, "use_bias": True, "sliding_window": 4096},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 100352,
              "max_position_embeddings": 4096},
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
                    "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
                    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400, "max_position_embeddings": 163840},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                  "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                  "decoder_sparse_step": 1, "norm_topk_prob": True, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
                  "rope_theta": 1000000, "tie_word_embeddings": False},
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "intermediate_size": 6912,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
                    "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                    "rope_theta": 1000000, "rope_local_base_freq": 10000, "max_position_embeddings": 32768,
                    "tie_word_embeddings": True},
    "cohere": {"architectures": ["CohereForCausalLM"], "hidden_size": 8192, "intermediate_size": 22528,
               "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 256000, "logit_scale": 0.0625,
               "max_position_embeddings": 8192, "rope_theta": 8000000, "use_qk_norm": False,
               "tie_word_embeddings": True},
    "granite": {"architectures": ["GraniteForCausalLM"], "hidden_size": 4096, "intermediate_size": 12800,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 49155,
                "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125, "residual_multiplier": 0.22,
                "logits_scaling": 16.0, "max_position_embeddings": 131072, "rope_theta": 10000000,
                "tie_word_embeddings": True},
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 1024,
              "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "num_attention_heads": 16,
              "num_key_value_heads": 16, "vocab_size": 50304, "max_position_embeddings": 4096,
              "tie_word_embeddings": False},
    "glm4": {"architectures": ["Glm4ForCausalLM"], "hidden_size": 4096, "intermediate_size": 13696,
             "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151552,
             "partial_rotary_factor": 0.5, "attention_bias": True, "max_position_embeddings": 32768,
             "tie_word_embeddings": False},
}
PUBLISHED_LAYERS = {"qwen3": 36, "starcoder2": 40, "olmo2": 32, "deepseek_v2": 27, "qwen3_moe": 48,
                    "gemma3_text": 26, "cohere": 40, "granite": 40, "olmoe": 16, "glm4": 40}
"""``num_hidden_layers`` of the published models (Qwen3-8B, StarCoder2-15B, OLMo-2-7B, DeepSeek-V2-Lite,
Qwen3-30B-A3B, Gemma-3-1B, Command-R v01, Granite-3.1-8B, OLMoE-1B-7B-0924, GLM-4-9B-0414)."""


def published_config(model_type: str, *, layers: int | None = None) -> dict:
    """``model_type``'s published config as a ``config.json`` holds it (``layers`` blocks, default
    the published count)."""
    return {"model_type": model_type, "num_hidden_layers": layers or PUBLISHED_LAYERS[model_type],
            **FAMILIES[model_type]}


def config_hash(model_type: str, *, layers: int | None = None) -> str:
    """A short digest of :func:`published_config` (what a recorded measurement of it was made of)."""
    text = json.dumps(published_config(model_type, layers=layers), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def write_config(folder, model_type: str, *, layers: int | None = None) -> str:
    """A model folder holding ``model_type``'s published config (``layers`` blocks, default the
    published count); returns its path."""
    folder = Path(folder) / model_type
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(published_config(model_type, layers=layers)), encoding="utf-8")
    return str(folder)
