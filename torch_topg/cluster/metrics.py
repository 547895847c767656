"""The cluster's ``/metrics``: the replicas' Prometheus texts merged into one, plus the
router's own figures.

Samples with the same name and labels are added up (counters, histogram buckets, sums
and counts, and gauges such as running or waiting requests: the cluster's totals);
gauges that are fractions (names with ``usage``, ``perc``, ``fraction`` or ``rate``)
are averaged over the replicas instead. ``*_created`` samples (a replica's start time)
are dropped.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_MEAN = ("usage", "perc", "fraction", "rate")


def merge_metrics(texts: list[str]) -> bytes:
    families: dict[str, tuple[str, str, dict[tuple, list[float]]]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            _, _, samples = families.setdefault(fam.name, (fam.type, fam.documentation, {}))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                samples.setdefault(key, []).append(s.value)
    lines: list[str] = []
    for name, (kind, doc, samples) in families.items():
        shown = name  # prometheus-client's text names a counter's family with its _total
        if kind == "counter" and any(s == f"{name}_total" for s, _ in samples):
            shown = f"{name}_total"
        lines.append(f"# HELP {shown} {doc}")
        lines.append(f"# TYPE {shown} {kind}")
        mean = kind == "gauge" and any(w in name for w in _MEAN)
        for (sname, labels), vals in samples.items():
            v = sum(vals) / len(vals) if mean else sum(vals)
            lines.append(f"{sname}{_labels(dict(labels))} {_num(v)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def router_metrics(state: dict[str, Any], retries: int, failed: int, now: float) -> bytes:
    reps = state["replicas"]
    out = [
        "# HELP topg_router_replicas Replicas known to the router, by state",
        "# TYPE topg_router_replicas gauge",
        f'topg_router_replicas{{state="alive"}} {sum(r["alive"] for r in reps.values())}',
        f'topg_router_replicas{{state="dead"}} {sum(not r["alive"] for r in reps.values())}',
        "# HELP topg_router_requests_in_flight Requests routed to a replica and not finished",
        "# TYPE topg_router_requests_in_flight gauge",
        *(f'topg_router_requests_in_flight{{replica="{r}"}} {s["inflight"]}' for r, s in reps.items()),
        "# HELP topg_router_decisions_total Routing decisions by reason",
        "# TYPE topg_router_decisions_total counter",
        *(f'topg_router_decisions_total{{reason="{k}"}} {v}' for k, v in state["decisions"].items()),
        "# HELP topg_router_indexed_blocks Prefix blocks the router knows a replica holds",
        "# TYPE topg_router_indexed_blocks gauge",
        f"topg_router_indexed_blocks {state['indexed_blocks']}",
        "# HELP topg_router_retries_total Requests sent again after their replica failed",
        "# TYPE topg_router_retries_total counter",
        f"topg_router_retries_total {retries}",
        "# HELP topg_router_failed_streams_total Streams ended by an error event (replica lost)",
        "# TYPE topg_router_failed_streams_total counter",
        f"topg_router_failed_streams_total {failed}",
    ]  # fmt: skip
    return ("\n".join(out) + "\n").encode()


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = (
        v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values()
    )
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc, strict=True)) + "}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
