"""Run a callback right after a transformers module is imported.

Registering ``topg`` in transformers' interfaces needs transformers imported, which
takes seconds; importing torch_topg must not pay that. This meta-path finder lets
transformers import itself whenever the user does, and calls back after each
``transformers.*`` module of interest has executed. It only wraps the loader that the
normal finders return; the module itself is unchanged (the wrapper delegates every
other loader attribute, e.g. ``get_source`` for tracebacks).
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any


def wanted(name: str) -> bool:
    """Modules whose import matters: the two interfaces and every model file."""
    return name in ("transformers.modeling_utils", "transformers.integrations.moe") or (
        name.startswith("transformers.models.") and ".modeling_" in name
    )


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str, callback: Callable[[str, ModuleType], None]):
        self._loader, self._name, self._callback = loader, name, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(self._name, module)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)


class PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, callback: Callable[[str, ModuleType], None]):
        self._callback = callback
        self._local = threading.local()

    def find_spec(self, name, path, target=None):
        if not name.startswith("transformers.") or not wanted(name):
            return None
        if getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._local.busy = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, name, self._callback)
        return spec


_installed: list[PostImportFinder] = []


def install(callback: Callable[[str, ModuleType], None]) -> None:
    """Install the finder once, first in ``sys.meta_path``."""
    if not _installed:
        finder = PostImportFinder(callback)
        sys.meta_path.insert(0, finder)
        _installed.append(finder)
