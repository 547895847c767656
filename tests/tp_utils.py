"""Spawning small gloo groups for the tensor-parallel tests.

Each rank is a fresh ``python tests/tp_worker.py <job> ...`` subprocess (one thread),
joined through a FileStore in a temporary folder. Every run is bounded: after
``timeout`` seconds the ranks still alive are killed and the test fails, so a hang is a
failure, never a stuck CI job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("tp_worker.py")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed after the timeout
    output: str

    def lines(self, prefix: str) -> list[str]:
        return [ln for ln in self.output.splitlines() if ln.startswith(prefix)]


def run_ranks(job: str, tmp_path: Path, world: int = 2, timeout: float = 120.0) -> list[RankResult]:
    init = tmp_path / "store"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    procs = []
    for rank in range(world):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        cmd = [sys.executable, str(WORKER), job, str(rank), str(world), str(init), str(tmp_path)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = time.monotonic() + timeout
    results = []
    for rank, (p, log) in enumerate(procs):
        try:
            rc: int | None = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
        log.seek(0)
        results.append(RankResult(rank, rc, log.read()))
        log.close()
    return results


def assert_ok(results: list[RankResult]) -> None:
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(
        f"--- rank {r.rank} returncode {r.returncode} (None: killed at the timeout)\n"
        f"{r.output[-4000:]}"
        for r in bad
    )
