"""The model-family registry: one plain-data entry per family, each with a tiny debug config.

A family names the Hugging Face ``model_type`` it covers and a tiny config of that type
(hidden 32, 2 layers, vocabulary 128) that builds a real model in milliseconds, for tests and
for ``fsdp-presets inspect llama``. Nothing else is typed in by hand: block classes, tied
weights, norms and parameter counts are read off the model by :mod:`fsdp_presets.model.profile`.
A ``model_type`` that is not listed here still profiles through that structural detection.

Adding a family is adding one entry to the table of its kind, written with the builder of that
kind (``decoder(...)``, ``encoder(...)``, ... in :mod:`fsdp_presets.model.family`: a tiny base shape
plus what differs): decoders in :mod:`fsdp_presets.model.families_decoders`, the others below;
``tests/test_profile.py`` builds every entry for real.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_presets.errors import UsageError, unknown_name_message
from fsdp_presets.fileio import text_table
from fsdp_presets.model.families_decoders import DECODER_FAMILIES
from fsdp_presets.model.family import ENCODER_TINY, SEQ2SEQ_IDS, Family, encoder, seq2seq, vision

if TYPE_CHECKING:  # transformers is imported only when a config is built
    from transformers import PretrainedConfig


FAMILIES: tuple[Family, ...] = DECODER_FAMILIES + (
    # ---------------------------------------------------------------- encoders
    encoder("bert", "BertForMaskedLM", base=ENCODER_TINY,
            note="BERT (google-bert/bert-base-uncased) and sentence encoders such as all-MiniLM-L6-v2."),
    # RoBERTa offsets positions by pad_token_id + 1, hence 2 extra rows.
    encoder("roberta", "RobertaForMaskedLM", base=ENCODER_TINY, max_position_embeddings=66, pad_token_id=1,
            note="RoBERTa (FacebookAI/roberta-base)."),
    encoder("deberta-v2", "DebertaV2ForMaskedLM", base=ENCODER_TINY, relative_attention=True, position_buckets=16,
            max_relative_positions=64, pos_att_type=["p2c", "c2p"], position_biased_input=False,
            note="DeBERTa v2/v3 (microsoft/deberta-v3-base): disentangled relative attention."),
    encoder("modernbert", "ModernBertForMaskedLM", base=ENCODER_TINY, bos_token_id=1, eos_token_id=2,
            cls_token_id=1, sep_token_id=2,
            note="ModernBERT (answerdotai/ModernBERT-base): rotary, alternating local attention."),
    # ---------------------------------------------------------------- encoder-decoders
    seq2seq("t5", "T5ForConditionalGeneration", base=SEQ2SEQ_IDS, d_model=32, d_ff=64, d_kv=8, num_layers=2,
            num_heads=4, vocab_size=128, relative_attention_num_buckets=8,
            note="T5 and Flan-T5 (google/flan-t5-base): shared embedding, relative position bias in the first block"
                 " of each stack (so that block is larger)."),
    seq2seq("bart", "BartForConditionalGeneration", base=SEQ2SEQ_IDS, d_model=32, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, vocab_size=128, max_position_embeddings=64, forced_eos_token_id=2,
            note="BART (facebook/bart-large): separate encoder and decoder layer classes."),
    seq2seq("whisper", "WhisperForConditionalGeneration", base=SEQ2SEQ_IDS, d_model=32, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, vocab_size=128, num_mel_bins=16, max_source_positions=32, max_target_positions=32,
            suppress_tokens=[], begin_suppress_tokens=[],
            note="Whisper speech recognition (openai/whisper-large-v3): convolutional audio stem."),
    # ---------------------------------------------------------------- vision
    vision("vit", "ViTForImageClassification", base={}, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, image_size=32, patch_size=8, num_labels=10,
           note="Vision Transformer (google/vit-base-patch16-224): patch embedding, classifier head."),
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


def families_table() -> str:
    """``fsdp-presets inspect --list``: every family, its model_type, kind and what it covers."""
    rows = [[family.name, family.model_type, family.kind, family.note] for family in FAMILIES]
    return "\n".join(text_table(["family", "model_type", "kind", "covers"], rows, right=set()))


__all__ = ["FAMILIES", "FAMILY_NAMES", "families_table", "family_for_model_type", "get_family", "tiny_config"]
