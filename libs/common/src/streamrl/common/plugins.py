"""User code named in a recipe: ``path/to/file.py:name`` or ``package.module:name``.

Reward functions (the reward tier) and environments (the rollout tier) are loaded the same way: the
part after the last colon names the object (a default when absent; a Windows drive colon is not a
separator), the part before is a Python file or an importable module. A file is imported under a
name unique to its path, so two files called ``rewards.py`` do not collide.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def split_spec(spec: str, default: str) -> tuple[str, str]:
    """``a/b.py:f`` -> (``a/b.py``, ``f``); without a name after the colon, ``default``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not name or "/" in name or "\\" in name or not target:
        return spec, default
    return target, name


def import_target(target: str, what: str) -> ModuleType:
    """The module of ``target`` (a ``.py`` path or a module name); ValueError starting with ``what``
    when the file or module is missing."""
    if not (target.endswith(".py") or "/" in target or "\\" in target):
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ValueError(f"{what} module {target!r} not found: {e}") from e
    path = Path(target).expanduser()
    if not path.is_file():
        raise ValueError(f"{what} file not found: {path}")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"streamrl_plugin_{digest}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what} {path} is not a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module
