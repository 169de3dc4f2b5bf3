"""``fsdp-presets inspect``: the readable table, the --json contract, and bad input as one line
with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_presets.model import families
from fsdp_presets.cli import main
from fsdp_presets.model.profile import profile_model

from test_profile import LLAMA_70B, bad_source

REPO = Path(__file__).resolve().parent.parent


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_is_the_profile(capsys):
    code, out, err = run_cli(capsys, "mixtral", "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload == json.loads(json.dumps(profile_model("mixtral").to_json()))
    assert payload["wrap_classes"] == ["MixtralDecoderLayer"]
    assert payload["units"][0]["class"] == "MixtralDecoderLayer"
    assert payload["tied_embeddings"] is False
    assert payload["largest_unit_params"] == max(
        [unit["params_each"] for unit in payload["units"]] + [payload["root_params"]]
    )


def test_json_for_the_70b_config(capsys):
    code, out, _ = run_cli(capsys, str(LLAMA_70B / "config.json"), "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["total_params"] == 70_553_706_496
    assert payload["units"] == [{"class": "LlamaDecoderLayer", "count": 80, "params_each": 855_654_400}]


def test_human_output_is_a_table(capsys):
    code, out, _ = run_cli(capsys, "t5")
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("FSDP unit"))
    assert header.split() == ["FSDP", "unit", "count", "params", "each", "total", "share"]
    assert sum(line.startswith("T5Block ") for line in lines) == 4  # two sizes per stack
    assert any(line.startswith("root (embeddings, norms, head)") for line in lines)
    assert "output head    lm_head (tied to the input embedding)" in lines
    assert "registry family" in lines[0]


def test_warning_for_missing_no_split_modules(capsys):
    code, out, _ = run_cli(capsys, "gemma3")
    assert code == 0
    assert "warning: _no_split_modules names SiglipMultiheadAttentionPoolingHead, SiglipTextEmbeddings" in out


def test_list_names_every_family(capsys):
    code, out, _ = run_cli(capsys, "--list")
    assert code == 0
    names = {line.split()[0] for line in out.splitlines()[1:]}
    assert names == set(families.FAMILY_NAMES)


BAD_INPUT = [
    ("unknown-family", "unknown family 'lama'; did you mean 'llama'?"),
    ("missing-folder", "no such file or folder"),
    ("folder-without-config", "has no config.json"),
    ("malformed-json", "is not valid JSON: Expecting property name enclosed in double quotes at line 2"),
    ("unknown-model-type", "model_type 'lama3' is not known to transformers"),
    ("no-model-type", "has no 'model_type' key"),
    ("remote-code", "pass --trust-remote-code"),
]


@pytest.mark.parametrize(("case", "message"), BAD_INPUT, ids=[case for case, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, message):
    code, out, err = run_cli(capsys, bad_source(tmp_path, case))
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("fsdp-presets inspect: error: ")
    assert message in err


def test_missing_model_argument(capsys):
    code, _, err = run_cli(capsys)
    assert code == 2 and "give a MODEL" in err


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_presets.cli", "inspect", bad_source(tmp_path, "malformed-json")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert "is not valid JSON" in result.stderr


REMOTE_CONFIG = """\
from transformers import PretrainedConfig


class ToyConfig(PretrainedConfig):
    model_type = "toy_remote"

    def __init__(self, hidden=16, layers=3, vocab=40, **kwargs):
        self.hidden = hidden
        self.layers = layers
        self.vocab = vocab
        super().__init__(**kwargs)
"""

REMOTE_MODEL = """\
from torch import nn
from transformers import PreTrainedModel

from .configuration_toy import ToyConfig


class ToyBlock(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, hidden)


class ToyForCausalLM(PreTrainedModel):
    config_class = ToyConfig
    _no_split_modules = ["ToyBlock", "ToyGhostLayer"]

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.blocks = nn.ModuleList(ToyBlock(config.hidden) for _ in range(config.layers))
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head
"""


def test_remote_code_runs_only_with_the_flag(tmp_path, capsys):
    """A model transformers does not know, with its own code: refused without the flag, then
    profiled from its structure alone (a ModuleList of ToyBlock) with the flag."""
    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "configuration_toy.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_toy.py").write_text(REMOTE_MODEL)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "toy_remote", "hidden": 16, "layers": 3, "vocab": 40,
        "architectures": ["ToyForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_toy.ToyConfig",
                     "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"},
    }))
    code, _, err = run_cli(capsys, str(folder), "--json")
    assert code == 2 and "--trust-remote-code" in err

    # transformers copies remote code into its modules cache: keep that inside tmp_path.
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_presets.cli", "inspect", str(folder), "--trust-remote-code",
         "--json"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    block = 2 * 16 + 16 * 16 + 16  # LayerNorm weight and bias, Linear weight and bias
    assert payload["units"] == [{"class": "ToyBlock", "count": 3, "params_each": block}]
    assert payload["total_params"] == 40 * 16 + 3 * block + 16 * 40
    assert payload["structure"]["missing_no_split"] == ["ToyGhostLayer"]
    assert payload["tied_embeddings"] is False
    assert payload["dims"]["hidden_size"] == 16 and payload["dims"]["vocab_size"] == 40
    assert payload["architecture"] == "ToyForCausalLM"


PARALLEL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2", "granite", "mixtral", "qwen3_moe")
"""Ten families whose transformers classes ship a tensor-parallel plan, two of them mixtures of experts."""


@pytest.mark.parametrize("family", PARALLEL_FAMILIES)
def test_inspect_lists_the_parallel_plans_and_the_sizes_they_allow(family, capsys):
    from fsdp_presets.cli import main

    assert main(["inspect", family, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    parallel, dims = document["structure"]["parallel"], document["dims"]
    assert parallel["tp_plan"] and parallel["tp_sizes"][0] == 1
    for size in parallel["tp_sizes"]:
        assert dims["num_attention_heads"] % size == 0 and dims["num_key_value_heads"] % size == 0
    # The key/value heads bound it (transformers issue 48307): one more than they allow is not listed.
    assert dims["num_key_value_heads"] * 2 not in parallel["tp_sizes"]
    if dims["num_experts"]:
        assert parallel["ep_plan"] and parallel["ep_sizes"] == [size for size in range(1, dims["num_experts"] + 1)
                                                                if dims["num_experts"] % size == 0]
    else:
        assert parallel["ep_plan"] is None and parallel["ep_sizes"] == []
    assert main(["inspect", family]) == 0
    text = capsys.readouterr().out
    assert "tensor parallel   " in text and "sizes 1, 2" in text
    assert ("expert parallel   " in text) == bool(dims["num_experts"])


def test_inspect_says_when_a_model_has_no_tensor_parallel_plan_and_reads_real_sizes(capsys):
    from fsdp_presets.cli import main

    assert main(["inspect", "gpt2", "--json"]) == 0
    parallel = json.loads(capsys.readouterr().out)["structure"]["parallel"]
    assert parallel["tp_plan"] is None and parallel["tp_sizes"] == []
    assert main(["inspect", "model_configs/llama-3.1-70b", "--json"]) == 0
    parallel = json.loads(capsys.readouterr().out)["structure"]["parallel"]
    assert parallel["tp_sizes"] == [1, 2, 4, 8]  # 8 key/value heads; the 64 query heads would allow 64
    assert parallel["fsdp_plan"] == {"lm_head": "keep_full_weight"}
