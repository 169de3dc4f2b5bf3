"""``fsdp-presets check --script TRAIN.py``: what a training script says that its accelerate config
cannot, read statically with :mod:`ast` (the script is never imported or run).

What it looks for (a Hugging Face ``Trainer``/TRL script or a plain accelerate loop):

* a ``*Trainer(...)`` call and a ``.save_model(...)`` call, and whether ``FSDPPresetsCallback`` is
  named anywhere (transformers' Trainer writes no weights from ``save_model`` under
  SHARDED_STATE_DICT; transformers issue 30491);
* gradient checkpointing turned on (``gradient_checkpointing=True``, ``activation_checkpointing=True``,
  ``.gradient_checkpointing_enable()``);
* ``model.to(...)`` / ``model.cuda()`` on a line before the first ``.prepare(...)``;
* ``trust_remote_code=True``;
* a ``DistributedConfig(...)`` (transformers shards the model itself: TP, EP, FSDP2) and its literal
  sizes;
* the training inputs that decide memory: ``bf16``/``fp16``, ``per_device_train_batch_size``,
  ``max_length``/``max_seq_length``, ``load_in_4bit``, ``bnb_4bit_quant_storage``, a ``LoraConfig``,
  and the defaults of ``add_argument`` flags with those names (``--max-seq-length 2048``).

Only literal values count (``bf16=True``, ``max_length=2048``); a value computed at run time is
unknown, and the memory verdict says what it assumed instead.

Bounds: a regular file (no FIFO, device or directory; a symlink is followed to a regular file),
at most :data:`MAX_SCRIPT_BYTES`, UTF-8; Python's parser has its own nesting limit
(``RecursionError``/``MemoryError`` become a refusal too).
"""

from __future__ import annotations

import ast
import os
import stat
from dataclasses import dataclass, field

from fsdp_presets.errors import UsageError

MAX_SCRIPT_BYTES = 2 * 1024 * 1024
"""A training script larger than 2 MiB is refused: scripts are a few hundred lines."""

CALLBACK_NAME = "FSDPPresetsCallback"
"""The Trainer callback (``fsdp_presets.FSDPPresetsCallback``) that makes ``save_model`` write weights."""

_SEQ_NAMES = ("max_length", "max_seq_length", "max_seq_len", "seq_len", "model_max_length", "block_size")
_BATCH_NAMES = ("per_device_train_batch_size", "micro_batch", "micro_batch_size", "batch_size")
_CHECKPOINTING_NAMES = ("gradient_checkpointing", "activation_checkpointing")


@dataclass(kw_only=True)
class ScriptFacts:
    """What a static read of a training script found; None where the script does not say."""

    path: str
    """The script read."""
    trainer_line: int | None = None
    """Line of the first ``*Trainer(...)`` call (transformers' Trainer, TRL's SFTTrainer, ...)."""
    save_model_line: int | None = None
    """Line of the first ``.save_model(...)`` call."""
    has_callback: bool = False
    """``FSDPPresetsCallback`` is named in the script."""
    full_state_dict_for_save: bool = False
    """``set_state_dict_type("FULL_STATE_DICT")`` is called (PEFT's examples do it before ``save_model``)."""
    gradient_checkpointing_line: int | None = None
    """Line where gradient checkpointing is turned on."""
    moved_before_prepare: list[int] = field(default_factory=list)
    """Lines of ``model.to(...)``/``model.cuda()`` before the first ``.prepare(...)``."""
    trust_remote_code_line: int | None = None
    """Line of ``trust_remote_code=True``."""
    precision: str | None = None
    """``bf16``/``fp16`` from ``bf16=True``/``fp16=True`` (Trainer arguments); None: not said."""
    micro_batch: int | None = None
    """``per_device_train_batch_size`` (or a batch flag's default)."""
    seq_len: int | None = None
    """``max_length``/``max_seq_length`` (or such a flag's default)."""
    load_in_4bit: bool = False
    """``load_in_4bit=True``: a 4-bit (QLoRA) base."""
    quant_storage: str | None = None
    """``bnb_4bit_quant_storage`` as written (``bfloat16``, ``uint8``)."""
    uses_lora: bool = False
    """A ``LoraConfig(...)``/``get_peft_model(...)`` call: an adapter over a frozen base."""
    model_dtype: str | None = None
    """``bf16``/``fp16``/``fp32`` from ``from_pretrained(dtype=torch.X)`` (or ``torch_dtype=``)."""
    double_quant: bool = False
    """``bnb_4bit_use_double_quant=True``."""
    distributed_config_line: int | None = None
    """Line of a ``DistributedConfig(...)`` call: ``from_pretrained`` shards the model itself."""
    distributed_sizes: dict = field(default_factory=dict)
    """Its literal sizes (``tp_size``, ``ep_size``, ``fsdp_size``, ``dp_replicate_size``; legacy
    ``enable_expert_parallel=True`` counts as ``ep_size`` = ``tp_size``)."""
    parses_arguments: bool = False
    """The script takes its settings from the command line (``HfArgumentParser``, ``TrlParser``,
    ``parse_args``): what it does not write as a literal is decided at launch, so still unknown."""

    @property
    def method(self) -> str | None:
        """``qlora`` (4-bit base), ``lora`` (an adapter), None (the script does not show)."""
        if self.load_in_4bit:
            return "qlora"
        return "lora" if self.uses_lora else None

    def inputs(self) -> list[str]:
        """What the script gave the memory verdict, in words."""
        said = []
        if self.precision:
            said.append(self.precision)
        if self.gradient_checkpointing_line:
            said.append("gradient checkpointing")
        if self.micro_batch:
            said.append(f"micro-batch {self.micro_batch}")
        if self.seq_len:
            said.append(f"sequence {self.seq_len}")
        if self.method:
            said.append(self.method + (f" ({self.quant_storage} storage)" if self.quant_storage else ""))
        return said


def read_script(path: str | os.PathLike) -> ScriptFacts:
    """Read ``path`` statically; raises :class:`UsageError` (one line) when it cannot be read as Python."""
    name = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the type is checked on what was opened
        descriptor = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        raise UsageError(f"--script {name}: {error.strerror or error}") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"--script {name}: not a regular file; give the training script (a .py file)")
        if info.st_size > MAX_SCRIPT_BYTES:
            raise UsageError(f"--script {name}: {info.st_size} bytes, more than the {MAX_SCRIPT_BYTES} a training "
                             "script is allowed here; give the script itself")
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            data = handle.read(MAX_SCRIPT_BYTES + 1)
        if len(data) > MAX_SCRIPT_BYTES:
            raise UsageError(f"--script {name}: more than the {MAX_SCRIPT_BYTES} bytes a training script is allowed "
                             "here; give the script itself")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--script {name}: cannot read it as UTF-8 text ({error})") from None
    finally:
        os.close(descriptor)
    return read_source(text, path=name)


def read_source(text: str, *, path: str = "<script>") -> ScriptFacts:
    """The facts of Python source ``text`` (parsed, never run)."""
    try:
        tree = ast.parse(text, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise UsageError(f"--script {path}: not Python that parses ({type(error).__name__}: "
                         f"{getattr(error, 'msg', error)}); give the training script") from None
    facts = ScriptFacts(path=path)
    prepare_lines, moves = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == CALLBACK_NAME:
            facts.has_callback = True
        elif isinstance(node, ast.Attribute) and node.attr == CALLBACK_NAME:
            facts.has_callback = True
        if not isinstance(node, ast.Call):
            continue
        called = _called_name(node.func)
        if called.endswith("Trainer"):
            facts.trainer_line = _first(facts.trainer_line, node.lineno)
        if called == "save_model" and isinstance(node.func, ast.Attribute):
            facts.save_model_line = _first(facts.save_model_line, node.lineno)
        if called == "set_state_dict_type" and any(
                "FULL_STATE_DICT" in ast.unparse(argument) for argument in node.args):
            facts.full_state_dict_for_save = True
        if called == "prepare" and isinstance(node.func, ast.Attribute):
            prepare_lines.append(node.lineno)
        if called in ("gradient_checkpointing_enable", "activation_checkpointing_enable"):
            facts.gradient_checkpointing_line = _first(facts.gradient_checkpointing_line, node.lineno)
        if called in ("LoraConfig", "get_peft_model"):
            facts.uses_lora = True
        if called == "DistributedConfig":
            facts.distributed_config_line = _first(facts.distributed_config_line, node.lineno)
            for keyword in node.keywords:
                value = _literal(keyword.value)
                if keyword.arg in ("tp_size", "ep_size", "fsdp_size", "dp_replicate_size") and _count(value):
                    facts.distributed_sizes[keyword.arg] = value
                elif keyword.arg == "enable_expert_parallel" and value is True:
                    facts.distributed_sizes.setdefault("enable_expert_parallel", 1)
        if isinstance(node.func, ast.Attribute) and called in ("to", "cuda") and _names_a_model(node.func.value):
            if called == "cuda" or _moves_to_a_device(node):
                moves.append(node.lineno)
        if called == "add_argument":
            _flag_default(node, facts)
        if called in ("HfArgumentParser", "TrlParser", "parse_args", "parse_args_into_dataclasses",
                      "parse_args_and_config"):
            facts.parses_arguments = True
        for keyword in node.keywords:
            _keyword(keyword, node.lineno, facts, called)
    if prepare_lines:
        first_prepare = min(prepare_lines)
        facts.moved_before_prepare = sorted(line for line in moves if line < first_prepare)
    return facts


def _first(current: int | None, line: int) -> int:
    return line if current is None else min(current, line)


def _called_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _names_a_model(value: ast.expr) -> bool:
    """``model``, ``self.model``, ``base_model``, ``model.module``: a receiver that reads as the model."""
    while isinstance(value, ast.Attribute) and value.attr in ("module", "base_model"):
        value = value.value
    name = value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""
    return "model" in name.lower()


def _moves_to_a_device(call: ast.Call) -> bool:
    """``.to("cuda")``, ``.to(device)``, ``.to(accelerator.device)``: not ``.to(torch.bfloat16)``."""
    for argument in [*call.args, *(keyword.value for keyword in call.keywords if keyword.arg == "device")]:
        if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
            return argument.value.split(":")[0] in ("cuda", "xpu", "npu", "mps", "hpu")
        text = ast.unparse(argument)
        if "dtype" in text or text.startswith("torch.") and not text.startswith("torch.device"):
            continue
        if "device" in text or "local_rank" in text or "rank" in text:
            return True
    return False


def _literal(value: ast.expr):
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return None


def _keyword(keyword: ast.keyword, line: int, facts: ScriptFacts, called: str) -> None:
    name = keyword.arg
    if name is None:
        return
    value = _literal(keyword.value)
    if name in _CHECKPOINTING_NAMES and value is True:
        facts.gradient_checkpointing_line = _first(facts.gradient_checkpointing_line, line)
    elif name == "trust_remote_code" and value is True:
        facts.trust_remote_code_line = _first(facts.trust_remote_code_line, line)
    elif name in ("bf16", "fp16") and value is True:
        facts.precision = name
    elif name in _BATCH_NAMES and _count(value):
        facts.micro_batch = facts.micro_batch or value
    elif name in _SEQ_NAMES and _count(value):
        facts.seq_len = facts.seq_len or value
    elif name == "load_in_4bit" and value is True:
        facts.load_in_4bit = True
    elif name in ("dtype", "torch_dtype") and called == "from_pretrained":
        text = (value if isinstance(value, str) else ast.unparse(keyword.value)).removeprefix("torch.")
        facts.model_dtype = facts.model_dtype or {"bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                                                  "float32": "fp32", "float": "fp32"}.get(text)
    elif name == "bnb_4bit_use_double_quant" and value is True:
        facts.double_quant = True
    elif name == "bnb_4bit_quant_storage":
        text = value if isinstance(value, str) else ast.unparse(keyword.value)
        facts.quant_storage = text.removeprefix("torch.")
    elif name == "peft_config" and not (isinstance(keyword.value, ast.Constant) and keyword.value.value is None):
        facts.uses_lora = True


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _flag_default(call: ast.Call, facts: ScriptFacts) -> None:
    """``parser.add_argument("--max-seq-length", type=int, default=2048)``: the default counts as the
    script's value (a recipe's own flags, launched without overriding them)."""
    names = [argument.value.lstrip("-").replace("-", "_") for argument in call.args
             if isinstance(argument, ast.Constant) and isinstance(argument.value, str)]
    default = next((_literal(keyword.value) for keyword in call.keywords if keyword.arg == "default"), None)
    if not names or default is None:
        return
    for name in names:
        if name in _SEQ_NAMES and _count(default):
            facts.seq_len = facts.seq_len or default
        elif name in _BATCH_NAMES and _count(default):
            facts.micro_batch = facts.micro_batch or default
        elif name in _CHECKPOINTING_NAMES and default is True:
            facts.gradient_checkpointing_line = _first(facts.gradient_checkpointing_line, call.lineno)
        elif name in ("bf16", "fp16") and default is True:
            facts.precision = name


# --------------------------------------------------------------------------- the rules


def script_rules(fsdp: dict, version, context) -> list:
    """The traps of the script (``context.script``) under this config (``fsdp``: canonical values)."""
    from fsdp_presets.check.findings import finding
    from fsdp_presets.schema import K, fsdp_where

    script: ScriptFacts = context.script
    findings = []
    where = f"{script.path}:"
    state_dict = fsdp.get(K.state_dict_type) or ("SHARDED_STATE_DICT" if version == 2 else "FULL_STATE_DICT")
    if script.trainer_line and script.save_model_line and state_dict == "SHARDED_STATE_DICT" \
            and not script.has_callback and not script.full_state_dict_for_save:
        findings.append(finding(
            "trainer-save-model-sharded", f"{where}{script.save_model_line} calls save_model on the Trainer (line "
            f"{script.trainer_line}) under {state_dict}" + ("" if K.state_dict_type in fsdp else
                                                            " (accelerate's FSDP2 default)") + ": transformers' "
            "Trainer then writes no model weights at all, silently (transformers issue 30491), so the run ends "
            "without a loadable model", f"add callbacks=[fsdp_presets.{CALLBACK_NAME}()] to the Trainer (save_model "
            f"then writes a complete Hugging Face folder), or set {K.state_dict_type}: FULL_STATE_DICT",
            fsdp_where(K.state_dict_type)))
    if script.gradient_checkpointing_line and fsdp.get(K.activation_checkpointing) is True:
        trainer = script.trainer_line is not None
        findings.append(finding(
            "double-activation-checkpointing", f"{where}{script.gradient_checkpointing_line} turns on gradient "
            f"checkpointing and the config sets {K.activation_checkpointing}: true: " + (
                "transformers' Trainer refuses the two together at start ('can't both be set to True')" if trainer
                else "the blocks are checkpointed twice (model and FSDP), recomputing the forward twice"),
            f"keep one: {K.activation_checkpointing}: true with gradient_checkpointing=False in the script (FSDP's "
            "own, as transformers recommends under FSDP), or the reverse", fsdp_where(K.activation_checkpointing)))
    if script.moved_before_prepare and script.trainer_line is None:
        lines = ", ".join(str(line) for line in script.moved_before_prepare[:3])
        findings.append(finding(
            "model-moved-before-prepare", f"{where}{lines} moves the model onto the GPU before accelerator.prepare: "
            "every rank then holds the whole unsharded model at once (a 70B model in bf16 is 140 GB) before FSDP "
            "shards it, the very peak FSDP exists to avoid, and RAM-efficient loading is undone",
            "remove the .to(device)/.cuda() call: accelerator.prepare(model) moves each rank's shard to its GPU",
            None))
    if script.distributed_config_line:
        findings += _distributed_config_rules(fsdp, version, context)
    if script.trust_remote_code_line:
        model = context.model
        built_alike = model is None or model.trust_remote_code
        findings.append(finding(
            "trust-remote-code", f"{where}{script.trust_remote_code_line} passes trust_remote_code=True: the model "
            "repository's own Python code runs on every rank at load time, and its module classes are the ones to "
            "wrap" + ("" if built_alike else "; this check built the model with transformers' own classes"),
            "pin the repository revision you reviewed (revision=...)" + (
                "" if built_alike else ", and pass --trust-remote-code to check the classes the script builds"),
            None))
    return findings


def _distributed_config_rules(fsdp: dict, version, context) -> list:
    """A model transformers shards itself (``from_pretrained(..., distributed_config=...)``) under an
    FSDP config: the findings of its mesh."""
    from fsdp_presets.check.findings import finding
    from fsdp_presets.check.rules_parallel import mesh_rules
    from fsdp_presets.schema import K, T, fsdp_where

    script: ScriptFacts = context.script
    sizes = dict(script.distributed_sizes)
    where = f"{script.path}:{script.distributed_config_line}"
    tp = sizes.get("tp_size", 1)
    ep = sizes.get("ep_size") or (tp if sizes.get("enable_expert_parallel") else 1)
    findings = []
    trainer_config = "NAME.trainer.yaml (`fsdp-presets generate --tp N` / `--ep N` writes it beside NAME.yaml)"
    if script.trainer_line is None:
        findings.append(finding(
            "distributed-config-under-fsdp", f"{where} shards the model with transformers' DistributedConfig and "
            "the config gives accelerate an FSDP plugin too: accelerator.prepare wraps the sharded model again and "
            "fails ('Could not find the transformer layer class ...', measured with accelerate 1.16)",
            "shard it once: drop distributed_config and let the FSDP config shard the model, or hand the model "
            "sharded by transformers to transformers' Trainer launched under a DDP-type config with every rank "
            f"of the mesh, {trainer_config}", None))
    else:
        findings.append(finding(
            "distributed-config-under-fsdp", f"{where} shards the model with transformers' DistributedConfig and "
            f"hands it to the Trainer (line {script.trainer_line}) under an FSDP config: the Trainer takes the model "
            "as it is and prepares its optimizer alone, which accelerate refuses under FSDP ('an optimizer must be "
            "passed together with its model', measured with accelerate 1.16 and transformers 5.25)",
            f"launch the script with a DDP-type config ({T.distributed_type}: MULTI_GPU) of every rank of the mesh, "
            f"{trainer_config}", None))
    loads_on_rank_0 = fsdp.get(K.cpu_ram_efficient_loading, True)
    if ep > 1 and loads_on_rank_0:
        findings.append(finding(
            "ep-ram-efficient-loading", f"{where} asks for expert parallelism {ep} and the config loads the weights on "
            f"rank 0 and broadcasts them ({K.cpu_ram_efficient_loading}: true"
            + ("" if K.cpu_ram_efficient_loading in fsdp else ", accelerate's default") + "): every rank then holds rank "
            "0's experts, silently (transformers issue 45662)", f"set {K.cpu_ram_efficient_loading}: false",
            fsdp_where(K.cpu_ram_efficient_loading)))
    if tp > 1:
        findings.append(finding(
            "tp-loss-reduction", f"{where}: tensor parallelism {tp}: a loss counted {tp} times, or a rank that skips "
            "its all-reduce, trains without an error (transformers issues 45994, 39674)",
            "hold the run to its DDP baseline: fsdp-presets converge (docs/convergence.md)", None))
    findings += mesh_rules(tp=tp, ep=ep, context=context, where=where)
    return findings
