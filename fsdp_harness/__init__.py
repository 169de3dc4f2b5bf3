"""Test and benchmark harness for fsdp-presets: launching recipes and workers (``launch``),
measuring what a rank holds and sends (``measure``), fault drills (``drill``), the benchmark
(``bench``, ``bench_report``, ``step_bench``), the fault campaign (``campaign``), the GPU
benchmark's figures (``gpu_report``), tiny and prepared real models (``tiny_model``,
``pretrained``), and generated documentation sections (``doc_sections``).

The scripts under ``scripts/`` are thin entry points to these modules. Not part of the runtime
package: nothing under :mod:`fsdp_presets` imports it (tests/test_layout_imports.py).
"""
