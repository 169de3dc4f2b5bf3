"""What the `check` tests and the documentation tests share: the clean config every planted error
is put into, and model facts built once per session."""

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
    from fsdp_presets.plan.check import model_facts

    if source is None:
        return None
    if source not in _FACTS:
        _FACTS[source] = model_facts(str(REPO / source) if (REPO / source).exists() else source)
    return _FACTS[source]
