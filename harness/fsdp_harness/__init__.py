"""Test and benchmark harness for fsdp-presets: forked and captured launches of recipes and
workers (``launch``, ``forked_launch``; the command line and environment are
:mod:`fsdp_presets.launching.local`), measuring what a rank holds and sends (``measure``),
fault drills (``drill``), the benchmark (``bench``, ``bench_report``, ``step_bench``), the fault
campaign (``campaign``), the GPU benchmark's figures (``gpu_report``), tiny models
(``tiny_model``), generated documentation sections (``doc_sections``), and the repository's scripts
imported as modules (``scripts``).

A development package of its own (``harness/pyproject.toml``), installed editable by
``scripts/setup.sh`` for the tests and the benchmark scripts, never with fsdp-presets: nothing
under :mod:`fsdp_presets` imports it, nor do the user-facing scripts (tests/test_layout_imports.py).
"""
