"""The decoder families of the registry (dense and mixture-of-experts): plain data, one
:class:`~fsdp_presets.model.family.Family` each, written as a tiny base shape plus what differs.
:data:`fsdp_presets.model.families.FAMILIES` lists them first, then the encoders, encoder-decoders
and vision models.
"""

from __future__ import annotations

from fsdp_presets.model.family import DECODER_TINY, MOE_TINY, TINY_IDS, Family, decoder, moe_decoder, multimodal

DECODER_FAMILIES: tuple[Family, ...] = (
    # ---------------------------------------------------------------- dense decoders
    decoder("llama", "LlamaForCausalLM", base=DECODER_TINY,
            note="Llama 2/3.x (meta-llama/Llama-3.1-8B); also SmolLM2, TinyLlama, Vicuna."),
    decoder("mistral", "MistralForCausalLM", base=DECODER_TINY, sliding_window=32,
            note="Mistral 7B and NeMo (mistralai/Mistral-7B-v0.3)."),
    decoder("qwen2", "Qwen2ForCausalLM", base=DECODER_TINY,
            note="Qwen2 and Qwen2.5 (Qwen/Qwen2.5-7B): Llama layout with q/k/v biases."),
    decoder("qwen3", "Qwen3ForCausalLM", base=DECODER_TINY, head_dim=8,
            note="Qwen3 dense (Qwen/Qwen3-8B): q/k norms, explicit head_dim."),
    decoder("gemma", "GemmaForCausalLM", base=DECODER_TINY, head_dim=8,
            note="Gemma 1 (google/gemma-7b): tied embeddings, explicit head_dim."),
    decoder("gemma2", "Gemma2ForCausalLM", base=DECODER_TINY, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=32,
            note="Gemma 2 (google/gemma-2-9b): four norms per layer, alternating sliding attention."),
    # (28 / 14)^2 = 4 patches pooled to 4 image tokens; special ids inside the vocabulary.
    multimodal("gemma3", "Gemma3ForConditionalGeneration", base={},
               text_config={**DECODER_TINY, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 32},
               vision_config={
                   "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "image_size": 28, "patch_size": 14, "vision_use_head": False,
               }, mm_tokens_per_image=4, boi_token_index=125, eoi_token_index=126, image_token_index=127,
               note="Gemma 3 4B-27B (google/gemma-3-4b-it): SigLIP vision tower plus Gemma 3 text decoder, so two "
                    "kinds of FSDP unit."),
    decoder("gemma3_text", "Gemma3ForCausalLM", base=DECODER_TINY, head_dim=8, query_pre_attn_scalar=8,
            sliding_window=32,
            note="Gemma 3 text-only (google/gemma-3-1b-it)."),
    decoder("phi", "PhiForCausalLM", base=DECODER_TINY, partial_rotary_factor=0.5,
            note="Phi-1/1.5/2 (microsoft/phi-2): parallel attention and MLP, LayerNorm, biased head."),
    decoder("phi3", "Phi3ForCausalLM", base=DECODER_TINY,
            note="Phi-3 and Phi-4 (microsoft/phi-4): fused qkv and gate_up projections."),
    decoder("gpt2", "GPT2LMHeadModel", base=TINY_IDS, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            note="GPT-2 (openai-community/gpt2) and DistilGPT2: Conv1D layers, learned positions, tied head."),
    decoder("gpt_neox", "GPTNeoXForCausalLM", base=DECODER_TINY, rotary_pct=0.25,
            note="GPT-NeoX and Pythia (EleutherAI/pythia-1b): untied 'embed_out' head."),
    decoder("gptj", "GPTJForCausalLM", base=TINY_IDS, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
            note="GPT-J (EleutherAI/gpt-j-6b)."),
    decoder("falcon", "FalconForCausalLM", base=TINY_IDS, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4,
            note="Falcon 7B layout (tiiuae/falcon-7b): multi-query attention, parallel attention/MLP."),
    decoder("opt", "OPTForCausalLM", base=TINY_IDS, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
            num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=0,
            note="OPT (facebook/opt-1.3b): learned positions, tied head."),
    decoder("bloom", "BloomForCausalLM", base=TINY_IDS, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0,
            note="BLOOM (bigscience/bloom-7b1): ALiBi, embedding LayerNorm, tied head."),
    decoder("olmo2", "Olmo2ForCausalLM", base=DECODER_TINY,
            note="OLMo 2 (allenai/OLMo-2-1124-7B): post-norm layers, q/k norms."),
    decoder("granite", "GraniteForCausalLM", base=DECODER_TINY,
            note="IBM Granite 3.x dense (ibm-granite/granite-3.3-8b-instruct)."),
    decoder("starcoder2", "Starcoder2ForCausalLM", base=DECODER_TINY, sliding_window=32,
            note="StarCoder2 (bigcode/starcoder2-7b): LayerNorm, biased projections."),
    decoder("gpt_bigcode", "GPTBigCodeForCausalLM", base=TINY_IDS, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            note="StarCoder 1 and SantaCoder (bigcode/starcoderbase-1b): multi-query attention."),
    decoder("cohere", "CohereForCausalLM", base=DECODER_TINY,
            note="Command-R (CohereForAI/c4ai-command-r-v01): parallel blocks, tied head."),
    decoder("stablelm", "StableLmForCausalLM", base=DECODER_TINY,
            note="StableLM 2 (stabilityai/stablelm-2-1_6b): partial rotary, LayerNorm."),
    # ---------------------------------------------------------------- mixture-of-experts decoders
    moe_decoder("mixtral", "MixtralForCausalLM", base=DECODER_TINY | MOE_TINY, num_local_experts=4,
                note="Mixtral 8x7B/8x22B (mistralai/Mixtral-8x7B-v0.1): 8 experts, top-2."),
    moe_decoder("qwen2_moe", "Qwen2MoeForCausalLM", base=DECODER_TINY | MOE_TINY, num_experts=4,
                moe_intermediate_size=32, shared_expert_intermediate_size=64,
                note="Qwen1.5-MoE and Qwen2-MoE (Qwen/Qwen2-57B-A14B): routed plus gated shared expert."),
    moe_decoder("qwen3_moe", "Qwen3MoeForCausalLM", base=DECODER_TINY | MOE_TINY, head_dim=8, num_experts=4,
                moe_intermediate_size=32,
                note="Qwen3 MoE (Qwen/Qwen3-30B-A3B): 128 experts, top-8."),
    # The first layer stays dense as in the real model (which keeps 3 of 61 dense), so the
    # same layer class appears at two sizes.
    moe_decoder("deepseek_v3", "DeepseekV3ForCausalLM", base=DECODER_TINY | MOE_TINY, num_key_value_heads=4,
                moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                v_head_dim=8,
                note="DeepSeek-V3/R1 (deepseek-ai/DeepSeek-V3): multi-head latent attention, 256 routed experts "
                     "top-8 plus a shared one, first 3 layers dense."),
    moe_decoder("olmoe", "OlmoeForCausalLM", base=DECODER_TINY | MOE_TINY, num_experts=4,
                note="OLMoE (allenai/OLMoE-1B-7B-0924): 64 experts, top-8."),
    moe_decoder("granitemoe", "GraniteMoeForCausalLM", base=DECODER_TINY | MOE_TINY, num_local_experts=4,
                note="IBM Granite 3.x MoE (ibm-granite/granite-3.1-3b-a800m-instruct)."),
    # YaRN as released (factor 32), scaled to the tiny context so that
    # max_position_embeddings / original_max_position_embeddings == factor.
    moe_decoder("gpt_oss", "GptOssForCausalLM", base=DECODER_TINY | MOE_TINY, num_local_experts=4, head_dim=8,
                sliding_window=32,
                rope_parameters={
                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 2,
                },
                note="gpt-oss (openai/gpt-oss-20b): attention sinks, 32 experts top-4."),
)
