"""Loading the native extension (``torch_topg/_C.so``) and reporting what it provides.

Importing the shared library runs its static ``TORCH_LIBRARY_IMPL`` registrations;
there is no Python binding layer. If the library is missing, was built for another
torch, or needs CPU instructions this machine lacks, it is not loaded: every op then
runs through its reference (``torch_topg.reference``) and says so once.

Environment: ``TOPG_DISABLE_NATIVE=1`` skips loading (used by tests of the fallback);
``TOPG_NATIVE_DIR=<dir>`` loads ``_C*.so`` and ``_build_info.json`` from ``<dir>`` instead
of the package folder (an out-of-tree build, e.g. the CI's CUDA lane or the GPU suite).

``_build_info.json`` records the torch version, the CPU ISA and whether CUDA kernels were
compiled (``"cuda": true``, ``"cuda_archs": "80;90"``). A CUDA build needs a CUDA build of
torch at run time (its library links ``libtorch_cuda``); a GPU is not needed to load it.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

_PKG = pathlib.Path(__file__).resolve().parent
_state: dict[str, object] = {"loaded": False, "error": "not loaded yet", "info": {}}

# CPU capability names torch reports, ordered by what they include.
_ISA_ORDER = ["DEFAULT", "AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX"]


def _lib_dir() -> pathlib.Path:
    override = os.environ.get("TOPG_NATIVE_DIR", "")
    return pathlib.Path(override).resolve() if override else _PKG


def _find_library() -> pathlib.Path | None:
    return next(iter(sorted(_lib_dir().glob("_C*.so"))), None)


def load() -> bool:
    """Load the extension once; returns whether native kernels are available."""
    if _state["loaded"]:
        return True
    if os.environ.get("TOPG_DISABLE_NATIVE", "") == "1":
        _state["error"] = "disabled by TOPG_DISABLE_NATIVE=1"
        return False
    lib = _find_library()
    if lib is None:
        _state["error"] = "native extension not built (pip install --no-build-isolation -e .)"
        return False
    info_path = _lib_dir() / "_build_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    _state["info"] = info
    built_for = info.get("torch_version", "")
    if built_for and built_for.split("+")[0] != torch.__version__.split("+")[0]:
        _state["error"] = (
            f"native extension built for torch {built_for}, running torch {torch.__version__}; "
            "rebuild it"
        )
        return False
    if info.get("cuda") and not torch.version.cuda:
        _state["error"] = (
            f"native extension built with CUDA kernels (archs {info.get('cuda_archs', '?')}), "
            f"running a CPU-only torch {torch.__version__}; rebuild with TOPG_CUDA=OFF"
        )
        return False
    need = info.get("cpu_isa", "DEFAULT")
    have = torch.backends.cpu.get_cpu_capability()
    if (
        need in _ISA_ORDER
        and have in _ISA_ORDER
        and _ISA_ORDER.index(have) < _ISA_ORDER.index(need)
    ):
        _state["error"] = f"native extension built for {need}, this CPU offers {have}"
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError as exc:  # pragma: no cover - depends on the build
        _state["error"] = f"failed to load {lib.name}: {exc}"
        return False
    _state["loaded"], _state["error"] = True, ""
    return True


def is_loaded() -> bool:
    return bool(_state["loaded"])


def build_info() -> dict:
    """What the extension was built with (torch version, CPU ISA, CUDA on/off)."""
    return dict(_state["info"])  # type: ignore[arg-type]


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether ``topg::<op>`` has a kernel registered exactly at ``dispatch_key``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"topg::{op}", dispatch_key)


def cuda_built() -> bool:
    """Whether the loaded extension was compiled with CUDA kernels (``_build_info.json``)."""
    return bool(_state["loaded"]) and bool(_state["info"].get("cuda"))  # type: ignore[union-attr]


def missing_reason(device: str) -> str:
    if not _state["loaded"]:
        return str(_state["error"])
    if device == "cuda" and not _state["info"].get("cuda"):  # type: ignore[union-attr]
        return (
            "the native extension was built without CUDA kernels (TOPG_CUDA=AUTO needs a "
            "CUDA build of torch and nvcc; see docs/build.md)"
        )
    return f"the native extension has no kernel for the '{device}' dispatch key"
