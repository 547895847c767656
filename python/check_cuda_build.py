"""CI check of the CUDA lane: the CUDA-enabled extension loads and registers every op.

Usage: python python/check_cuda_build.py <dir holding _C.so and _build_info.json>

Runs with a CUDA build of torch on a machine without a GPU (loading works; nothing is
launched). Checks that ``_build_info.json`` says ``cuda: true``, that the library loads
through ``torch_topg._native`` and that every schema in ``_schemas.py`` has a kernel at
the ``CUDA`` and at the ``CPU`` dispatch key, except those listed in
``torch_topg.ops._registry.PENDING_KERNELS`` (printed with their reason; an entry whose
kernel now exists is an error: the list must stay true). Exits non-zero otherwise.
"""

from __future__ import annotations

import os
import pathlib
import sys


def main() -> int:
    lib_dir = pathlib.Path(sys.argv[1]).resolve()
    os.environ["TOPG_NATIVE_DIR"] = str(lib_dir)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import torch

    import torch_topg  # noqa: F401  (loads the library from TOPG_NATIVE_DIR)
    from torch_topg import _native
    from torch_topg.ops._registry import pending
    from torch_topg.ops._schemas import SCHEMAS

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), library in {lib_dir}")
    if not _native.is_loaded():
        print(f"FAIL: native extension not loaded: {_native.missing_reason('cuda')}")
        return 1
    info = _native.build_info()
    print(f"build info: {info}")
    keys = ("CUDA", "CPU")
    waiting = {f"{op}@{k}": why for op in SCHEMAS for k in keys if (why := pending(op, k))}
    missing = [f"{op}@{k}" for op in SCHEMAS for k in keys
               if f"{op}@{k}" not in waiting and not _native.has_kernel(op, k)]  # fmt: skip
    stale = [k for k in waiting if _native.has_kernel(*k.split("@"))]
    if not info.get("cuda") or missing or stale:
        print(f"FAIL: cuda={info.get('cuda')}, kernels missing: {missing}, "
              f"registered but listed in PENDING_KERNELS: {stale}")  # fmt: skip
        return 1
    for k, why in waiting.items():
        print(f"pending: {k} ({why}): the reference runs")
    n = len(SCHEMAS)
    print(f"ok: {n - len({k.split('@')[0] for k in waiting})} of {n} ops have CUDA and CPU "
          f"kernels, {len(waiting)} kernels pending (archs {info.get('cuda_archs')})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
