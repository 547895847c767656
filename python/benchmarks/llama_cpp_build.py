"""Build llama.cpp's `llama-server`, `llama-bench` and `llama-batched-bench` (and the
quantizer, perplexity and tokenizer tools) from the sources vendored in the
llama-cpp-python source distribution, once, into a cache folder outside the git tree.

    python python/benchmarks/llama_cpp_build.py          # build (or reuse) and print paths
    python python/benchmarks/llama_cpp_build.py --force  # rebuild

The binaries land in ~/.cache/torch_topg/llama.cpp-<version>/bin (override the root
with TOPG_LLAMA_CPP_DIR). `ensure_llama_cpp()` returns their paths, or raises
`LlamaCppUnavailable` with the reason (download or build failure), so a benchmark can
print that reason in its llama.cpp column and go on. Takes 15-20 minutes on 2 cores
(twice that where the native build crashes and is built again without AMX: below).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-quantize",
           "llama-perplexity", "llama-tokenize")  # fmt: skip


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp could not be downloaded or built; str() says why."""


def cache_dir(version: str = VERSION) -> Path:
    root = os.environ.get("TOPG_LLAMA_CPP_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "torch_topg"
    return base / f"llama.cpp-{version}"


def binaries(version: str = VERSION) -> dict[str, Path]:
    d = cache_dir(version) / "bin"
    return {t: d / t for t in TARGETS}


def _run(cmd: list[str], log, cwd: Path | None = None, nice: bool = True) -> None:
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", "19", *cmd]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    r = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise LlamaCppUnavailable(f"`{' '.join(cmd[-6:])}` exited {r.returncode}")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ggml's AMX matmul (compiled in by -march=native where the CPU has AMX) crashed with
# SIGSEGV in ggml_backend_amx_mul_mat on every prompt-processing call of the SmolLM2 Q4_1
# file on a Sapphire Rapids-class VM (2026-12-02; decode ran, and ARCH_REQ_XCOMP_PERM
# succeeded). So each build is smoke-tested on that file, and where it crashes it is
# built again with AMX off and everything else native: what a user of that machine has
# to do. `variant.txt` beside bin/ says which build it is.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* win over -march


def _smoke(bench: Path) -> str | None:
    """None if llama-bench processes a short prompt of the shipped file, else why not."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from torch_topg.models.hf import gguf_path

        model = gguf_path()
    except Exception:  # no model to test with: nothing to say
        return None
    cmd = [str(bench), "-m", str(model), "-t", "1", "-r", "1", "-p", "32", "-n", "0"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "llama-bench -p 32 timed out"
    return None if r.returncode == 0 else f"llama-bench -p 32 exited {r.returncode}"


def _configure_and_build(src: Path, build: Path, jobs: int, log, extra: list[str]) -> None:
    _run(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(build),
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            # the web UI would be fetched from a hub or built with npm: neither here
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries, copied to bin/
            "-DCMAKE_BUILD_TYPE=Release",
            *extra,
        ],
        log,
    )
    _run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(jobs)], log)


def _install(build: Path, bins: dict[str, Path]) -> None:
    bins[TARGETS[0]].parent.mkdir(exist_ok=True)
    for t in TARGETS:
        found = list((build / "bin").glob(t)) or list(build.rglob(t))
        if not found:
            raise LlamaCppUnavailable(f"built, but no {t} binary in {build}")
        shutil.copy2(found[0], bins[t])


def _sources(d: Path, version: str, log, verbose: bool) -> Path:
    """The vendored llama.cpp tree of the llama-cpp-python sdist (downloaded and
    extracted into d once)."""
    sdist = d / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        if verbose:
            print(f"[llama.cpp] downloading llama-cpp-python=={version} sdist")
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                "llama-cpp-python",  # the sdist only: its build tools (cmake) as wheels
                "--no-deps",
                f"llama-cpp-python=={version}",
                "-d",
                str(d),
            ],
            log,
            nice=False,
        )
    if not sdist.exists():
        raise LlamaCppUnavailable(f"pip download produced no {sdist.name}")
    src_root = d / f"llama_cpp_python-{version}"
    if not src_root.exists():
        with tarfile.open(sdist) as tf:
            tf.extractall(d, filter="data")
    src = src_root / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        raise LlamaCppUnavailable(f"no vendored llama.cpp in {src_root}")
    return src


def llama_cpp_sources(version: str = VERSION) -> Path:
    """The vendored llama.cpp sources (convert_hf_to_gguf.py, gguf-py), downloaded and
    extracted on first use; nothing is built. Raises LlamaCppUnavailable."""
    d = cache_dir(version)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "build.log", "a") as log:
        return _sources(d, version, log, verbose=False)


def ensure_llama_cpp(
    version: str = VERSION, force: bool = False, jobs: int = 2, verbose: bool = True
) -> dict[str, Path]:
    """Return {target: path} of the built binaries, building them first if needed."""
    bins = binaries(version)
    if not force and all(p.exists() for p in bins.values()):
        return bins
    d = cache_dir(version)
    d.mkdir(parents=True, exist_ok=True)
    log_path = d / "build.log"
    t0 = time.time()
    with open(log_path, "a") as log:
        log.write(f"\n==== build {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
        try:
            src = _sources(d, version, log, verbose)
            build = d / "build"
            if verbose:
                print(f"[llama.cpp] building {', '.join(TARGETS)} (log: {log_path})")
            _configure_and_build(src, build, jobs, log, [])
            _install(build, bins)
            variant = "native (-march=native)"
            why = _smoke(bins["llama-bench"])
            if why:
                log.write(f"smoke test failed: {why}; building again with {NO_AMX}\n")
                if verbose:
                    print(f"[llama.cpp] {why}: building again without AMX ({NO_AMX})")
                flags = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
                _configure_and_build(src, d / "build-noamx", jobs, log, flags)
                _install(d / "build-noamx", bins)
                if again := _smoke(bins["llama-bench"]):
                    raise LlamaCppUnavailable(f"{why}; without AMX too: {again}")
                variant = f"native without AMX ({NO_AMX}): the native build's {why}"
            (d / "variant.txt").write_text(variant + "\n")
        except LlamaCppUnavailable as e:
            log.write(f"FAILED: {e}\n")
            raise LlamaCppUnavailable(f"{e}; log {log_path}:\n{_tail(log_path)}") from None
        except Exception as e:  # download/unpack/copy errors: same treatment
            log.write(f"FAILED: {e!r}\n")
            raise LlamaCppUnavailable(f"{type(e).__name__}: {e}") from None
        dt = time.time() - t0
        log.write(f"built in {dt:.0f} s\n")
    with open(d / "build_seconds.txt", "a") as f:  # one line per build (first = from scratch)
        f.write(f"{time.strftime('%Y-%m-%d %H:%M')} {' '.join(TARGETS)}: {dt:.0f} s\n")
    if verbose:
        print(f"[llama.cpp] built in {dt / 60:.1f} min")
    return bins


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default=VERSION)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    a = ap.parse_args()
    try:
        bins = ensure_llama_cpp(a.version, force=a.force, jobs=a.jobs)
    except LlamaCppUnavailable as e:
        print(f"llama.cpp unavailable: {e}", file=sys.stderr)
        return 1
    for t, p in bins.items():
        print(f"{t}: {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
