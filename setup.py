"""Build driver: configures and builds CMakeLists.txt with Ninja, against the torch that
is already installed (use ``pip install --no-build-isolation``; torch is never replaced).

Environment (documented in docs/build.md):
  TOPG_CUDA=AUTO|ON|OFF     CUDA kernels (default AUTO: torch is a CUDA build and nvcc found)
  TOPG_CPU_ARCH=<march>     -march for the CPU kernels (default x86-64-v3 on x86-64)
  TOPG_BUILD_DIR=<dir>      CMake build folder (default build/<python tag>)
  MAX_JOBS=<n>              parallel compile jobs (default: number of CPUs)
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def _tool(name: str) -> str:
    """cmake / ninja from the running Python's environment first (pip-installed), then PATH."""
    env_bin = pathlib.Path(sys.executable).parent
    found = shutil.which(name, path=f"{env_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise RuntimeError(f"{name} not found: pip install {name}")
    return found


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = pathlib.Path(
            os.environ.get(
                "TOPG_BUILD_DIR", ROOT / "build" / f"py{sys.version_info[0]}{sys.version_info[1]}"
            )
        )
        build_dir.mkdir(parents=True, exist_ok=True)
        out_dir = build_dir / "out"
        cmake_args = [
            _tool("cmake"), "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DTOPG_OUTPUT_DIR={out_dir}",
            f"-DTOPG_CUDA={os.environ.get('TOPG_CUDA', 'AUTO').upper()}",
        ]  # fmt: skip
        if "TOPG_CPU_ARCH" in os.environ:
            cmake_args.append(f"-DTOPG_CPU_ARCH={os.environ['TOPG_CPU_ARCH']}")
        subprocess.check_call(cmake_args)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call([_tool("cmake"), "--build", str(build_dir), "--", f"-j{jobs}"])
        # Place the library and its build info where setuptools expects the extension
        # (the source tree for editable installs, build_lib for wheels).
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out_dir / "_C.so", target)
        shutil.copy2(out_dir / "_build_info.json", target.parent / "_build_info.json")
        if self.inplace or getattr(self, "editable_mode", False):
            # Editable installs import from the source tree; setuptools copies only _C there.
            shutil.copy2(out_dir / "_build_info.json", ROOT / "torch_topg" / "_build_info.json")


setup(
    # The Pallas kernels live in csrc/tpu beside the CPU and CUDA sources and ship as
    # torch_topg._tpu_kernels (torch_topg/tpu/kernels.py loads them; docs/tpu.md).
    packages=[*find_packages(include=["torch_topg", "torch_topg.*"]), "torch_topg._tpu_kernels"],
    package_dir={"torch_topg._tpu_kernels": "csrc/tpu"},
    ext_modules=[CMakeExtension("torch_topg._C")],
    cmdclass={"build_ext": CMakeBuild},
)
