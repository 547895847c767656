"""The benchmark harness (torch_topg.bench) on synthetic clocks and records: no timing
thresholds, nothing measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from torch_topg import bench
from torch_topg.bench import Budget, Stats, compare, summarize, verdict
from torch_topg.bench.machine import (
    classify,
    cold_copies,
    cpu_busy,
    describe,
    fp32_flops_per_cycle,
    llc_bytes,
    theoretical_peak,
)

BENCH_DIR = Path(__file__).resolve().parent.parent / "python" / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))  # bench_ops, render_readme, offload, tp
MiB = 1 << 20


class Clock:
    """A synthetic timer: variants advance it by their scripted durations."""

    def __init__(self) -> None:
        self.now = 0.0
        self.log: list[str] = []

    def __call__(self) -> float:
        return self.now

    def variant(self, name: str, durations: list[float]):
        it = iter(durations)

        def fn() -> None:
            self.log.append(name)
            self.now += next(it)

        return fn


NO_CALIBRATION = Budget(warmup=1, min_rounds=1, max_rounds=100, min_sample_s=0.0)


def test_rounds_interleave_variants():
    clock = Clock()
    variants = {n: clock.variant(n, [1.0] * 10) for n in ("a", "b", "c")}
    compare(variants, NO_CALIBRATION, rounds=4, timer=clock)
    # one calibration call each, then rounds a b c a b c ..., never a run of one variant
    assert clock.log[:3] == ["a", "b", "c"]
    assert clock.log[3:] == ["a", "b", "c"] * 4


def test_warmup_calls_precede_calibration():
    clock = Clock()
    variants = {n: clock.variant(n, [1.0] * 10) for n in ("a", "b")}
    compare(variants, Budget(warmup=3, min_sample_s=0.0), rounds=2, timer=clock)
    assert clock.log == ["a", "a", "a", "b", "b", "b", "a", "b", "a", "b"]


def test_samples_are_per_call_means_when_calibrated():
    clock = Clock()
    # calibration call 0.5 ms: a sample of at least 2 ms takes 4 calls
    fn = clock.variant("a", [0.5e-3] + [1e-3, 2e-3, 3e-3, 2e-3] * 3)
    cmp = compare({"a": fn}, Budget(warmup=1, min_sample_s=2e-3), rounds=3, timer=clock)
    assert cmp.samples["a"] == pytest.approx([2e-3] * 3)


def test_median_and_spread():
    s = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s.median, s.lo, s.hi, s.n, s.spread) == (3.0, 1.0, 5.0, 5, "min-max")
    s = summarize([float(x) for x in range(1, 12)])  # 1..11
    assert s.spread == "p10-p90"
    assert (s.median, s.lo, s.hi) == pytest.approx((6.0, 2.0, 10.0))
    s = summarize([float(x) for x in range(10)])  # 0..9: interpolated ends
    assert (s.lo, s.hi) == pytest.approx((0.9, 8.1))
    with pytest.raises(ValueError):
        summarize([])


def test_ratio_is_taken_per_round():
    """A drift that hits both variants alike leaves the per-round ratio exact."""
    clock = Clock()
    drift = [1.0, 3.0, 2.0, 5.0, 4.0]
    a = clock.variant("a", [1.0, *drift])
    b = clock.variant("b", [2.0, *(2 * t for t in drift)])
    cmp = compare({"a": a, "b": b}, NO_CALIBRATION, rounds=5, timer=clock)
    assert cmp.stats("a") == Stats(3.0, 1.0, 5.0, 5, "min-max")
    assert cmp.ms("b").median == pytest.approx(6000.0)
    r = cmp.ratio("b", "a")  # b's time over a's: a is 2x faster, every round
    assert (r.median, r.lo, r.hi) == pytest.approx((2.0, 2.0, 2.0))
    limit = cmp.per_round("a", lambda t: 0.5 / t)
    assert (limit.median, limit.lo, limit.hi) == pytest.approx((0.5 / 3, 0.1, 0.5))


def test_rounds_follow_the_budget():
    clock = Clock()
    fn = clock.variant("a", [0.1] * 100)
    cmp = compare({"a": fn}, Budget(warmup=1, min_rounds=3, max_rounds=50, budget_s=1.0,
                                    min_sample_s=0.0), timer=clock)  # fmt: skip
    assert len(cmp.samples["a"]) == 10
    fn = clock.variant("b", [10.0] * 100)
    cmp = compare({"b": fn}, Budget(warmup=1, min_rounds=3, budget_s=1.0, min_sample_s=0.0),
                  timer=clock)  # fmt: skip
    assert len(cmp.samples["b"]) == 3


def test_bench_single_callable():
    clock = Clock()
    t = bench.bench(clock.variant("a", [1.0] * 20), warmup=2, min_runs=5, max_runs=5,
                    min_time_s=0.0, timer=clock)  # fmt: skip
    assert t.runs == 5 and t.median_ms == pytest.approx(1000.0)


def test_stats_helpers():
    s = Stats(2.0, 1.0, 4.0, 7, "min-max")
    assert s.scaled(1e3) == Stats(2000.0, 1000.0, 4000.0, 7, "min-max")
    assert s.inverse(8.0) == Stats(4.0, 2.0, 8.0, 7, "min-max")
    assert s.fmt(".1f") == "2.0 [1.0-4.0]"
    assert Stats.from_dict(s.to_dict()) == s
    assert s.overlaps(Stats(4.0, 4.0, 5.0, 3, "min-max"))
    assert not s.overlaps(Stats(5.0, 4.5, 5.5, 3, "min-max"))


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (Stats(1.30, 1.25, 1.40, 9, "min-max"), "met"),
        (Stats(1.30, 1.10, 1.50, 9, "min-max"), "met, within noise"),
        (Stats(1.10, 1.00, 1.15, 9, "min-max"), "missed"),
        (Stats(1.10, 1.00, 1.30, 9, "min-max"), "missed, within noise"),
        (Stats(1.20, 1.20, 1.20, 1, "n=1"), "met"),
    ],
)
def test_verdict(ratio, expected):
    assert verdict(ratio, 1.2) == expected


def test_in_cache_classification(tmp_path):
    llc = 32 * MiB
    assert classify(1 * MiB, llc) == "in cache"
    assert classify(10 * MiB, llc) == "in cache"  # the rotary row that read 287%
    assert classify(35 * MiB, llc) == "in cache"  # fused_moe fp32, one token
    assert classify(4 * llc, llc) == "DRAM"
    assert cold_copies(4 * MiB, llc) == 32
    assert cold_copies(35 * MiB, llc) == 4
    assert cold_copies(200 * MiB, llc) == 1
    # sysfs: the largest level's data/unified cache
    for i, (level, kind, size) in enumerate(
        [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
         (3, "Unified", "32768K")]
    ):  # fmt: skip
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert llc_bytes(tmp_path) == (32 * MiB, f"L3 from {tmp_path}")
    assert llc_bytes(tmp_path / "missing")[0] == 32 * MiB  # assumed, and says so


def test_rows_classify_and_rotate(monkeypatch):
    from torch_topg.bench import rows as bench_rows

    monkeypatch.setattr(bench_rows, "llc_bytes", lambda: (32 * MiB, "test"))
    monkeypatch.setattr(bench_rows, "cold_copies", lambda ws: cold_copies(ws, 32 * MiB))
    assert bench_rows.regime_of(10 * MiB) == "in cache (10 MiB)"
    assert bench_rows.regime_of(200 * MiB) == "DRAM"
    assert bench_rows.regime_of(4 * MiB, sets=32) == "cold: 32 sets of 4 MiB rotated"
    made = []
    rot = bench_rows.Rotation(lambda i: made.append(i) or (i,), 16 * MiB, cold=True)
    assert rot.n == 8 and made == list(range(8))
    assert [rot.next()[0] for _ in range(10)] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert bench_rows.Rotation(lambda i: (i,), 16 * MiB, cold=False).n == 1


def test_theoretical_peak_assumptions():
    zen4 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fma avx avx2 avx512f"}
    intel = {"vendor_id": "GenuineIntel", "cpu family": "6", "flags": "fma avx avx2 avx512f"}
    avx2 = {"vendor_id": "GenuineIntel", "cpu family": "6", "flags": "fma avx avx2"}
    assert fp32_flops_per_cycle(zen4)[0] == 32
    assert fp32_flops_per_cycle(intel)[0] == 64
    assert fp32_flops_per_cycle(avx2)[0] == 32
    peak = theoretical_peak(threads=2, info={**avx2, "cpu MHz": "3000.0"})
    if peak["clock_hz"] == 3e9:  # no cpufreq on this machine: cpuinfo's clock is used
        assert peak["fp32_flops"] == pytest.approx(2 * 32 * 3e9)
    assert "assumed" in peak["assumptions"]
    # a measured rate above the nominal-clock peak: the clock it implies is used instead
    faster = theoretical_peak(threads=2, info={**avx2, "cpu MHz": "3000.0"}, measured_flops=2.4e11)
    if "cpufreq" not in faster["assumptions"]:
        assert faster["fp32_flops"] == pytest.approx(2.4e11)
        assert "implied by the fastest fp32 GEMM measured" in faster["assumptions"]
    slower = theoretical_peak(threads=2, info={**avx2, "cpu MHz": "3000.0"}, measured_flops=1e11)
    assert slower["fp32_flops"] == peak["fp32_flops"]


MACHINE = {
    "cpu_model": "Test CPU",
    "logical_cpus": 2,
    "threads": 2,
    "llc_bytes": 32 * MiB,
    "torch": "2.x",
    "torch_cpu_capability": "AVX2",
    "compiler": "c++ 12",
    "read_bw_buffer_bytes": 256 * MiB,
    "peak": {"fp32_flops": 1.6e11, "assumptions": "test"},
    "read_bw": Stats(20e9, 19e9, 21e9, 10, "p10-p90").to_dict(),
    "gemm_fp32_1024": Stats(1e11, 0.9e11, 1.1e11, 10, "p10-p90").to_dict(),
}


def _row(op: str, topg: Stats, base: Stats, target=None, limit: Stats | None = None):
    from torch_topg.bench.rows import Row

    ratios = {"hf": Stats(base.median / topg.median, 1.0, 2.0, 10, "p10-p90")}
    if limit:
        ratios["limit"] = limit
    regime = "DRAM" if limit else "in cache (8 KiB)"
    return Row("fam", op, "T=1", "fp32", {"topg": topg, "hf": base}, ratios, regime=regime,
               limit_ms=0.5 if limit else None, limit_kind="read bw" if limit else "",
               target=target)  # fmt: skip


def _record(rows, date="2026-12-01T00:00:00Z"):
    return bench.new_record("ops", [r.to_dict() for r in rows], MACHINE, date=date, argv=["x"])


def test_record_round_trip(tmp_path):
    from torch_topg.bench.rows import Row

    rows = [
        _row("a", Stats(1.0, 0.9, 1.1, 10, "p10-p90"), Stats(2.0, 1.9, 2.1, 10, "p10-p90"),
             target=("hf", 1.5)),
        _row("b", Stats(1.0, 0.9, 1.1, 10, "p10-p90"), Stats(2.0, 1.9, 2.1, 10, "p10-p90"),
             target=("limit", 0.8), limit=Stats(0.9, 0.85, 0.95, 10, "p10-p90")),
    ]  # fmt: skip
    rec = _record(rows)
    path = bench.write_record(rec, tmp_path)
    assert path.name.startswith("ops-20261201T000000Z-")
    back = bench.load_record(path)
    assert back == json.loads(json.dumps(rec))
    assert [Row.from_dict(d) for d in back["rows"]] == rows
    assert {"date", "commit", "machine", "rows", "argv"} <= set(back)
    assert back["rows"][1]["verdict"] == "met"
    assert bench.latest(tmp_path, "ops") == [path]
    bad = dict(rec, schema="other/1")
    with pytest.raises(ValueError):
        bench.write_record(bad, tmp_path)


def test_bench_compare_cli(tmp_path, capsys):
    from torch_topg.__main__ import main

    same = Stats(1.0, 0.9, 1.1, 10, "p10-p90")
    old = [
        _row("faster_op", Stats(2.0, 1.9, 2.1, 10, "p10-p90"), same),
        _row("slower_op", same, same),
        _row("noisy_op", same, same),
        _row("gone_op", same, same),
    ]
    new = [
        _row("faster_op", Stats(1.0, 0.95, 1.05, 10, "p10-p90"), same),
        _row("slower_op", Stats(1.5, 1.4, 1.6, 10, "p10-p90"), same),
        _row("noisy_op", Stats(1.05, 0.8, 1.3, 10, "p10-p90"), same),
    ]
    a = bench.write_record(_record(old), tmp_path / "a")
    b = bench.write_record(_record(new, date="2026-12-02T00:00:00Z"), tmp_path / "b")
    assert main(["bench", "compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    faster, slower = out.split("faster beyond the spread")[1].split("slower beyond the spread")
    assert "faster_op | T=1 | fp32 | topg" in faster and "2.00x" in faster
    assert "slower_op" in slower and "noisy_op" not in out.split("within the spread")[0]
    assert "(1):" in faster and "(1):" in slower
    assert "only in A: gone_op | T=1 | fp32" in out
    assert main(["bench", "compare", str(a), str(tmp_path / "missing.json")]) == 2


def test_ops_table_marks_noise_and_cache():
    import bench_ops

    noisy = _row("noisy", Stats(1.0, 0.9, 1.1, 10, "p10-p90"), Stats(1.6, 1.0, 2.0, 10, "p10-p90"),
                 target=("hf", 1.5))  # fmt: skip
    rows = [noisy, _row("cached", Stats(1.0, 0.9, 1.1, 10, "p10-p90"),
                        Stats(3.0, 2.9, 3.1, 10, "p10-p90"))]  # fmt: skip
    text = bench_ops.table(rows)
    assert "yes, within noise" in text
    assert "in cache (8 KiB)" in text
    summary = bench_ops.summary(rows)
    assert "targets met: 1 of 1" in summary and "1 within noise" in summary
    assert "2 rows in cache" in summary and "ABOVE" not in summary
    over = _row("over", Stats(1.0, 0.9, 1.1, 10, "p10-p90"), Stats(1.0, 0.9, 1.1, 10, "p10-p90"),
                limit=Stats(1.3, 1.2, 1.4, 10, "p10-p90"))  # fmt: skip
    within = _row("within", Stats(1.0, 0.9, 1.1, 10, "p10-p90"), Stats(1.0, 0.9, 1.1, 10, "p10-p90"),
                  limit=Stats(1.02, 0.95, 1.1, 10, "p10-p90"))  # fmt: skip
    summary = bench_ops.summary([over, within])
    assert "largest % of read bw: 130% [120-140] (over T=1 fp32)" in summary
    assert "ABOVE the read-bandwidth limit in every round: over T=1 fp32" in summary
    assert "within T=1" not in summary.split("ABOVE")[1]


def test_render_readme_replaces_only_the_block(tmp_path):
    import render_readme

    text = "# x\nbefore\n<!-- bench:ops-targets:begin -->\nold\n<!-- bench:ops-targets:end -->\nafter\n"
    new = render_readme.replace_block(text, "ops-targets", "new table")
    assert new == text.replace("\nold\n", "\nnew table\n")
    with pytest.raises(render_readme.MissingBlock):
        render_readme.replace_block(text, "models", "x")
    rows = [_row("a", Stats(1.0, 0.9, 1.1, 10, "p10-p90"), Stats(2.0, 1.9, 2.1, 10, "p10-p90"),
                 target=("hf", 1.5))]  # fmt: skip
    rec_path = bench.write_record(_record(rows), tmp_path / "results")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(text)
    (tmp_path / "docs" / "benchmarks.md").write_text(
        "<!-- bench:ops-all:begin -->\n<!-- bench:ops-all:end -->\n"
    )
    argv = ["--root", str(tmp_path), "--results", str(tmp_path / "results")]
    assert render_readme.main([*argv, "--check"]) == 1
    assert render_readme.main([*argv, "--no-plot"]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("# x\nbefore\n") and readme.endswith("after\n")
    assert "targets met: 1 of 1" in readme and "| a | T=1 | fp32 |" in readme
    assert "| a | T=1 | fp32 |" in (tmp_path / "docs" / "benchmarks.md").read_text()
    assert render_readme.main([*argv, "--check", "--ops", str(rec_path)]) == 0


def test_contexts_are_entered_outside_the_timed_region():
    clock = Clock()
    entered = []

    class Ctx:
        def __enter__(self):
            entered.append(True)
            clock.now += 100.0  # a costly toggle: not part of any sample

        def __exit__(self, *exc):
            clock.now += 100.0

    fn = clock.variant("a", [1.0] * 10)
    cmp = compare({"a": fn}, NO_CALIBRATION, rounds=3, contexts={"a": Ctx}, timer=clock)
    assert cmp.samples["a"] == [1.0, 1.0, 1.0]
    assert len(entered) == 1 + 1 + 3  # warm-up, calibration, one per round


def test_compare_records_rates_are_higher_is_better():
    def rec(rate: float, date: str) -> dict:
        fig = Stats(rate, rate * 0.98, rate * 1.02, 5, "min-max").to_dict()
        row = {"key": "engine | fp32", "figures": {"tok_s": fig}, "higher_is_better": ["tok_s"]}
        return bench.new_record("engine", [row], MACHINE, date=date, argv=[])

    out = bench.compare_records(rec(100.0, "2026-01-01"), rec(150.0, "2026-01-02"))
    assert "faster beyond the spread (1)" in out and "1.50x higher" in out
    out = bench.compare_records(rec(150.0, "2026-01-01"), rec(100.0, "2026-01-02"))
    assert "slower beyond the spread (1)" in out


def test_dram_rows_use_the_bandwidth_of_their_own_rounds(monkeypatch):
    """The probe runs in every round of a DRAM row; a round at half the bandwidth has
    half the limit time... and the fraction follows it, round by round."""
    from torch_topg.bench import Comparison
    from torch_topg.bench import rows as bench_rows

    seen = {}

    def fake_compare(variants, budget, contexts=None):
        seen["names"] = list(variants)
        return Comparison(
            {
                "topg": [1.0, 2.0, 1.0],  # the load doubles topg's time in round 2 ...
                "stock": [2.0, 4.0, 2.0],
                bench_rows.PROBE: [0.5, 1.0, 0.5],  # ... and the probe's
            }
        )

    monkeypatch.setattr(bench_rows, "compare", fake_compare)
    monkeypatch.setattr(bench_rows, "read_probe", lambda: (lambda: None, 100))
    monkeypatch.setattr(bench_rows, "llc_bytes", lambda: (32 * MiB, "test"))
    noop = lambda: None  # noqa: E731
    row = bench_rows.measure("f", "op", "c", "fp32", {"topg": noop, "stock": noop}, quick=True,
                         dram_bytes=160.0, working_set=200 * MiB, target=("limit", 0.8))  # fmt: skip
    assert seen["names"] == ["topg", "stock", bench_rows.PROBE]
    assert list(row.figures) == ["topg", "stock"] and row.regime == "DRAM"
    lim = row.ratios["limit"]  # 160 bytes at 100 / 0.5 s = 0.8 s, over topg's 1 s
    assert (lim.median, lim.lo, lim.hi) == pytest.approx((0.8, 0.8, 0.8))
    assert row.read_bw.median == pytest.approx(200.0) and row.verdict == "met"
    cached = bench_rows.measure("f", "op", "c", "fp32", {"topg": noop, "stock": noop}, quick=True,
                            dram_bytes=160.0, working_set=1 * MiB, target=("limit", 0.8))  # fmt: skip
    assert seen["names"] == ["topg", "stock"] and "limit" not in cached.ratios
    assert cached.regime == "in cache (1 MiB)" and cached.verdict == "not measured"
    # another variant's share of the limit, round by round against the same probe
    both = bench_rows.measure("f", "op", "c", "fp32", {"topg": noop, "stock": noop}, quick=True,
                          dram_bytes=160.0, working_set=200 * MiB, limit_for=("stock",),
                          target=("limit stock", 0.8))  # fmt: skip
    lim = both.ratios["limit stock"]  # 0.8 s over stock's 2 s
    assert (lim.median, lim.lo, lim.hi) == pytest.approx((0.4, 0.4, 0.4))
    assert both.verdict.startswith("missed")


def test_a_variants_share_of_the_limit_renders_as_its_target():
    import bench_ops

    r = _row("c", Stats(1.0, 0.9, 1.1, 10, "p10-p90"), Stats(2.0, 1.9, 2.1, 10, "p10-p90"),
             target=("limit int8 act", 0.8), limit=Stats(0.6, 0.55, 0.65, 10, "p10-p90"))  # fmt: skip
    r.ratios["limit int8 act"] = Stats(0.85, 0.82, 0.9, 10, "p10-p90")
    assert bench_ops.target_cells(r) == (">= 80% of limit (int8 act)", "yes")
    assert "60% [55-65] of read bw" in bench_ops.limit_cell(r)
    assert "<br>85% [82-90] int8 act" in bench_ops.limit_cell(r)
    r.ratios["limit int8 act"] = Stats(0.7, 0.65, 0.75, 10, "p10-p90")
    assert bench_ops.target_cells(r)[1] == "**no** (70% [65-75])"


def test_tp_and_offload_blocks_render_from_records():
    import offload
    import tp

    def s(m: float) -> dict:
        return Stats(m, 0.9 * m, 1.1 * m, 5, "min-max").to_dict()

    tp1 = {"llama-150m|eager|decode": s(60.0), "llama-150m|eager|prefill 128": s(800.0)}
    tp2 = {"llama-150m|eager|decode": s(100.0), "llama-150m|eager|prefill 128": s(850.0)}
    for n in ("fused", "all_reduce + fused_add_rms_norm", "all_reduce + add + rms_norm", "ratio"):
        tp2[f"allreduce_norm|T=1 H=512|{n}"] = s(1.2)
    rec = bench.new_record("tp", tp.record_rows(tp1, tp2), MACHINE, argv=[])
    text = tp.render_record(json.loads(json.dumps(rec)))
    assert "| llama-150m | eager | 60.00 [54.00-66.00] / 100.00 [90.00-110.00] | 0.60x |" in text
    assert "| T=1 H=512 |" in text
    row = {"model": "m", "io": "mmap", "throttle": "none", "peak_mib": 54.0, "bound_mib": 54.0,
           "offloaded_mb": 425.0}  # fmt: skip
    rows = [{**row, "depth": d, "ratio": r} for d, r in enumerate((1.5, 1.1, 1.2, 1.14))]
    text = offload.compact(rows)
    assert "| m | 425 MB | unthrottled | 1.50 | **1.10** | 1.20 | **1.14** | 54 / 54 MiB |" in text


def test_busy_is_measured_not_trailing():
    """The BUSY label comes from the CPU time others used just before the run (the 1-min
    load average trails: it called a run busy because of the run before it)."""
    used = cpu_busy(0.05)
    assert used is None or 0.0 <= used <= 1.0
    base = {**MACHINE, "peak": {"fp32_flops": 1e11, "assumptions": "test"}}
    base.setdefault("torch_cpu_capability", "AVX2")
    base.setdefault("compiler", "cc")
    quiet = describe({**base, "load_avg_1min": 1.9, "cpu_busy_1s": 0.02})
    assert "BUSY" not in quiet and "2% busy" in quiet
    assert "BUSY" in describe({**base, "load_avg_1min": 0.1, "cpu_busy_1s": 0.6})
    assert "BUSY" in describe({**base, "load_avg_1min": 1.9})  # older records: load average


# --- clocks: the host's and the GPU's (CUDA events, driven here by fakes) -------------
class FakeEvent:
    """A CUDA event's interface on a synthetic clock: ``record`` notes the time;
    ``elapsed_time`` (ms) is only valid once the round has synchronised."""

    def __init__(self, clock: Clock, synced: list[int]) -> None:
        self.clock, self.synced, self.t = clock, synced, None

    def record(self) -> None:
        self.clock.log.append("record")
        self.t = self.clock.now
        self.round = len(self.synced)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert len(self.synced) > self.round, "elapsed_time before the round synchronised"
        return (end.t - self.t) * 1e3


def fake_cuda_clock(clock: Clock) -> bench.CudaClock:
    synced: list[int] = []

    def synchronize() -> None:
        clock.log.append("sync")
        synced.append(1)

    return bench.CudaClock(event=lambda: FakeEvent(clock, synced), synchronize=synchronize)


def test_cuda_clock_synchronises_once_per_round():
    clock = Clock()
    variants = {n: clock.variant(n, [d] * 10) for n, d in (("a", 1.0), ("b", 3.0))}
    cmp = compare(variants, NO_CALIBRATION, rounds=3, clock=fake_cuda_clock(clock))
    assert cmp.samples == {"a": [1.0] * 3, "b": [3.0] * 3}  # event ms back to seconds
    rounds = clock.log[clock.log.index("b") + 3 :]  # after calibrating a, then b
    assert rounds == ["record", "a", "record", "record", "b", "record", "sync"] * 3


def test_bench_and_stopwatch_on_the_cuda_clock():
    clock = Clock()
    t = bench.bench(clock.variant("a", [2.0] * 10), warmup=1, min_runs=3, max_runs=3,
                    min_time_s=0.0, clock=fake_cuda_clock(clock))  # fmt: skip
    assert t.median_s == pytest.approx(2.0) and t.runs == 3
    sw = bench.Stopwatch(clock=fake_cuda_clock(clock))
    for d in (1.0, 2.0, 4.0):
        with sw.lap():
            clock.now += d
    assert sw.samples == [1.0, 2.0, 4.0] and sw.last == 4.0
    assert sw.ms().median == pytest.approx(2000.0) and sw.stats().spread == "min-max"


def test_stopwatch_and_timed_on_the_host_clock():
    clock = Clock()
    sw = bench.Stopwatch(timer=clock)
    with sw.lap():
        clock.now += 0.5
    assert sw.samples == [0.5]
    out, s = bench.timed(lambda x, y=0: x + y, 2, y=3)
    assert out == 5 and s >= 0.0


def test_timing_device_follows_the_callables_tensors(monkeypatch):
    import functools

    import torch

    from torch_topg.bench.timing import make_clock, tensors_of

    x = torch.ones(2)
    m = torch.ones(2, device="meta")
    assert [t.device.type for t in tensors_of(lambda: x + 1)] == ["cpu"]
    assert tensors_of(x.sum)[0] is x  # a bound method's tensor
    assert tensors_of(functools.partial(torch.add, m, other=x)) == [m, x]
    assert tensors_of(lambda: torch.ones(1)) == []  # made by the call, not held
    pair = (x, m)
    assert tensors_of(lambda: pair) == [x, m]  # tensors in a held tuple
    assert bench.timing_device(None, [lambda: x + 1]) == "cpu"
    assert bench.timing_device("cuda:1") == "cuda" and bench.timing_device("cpu") == "cpu"
    assert bench.timing_device(torch.device("cpu"), [lambda: x]) == "cpu"  # explicit wins

    class OnCuda:  # what timing_device sees of a CUDA tensor: its device's type
        device = torch.device("cuda", 0)

    from torch_topg.bench import timing

    monkeypatch.setattr(timing, "tensors_of", lambda fn: [OnCuda()])
    assert bench.timing_device(None, [lambda: None]) == "cuda"
    with pytest.raises(ValueError, match="no usable CUDA device"):
        make_clock(None, [lambda: None], cuda_available=lambda: False)
    assert isinstance(make_clock(None, [lambda: None], cuda_available=lambda: True),
                      bench.CudaClock)  # fmt: skip
    assert isinstance(make_clock("cpu", cuda_available=lambda: True), bench.HostClock)


def test_memory_figures_of_this_process():
    import torch

    from torch_topg.bench import memory

    rss, peak = memory.rss_mb(), memory.peak_rss_mb()
    assert rss is None or 0 < rss <= peak
    memory.reset_peak_rss()  # never raises, /proc or not
    x = torch.ones(1 << 20)  # 4 MiB, written: resident
    res = memory.resident_mb([x])
    assert res is None or 3.9 <= res <= 4.1
    assert memory.rss_mb(pid=2**22 + 7) is None  # no such process


def test_decode_read_bytes_and_flops_from_a_config():
    import types

    import torch

    from torch_topg.bench.models import decode_read_bytes, decoder_shape, round_flops

    cfg = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                hidden_size=8, intermediate_size=16, vocab_size=10)  # fmt: skip
    m = torch.nn.Linear(8, 8, bias=False)
    m.config = cfg
    m.register_buffer("shared", m.weight)  # the same storage: counted once
    # weights 8*8*4 bytes; KV: 2 (K, V) x 2 layers x 2 heads x head_dim 2 x 10 tokens x 4 bytes
    assert decode_read_bytes(m, 10) == 256 + 2 * 2 * 2 * 2 * 10 * 4
    moe = types.SimpleNamespace(**vars(cfg), num_local_experts=4, num_experts_per_tok=1)
    m.config = moe  # 3 unread experts x 3 x 8 x 16 x 4 bytes per layer
    assert decode_read_bytes(m, 0) == 256 - 2 * 3 * 3 * 8 * 16 * 4
    shape = decoder_shape(cfg)
    assert shape["head_dim"] == 2 and shape["params_embedding"] == 80
    n, attn = shape["params_non_embedding"], 4 * 2 * 4 * 2
    assert round_flops(shape, [3], 2) == 2 * n * 4 + attn * 4 * 5 / 2


def test_wall_clock_waits_for_the_device_at_each_mark():
    clock = Clock()
    host = bench.HostClock(clock, synchronize=lambda: clock.log.append("sync"))
    sw = bench.Stopwatch(clock=host)
    with sw.lap():
        clock.log.append("work")
        clock.now += 2.0
    assert clock.log == ["sync", "work", "sync"] and sw.samples == [2.0]
    assert bench.wall_clock("cpu")._synchronize is None


def test_release_probe_frees_the_buffer_and_keeps_the_figures(monkeypatch):
    """A large-model benchmark frees the probe's buffer once the bandwidth is measured:
    the buffer is gone, the figure and the probe's name stay, nothing is re-measured."""
    from torch_topg.bench import machine as m

    monkeypatch.setattr(m, "llc_bytes", lambda *a: (1 * MiB, "test"))  # the 256 MiB floor
    m.release_probe()  # buffers other tests' probes left
    m.remeasure()
    try:
        bw = m.read_bandwidth_stats()
        name = m.read_probe_name()
        assert m._probe_buffer.cache_info().currsize == 1
        m.release_probe()
        assert m._probe_buffer.cache_info().currsize == 0
        assert m.read_bandwidth_stats() is bw and m.read_probe_name() == name
        assert m._probe_buffer.cache_info().currsize == 0  # the name did not re-probe
    finally:
        m.release_probe()
        m.remeasure()
