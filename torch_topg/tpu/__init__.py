"""TPU path: the Pallas kernels of ``csrc/tpu`` (package ``torch_topg._tpu_kernels``) and
their registration for the ``XLA`` dispatch key.

Importing this package imports neither JAX nor torch_xla: ``import torch_topg`` calls
:func:`register_xla`, which only registers Python kernels at the ``XLA`` key (the key
exists in core torch). Each such kernel decides on its first call, through :func:`probe`,
whether to run the Pallas kernel through torch_xla (torch_xla and JAX importable, the
XLA device is a TPU) or the reference, the latter with one warning per op.

* :func:`kernels` loads a kernel module (``kernels("attention")``), installed or from a
  source checkout;
* :mod:`torch_topg.tpu.jax_api` calls the kernels on JAX arrays (interpret mode unless
  JAX's default backend is a TPU);
* :func:`set_probe` / :func:`set_backend` let tests inject the TPU decision and the way a
  Pallas kernel is run.

See docs/tpu.md.
"""

from __future__ import annotations

import importlib.util

from torch_topg.tpu._xla import (
    PALLAS_OPS,
    Probe,
    default_probe,
    probe,
    register_xla,
    set_backend,
    set_probe,
)
from torch_topg.tpu.kernels import kernels

__all__ = [
    "PALLAS_OPS",
    "Probe",
    "default_probe",
    "jax_available",
    "kernels",
    "probe",
    "register_xla",
    "set_backend",
    "set_probe",
]


def jax_available() -> bool:
    """Whether JAX (with Pallas) can be imported; does not import it."""
    try:
        return importlib.util.find_spec("jax") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken install
        return False
