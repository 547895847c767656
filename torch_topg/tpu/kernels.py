"""Loading the Pallas kernel package ``torch_topg._tpu_kernels`` (source: ``csrc/tpu``).

An installed torch_topg (wheel or editable install) maps ``csrc/tpu`` to that package
(``package_dir`` in setup.py). A source checkout used through ``PYTHONPATH`` has no such
folder under ``torch_topg/``; there the package is loaded from ``<repo>/csrc/tpu`` under the
same name, so ``import torch_topg._tpu_kernels.attention`` works in both cases once
:func:`kernels` (or :func:`load_package`) has run. Keeping the kernels in ``csrc/tpu``
beside ``csrc/cpu`` and ``csrc/cuda`` is the layout of the design; the mapping is the one
line that makes them ship.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
from types import ModuleType

PACKAGE = "torch_topg._tpu_kernels"
_SOURCE = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "tpu"


def load_package() -> ModuleType:
    """Import ``torch_topg._tpu_kernels`` (installed, else from the source checkout)."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    if importlib.util.find_spec(PACKAGE) is not None:
        return importlib.import_module(PACKAGE)
    init = _SOURCE / "__init__.py"
    if not init.exists():
        raise ModuleNotFoundError(
            f"{PACKAGE} is not installed and no source checkout was found at {_SOURCE}"
        )
    spec = importlib.util.spec_from_file_location(
        PACKAGE, init, submodule_search_locations=[str(_SOURCE)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def kernels(family: str) -> ModuleType:
    """The kernel module of a family: ``norm``, ``attention``, ``paged_attention``, ``moe``.
    Imports JAX."""
    load_package()
    return importlib.import_module(f"{PACKAGE}.{family}")
