"""Every repository path that README.md and docs/*.md name exists in the repository.

A path is named in an inline code span (`csrc/cpu/vec.h`), a markdown link
([gpu.md](gpu.md)) or a fenced code block (`python python/examples/quickstart.py`). In a
code span it counts as a path when it contains a ``/`` or ends in a source or doc
extension; in a fenced block, when it starts with a top-level folder of the repository.
It exists when git tracks that file, a file under that folder, or (for partial paths
such as `passes/base.py` or `vec.h`) a file ending in it; `<family>`, `*` and `{a,b}`
are templates that must match at least one file. Links are resolved from the document's
folder. Only the names in ``NOT_IN_REPO`` are exempt, each with its reason.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH_EXTENSIONS = (".py", ".md", ".cpp", ".cu", ".cuh", ".h", ".sh")

# Named on purpose, not files of the repository. Exact names, or a prefix when they end
# in "/".
NOT_IN_REPO = {
    "~/.cache/torch_topg/llama.cpp-0.3.36/bin": "llama.cpp built once into the user's cache",
    "~/.cache/torch_topg": "torch_topg's cache in the user's home (TOPG_CACHE_DIR unset)",
    "$TOPG_CACHE_DIR/": "torch_topg's cache folder, set by the user",
    "/work/venv-xla": "the TPU lane's virtual environment, outside the checkout",
    "/tmp": "scratch space of the machine",
    "/completion": "llama-server's HTTP endpoint, not a file",
    "./gpu_out": "where python/gpu_suite.sh writes when $OUT is unset (run time)",
    "summary.md": "written to $OUT by python/gpu_suite.sh",
    "results.md": "written to $OUT by python/gpu_suite.sh",
    "table.md": "written by python/benchmarks/bench_ops.py",
    "torch_topg/_C.so": "the native library: a build output",
    "torch_topg/_tpu_kernels/": "csrc/tpu as installed (setup.py maps it into the package)",
    "build/": "build folders (ignored): CMake's and the GPU suite's",
    "bench_results/table.md": "written by bench_ops.py (ignored by git)",
    "bench_results/targets.md": "written by bench_ops.py (ignored by git)",
    "bench_results/models.md": "written by bench_models.py; no run of it is committed",
    "bench_results/models.json": "written by bench_models.py; no run of it is committed",
    "bench_results/models.png": "written by bench_models.py; no run of it is committed",
    "bench_results/models-<date>-<commit>.json": "bench_models.py's record; none committed",
    "ATen/": "torch's C++ headers",
    "c10/": "torch's C++ headers",
    "torch/": "torch's C++ headers",
    "paged_attention_v1/v2": "vLLM's op names paged_attention_v1 and _v2, not a path",
}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


@functools.cache
def tracked() -> tuple[str, ...]:
    """The repository's files: git's index (what a commit holds) that exist on disk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        files = []
        for d, dirs, names in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in {".git", "build", "__pycache__"}]
            dirs[:] = [x for x in dirs if not x.startswith(".venv")]
            files += [str(Path(d, f).relative_to(ROOT)) for f in names]
    return tuple(sorted(f for f in files if (ROOT / f).exists()))


def top_level() -> set[str]:
    return {f.split("/", 1)[0] for f in tracked() if "/" in f}


def exempt(path: str) -> bool:
    return any(
        path == name or (name.endswith("/") and path.startswith(name)) for name in NOT_IN_REPO
    )


def expand(path: str) -> list[str]:
    """`{a,b}` alternatives, then `<anything>` as `*`."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m:
        return [
            q
            for alt in m.group(1).split(",")
            for q in expand(path[: m.start()] + alt + path[m.end() :])
        ]
    return [re.sub(r"<[^<>/]*>", "*", path)]


def exists(path: str, base: str = "", link: bool = False) -> bool:
    """Whether ``path`` names a tracked file or folder: a link from the document's folder
    ``base``; anything else from the root, from ``base``, or as the tail of a path. A
    pytest node id (``tests/x.py::test_y``) names the file, which must define the test."""
    files = tracked()
    if "::" in path:
        file, _, node = path.partition("::")
        name = node.split("::")[-1].split("[")[0]
        target = ROOT / file
        return (
            exists(file, base, link)
            and target.is_file()
            and re.search(
                rf"^\s*(async\s+)?(def|class)\s+{re.escape(name)}\b", target.read_text(), re.M
            )
            is not None
        )

    def found(cand: str) -> bool:
        cand = os.path.normpath(cand).removeprefix("./").rstrip("/")
        return any(fnmatch.fnmatchcase(f, cand) or f.startswith(cand + "/") for f in files)

    for pattern in expand(path):
        if link:
            if found(os.path.join(base, pattern)):
                return True
            continue
        if found(pattern) or found(os.path.join(base, pattern)):
            return True
        tail = pattern.rstrip("/")
        if any(fnmatch.fnmatchcase(f, "*/" + tail) or f"/{tail}/" in "/" + f for f in files):
            return True
    return False


def blank_fences(text: str) -> str:
    """``text`` with fenced blocks blanked (line numbers kept)."""
    return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def named_paths(doc: Path) -> list[tuple[int, str, str]]:
    """(line, path, kind) for every repository path ``doc`` names."""
    text = doc.read_text()
    found = []

    def line(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    inline = blank_fences(text)
    for m in SPAN.finditer(inline):
        span = m.group(1).strip()
        token = span.split("=", 1)[1] if re.match(r"^[A-Z_]+=", span) else span
        if "://" in token or token.startswith("/"):  # a URL or an HTTP route, not a path
            continue
        if " " not in token and ("/" in token or token.endswith(PATH_EXTENSIONS)):
            found.append((line(m.start()), token.removeprefix("<repo>/"), "span"))
    for m in LINK.finditer(inline):
        target = m.group(1).split("#", 1)[0]
        if target and not re.match(r"^[a-z]+:", target):  # not http:, mailto:, ...
            found.append((line(m.start()), target, "link"))
    dirs = "|".join(re.escape(d) for d in sorted(top_level()))
    token = re.compile(rf"(?<![\w./~-])((?:{dirs})/[\w./*<>{{}},-]*)")
    for fence in FENCE.finditer(text):
        for m in token.finditer(fence.group(0)):
            found.append((line(fence.start() + m.start()), m.group(1).rstrip(".,"), "code"))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc: Path) -> None:
    base = str(doc.parent.relative_to(ROOT))
    missing = [
        f"{doc.relative_to(ROOT)}:{ln}: {path}"
        for ln, path, kind in named_paths(doc)
        if not exempt(path) and not exists(path, "" if base == "." else base, kind == "link")
    ]
    assert not missing, "paths named in the docs that the repository lacks:\n" + "\n".join(missing)


def test_the_checker_finds_what_it_should(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "See `csrc/cpu/vec.h`, `passes/base.py`, `csrc/cuda/<family>.cu`, [ops](docs/ops.md),\n"
        "`torch_topg.ops` and `a b/c`, `TOPG_NATIVE_DIR=build/gpu/out`.\n"
        "```bash\npython python/examples/quickstart.py --x=1\n```\n"
    )
    paths = [(ln, p) for ln, p, _ in named_paths(doc)]
    assert paths == [
        (1, "csrc/cpu/vec.h"),
        (1, "passes/base.py"),
        (1, "csrc/cuda/<family>.cu"),
        (2, "build/gpu/out"),
        (1, "docs/ops.md"),
        (4, "python/examples/quickstart.py"),
    ]
    assert exists("csrc/cpu/vec.h") and exists("passes/base.py") and exists("csrc/cuda/<family>.cu")
    assert exists("tests/test_docs.py::test_the_checker_finds_what_it_should")
    assert not exists("tests/test_docs.py::test_no_such_test")
    assert exists("tests/test_cuda_*.py") and exists("csrc/tpu/") and exists("gpu.md", "docs")
    assert not exists("csrc/cpu/nonexistent.h") and not exists("docs/gpu.md", "docs", link=True)
    assert exists("gpu.md", "docs", link=True) and exists("docs/gpu.md", "", link=True)
    assert not exists("csrc/cuda/<family>.cpp")
    assert exempt("build/gpu/out") and not exempt("csrc/cpu/vec.h")
