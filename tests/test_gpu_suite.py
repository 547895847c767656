"""python/gpu_suite.sh without a GPU: its dry run, its budgets and file counts, a clean
exit on a machine without a GPU, and its stage handling with stand-in tools.

The suite runs on a lent GPU machine where one command may run at most 600 s and at
most 8 files come back (docs/gpu.md); these tests keep it inside those limits.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "python" / "gpu_suite.sh"
# Per mode: the script's own budget and the run's timeout_s that docs/gpu.md gives.
MODES = {"build-test": (290, 300), "bench": (230, 240), "profile": (180, 190)}

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None,
    reason="needs bash and coreutils timeout",
)

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Stand-in for the GPU machine's python3: the preflight, pytest and the scripts.
case "$1" in
  -c) echo "torch 0.0 (fake)"; exit "${FAKE_CUDA_RC:-0}" ;;
  -m) echo "pytest: $*"; exit "${FAKE_PYTEST_RC:-0}" ;;
esac
echo "ran $*"
while [ "$#" -gt 0 ]; do
  case "$1" in
    --md) echo "| fake | row |" >"$2"; shift ;;
    --json) echo "{}" >"$2"; shift ;;
  esac
  shift
done
"""
FAKE_TOOL = '#!/usr/bin/env bash\necho "$(basename "$0") $*"\nexit "${FAKE_%s_RC:-0}"\n'


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the script in a tiny repository-shaped folder, with stand-in tools."""
    (tmp_path / "python").mkdir()
    shutil.copy(SCRIPT, tmp_path / "python" / "gpu_suite.sh")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_cuda_ops.py").write_text("def test_cuda_x(): pass\n")
    (tests / "test_norm.py").write_text("from op_samples import sample_inputs\n")
    (tests / "test_engine.py").write_text("def test_engine(): pass  # no op_samples\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {"python3": FAKE_PYTHON, "cmake": FAKE_TOOL % "CMAKE"}
    tools["compute-sanitizer"] = FAKE_TOOL % "SANITIZER"
    tools["ncu"] = FAKE_TOOL % "NCU"
    for name, text in tools.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def run_suite(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(
        PATH=f"{tree / 'bin'}:{os.environ['PATH']}",
        PYTHON=str(tree / "bin" / "python3"),
        OUT=str(tree / "out"),
    )
    full_env.update(env)
    return subprocess.run(
        ["bash", str(tree / "python" / "gpu_suite.sh"), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.parametrize("mode", MODES)
def test_dry_run_fits_the_device_limits(tree: Path, mode: str) -> None:
    budget, timeout_s = MODES[mode]
    done = run_suite(tree, mode, "--dry-run")
    assert done.returncode == 0, done.stderr
    limits = [int(m) for m in re.findall(r"^stage \S+ limit=(\d+)s", done.stdout, re.M)]
    assert len(limits) >= 3
    assert sum(limits) <= budget < timeout_s  # a stage killed at its limit has 5 s more
    files = re.search(r"^writes \((\d+)\): (.*)$", done.stdout, re.M)
    names = files.group(2).split()
    assert int(files.group(1)) == len(names) <= 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    assert not (tree / "out").exists()  # a dry run writes nothing
    if mode == "profile":  # no tests: the engine benchmark and Nsight Compute
        assert "engine_decode.py" in done.stdout and "--profile-from-start off" in done.stdout
        return
    # The CUDA tests and the device-parametrised test files, not the others.
    pytest_line = next(line for line in done.stdout.splitlines() if "-m pytest" in line)
    assert "tests/test_cuda_*.py tests/test_norm.py -k" in pytest_line
    assert "test_engine" not in pytest_line


@pytest.mark.parametrize("args", [(), ("all",), ("bench", "--fast"), ("bench", "--dry-run", "x")])
def test_usage_errors(tree: Path, args: tuple[str, ...]) -> None:
    done = run_suite(tree, *args)
    assert done.returncode == 64
    assert "build-test" in done.stderr


@pytest.mark.parametrize("mode", MODES)
def test_no_gpu_stops_cleanly(tree: Path, mode: str) -> None:
    done = run_suite(tree, mode, FAKE_CUDA_RC="1")
    assert done.returncode == 2
    assert sorted(os.listdir(tree / "out")) == ["summary.md"]
    summary = (tree / "out" / "summary.md").read_text()
    assert "no usable GPU" in summary
    assert "cmake" not in done.stdout


@pytest.mark.parametrize("mode", MODES)
def test_all_stages_pass(tree: Path, mode: str) -> None:
    done = run_suite(tree, mode)
    assert done.returncode == 0, done.stdout + done.stderr
    out = sorted(os.listdir(tree / "out"))
    assert "summary.md" in out
    assert len(out) <= 8
    summary = (tree / "out" / "summary.md").read_text()
    rows = re.findall(r"^\| ([\w-]+) \| (\S+) \| \d+ \|", summary, re.M)
    assert rows and all(rc == "0" for _, rc in rows), summary
    if mode != "build-test":
        assert "| fake | row |" in summary  # the result tables are in the summary too


def test_build_failure_stops_the_run(tree: Path) -> None:
    done = run_suite(tree, "build-test", FAKE_CMAKE_RC="1")
    assert done.returncode == 1
    assert sorted(os.listdir(tree / "out")) == ["build.log", "summary.md"]
    summary = (tree / "out" / "summary.md").read_text()
    assert "the build failed" in summary
    assert "## build.log (last 30 lines)" in summary


def test_failed_stage_does_not_stop_the_next(tree: Path) -> None:
    done = run_suite(tree, "build-test", FAKE_PYTEST_RC="1")
    assert done.returncode == 1
    summary = (tree / "out" / "summary.md").read_text()
    assert re.search(r"^\| tests \| 1 \|", summary, re.M)
    assert re.search(r"^\| sanitizer \| 0 \|", summary, re.M)


def test_docs_give_the_commands() -> None:
    gpu_md = (ROOT / "docs" / "gpu.md").read_text()
    for mode, (_, timeout_s) in MODES.items():
        call = f'run(command="bash python/gpu_suite.sh {mode}", timeout_s={timeout_s})'
        assert call in gpu_md


def test_bench_reuses_a_finished_build(tree: Path) -> None:
    fresh = run_suite(tree, "bench", "--dry-run").stdout
    assert "the build stage gets 125 s" in fresh and "bench_gpu.py --quick" in fresh
    # a configured but unfinished build (build-test stopped mid-compile) is no build
    (tree / "build" / "gpu" / "out").mkdir(parents=True)
    (tree / "build" / "gpu" / "out" / "_build_info.json").write_text("{}")
    assert "the build stage gets 125 s" in run_suite(tree, "bench", "--dry-run").stdout
    (tree / "build" / "gpu" / "out" / "_C.so").write_text("")
    warm = run_suite(tree, "bench", "--dry-run").stdout
    assert "stage build limit=30s" in warm and "bench_gpu.py --md" in warm
    assert "the build stage gets" not in warm


@pytest.mark.parametrize("script", ["profile_cases.py", "engine_decode.py"])
def test_profile_scripts_run_on_the_cpu(script: str, tmp_path: Path) -> None:
    """The profile mode's scripts at a small scale on the CPU, so an API change does not
    first show on a lent GPU."""
    args = ["--device", "cpu"]
    if script == "engine_decode.py":
        md = tmp_path / "engine.md"
        args += ["--preset", "llama-tiny", "--context", "16", "--tokens", "4", "--quick"]
        args += ["--md", str(md)]
    path = ROOT / "python" / "benchmarks" / "gpu" / script
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    if script == "engine_decode.py":
        rows = re.findall(r"^\| (1|8) \| ([\d.]+) \| ([\d.]+) \|", md.read_text(), re.M)
        assert [r[0] for r in rows] == ["1", "8"] and all(float(r[1]) > 0 for r in rows)
        if os.environ.get("TOPG_DISABLE_NATIVE") != "1":  # the plan needs the native kernels
            assert "on: plan" in md.read_text()  # decode_plan=True took the plan on the CPU
    else:
        assert done.stdout.count(": ran, output") == 4


def test_build_test_tunes_after_the_tests(tree: Path) -> None:
    """build-test measures the dispatch's tuning table right after the tests and brings it
    back; tune's own budget ends it inside its stage's limit, so the table gets written."""
    out = run_suite(tree, "build-test", "--dry-run").stdout
    stages = re.findall(r"^stage (\S+) limit=(\d+)s", out, re.M)
    names = [n for n, _ in stages]
    assert names.index("tune") == names.index("tests") + 1
    line = next(ln for ln in out.splitlines() if ln.startswith("stage tune "))
    own = float(re.search(r"--budget (\d+)", line).group(1))
    assert own + 15 <= int(dict(stages)["tune"])  # start-up and the last case fit
    assert "-m torch_topg tune --quick" in line and "tuning.json" in line
    assert "tuning.json" in re.search(r"^writes \(\d+\): (.*)$", out, re.M).group(1).split()


def test_the_suite_speaks_in_project_terms() -> None:
    for path in (SCRIPT, ROOT / "docs" / "gpu.md"):
        text = path.read_text()
        assert not re.search(r"device tool|this workplace|device notes", text), path
