"""CI check of the CUDA lane: the CUDA-enabled extension loads and registers every op.

Usage: python python/check_cuda_build.py <dir holding _C.so and _build_info.json>

Runs with a CUDA build of torch on a machine without a GPU (loading works; nothing is
launched). Checks that ``_build_info.json`` says ``cuda: true``, that the library loads
through ``torch_topg._native`` and that every schema in ``_schemas.py`` has a kernel at
the ``CUDA`` and at the ``CPU`` dispatch key. Exits non-zero otherwise.
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
    from torch_topg.ops._schemas import SCHEMAS

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), library in {lib_dir}")
    if not _native.is_loaded():
        print(f"FAIL: native extension not loaded: {_native.missing_reason('cuda')}")
        return 1
    info = _native.build_info()
    print(f"build info: {info}")
    missing = [
        f"{op}@{key}"
        for op in SCHEMAS
        for key in ("CUDA", "CPU")
        if not _native.has_kernel(op, key)
    ]
    if not info.get("cuda") or missing:
        print(f"FAIL: cuda={info.get('cuda')}, kernels missing: {missing}")
        return 1
    print(f"ok: {len(SCHEMAS)} ops have CUDA and CPU kernels (archs {info.get('cuda_archs')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
