"""The one benchmark harness: timing, the machine's limits, and the record of a run.

* ``compare(variants)`` times variants in interleaved rounds after a warm-up and returns
  per-round samples; ``Comparison.ms(name)`` and ``Comparison.ratio(a, b)`` summarise a
  figure or a per-round ratio as ``Stats`` (median and spread). ``bench(fn)`` times one
  callable; ``Stopwatch`` one-off events (``with sw.lap(): ...``). On a GPU the samples
  are CUDA events (``timing_device``). ``verdict(ratio, target)`` says "met", "missed", or either "within noise".
* ``read_probe()``, ``read_bandwidth_stats()``, ``llc_bytes()``, ``classify()``, ``cold_copies()``,
  ``theoretical_peak()``, ``gemm_stats()``, ``machine_info()``: the limits (machine.py).
* ``new_record()``, ``write_record()``, ``load_record()``, ``compare_records()``: the JSON
  record of a run under ``bench_results/`` (record.py); ``python -m torch_topg bench
  compare A.json B.json`` prints what changed beyond the spread.
"""

from torch_topg.bench.machine import (
    DRAM_FACTOR,
    classify,
    cold_copies,
    describe,
    gemm_rate,
    gemm_stats,
    llc_bytes,
    load_average,
    machine_info,
    read_bandwidth,
    read_bandwidth_stats,
    read_probe,
    remeasure,
    theoretical_peak,
)
from torch_topg.bench.record import (
    SCHEMA,
    compare_records,
    latest,
    load_record,
    new_record,
    write_record,
)
from torch_topg.bench.timing import (
    Budget,
    Comparison,
    CudaClock,
    HostClock,
    Stats,
    Stopwatch,
    Timing,
    bench,
    compare,
    quantile,
    summarize,
    timed,
    timing_device,
    verdict,
    wall_clock,
)

__all__ = [
    "DRAM_FACTOR",
    "SCHEMA",
    "Budget",
    "Comparison",
    "CudaClock",
    "HostClock",
    "Stats",
    "Stopwatch",
    "Timing",
    "bench",
    "classify",
    "cold_copies",
    "compare",
    "compare_records",
    "describe",
    "gemm_rate",
    "gemm_stats",
    "latest",
    "llc_bytes",
    "load_average",
    "load_record",
    "machine_info",
    "new_record",
    "quantile",
    "read_bandwidth",
    "read_bandwidth_stats",
    "read_probe",
    "remeasure",
    "summarize",
    "theoretical_peak",
    "timed",
    "timing_device",
    "verdict",
    "wall_clock",
    "write_record",
]
