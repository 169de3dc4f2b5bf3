"""A script of the repository (``scripts/NAME.py``, a documentation example) imported as a module,
so that a test calls its ``main`` in the test's own process::

    script_module(REPO / "scripts" / "make_presets.py").main(["--output-dir", str(tmp_path)])
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path


def script_module(path: str | Path):
    """The script at ``path`` imported once per process (its ``if __name__ == "__main__"`` part
    does not run); a file that fails to import is not kept."""
    name = "script_" + re.sub(r"\W", "_", str(Path(path).resolve()))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
