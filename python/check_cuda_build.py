"""CI check of the CUDA lane: the CUDA-enabled extension loads and registers every op.

Usage: python python/check_cuda_build.py <dir holding _C.so and _build_info.json>

Runs with a CUDA build of torch on a machine without a GPU (loading works; nothing is
launched). Checks that ``_build_info.json`` says ``cuda: true``, that the library loads
through ``torch_topg._native`` and that every schema in ``_schemas.py`` has a kernel at
the ``CUDA`` and at the ``CPU`` dispatch key, except those listed in
``torch_topg.ops._registry.PENDING_KERNELS`` (printed with their reason; an entry whose
kernel now exists is an error: the list must stay true). For the ops dispatched on CUDA
(``_schemas.DISPATCHED_ON_CUDA``) topg's kernel is the internal ``topg::_cuda_<op>``, and
the op's CUDA key must hold the dispatch that ``torch_topg`` installs over it
(``torch_topg.ops.dispatch``). Then, in a child process, that
a kernel's argument error reaches Python whole: with a libstdc++ linked into the library
statically, the first number written into the message crashed the process (seen on the GPU
machine, 2026-12-04; CMakeLists.txt now links the shared one). Exits non-zero otherwise.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

# A bad weight for rms_norm on the CPU (no GPU needed) and the first line of its message.
_BAD_CALL = """
import torch, torch_topg
try:
    torch.ops.topg.rms_norm(torch.ones(2, 3), torch.ones(4), 1e-6)
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""
_EXPECTED = ("topg::rms_norm: argument 'weight' (shape [4], dtype float32, device cpu) "
             "expected size 3 at dim 0")  # fmt: skip


def error_reaches_python(lib_dir: pathlib.Path) -> str | None:
    """None if the argument error of ``_BAD_CALL`` arrives whole, else what went wrong."""
    env = {**os.environ, "TOPG_NATIVE_DIR": str(lib_dir), "TOPG_REQUIRE_NATIVE": "1"}
    r = subprocess.run([sys.executable, "-c", _BAD_CALL], env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    if r.returncode == 0 and _EXPECTED in r.stdout:
        return None
    try:
        needed = subprocess.run(["readelf", "-d", str(lib_dir / "_C.so")],
                                capture_output=True, text=True).stdout  # fmt: skip
        libstdcxx = "libstdc++.so" in needed
    except OSError:
        libstdcxx = None
    return (f"exit status {r.returncode}, message {r.stdout.strip()!r} (expected it to start "
            f"with {_EXPECTED!r}); libstdc++.so among the library's needs: {libstdcxx}; "
            f"{r.stderr.strip()[-300:]}")  # fmt: skip


def _cuda_line(qualified: str) -> str:
    """The dispatcher's ``CUDA: registered at <file>:<line>`` line of an op ("" if none)."""
    import torch

    dump = torch._C._dispatch_dump(qualified)
    return next((ln for ln in dump.splitlines() if ln.startswith("CUDA:")), "")


def main() -> int:
    lib_dir = pathlib.Path(sys.argv[1]).resolve()
    os.environ["TOPG_NATIVE_DIR"] = str(lib_dir)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import torch

    import torch_topg  # noqa: F401  (loads the library from TOPG_NATIVE_DIR)
    from torch_topg import _native
    from torch_topg.ops import dispatch
    from torch_topg.ops._registry import pending
    from torch_topg.ops._schemas import DISPATCHED_ON_CUDA, SCHEMAS, cuda_kernel_op

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
    missing += [f"{cuda_kernel_op(op)}@CUDA" for op in DISPATCHED_ON_CUDA
                if not _native.has_kernel(cuda_kernel_op(op), "CUDA")]  # fmt: skip
    no_dispatch = [op for op in DISPATCHED_ON_CUDA if op not in dispatch.INSTALLED
                   or "dispatch/selector.py" not in _cuda_line(f"topg::{op}")]  # fmt: skip
    if not info.get("cuda") or missing or stale or no_dispatch:
        print(f"FAIL: cuda={info.get('cuda')}, kernels missing: {missing}, "
              f"registered but listed in PENDING_KERNELS: {stale}, "
              f"CUDA key without the dispatch: {no_dispatch}")  # fmt: skip
        return 1
    if why := error_reaches_python(lib_dir):
        print(f"FAIL: a kernel's argument error does not reach Python whole: {why}")
        return 1
    for k, why in waiting.items():
        print(f"pending: {k} ({why}): the reference runs")
    n = len(SCHEMAS)
    print(f"ok: {n - len({k.split('@')[0] for k in waiting})} of {n} ops have CUDA and CPU "
          f"kernels, {len(waiting)} kernels pending (archs {info.get('cuda_archs')}); "
          f"dispatched on CUDA: {', '.join(sorted(dispatch.INSTALLED))}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
