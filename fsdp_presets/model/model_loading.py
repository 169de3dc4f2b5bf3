"""From a model source (a registry family, a model folder or a config.json) to a Hugging Face
config (:func:`load_config`), checked before anything is built, and to the model on the meta
device (:func:`build_meta_model`): no weights, no RAM. Nothing from the folder runs unless
``trust_remote_code`` is given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_presets.errors import UsageError, closest_names, unknown_name_message
from fsdp_presets.fileio import CONFIG_MAX_BYTES, read_regular_text

if TYPE_CHECKING:  # heavy imports stay out of module import time (the CLI imports us lazily)
    from transformers import PretrainedConfig, PreTrainedModel


# --------------------------------------------------------------------------- loading a config

def _looks_like_path(source: str) -> bool:
    return (
        os.sep in source
        or "/" in source
        or source.endswith(".json")
        or source.startswith(("~", "."))
    )


def _read_config_json(path: Path) -> dict:
    """The parsed config.json, or a UsageError naming what is wrong with it."""
    try:
        text = read_regular_text(path, limit=CONFIG_MAX_BYTES)
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {path}: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(
            f"{path} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} must hold a JSON object (a model config), not {type(data).__name__}")
    return data


MAX_LAYERS = 1000
"""Most blocks a config may declare: the deepest published transformers have about 100-130 (GPT-3
96, Llama-3.1-405B 126). The profile builds every block on the meta device, a few milliseconds
each, so a typo like 10^7 layers would otherwise run for hours."""
# Keys of a config.json that count blocks, and keys that give a size; neither can be negative.
_LAYER_KEYS = frozenset(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers",
                         "num_encoder_layers", "encoder_layers", "decoder_layers"))
_SIZE_KEYS = frozenset(("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                        "num_key_value_heads", "max_position_embeddings", "head_dim", "n_embd", "n_head",
                        "n_positions", "n_ctx", "n_inner", "d_model", "d_ff", "d_kv", "ffn_dim", "num_heads",
                        "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                        "moe_intermediate_size", "encoder_attention_heads", "decoder_attention_heads",
                        "encoder_ffn_dim", "decoder_ffn_dim"))


def _config_number_problems(data: dict, where: str = "") -> list[str]:
    """Layer counts and sizes of a parsed config.json (and of its nested configs: ``text_config``...)
    that no model can have: negative, not whole numbers, or more than :data:`MAX_LAYERS` blocks."""
    problems = []
    for key, value in data.items():
        name = f"{where}{key}"
        if isinstance(value, dict):
            problems += _config_number_problems(value, f"{name}.")
            continue
        if key not in _LAYER_KEYS and key not in _SIZE_KEYS or value is None or isinstance(value, list):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            if key in _LAYER_KEYS or not isinstance(value, float) or not value.is_integer():
                problems.append(f"{name} is {json.dumps(value)}, not a whole number")
                continue
            value = int(value)
        if value < 0:
            problems.append(f"{name} is {value}, a negative {'number of blocks' if key in _LAYER_KEYS else 'size'}")
        elif key in _LAYER_KEYS and value > MAX_LAYERS:
            problems.append(f"{name} is {value}, more blocks than any real model (at most {MAX_LAYERS} are profiled)")
    return problems


def _known_model_types() -> list[str]:
    from transformers import CONFIG_MAPPING

    return list(CONFIG_MAPPING.keys())


def _config_from_file(path: Path, *, trust_remote_code: bool) -> "PretrainedConfig":
    data = _read_config_json(path)  # before importing transformers: bad files fail fast
    problems = _config_number_problems(data)
    if problems:
        raise UsageError(f"{path}: " + "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5
                                                                  else "")
                         + "; fix these numbers in config.json (the model's published config has the real ones)")

    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    model_type = data.get("model_type")
    remote = isinstance(data.get("auto_map"), dict) and "AutoConfig" in data["auto_map"]
    if remote and trust_remote_code:
        # The model's own code: transformers imports it from the folder that holds config.json.
        try:
            return AutoConfig.from_pretrained(
                str(path.parent), trust_remote_code=True, local_files_only=True
            )
        except Exception as error:  # noqa: BLE001 - remote code can raise anything
            raise UsageError(f"{path}: its own config code failed: {_one_line(error)}") from None
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(
            f"{path} has no 'model_type' key; a Hugging Face config.json names its model_type "
            "(e.g. \"llama\")"
        )
    if model_type not in CONFIG_MAPPING:
        if remote:
            raise UsageError(
                f"{path}: model_type {model_type!r} needs the model's own code (auto_map in "
                "config.json); pass --trust-remote-code if you trust that code"
            )
        guesses = closest_names(model_type, _known_model_types())
        hint = f"; did you mean {' or '.join(repr(g) for g in guesses)}?" if guesses else ""
        raise UsageError(
            f"{path}: model_type {model_type!r} is not known to transformers "
            f"{transformers.__version__}{hint} (a newer model may need a newer transformers)"
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as error:  # noqa: BLE001 - config classes validate with several error types
        raise UsageError(f"{path}: transformers rejects this {model_type} config: "
                         f"{_one_line(error)}") from None


def load_config(source: str, *, trust_remote_code: bool = False) -> "PretrainedConfig":
    """The transformers config of ``source``: a registry family name (its tiny debug config), a
    local model folder (holding ``config.json``) or a ``config.json`` path. An existing path wins
    over a family of the same name. Nothing is downloaded.

    Raises UsageError, with the fix, for anything that is not one of those.
    """
    from fsdp_presets.model import families

    path = Path(source).expanduser()
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise UsageError(
                f"folder {source} has no config.json; pass a Hugging Face model folder or the "
                "config.json itself"
            )
        return _config_from_file(config_path, trust_remote_code=trust_remote_code)
    if path.is_file():
        return _config_from_file(path, trust_remote_code=trust_remote_code)
    if source in families.FAMILY_NAMES:
        return families.tiny_config(source)
    if _looks_like_path(source):
        hub_hint = ""
        if source.count("/") == 1 and not source.startswith((".", "/", "~")):
            hub_hint = (
                " (nothing is downloaded: fetch the Hub model's config.json, e.g. "
                f"`hf download {source} config.json --local-dir DIR`, and pass DIR)"
            )
        raise UsageError(f"no such file or folder: {source}{hub_hint}")
    raise UsageError(
        unknown_name_message("family", source, families.FAMILY_NAMES)
        + " (or pass a model folder or config.json path)"
    )


def _one_line(error: BaseException) -> str:
    """The root cause of ``error`` on one line (validators wrap the useful message)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(line.strip() for line in str(error).strip().splitlines())
    if len(text) > 300:  # install hints of optional dependencies run to a paragraph
        text = text[:297] + "..."
    return f"{type(error).__name__}: {text}".rstrip(": ")


# --------------------------------------------------------------------------- building on meta

# Auto classes in order of preference when the config does not name its model class. MaskedLM
# comes before CausalLM because every model type in both mappings (bert, roberta, electra, ...)
# is an encoder whose causal-LM head is a side use.
_AUTO_CLASS_ORDER = (
    "AutoModelForSeq2SeqLM",  # encoder-decoders only (T5, BART)
    "AutoModelForSpeechSeq2Seq",  # encoder-decoders only (Whisper)
    "AutoModelForMaskedLM",
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",  # vision-language models (LLaVA) keep their LM head
    "AutoModelForImageClassification",
    "AutoModel",
)
_ENCODER_DECODER_ONLY = ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq")


def _model_class_from_architectures(config: "PretrainedConfig"):
    """The class ``config.architectures`` names, when transformers has it for this config."""
    import transformers

    for name in getattr(config, "architectures", None) or []:
        try:
            cls = getattr(transformers, name)
        except Exception:  # noqa: BLE001 - lazy module raises AttributeError or import errors
            continue
        config_class = getattr(cls, "config_class", None)
        if isinstance(cls, type) and config_class is not None and isinstance(config, config_class):
            return cls
    return None


def _model_class_by_name(config: "PretrainedConfig"):
    """``XModel`` for an ``XConfig`` that no auto class maps: the towers of composite models
    (``Blip2VisionConfig`` builds ``Blip2VisionModel``)."""
    import transformers

    name = type(config).__name__
    if not name.endswith("Config"):
        return None
    try:
        cls = getattr(transformers, name.removesuffix("Config") + "Model")
    except Exception:  # noqa: BLE001 - lazy module raises AttributeError or import errors
        return None
    config_class = getattr(cls, "config_class", None)
    return cls if config_class is not None and isinstance(config, config_class) else None


def _auto_class_for(config: "PretrainedConfig", *, trust_remote_code: bool):
    """The first auto class that can build ``config`` (see ``_AUTO_CLASS_ORDER``)."""
    import transformers

    auto_map = getattr(config, "auto_map", None) or {}
    for auto_name in _AUTO_CLASS_ORDER:
        if auto_name in _ENCODER_DECODER_ONLY and not getattr(config, "is_encoder_decoder", False):
            continue
        auto_cls = getattr(transformers, auto_name, None)
        if auto_cls is None:  # an older transformers without this auto class
            continue
        if trust_remote_code and auto_name in auto_map:
            return auto_cls
        if type(config) in auto_cls._model_mapping:
            return auto_cls
    return None


def build_meta_model(config: "PretrainedConfig", *, trust_remote_code: bool = False) -> "PreTrainedModel":
    """The model of ``config`` with every tensor on the meta device (shapes only, no memory).

    The class is the one ``config.architectures`` names when transformers has it, otherwise the
    first auto class of ``_AUTO_CLASS_ORDER`` (seq2seq LM for encoder-decoders, masked LM,
    causal LM, image-text-to-text, image classification, base model) that supports the config,
    otherwise ``XModel`` for an ``XConfig``. With ``trust_remote_code`` the config's own
    ``auto_map`` classes are used.
    """
    import torch

    model_cls = None if trust_remote_code else _model_class_from_architectures(config)
    auto_cls = None if model_cls is not None else _auto_class_for(config, trust_remote_code=trust_remote_code)
    if model_cls is None and auto_cls is None and not trust_remote_code:
        model_cls = _model_class_by_name(config)
    if model_cls is None and auto_cls is None:
        raise UsageError(
            f"transformers has no model class for model_type {config.model_type!r} "
            f"({type(config).__name__})"
        )

    def build():
        if model_cls is not None:
            return model_cls._from_config(config)
        return auto_cls.from_config(config, trust_remote_code=trust_remote_code)

    try:
        with torch.device("meta"):
            return build()
    except UsageError:
        raise
    except Exception as first_error:  # noqa: BLE001
        # A few models compute with their buffers in __init__, which meta tensors cannot do:
        # accelerate's init_empty_weights keeps buffers real (they are small) and parameters meta.
        from accelerate import init_empty_weights

        try:
            with init_empty_weights(include_buffers=False):
                return build()
        except Exception:  # noqa: BLE001
            raise UsageError(
                f"cannot build {config.model_type!r} from its config: {_one_line(first_error)}"
            ) from None
