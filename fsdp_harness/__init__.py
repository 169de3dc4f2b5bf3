"""Test and benchmark harness for fsdp-presets: launching recipes and workers, measuring what a
rank holds and sends, fault drills, tiny models, generated documentation sections.

Not part of the runtime package: nothing under :mod:`fsdp_presets` imports it.
"""
