"""The family registry: plain data, tiny configs, helpful failures."""

from __future__ import annotations

import pytest
from transformers import CONFIG_MAPPING, PretrainedConfig

from fsdp_presets.model import families
from fsdp_presets.errors import UsageError
from fsdp_presets.model.family import Family, KINDS

# The families the registry must cover (decoders, MoE, encoders, encoder-decoders, vision).
REQUIRED = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3", "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon", "opt", "bloom", "olmo2",
    "granite", "starcoder2", "deepseek_v3", "bert", "roberta", "deberta-v2", "t5", "bart", "vit",
}


def test_registry_covers_the_required_families():
    assert len(families.FAMILIES) >= 25
    assert REQUIRED <= set(families.FAMILY_NAMES)
    assert len(set(families.FAMILY_NAMES)) == len(families.FAMILIES)
    assert {family.kind for family in families.FAMILIES} == set(KINDS)


@pytest.mark.parametrize("name", families.FAMILY_NAMES)
def test_tiny_config_is_tiny_and_of_its_model_type(name):
    family = families.get_family(name)
    assert family.model_type in CONFIG_MAPPING
    config = families.tiny_config(name)
    assert isinstance(config, PretrainedConfig)
    assert config.model_type == family.model_type
    assert family.note
    # Tiny means a test can build every family for real in milliseconds.
    parts = [config.get_text_config(decoder=True), getattr(config, "vision_config", None)]
    for part in filter(None, parts):
        assert 32 <= part.hidden_size <= 64
        assert getattr(part, "vocab_size", 128) <= 256
        assert part.num_hidden_layers <= 3


def test_tiny_config_returns_a_fresh_object():
    first = families.tiny_config("gemma3")
    first.text_config.hidden_size = 999
    first.architectures.append("Changed")
    second = families.tiny_config("gemma3")
    assert second.text_config.hidden_size == 32
    assert second.architectures == ["Gemma3ForConditionalGeneration"]
    with pytest.raises(TypeError):
        families.get_family("llama").tiny["hidden_size"] = 1  # the registry is read-only


def test_unknown_family_suggests_close_names():
    with pytest.raises(UsageError, match=r"unknown family 'mixtrl'; did you mean 'mixtral'"):
        families.get_family("mixtrl")
    with pytest.raises(UsageError, match="known: .*llama"):
        families.tiny_config("nothing-like-it")


def test_family_for_model_type():
    assert families.family_for_model_type("deberta-v2").name == "deberta-v2"
    assert families.family_for_model_type("gemma3_text").name == "gemma3_text"
    assert families.family_for_model_type("codegen") is None


def test_bad_entries_are_rejected_with_every_problem():
    with pytest.raises(ValueError, match="lower case.*kind.*architectures"):
        Family(name="Llama", model_type="llama", kind="dense", tiny={}, note="x")
