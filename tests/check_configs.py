"""What the `check` tests and the documentation tests share: the clean config every planted error
is put into, the table of planted errors, and model facts built once per session."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A clean FSDP2 config for the tiny Llama on 2 GPUs, as `fsdp-presets generate` writes it.
GOOD = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "num_processes": 2,
    "num_machines": 1,
    "machine_rank": 0,
    "mixed_precision": "bf16",
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": False,
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False,
        "fsdp_activation_checkpointing": False,
    },
}

_FACTS: dict = {}


def facts(source: str | None):
    """Model facts of a family name or a repository path (``model_configs/...``), built once per
    test session (profiles are pure)."""
    from fsdp_presets.check.lint import model_facts

    if source is None:
        return None
    if source not in _FACTS:
        _FACTS[source] = model_facts(str(REPO / source) if (REPO / source).exists() else source)
    return _FACTS[source]


FSDP1 = {"fsdp_version": 1, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_backward_prefetch": "BACKWARD_PRE",
         "fsdp_forward_prefetch": False, "fsdp_use_orig_params": True, "fsdp_sync_module_states": True}


def mutate(top: dict | None = None, fsdp: dict | None = None, drop: tuple = (), drop_fsdp: tuple = (),
           parallelism: dict | None = None):
    def apply(config: dict) -> dict:
        config.update(top or {})
        config["fsdp_config"].update(fsdp or {})
        for key in drop:
            config.pop(key, None)
        for key in drop_fsdp:
            config["fsdp_config"].pop(key, None)
        if parallelism is not None:
            config["parallelism_config"] = parallelism
        return config
    return apply


LLAMA_70B, LLAMA_8B = "model_configs/llama-3.1-70b", "model_configs/llama-3.1-8b"


def _mesh(*, tp: int = 1, cp: int = 1, shard: int = 1) -> dict:
    return {"parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": shard,
            "parallelism_config_tp_size": tp, "parallelism_config_cp_size": cp}


def _script(text: str):
    from fsdp_presets.check.script import read_source

    return read_source(text, path="train.py")


# A Trainer script as users write them (read statically by `check --script`, never run).
TRAINER_SCRIPT = _script("""
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
model = AutoModelForCausalLM.from_pretrained("m")
args = TrainingArguments("out", bf16=True, gradient_checkpointing=True, per_device_train_batch_size=4)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
trainer.save_model("out/final")
""")
# A plain accelerate loop that moves the model before prepare and trusts remote code.
LOOP_SCRIPT = _script("""
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
accelerator = Accelerator()
model = AutoModelForCausalLM.from_pretrained("m", trust_remote_code=True)
model = model.to(accelerator.device)
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
""")
# A loop that lets transformers shard the model (TP 3: not a divisor of Llama's heads) and hands it to
# accelerate's prepare, and a Trainer script with expert parallelism on a model without experts and on
# Mixtral (EP 3: not a divisor of its 8 experts).
DISTRIBUTED_LOOP_SCRIPT = _script("""
from accelerate import Accelerator
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
accelerator = Accelerator()
model = AutoModelForCausalLM.from_pretrained("m", distributed_config=DistributedConfig(fsdp_size=2, tp_size=3))
model = accelerator.prepare(model)
""")
DISTRIBUTED_EP_SCRIPT = _script("""
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig
config = DistributedConfig(fsdp_size=6, ep_size=3)
model = AutoModelForCausalLM.from_pretrained("m", distributed_config=config)
trainer = Trainer(model=model, args=TrainingArguments("out", bf16=True), train_dataset=data)
trainer.train()
""")
MIXTRAL = "model_configs/mixtral-8x7b"

# id: (mutation, rule expected, model, context settings, text the message or fix must hold)
BAD_CONFIGS = {
    "misspelled-top-level-key": (mutate(top={"mixed_precison": "bf16"}), "unknown-key", None, {},
                                 "'mixed_precision'"),
    "misspelled-fsdp-key": (mutate(fsdp={"fsdp_reshard_after_foward": False}), "unknown-fsdp-key", None, {},
                            "'fsdp_reshard_after_forward'"),
    "misspelled-parallelism-key": (mutate(top={"num_processes": 4}, parallelism={
        "parallelism_config_dp_replicat_size": 2, "parallelism_config_dp_shard_size": 2}),
        "unknown-parallelism-key", None, {}, "'parallelism_config_dp_replicate_size'"),
    "invalid-state-dict-type": (mutate(fsdp={"fsdp_state_dict_type": "SHARDED"}), "invalid-value", None, {},
                                "SHARDED_STATE_DICT"),
    "invalid-mixed-precision": (mutate(top={"mixed_precision": "bfloat16"}), "invalid-value", None, {}, "bf16"),
    "invalid-boolean": (mutate(fsdp={"fsdp_offload_params": "maybe"}), "invalid-value", None, {}, "true or false"),
    "fsdp-version-missing": (mutate(drop_fsdp=("fsdp_version",)), "fsdp-version-missing", None, {}, "FSDP1"),
    "sharding-strategy-under-fsdp2": (mutate(fsdp={"fsdp_sharding_strategy": "SHARD_GRAD_OP"}),
                                      "fsdp1-key-under-fsdp2", None, {}, "fsdp_reshard_after_forward"),
    "backward-prefetch-under-fsdp2": (mutate(fsdp={"fsdp_backward_prefetch": "BACKWARD_POST"}),
                                      "fsdp1-key-under-fsdp2", None, {}, "FSDP2 ignores it"),
    "reshard-after-forward-under-fsdp1": (mutate(fsdp={**FSDP1, "fsdp_reshard_after_forward": False}),
                                          "fsdp2-key-under-fsdp1", None, {}, "fsdp_sharding_strategy"),
    "hsdp-with-fsdp1": (mutate(top={"num_processes": 4, "num_machines": 2}, fsdp={**FSDP1}, drop_fsdp=(
        "fsdp_reshard_after_forward",), parallelism={"parallelism_config_dp_replicate_size": 2,
                                                     "parallelism_config_dp_shard_size": 2}),
                        "hsdp-needs-fsdp2", None, {}, "fsdp_version: 2"),
    "hsdp-sizes-do-not-multiply": (mutate(top={"num_processes": 4, "num_machines": 2}, parallelism={
        "parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 4}),
        "hsdp-size-mismatch", None, {}, "num_processes is 4"),
    "hsdp-shard-spans-nodes": (mutate(top={"num_processes": 8, "num_machines": 2}, parallelism={
        "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 8}),
        "hsdp-shard-spans-nodes", None, {}, "parallelism_config_dp_shard_size: 4"),
    "processes-not-divisible-by-machines": (mutate(top={"num_processes": 6, "num_machines": 4}),
                                            "machines-do-not-divide", None, {}, "multiple of 4"),
    "lora-fsdp1-orig-params-false": (mutate(fsdp={**FSDP1, "fsdp_use_orig_params": False}, drop_fsdp=(
        "fsdp_reshard_after_forward",)), "lora-fsdp1-flat-params", None, {"method": "lora"}, "uniform requires_grad"),
    "qlora-fsdp1": (mutate(fsdp={**FSDP1}, drop_fsdp=("fsdp_reshard_after_forward",)), "qlora-fsdp1", None,
                    {"method": "qlora"}, "bnb_4bit_quant_storage=bfloat16"),
    "qlora-full-state-dict": (mutate(fsdp={"fsdp_state_dict_type": "FULL_STATE_DICT"}), "qlora-full-state-dict",
                              None, {"method": "qlora"}, "quantization-state keys"),
    "no-wrap-policy": (mutate(fsdp={"fsdp_auto_wrap_policy": "NO_WRAP"}), "no-wrap-policy", None, {},
                       "TRANSFORMER_BASED_WRAP"),
    "wrap-classes-left-to-the-model": (mutate(drop_fsdp=("fsdp_transformer_layer_cls_to_wrap",)),
                                       "wrap-classes-unset", "llama", {}, "LlamaDecoderLayer"),
    "no-split-modules-names-missing-classes": (mutate(drop_fsdp=("fsdp_transformer_layer_cls_to_wrap",)),
                                               "no-split-modules-missing", "gemma3", {},
                                               "SiglipMultiheadAttentionPoolingHead"),
    "wrap-classes-as-a-list": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}),
                               "wrap-class-format", None, {}, "comma"),
    "wrap-classes-with-spaces": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer, LlamaMLP"}),
                                 "wrap-class-format", None, {}, "LlamaDecoderLayer,LlamaMLP"),
    "wrap-class-misspelled": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayr"}),
                              "wrap-class-not-in-model", "llama", {}, "did you mean 'LlamaDecoderLayer'"),
    "wrap-class-of-another-model": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": "GPT2Block"}),
                                    "wrap-class-not-in-model", "llama", {}, "LlamaDecoderLayer"),
    "wrap-class-not-a-block": (mutate(fsdp={"fsdp_transformer_layer_cls_to_wrap": "LlamaMLP"}),
                               "wrap-class-not-a-block", "llama", {}, "LlamaDecoderLayer"),
    "ignored-modules": (mutate(fsdp={"fsdp_ignored_modules": "lm_head"}), "ignored-modules", None, {},
                        "gradient-synchronises"),
    "ram-efficient-loading-without-sync": (mutate(fsdp={"fsdp_sync_module_states": False}),
                                           "ram-efficient-loading-needs-sync", None, {}, "fsdp_sync_module_states"),
    "ram-efficient-loading-off-70b": (mutate(top={"num_processes": 8}, fsdp={"fsdp_cpu_ram_efficient_loading": False}),
                                      "ram-efficient-loading-off", LLAMA_70B, {}, "1051 GiB"),
    "full-state-dict-70b": (mutate(fsdp={"fsdp_state_dict_type": "FULL_STATE_DICT"}),
                            "full-state-dict-host-memory", LLAMA_70B, {"host_memory_gib": 512, "method": "full"},
                            "SHARDED_STATE_DICT"),
    "offload-70b-on-one-node": (mutate(top={"num_processes": 8}, fsdp={"fsdp_offload_params": True,
                                                                        "fsdp_activation_checkpointing": True}),
                                "offload-host-memory", LLAMA_70B, {"method": "full"}, "1051 GiB"),
    "async-save-beyond-host-memory": (mutate(top={"num_processes": 8}), "async-save-host-memory", LLAMA_8B,
                                      {"method": "full", "host_memory_gib": 64,
                                       "metadata": {"kind": "fsdp", "summary": {"async_save": True}}},
                                      "drop --async-save"),
    # A second dimension (fsdp_presets/check/rules_parallel.py).
    "tp-more-than-key-value-heads": (mutate(top={"num_processes": 16}, parallelism=_mesh(tp=16, shard=1)),
                                     "tp-size-vs-model", LLAMA_8B, {}, "8 key/value heads"),
    "tp-through-accelerate": (mutate(top={"num_processes": 8}, parallelism=_mesh(tp=4, shard=2)),
                              "tp-pair-cannot-run", LLAMA_8B, {}, "ReplicateParallel"),
    "tp-loss-counted-twice": (mutate(top={"num_processes": 8}, parallelism=_mesh(tp=2, shard=4)),
                              "tp-loss-reduction", LLAMA_8B, {}, "fsdp-presets converge"),
    "tp-without-a-plan": (mutate(top={"num_processes": 8}, parallelism=_mesh(tp=2, shard=4)), "tp-no-plan", "gpt2",
                          {}, "no tensor-parallel plan"),
    "cp-with-sliding-windows": (mutate(top={"num_processes": 8}, parallelism=_mesh(cp=2, shard=4)), "cp-masks",
                                "mistral", {}, "accelerate issue 4177"),
    "offload-on-cpu-host": (mutate(fsdp={"fsdp_offload_params": True}), "offload-on-cpu", None, {"device": "cpu"},
                            "fsdp_offload_params: false"),
    "fp32-that-does-not-fit": (mutate(top={"num_processes": 8, "mixed_precision": "no"}), "fp32-does-not-fit",
                               LLAMA_8B, {"gpu_memory_gib": 56, "seq_len": 4096, "method": "full", "precision": "fp32",
                                         "activation_checkpointing": False},
                               "mixed_precision: bf16"),
    "fp32-left-to-the-script": (mutate(top={"num_processes": 8, "mixed_precision": "no"}), "fits-only-if",
                                LLAMA_8B, {"gpu_memory_gib": 56, "seq_len": 4096, "method": "full"},
                                "or if it trains in bf16"),
    "mixed-precision-no-unquoted": (mutate(top={"mixed_precision": False}), "yaml-read-as-boolean", None, {},
                                    "mixed_precision: 'no'"),
    "stale-prefetch-key-beside-the-new-one": (mutate(fsdp={**FSDP1, "fsdp_backward_prefetch_policy": "BACKWARD_PRE"},
                                                     drop_fsdp=("fsdp_reshard_after_forward",)),
                                              "stale-key-beside-new", None, {}, "delete fsdp_backward_prefetch_policy"),
    "stale-prefetch-key-alone": (mutate(fsdp={**FSDP1, "fsdp_backward_prefetch_policy": "BACKWARD_POST"},
                                        drop_fsdp=("fsdp_reshard_after_forward", "fsdp_backward_prefetch")),
                                 "prefetch-key-not-applied", None, {}, "rename it to 'fsdp_backward_prefetch'"),
    "fsdp1-without-backward-prefetch": (mutate(fsdp={**FSDP1}, drop_fsdp=("fsdp_reshard_after_forward",
                                                                          "fsdp_backward_prefetch")),
                                        "backward-prefetch-off", LLAMA_8B, {},
                                        "NO_PREFETCH (accelerate's default: the key is missing)"),
    "fsdp1-backward-post": (mutate(fsdp={**FSDP1, "fsdp_backward_prefetch": "BACKWARD_POST"},
                                   drop_fsdp=("fsdp_reshard_after_forward",)),
                            "backward-prefetch-off", LLAMA_8B, {"gpu": "A100-80GB"},
                            "per optimizer step on A100-80GB against"),
    "debug-mode-in-a-training-config": (mutate(top={"debug": True}), "debug-mode", None, {}, "debug: false"),
    "lora-fsdp1-orig-params-true": (mutate(fsdp={**FSDP1}, drop_fsdp=("fsdp_reshard_after_forward",)),
                                    "lora-fsdp1-orig-params", LLAMA_8B, {"method": "lora"}, "gradients"),
    "trainer-save-model-under-sharded": (mutate(), "trainer-save-model-sharded", None, {"script": TRAINER_SCRIPT},
                                         "FSDPPresetsCallback"),
    "gradient-checkpointing-twice": (mutate(fsdp={"fsdp_activation_checkpointing": True}),
                                     "double-activation-checkpointing", None, {"script": TRAINER_SCRIPT},
                                     "can't both be set to True"),
    "model-to-cuda-before-prepare": (mutate(), "model-moved-before-prepare", None, {"script": LOOP_SCRIPT},
                                     "accelerator.prepare(model)"),
    "trust-remote-code-in-the-script": (mutate(), "trust-remote-code", None, {"script": LOOP_SCRIPT}, "revision"),
    "distributed-config-model-prepared-under-fsdp": (mutate(), "distributed-config-under-fsdp", None,
                                                     {"script": DISTRIBUTED_LOOP_SCRIPT},
                                                     "Could not find the transformer layer class"),
    "distributed-config-tp-vs-heads": (mutate(), "tp-size-vs-model", LLAMA_8B, {"script": DISTRIBUTED_LOOP_SCRIPT},
                                       "transformers issue 48307"),
    "expert-parallel-with-ram-efficient-loading": (mutate(top={"num_processes": 6}), "ep-ram-efficient-loading",
                                                   MIXTRAL, {"script": DISTRIBUTED_EP_SCRIPT},
                                                   "fsdp_cpu_ram_efficient_loading: false"),
    "expert-parallel-size-vs-experts": (mutate(top={"num_processes": 6}), "ep-size-vs-model", MIXTRAL,
                                        {"script": DISTRIBUTED_EP_SCRIPT}, "8 experts"),
    "expert-parallel-on-a-dense-model": (mutate(top={"num_processes": 6}), "ep-no-plan", LLAMA_8B,
                                         {"script": DISTRIBUTED_EP_SCRIPT}, "not a mixture-of-experts model"),
    # The NAME.distributed.json beside a config, as check_file reads it (tests/test_mesh_plan.py reads real ones).
    "distributed-config-unreadable": (mutate(), "distributed-config-invalid", None, {"distributed_config": {
        "path": "x.distributed.json", "problem": "it cannot be read as JSON (Expecting value)"}},
        "the recipes refuse it at start"),
    "distributed-config-of-another-process-count": (mutate(top={"num_processes": 8}), "distributed-config-vs-processes",
                                                    None, {"distributed_config": {"path": "x.distributed.json", "sizes": {
                                                        "dp_replicate_size": 1, "fsdp_size": 2, "tp_size": 2,
                                                        "ep_size": 1}}}, "lays out 4 ranks (FSDP 2 x TP 2)"),
    "distributed-config-mesh-planned": (mutate(top={"num_processes": 4}), "distributed-config-mesh", None,
                                        {"distributed_config": {"path": "x.distributed.json", "sizes": {
                                            "dp_replicate_size": 1, "fsdp_size": 2, "tp_size": 2, "ep_size": 1}}},
                                        "the memory figures are that mesh's"),
    "70b-on-two-gpus": (mutate(), "does-not-fit", LLAMA_70B, {"method": "full"}, "FULL_SHARD (FSDP2) on 2 GPUs"),
    "70b-on-two-gpus-method-unknown": (mutate(), "memory-assumes-full-finetune", LLAMA_70B, {}, "--method full"),
    "fp16-on-a-bf16-model": (mutate(top={"num_processes": 8, "mixed_precision": "fp16"}), "fp16-on-bf16-model",
                             LLAMA_8B, {}, "bf16"),
    "fsdp-config-under-ddp": (mutate(top={"distributed_type": "MULTI_GPU"}), "fsdp-config-ignored", None, {},
                              "FSDP"),
    "accelerate-refuses-checkpointing-offload": (mutate(fsdp={"fsdp_activation_checkpointing_offload": True}),
                                                 "accelerate-rejects", None, {}, "activation_checkpointing"),
    # FSDP1 as `accelerate config` writes it: the key is not applied, but what applies is the same.
    "fsdp1-reshard-as-accelerate-writes-it": (mutate(fsdp={**FSDP1, "fsdp_reshard_after_forward": "FULL_SHARD"},
                                                     drop_fsdp=("fsdp_sharding_strategy",)),
                                              "ignored-default", None, {}, "FULL_SHARD"),
    "fsdp1-reshard-asks-for-another-strategy": (mutate(fsdp={**FSDP1, "fsdp_reshard_after_forward": "SHARD_GRAD_OP"},
                                                       drop_fsdp=("fsdp_sharding_strategy",)),
                                                "fsdp2-key-under-fsdp1", None, {},
                                                "fsdp_sharding_strategy: SHARD_GRAD_OP"),
    "limit-all-gathers-off": (mutate(fsdp={**FSDP1, "fsdp_limit_all_gathers": False}), "key-not-applied", None, {},
                              "FullyShardedDataParallelPlugin(limit_all_gathers"),
    "no-num-processes": (mutate(drop=("num_processes",)), "num-processes-unset", LLAMA_70B, {}, "--num_processes"),
    "fp8-config": (mutate(top={"mixed_precision": "fp8"}), "fp8-needs-backend", None, {}, "torchao"),
    "num-processes-edited-away-from-header": (lambda config: {**config, "num_processes": 16}, "num-processes-vs-header",
                                              None, {"metadata": {"kind": "fsdp", "summary": {
                                                  "processes": 8, "machines": 1, "data_parallel_size": 8,
                                                  "micro_batch": 2, "gradient_accumulation": 16,
                                                  "global_batch": 256}}}, "512 sequences"),
    "fsdp-on-one-process": (mutate(top={"num_processes": 1}), "fsdp-single-process", None, {}, "distributed_type"),
    "fixed-private-main-process-ip": (mutate(top={"num_processes": 16, "num_machines": 2,
                                                  "main_process_ip": "10.1.2.3"},
                                             parallelism={"parallelism_config_dp_replicate_size": 2,
                                                          "parallelism_config_dp_shard_size": 8}),
                                      "fixed-main-process-ip", None, {}, "--main_process_ip $MASTER_ADDR"),
    "full-shard-across-nodes": (mutate(top={"num_processes": 16, "num_machines": 2}), "full-shard-across-nodes",
                                None, {}, "parallelism_config_dp_replicate_size: 2"),
}
