"""What to do, and how to say it to accelerate: the request, the decisions, the config files.

``request`` (what the user asked for) -> ``presets`` (decisions with reasons, ``choices`` their
types) -> ``emit`` (accelerate's YAML with its self-describing header; ``emit_commands`` the launch
lines) -> ``generate`` (render and write every file atomically). ``accelerate_view`` reads any
config the way accelerate does; ``launchers`` writes multi-node launch scripts, ``quoting`` quotes
values for shells; ``rehearse_request`` rehearses a preset (or a model's decided preset) at full
size. Accelerate's key names come from :mod:`fsdp_presets.schema`.
"""
