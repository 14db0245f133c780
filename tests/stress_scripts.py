"""Load a script of stress/ as a module for tests (stress/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

STRESS = Path(__file__).resolve().parent.parent / "stress"


def load(name: str) -> ModuleType:
    """Import ``stress/<name>.py`` once, as module ``name`` (scripts import each other by name)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, STRESS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
