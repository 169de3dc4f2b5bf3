"""What ``fsdp-presets plan`` prints: a :class:`~fsdp_presets.plan.results.MemoryPlan` as text
(the table, the recommendation and its reason, the save costs and the notes) or as JSON."""

from __future__ import annotations


def plan_json(memory_plan, profile, *, source: str, chosen: list[str], storage_bytes_per_s: float,
              host_bytes: float, terms_note: dict) -> dict:
    """The plan as JSON: the plan itself, the model, the savers turned on (``chosen``), the save
    cost of every strategy (with ``--async-save``'s staging copy against ``host_bytes`` of host
    memory per node), where the activation terms came from and, for LoRA/QLoRA, the adapter."""
    from fsdp_presets.plan.save_cost import save_costs_json

    shape = memory_plan.shape
    document = memory_plan.to_json()
    document["model"] = {"source": source, "architecture": profile.architecture,
                         "total_params": profile.total_params}
    document["settings_chosen"] = chosen
    document["saves"] = save_costs_json(memory_plan, storage_bytes_per_s=storage_bytes_per_s, host_bytes=host_bytes)
    document["activation_terms"] = terms_note
    if shape.lora is not None:
        from fsdp_presets.plan.lora_memory import adapter_params, base_storage_bytes, default_target_modules

        document["lora"] = {**shape.lora.to_json(), "trainable_params": adapter_params(profile, shape),
                            "base_storage_bytes": base_storage_bytes(profile, shape),
                            "targets_resolved": shape.lora.target_modules and list(shape.lora.target_modules)
                            if shape.lora.target_modules and "all-linear" not in shape.lora.target_modules
                            else default_target_modules(profile)}
    return document


def plan_text(memory_plan, profile, *, source: str, chosen: list[str], seq_note: str | None, terms_note: dict,
              storage_bytes_per_s: float, host_bytes: float, saves: bool, mtbf_hours: float | None,
              step_time_s: float | None, diagram: str | None) -> str:
    """The plan as text: :func:`format_plan`, with ``saves`` the save costs (with ``--async-save``'s
    staging copy against ``host_bytes`` of host memory per node, and with ``mtbf_hours`` the save
    interval), then the notes: savers turned on, the sequence length, the
    activation terms' source and the diagram written."""
    from fsdp_presets.plan.save_cost import format_save_costs

    lines = [format_plan(memory_plan, profile, source=source)]
    if saves:
        lines += ["", *format_save_costs(memory_plan, storage_bytes_per_s=storage_bytes_per_s,
                                         mtbf_hours=mtbf_hours, step_time_s=step_time_s, host_bytes=host_bytes)]
    if chosen:
        lines.append(f"note: {' and '.join(chosen)} turned on (auto): nothing fits without")
    if seq_note:
        lines.append(f"note: {seq_note}")
    cache = f" ({terms_note['cache']})" if terms_note.get("cache") else ""
    lines.append(f"activations: {terms_note['source']}: {terms_note['how']}{cache}")
    if diagram:
        lines.append(f"diagram: {diagram}")
    return "\n".join(lines)


def format_plan(memory_plan, profile, *, source: str) -> str:
    """The table, the recommendation and its reason (or the suggestions when nothing fits)."""
    from fsdp_presets.fileio import GiB, byte_unit, format_count, text_table

    hardware, shape = memory_plan.hardware, memory_plan.shape
    nodes = f" on {hardware.nodes} nodes" if hardware.nodes > 1 else ""
    lines = [
        f"{source}: {profile.architecture}, {format_count(profile.total_params)} parameters",
        f"{hardware.gpus} GPUs{nodes} x {hardware.gpu_memory_bytes / GiB:g} GiB "
        f"({hardware.usable_bytes / GiB:.1f} usable), seq {shape.seq_len}, micro-batch {shape.micro_batch}"
        f"{_accumulation_text(shape)}, "
        f"{shape.precision}, {shape.optimizer}, {_method_text(shape)}activation checkpointing "
        f"{'on' if shape.activation_checkpointing else 'off'}, offload {'on' if shape.offload else 'off'}",
        "",
    ]
    # One unit per column family, picked from the largest value so small models stay readable.
    memory_name, memory_unit = byte_unit(max(s.per_gpu.total for s in memory_plan.strategies), binary=True)
    comm_name, comm_unit = byte_unit(max(s.comm.total for s in memory_plan.strategies), binary=False)
    lines.append(f"per GPU in {memory_name}; comm = {comm_name} each GPU sends per step")
    headers = ["strategy", "params", "grads", "optim", "activ", "buffers", "total", "fits", "max mb",
               "comm", "inter-node", "how"]
    rows = []
    for strategy in memory_plan.strategies:
        per_gpu = strategy.per_gpu
        marker = " *" if strategy is memory_plan.recommended else ""
        rows.append([
            strategy.label + marker,
            *(f"{value / memory_unit:.2f}" for value in (per_gpu.params, per_gpu.grads, per_gpu.optimizer,
                                                  per_gpu.activations, per_gpu.buffers, per_gpu.total)),
            "yes" if strategy.fits else "no",
            str(strategy.max_micro_batch),
            f"{strategy.comm.total / comm_unit:.2f}",
            f"{strategy.comm.inter_node / comm_unit:.2f}",
            "composed" if strategy.source == "composed from a rehearsal" else "estimated",
        ])
    lines += text_table(headers, rows, right=set(range(1, len(headers) - 1)))
    notes = sorted({note for strategy in memory_plan.strategies for note in strategy.notes})
    lines += [f"note: {note}" for note in notes]
    lines.append("")
    if memory_plan.recommended is not None:
        lines.append(f"recommended: {memory_plan.recommended.label} (marked *)")
        lines.append(f"reason: {memory_plan.reason}")
    else:
        lines.append("recommended: none")
        lines.append(f"reason: {memory_plan.reason}")
        lines += [f"try: {suggestion}" for suggestion in memory_plan.suggestions]
    return "\n".join(lines)


def _method_text(shape) -> str:
    lora = shape.lora
    if lora is None:
        return ""
    base = "4-bit NF4 base (bf16 storage)" if lora.method == "qlora" else "frozen base"
    targets = "default targets" if lora.target_modules is None else ",".join(lora.target_modules)
    return f"{lora.method} r {lora.r} ({targets}, {base}), "


def _accumulation_text(shape) -> str:
    if shape.grad_accum == 1:
        return ""
    how = "reduced every micro-batch" if shape.reduce_every_micro_batch else "no_sync"
    return f" x {shape.grad_accum} accumulation ({how})"
