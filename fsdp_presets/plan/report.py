"""What ``fsdp-presets plan`` prints: a :class:`~fsdp_presets.plan.results.MemoryPlan` as text
(the table, the recommendation and its reason, the save costs and the notes) or as JSON."""

from __future__ import annotations

from fsdp_presets.plan.limits import GPUS_PER_SERVER, one_machine_note


def plan_json(memory_plan, profile, *, source: str, chosen: list[str], storage_bytes_per_s: float,
              host_bytes: float, terms_note: dict, fastest=None, tokens: float | None = None) -> dict:
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
    document["fastest"] = None if fastest is None else fastest.to_json()
    if tokens:
        document["tokens"] = tokens
        for row, strategy in zip(document["strategies"], memory_plan.strategies):
            row.update(training_cost(strategy, memory_plan.hardware, tokens))
        if fastest is not None:
            document["fastest"].update(training_cost(fastest.row, memory_plan.hardware, tokens))
    if shape.lora is not None:
        from fsdp_presets.plan.lora_memory import adapter_params, base_storage_bytes, default_target_modules

        document["lora"] = {**shape.lora.to_json(), "trainable_params": adapter_params(profile, shape),
                            "base_storage_bytes": base_storage_bytes(profile, shape),
                            "targets_resolved": shape.lora.target_modules and list(shape.lora.target_modules)
                            if shape.lora.target_modules and "all-linear" not in shape.lora.target_modules
                            else default_target_modules(profile)}
    return document


def training_cost(strategy, hardware, tokens: float) -> dict:
    """Hours and GPU-hours to train on ``tokens`` with ``strategy`` (None each without a step time)."""
    if strategy.time is None:
        return {"training_hours": None, "gpu_hours": None}
    hours = tokens / (strategy.time.tokens_per_s_per_gpu * hardware.gpus) / 3600
    return {"training_hours": hours, "gpu_hours": hours * hardware.gpus}


def _hours(hours: float, unit: str = "hours") -> str:
    """``158.1 hours``, ``3,686 GPU-hours``; below one, three significant digits (``0.00417 hours``)
    rather than a zero."""
    if hours >= 1:
        return f"{hours:,.1f} {unit}" if unit == "hours" else f"{hours:,.0f} {unit}"
    return f"{hours:.3g} {unit}"


def plan_text(memory_plan, profile, *, source: str, chosen: list[str], seq_note: str | None, terms_note: dict,
              storage_bytes_per_s: float, host_bytes: float, saves: bool, mtbf_hours: float | None,
              step_time_s: float | None, diagram: str | None, fastest=None, tokens: float | None = None,
              gpu_note: str | None = None) -> str:
    """The plan as text: :func:`format_plan`, with ``saves`` the save costs (with ``--async-save``'s
    staging copy against ``host_bytes`` of host memory per node, and with ``mtbf_hours`` the save
    interval), then the notes: savers turned on, the sequence length, the
    activation terms' source and the diagram written."""
    from fsdp_presets.plan.save_cost import format_save_costs

    lines = [format_plan(memory_plan, profile, source=source)]
    if fastest is not None:
        lines.append(f"fastest: {fastest.reason}")
    best = memory_plan.recommended
    if tokens and best is not None and best.time is not None:
        cost = training_cost(best, memory_plan.hardware, tokens)
        line = (f"{tokens:.3g} tokens with {best.label}: {_hours(cost['training_hours'])} on "
                f"{memory_plan.hardware.gpus} GPUs, {_hours(cost['gpu_hours'], 'GPU-hours')}")
        if fastest is not None and fastest.row.time.tokens_per_s_per_gpu > best.time.tokens_per_s_per_gpu:
            quicker = training_cost(fastest.row, memory_plan.hardware, tokens)
            line += (f"; with the fastest above: {_hours(quicker['training_hours'])}, "
                     f"{_hours(quicker['gpu_hours'], 'GPU-hours')}")
        lines.append(line)
    if saves:
        lines += ["", *format_save_costs(memory_plan, storage_bytes_per_s=storage_bytes_per_s,
                                         mtbf_hours=mtbf_hours, step_time_s=step_time_s, host_bytes=host_bytes)]
    if chosen:
        lines.append(f"note: {' and '.join(chosen)} turned on (auto): nothing fits without")
    if gpu_note:
        lines.append(f"note: {gpu_note}")
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
    gpu = f" {hardware.gpu.name}" if hardware.gpu is not None else ""
    devices = f"{hardware.gpus} CPU processes (this host, measured)" if hardware.host is not None else \
        f"{hardware.gpus}{gpu} GPUs{nodes}"
    lines = [
        f"{source}: {profile.architecture}, {format_count(profile.total_params)} parameters",
        f"{devices} x {hardware.gpu_memory_bytes / GiB:g} GiB "
        f"({hardware.usable_bytes / GiB:.1f} usable), seq {shape.seq_len}, micro-batch {shape.micro_batch}"
        f"{_accumulation_text(shape)}, "
        f"{shape.precision}, {shape.optimizer}, {_method_text(shape)}activation checkpointing "
        f"{'on' if shape.activation_checkpointing else 'off'}, offload {'on' if shape.offload else 'off'}",
    ]
    one_machine = one_machine_note(hardware.gpus, hardware.nodes) if hardware.host is None else None
    lines += ([f"note: {one_machine}"] if one_machine else []) + [""]
    # One unit per column family, picked from the largest value so small models stay readable.
    memory_name, memory_unit = byte_unit(max(s.per_gpu.total for s in memory_plan.strategies), binary=True)
    comm_name, comm_unit = byte_unit(max(s.comm_total for s in memory_plan.strategies), binary=False)
    timed = all(s.time is not None for s in memory_plan.strategies)
    lines.append(f"per GPU in {memory_name}; comm = {comm_name} each GPU sends per step"
                 + ("; s/step, tokens/s per GPU, MFU (6N + 12LHQT), share of the step waiting on communication"
                    if timed else ""))
    headers = ["strategy", "params", "grads", "optim", "activ", "buffers", "total", "fits", "max mb",
               "comm", "inter-node"] + (["s/step", "tok/s/GPU", "MFU", "exposed"] if timed else []) + ["how"]
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
            f"{strategy.comm_total / comm_unit:.2f}",
            f"{strategy.comm.inter_node / comm_unit:.2f}",
            *(_time_cells(strategy.time) if timed else []),
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


def _time_cells(time) -> list[str]:
    return [f"{time.step_s:.3g}", f"{time.tokens_per_s_per_gpu:,.0f}", f"{time.mfu:.0%}",
            f"{time.exposed_comm_fraction:.0%}"]


def scaling_json(plans, profile, *, source: str, tokens: float | None) -> dict:
    """``plan --gpus 8,16,32 --json``: one row per count (its recommended strategy's time) and every plan."""
    return {"model": {"source": source, "architecture": profile.architecture, "total_params": profile.total_params},
            "scaling": _scaling_rows(plans, tokens),
            "plans": [{**memory_plan.to_json(), "settings_chosen": chosen,
                       "fastest": None if found is None else found.to_json()} for memory_plan, chosen, found in plans]}


def _scaling_rows(plans, tokens: float | None) -> list[dict]:
    rows, first = [], None
    for memory_plan, _, found in plans:
        hardware, best = memory_plan.hardware, memory_plan.recommended
        row = {"gpus": hardware.gpus, "nodes": hardware.nodes, "fits": best is not None,
               "recommended": None if best is None else {"name": best.name, "fsdp_version": best.fsdp_version},
               "step_time_s": None, "tokens_per_s_per_gpu": None, "tokens_per_s": None, "mfu": None,
               "exposed_comm_fraction": None, "speedup": None, "scaling_efficiency": None,
               "fastest": None if found is None else found.to_json()}
        if best is not None and best.time is not None:
            total = best.time.tokens_per_s_per_gpu * hardware.gpus
            first = first or (total, hardware.gpus)
            row.update(step_time_s=best.time.step_s, tokens_per_s_per_gpu=best.time.tokens_per_s_per_gpu,
                       tokens_per_s=total, mfu=best.time.mfu, exposed_comm_fraction=best.time.exposed_comm_fraction,
                       speedup=total / first[0], scaling_efficiency=(total / first[0]) / (hardware.gpus / first[1]))
            if tokens:
                row.update(training_cost(best, hardware, tokens))
        rows.append(row)
    return rows


def scaling_text(plans, profile, *, source: str, tokens: float | None, gpu_note: str | None) -> str:
    """The scaling table: per GPU count, the recommended strategy, its step time, throughput and
    speed-up over the first count that fits (and with ``tokens``, hours and GPU-hours)."""
    from fsdp_presets.fileio import format_count, text_table

    memory_plan = plans[0][0]
    shape, gpu = memory_plan.shape, memory_plan.hardware.gpu
    lines = [f"{source}: {profile.architecture}, {format_count(profile.total_params)} parameters",
             f"{gpu.name if gpu else ''} GPUs, {GPUS_PER_SERVER} a node above {GPUS_PER_SERVER}; seq {shape.seq_len}, "
             f"micro-batch {shape.micro_batch}"
             f"{_accumulation_text(shape)}, {shape.precision}, activation checkpointing "
             f"{'on' if shape.activation_checkpointing else 'off'}, offload {'on' if shape.offload else 'off'}", ""]
    headers = ["GPUs", "nodes", "recommended", "s/step", "tok/s/GPU", "tok/s", "MFU", "exposed", "speed-up",
               "efficiency"] + (["hours", "GPU-hours"] if tokens else []) + ["fastest"]
    table = []

    def described(found) -> str:
        return (f"{found.row.label} mb {found.shape.micro_batch} x {found.shape.grad_accum}, AC "
                f"{'on' if found.shape.activation_checkpointing else 'off'}: {found.row.time.step_s:.3g} s, "
                f"{found.row.time.tokens_per_s_per_gpu:,.0f} tok/s/GPU")

    for row, (counted, chosen, found) in zip(_scaling_rows(plans, tokens), plans):
        if row["step_time_s"] is None:
            table.append([str(row["gpus"]), str(row["nodes"]), "nothing fits"] + [""] * (len(headers) - 4)
                         + ["" if found is None else described(found)])
            continue
        best = counted.recommended
        cells = [str(row["gpus"]), str(row["nodes"]), best.label + (" +" + "+".join(chosen) if chosen else ""),
                 f"{row['step_time_s']:.3g}", f"{row['tokens_per_s_per_gpu']:,.0f}", f"{row['tokens_per_s']:,.0f}",
                 f"{row['mfu']:.0%}", f"{row['exposed_comm_fraction']:.0%}", f"{row['speedup']:.2f}x",
                 f"{row['scaling_efficiency']:.0%}"]
        if tokens:
            cells += [_hours(row["training_hours"]).split()[0], _hours(row["gpu_hours"], "GPU-hours").split()[0]]
        cells.append("as asked" if found is None or found.shape == counted.shape and found.row.label == best.label
                     else described(found))
        table.append(cells)
    lines += text_table(headers, table, right=set(range(3, len(headers) - 1)))
    lines.append("")
    lines.append("speed-up: tokens/s of the whole job against the first count that fits; efficiency: speed-up per "
                 "added GPU (100% = linear)")
    if gpu_note:
        lines.append(f"note: {gpu_note}")
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
