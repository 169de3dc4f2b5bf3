"""Model profiles checked against real models.

Every registry family is built for real from its tiny config and compared with the profile of
the same config built on the meta device: wrap classes exist, units cover the blocks, the total
equals a storage-deduplicated count, tied embeddings match shared storage. The same checks run on
model types the registry does not list (structural detection), and a full-size 70B config
profiles in seconds without allocating its weights.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from fsdp_presets.model.family import Family

import pytest
import torch
import transformers
from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from fsdp_presets.model import families
from fsdp_presets.errors import UsageError
from fsdp_presets.model.model_profile import ModelDims, ModelProfile, Unit
from fsdp_presets.model.model_loading import build_meta_model, load_config
from fsdp_presets.model.profile import profile_model, profile_module

DATA = Path(__file__).parent / "data"
LLAMA_70B = DATA / "llama-3-70b"

hf_logging.set_verbosity_error()  # token-id and deprecation advisories are noise here


# --------------------------------------------------------------------------- independent counts

def storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def real_param_count(module: torch.nn.Module) -> int:
    """Parameters of a real model, each block of memory counted once, whatever the module tree
    says (``remove_duplicate=False`` lists a tied weight under every name it has)."""
    seen: set[tuple] = set()
    total = 0
    for _, param in module.named_parameters(remove_duplicate=False):
        key = storage_key(param)
        if key not in seen:
            seen.add(key)
            total += param.numel()
    return total


def outermost_instances(model: torch.nn.Module, class_names) -> list[tuple[str, torch.nn.Module]]:
    """Modules of the given classes that no other such module contains."""
    found: list[tuple[str, torch.nn.Module]] = []
    for path, module in model.named_modules():
        if type(module).__name__ in class_names and not any(
            path.startswith(outer + ".") for outer, _ in found
        ):
            found.append((path, module))
    return found


def embeddings_share_storage(model: torch.nn.Module) -> bool:
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None or getattr(outputs, "weight", None) is None:
        return False
    return storage_key(inputs.weight) == storage_key(outputs.weight)


def check_against_real_model(config, *, expected_blocks: int) -> ModelProfile:
    """Profile ``config`` on meta, build it for real, and hold one against the other."""
    meta_model = build_meta_model(config)
    assert all(param.is_meta for param in meta_model.parameters()), "weights were allocated"
    profile = profile_module(meta_model)

    torch.manual_seed(0)
    real_model = type(meta_model)._from_config(config)
    assert profile.architecture == type(real_model).__name__

    present = {type(module).__name__ for module in real_model.modules()}
    assert profile.wrap_classes, "no FSDP unit found"
    assert set(profile.wrap_classes) <= present, f"wrap classes missing: {profile.wrap_classes}"

    # Units cover the blocks: every outermost instance of a wrap class, at its real size.
    blocks = outermost_instances(real_model, set(profile.wrap_classes))
    assert len(blocks) == expected_blocks == profile.num_blocks
    real_units = Counter((type(block).__name__, real_param_count(block)) for _, block in blocks)
    profiled_units = Counter({(unit.cls, unit.params_each): unit.count for unit in profile.units})
    assert profiled_units == real_units

    assert profile.total_params == real_param_count(real_model)
    assert profile.root_params == profile.total_params - sum(
        real_param_count(block) for _, block in blocks
    )
    assert profile.tied_embeddings == embeddings_share_storage(real_model)
    return profile


# --------------------------------------------------------------------------- every family

# Each tiny stack has 2 layers; encoder-decoders have two stacks, Gemma 3 a vision and a text one.
def expected_blocks(family: Family) -> int:
    return 4 if family.kind in ("encoder-decoder", "multimodal") else 2


@pytest.mark.parametrize("name", families.FAMILY_NAMES)
def test_family_profile_matches_real_model(name):
    family = families.get_family(name)
    profile = check_against_real_model(families.tiny_config(name), expected_blocks=expected_blocks(family))

    assert profile.model_type == family.model_type
    assert profile.architecture == family.tiny["architectures"][0]
    # The structural blocks agree with what the model declares, when it declares anything.
    no_split = profile.structure["no_split_modules"]
    if no_split:
        assert set(profile.wrap_classes) <= set(no_split)
    assert profile.norm_classes, "every family normalises somewhere"
    assert any(embedding["role"] == "input" for embedding in profile.embeddings)
    assert profile.is_moe == (family.kind == "moe-decoder")
    assert profile.is_encoder_decoder == (family.kind == "encoder-decoder")
    assert profile.dims.hidden_size == 32
    assert profile.dims.num_layers == profile.num_blocks
    # The family name goes through the same path as the CLI.
    assert profile_model(name).to_json() == profile.to_json()


def test_tied_weights_are_counted_once():
    """The naive count over every parameter name counts a tied head twice; the profile does not."""
    config = families.tiny_config("gpt2")
    model = type(build_meta_model(config))._from_config(config)
    naive = sum(param.numel() for _, param in model.named_parameters(remove_duplicate=False))
    profile = profile_model("gpt2")
    assert profile.tied_embeddings
    assert naive - profile.total_params == 128 * 32  # the head's weight, vocab x hidden


def test_t5_shares_one_embedding_across_encoder_decoder_and_head():
    profile = profile_model("t5")
    inputs = [emb for emb in profile.embeddings if emb["role"] == "input"]
    assert [emb["name"] for emb in inputs] == ["shared"]  # not encoder./decoder.embed_tokens too
    assert profile.structure["encoder_layers"] == profile.structure["decoder_layers"] == 2
    # The first block of each stack holds the relative position bias (buckets x heads).
    sizes = [unit.params_each for unit in profile.units]
    assert sizes[0] - sizes[1] == 8 * 4


def test_moe_structure():
    profile = profile_model("mixtral")
    moe = profile.structure["moe"]
    assert (moe["num_experts"], moe["experts_per_token"], moe["moe_layers"]) == (4, 2, 2)
    # Mixtral experts: gate, up and down projections, hidden 32 x intermediate 64, 4 per layer.
    assert moe["routed_expert_params"] == 2 * 4 * 3 * 32 * 64
    assert moe["active_params"] == profile.total_params - moe["routed_expert_params"] // 2


def test_deepseek_v3_dense_first_layer_is_its_own_unit():
    profile = profile_model("deepseek_v3")
    assert profile.wrap_classes == ["DeepseekV3DecoderLayer"]
    assert [unit.count for unit in profile.units] == [1, 1]
    dense, sparse = profile.units
    assert dense.params_each < sparse.params_each
    assert profile.structure["moe"]["dense_layers"] == 1
    assert profile.structure["moe"]["shared_experts"] is True


def test_missing_no_split_names_are_reported():
    """Gemma 3 declares SigLIP classes its vision tower does not build."""
    profile = profile_model("gemma3")
    present_check = {"SiglipMultiheadAttentionPoolingHead", "SiglipTextEmbeddings"}
    assert set(profile.missing_no_split) == present_check
    assert not set(profile.missing_no_split) & set(profile.wrap_classes)
    assert any("SiglipTextEmbeddings" in warning for warning in profile.structure["warnings"])
    assert profile.wrap_classes == ["SiglipEncoderLayer", "Gemma3DecoderLayer"]


# --------------------------------------------------------------------------- not in the registry

UNLISTED = {
    "codegen": (
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4, "n_positions": 64,
         "vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2,
         "architectures": ["CodeGenForCausalLM"]},
        ["CodeGenBlock"], 2,
    ),
    "electra": (
        # A narrower embedding than the encoder, projected up: not the decoder layout.
        {"embedding_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 128, "max_position_embeddings": 64,
         "architectures": ["ElectraForMaskedLM"]},
        ["ElectraLayer"], 2,
    ),
    "pegasus": (
        {"d_model": 32, "encoder_layers": 2, "decoder_layers": 3, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
         "vocab_size": 128, "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": 1,
         "decoder_start_token_id": 0, "forced_eos_token_id": 1},  # no architectures: auto class
        ["PegasusEncoderLayer", "PegasusDecoderLayer"], 5,
    ),
    "swin": (
        # Stages of blocks: the stage is the declared unit, its blocks are nested inside it.
        {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 2, 1],
         "num_heads": [2, 2, 4], "window_size": 4, "num_labels": 3,
         "architectures": ["SwinForImageClassification"]},
        ["SwinStage"], 3,
    ),
}


@pytest.mark.parametrize("model_type", sorted(UNLISTED))
def test_structural_detection_beyond_the_registry(model_type):
    settings, wrap_classes, blocks = UNLISTED[model_type]
    assert families.family_for_model_type(model_type) is None
    config = AutoConfig.for_model(model_type, **settings)
    profile = check_against_real_model(config, expected_blocks=blocks)
    assert profile.wrap_classes == wrap_classes
    assert profile.missing_no_split == []


def test_auto_class_follows_what_the_config_supports():
    """Without ``architectures`` the model class comes from the auto mappings."""
    expected = {
        "llama": "LlamaForCausalLM",
        "bert": "BertForMaskedLM",
        "t5": "T5ForConditionalGeneration",
        "whisper": "WhisperForConditionalGeneration",
        "vit": "ViTForImageClassification",
    }
    for name, architecture in expected.items():
        config = families.tiny_config(name)
        config.architectures = None
        assert type(build_meta_model(config)).__name__ == architecture, name
    # A tower of a composite model that no auto class maps: XConfig builds XModel.
    tower = AutoConfig.for_model("blip_2_vision_model", hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4)
    profile = profile_module(build_meta_model(tower))
    assert profile.architecture == "Blip2VisionModel"
    assert profile.units[0].cls == "Blip2EncoderLayer" and profile.num_blocks == 2


# --------------------------------------------------------------------------- full size

def test_llama_70b_config_profiles_in_seconds_without_weights():
    start = time.perf_counter()
    profile = profile_model(str(LLAMA_70B / "config.json"))
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"profiling took {elapsed:.1f} s"

    hidden, layers, vocab, mlp, kv = 8192, 80, 128_256, 28_672, 8 * 128
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden
    assert per_layer == 855_654_400
    assert profile.total_params == 70_553_706_496 == layers * per_layer + 2 * vocab * hidden + hidden
    assert profile.units == [Unit(cls="LlamaDecoderLayer", count=80, params_each=per_layer)]
    assert profile.root_params == 2 * vocab * hidden + hidden
    assert profile.largest_unit_params == profile.root_params
    assert not profile.tied_embeddings
    assert profile.output_head == "lm_head"
    assert profile.dims == ModelDims(
        hidden_size=8192, num_layers=80, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28_672, vocab_size=128_256, max_position_embeddings=8192,
    )
    assert profile.structure["config_dtype"] == "bfloat16"
    # The folder form gives the same profile.
    assert profile_model(str(LLAMA_70B)).to_json() == profile.to_json()


def test_70b_meta_model_holds_no_memory():
    model = build_meta_model(load_config(str(LLAMA_70B)))
    assert all(param.is_meta for param in model.parameters())
    assert all(buffer.is_meta for buffer in model.buffers())


# --------------------------------------------------------------------------- contract and input

def test_json_contract_keys():
    payload = profile_model("qwen2").to_json()
    required = {"model_type", "architecture", "total_params", "wrap_classes", "units",
                "embeddings", "norm_classes", "output_head", "tied_embeddings",
                "largest_unit_params"}
    assert required <= set(payload)
    assert payload["units"] == [{"class": "Qwen2DecoderLayer", "count": 2, "params_each": 9344}]
    assert all(set(emb) >= {"name", "class", "params"} for emb in payload["embeddings"])


def test_load_config_accepts_family_folder_and_file(tmp_path):
    assert load_config("llama").hidden_size == 32
    folder = tmp_path / "model"
    folder.mkdir()
    families.tiny_config("mistral").save_pretrained(folder)
    assert load_config(str(folder)).model_type == "mistral"
    assert load_config(str(folder / "config.json")).model_type == "mistral"
    assert isinstance(load_config(str(folder)), transformers.MistralConfig)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown-family", "did you mean 'llama'"),
        ("missing-folder", "no such file or folder"),
        ("folder-without-config", "has no config.json"),
        ("malformed-json", "is not valid JSON"),
        ("unknown-model-type", "is not known to transformers"),
        ("no-model-type", "has no 'model_type'"),
        ("remote-code", "--trust-remote-code"),
        ("invalid-values", "not a multiple of the number of attention heads"),
    ],
)
def test_bad_sources_raise_usage_errors(tmp_path, case, message):
    source = bad_source(tmp_path, case)
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        profile_model(source)


def bad_source(tmp_path: Path, case: str) -> str:
    """A source of each kind of bad input (shared with the CLI tests)."""
    if case == "unknown-family":
        return "lama"
    if case == "missing-folder":
        return str(tmp_path / "nowhere")
    folder = tmp_path / case
    folder.mkdir()
    if case == "folder-without-config":
        return str(folder)
    contents = {
        "malformed-json": '{"model_type": "llama", "hidden_size": 32,\n',
        "unknown-model-type": '{"model_type": "lama3"}',
        "no-model-type": '{"hidden_size": 32}',
        "remote-code": '{"model_type": "toy_remote", "auto_map": {"AutoConfig": "c.ToyConfig"}}',
        "invalid-values": '{"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4}',
    }[case]
    (folder / "config.json").write_text(contents)
    return str(folder)


def test_dataclass_checks():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelDims(hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=8,
                  intermediate_size=64, vocab_size=128)
    with pytest.raises(ValueError, match="count"):
        Unit(cls="Block", count=0, params_each=10)


class ToyBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)


class BlocksAsAttributes(torch.nn.Module):
    """Blocks held as plain attributes, not in a ModuleList: only the declaration finds them."""

    _no_split_modules = ["ToyBlock", "GhostLayer"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.first = ToyBlock(4)
        self.second = ToyBlock(4)
        self.norm = torch.nn.LayerNorm(4)

    def get_input_embeddings(self):
        return self.embed


def test_blocks_outside_containers_fall_back_to_no_split_modules():
    profile = profile_module(BlocksAsAttributes())
    assert profile.units == [Unit(cls="ToyBlock", count=2, params_each=4 * 4 + 4)]
    assert profile.structure["stacks"] == [
        {"path": "first", "class": "ToyBlock", "count": 1},
        {"path": "second", "class": "ToyBlock", "count": 1},
    ]
    assert profile.missing_no_split == ["GhostLayer"]
    assert profile.total_params == 10 * 4 + 2 * 20 + 8
    assert (profile.dims.hidden_size, profile.dims.vocab_size) == (4, 10)  # read off the embedding
    assert profile.output_head is None and not profile.tied_embeddings


def test_a_model_without_blocks_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    profile = profile_module(model)
    assert profile.units == [] and profile.wrap_classes == []
    assert profile.root_params == profile.total_params == 4 * 4 + 4 + 4 * 2 + 2
    assert any("no repeated blocks" in warning for warning in profile.structure["warnings"])
