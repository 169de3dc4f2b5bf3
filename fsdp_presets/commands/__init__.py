"""One module per ``fsdp-presets`` subcommand.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
Module top levels import only the standard library so that ``fsdp-presets --help`` is instant;
heavy imports (torch, transformers) happen inside ``run``.
"""

# Order here is the order in `fsdp-presets --help`. Adding a command is adding its module name.
COMMANDS: tuple[str, ...] = ("inspect", "plan", "generate", "check", "rehearse", "compare", "converge", "launcher", "export", "import_", "inspect_checkpoint")


def add_conversion_flags(parser, *, verb: str, verify_help: str) -> None:
    """``--verify``, ``--force`` and ``--json`` of ``export`` and ``import`` (``verb``)."""
    parser.add_argument("--verify", action="store_true", help=verify_help)
    parser.add_argument("--force", action="store_true",
                        help=f"replace an existing --output that {verb} wrote before (never any other folder)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def print_conversion(report, *, as_json: bool, written, mismatch: str) -> int:
    """The end of ``export`` and ``import``: the report as JSON, or the lines ``written()`` gives
    (when the folder was written), the check's summary and, when the check failed, that nothing was
    written because of ``mismatch``. Returns the exit status: 1 when the check failed."""
    import json

    from fsdp_presets.checkpoint.hf_model import report_json

    verification = report.verification
    failed = verification is not None and not verification.passed
    if as_json:
        print(json.dumps(report_json(report), indent=2))
        return 1 if failed else 0
    if not failed:
        for line in written():
            print(line)
    if verification is not None:
        print(verification.summary())
    if failed:
        print(f"nothing written to {report.output}: {mismatch}")
    return 1 if failed else 0
