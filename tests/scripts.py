"""Load a script of the repository (``bench/*.py``, ``docs/regen.py``) as a module, so that tests
can call its functions: the scripts are not part of the installed package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str) -> ModuleType:
    """The script at ``ROOT / relative``, imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
