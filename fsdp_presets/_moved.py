"""Old import paths of modules that moved into subpackages keep working.

``import fsdp_presets.training`` (or ``from fsdp_presets.checkpoint_files import ...``) gives the
module at its new place, the same module object, so scripts written against the flat layout run
unchanged. New code imports the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

MOVED = {
    "fsdp_presets.digest": "fsdp_presets.fileio",
    "fsdp_presets.profile": "fsdp_presets.plan.profile",
    "fsdp_presets.families": "fsdp_presets.plan.families",
    "fsdp_presets.planner": "fsdp_presets.plan.planner",
    "fsdp_presets.presets": "fsdp_presets.plan.presets",
    "fsdp_presets.emit": "fsdp_presets.plan.emit",
    "fsdp_presets.lint": "fsdp_presets.plan.check",
    "fsdp_presets.wrap_probe": "fsdp_presets.plan.wrap_probe",
    "fsdp_presets.rehearsal": "fsdp_presets.plan.rehearsal",
    "fsdp_presets.rehearsed_presets": "fsdp_presets.plan.rehearsed_presets",
    "fsdp_presets.plan_diagram": "fsdp_presets.plan.diagram",
    "fsdp_presets.launchers": "fsdp_presets.plan.launchers",
    "fsdp_presets.quoting": "fsdp_presets.plan.quoting",
    "fsdp_presets.method_flags": "fsdp_presets.plan.methods",
    "fsdp_presets.training": "fsdp_presets.train.loop",
    "fsdp_presets.data": "fsdp_presets.train.data",
    "fsdp_presets.metrics": "fsdp_presets.train.metrics",
    "fsdp_presets.plots": "fsdp_presets.train.plots",
    "fsdp_presets.interrupts": "fsdp_presets.train.interrupts",
    "fsdp_presets.recipe_checks": "fsdp_presets.train.startup",
    "fsdp_presets.lora": "fsdp_presets.train.lora",
    "fsdp_presets.export": "fsdp_presets.train.final_model",
    "fsdp_presets.eval_metrics": "fsdp_presets.train.eval_metrics",
    "fsdp_presets.checkpoint_files": "fsdp_presets.checkpoint.files",
    "fsdp_presets.checkpoint_inspect": "fsdp_presets.checkpoint.inspect",
    "fsdp_presets.resume": "fsdp_presets.checkpoint.resume",
    "fsdp_presets.convert": "fsdp_presets.checkpoint.convert",
    "fsdp_presets.safe_unpickle": "fsdp_presets.checkpoint.safe_unpickle",
    "fsdp_presets.run_folder": "fsdp_presets.checkpoint.run_folder",
    "fsdp_presets.compare_report": "fsdp_presets.compare.report",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
