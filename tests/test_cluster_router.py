"""The router's core (torch_topg.cluster.router) without Ray: session stickiness, the
longest cached prefix, the load threshold, dead and removed replicas, KV events applied
once and in order; the command line's flags and the metrics merge. No engine runs here
(the prompt hashes against an engine's: test_cluster_shared_disk.py)."""

from __future__ import annotations

import pytest

from torch_topg.cluster.router import NoReplica, PrefixRouter
from torch_topg.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

pytestmark = pytest.mark.native_independent  # no topg op: run in the native lane only


def H(i: int) -> bytes:
    return i.to_bytes(16, "little")


def stored(hashes: list[bytes], medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(hashes, None, [], 4, None, medium)])


def router(n: int = 2, **kw) -> PrefixRouter:
    r = PrefixRouter(**kw)
    r.set_replicas([f"r{i}" for i in range(n)])
    return r


def test_session_stays_on_its_replica() -> None:
    r = router(3)
    first = r.decide([], "chat-1")
    assert first.reason == "least_load"
    r.routed(first.replica, "chat-1")
    r.done(first.replica)
    for _ in range(5):  # other traffic does not move it
        d = r.decide([], "chat-1")
        assert (d.replica, d.reason) == (first.replica, "session")
        r.routed(d.replica, "chat-1")
        other = r.decide([], None)  # a turn of another conversation, at the same time
        r.routed(other.replica)
        r.done(d.replica)
        r.done(other.replica)
    assert r.decide([], "chat-2").reason == "least_load"


def test_longest_prefix_wins() -> None:
    r = router(3)
    r.apply_events("r0", 0, 1, stored([H(1), H(2)]))
    r.apply_events("r1", 0, 1, stored([H(1), H(2), H(3)]))
    r.apply_events("r2", 0, 1, stored([H(9)]))
    d = r.decide([H(1), H(2), H(3), H(4)])
    assert (d.replica, d.reason, d.prefix_blocks) == ("r1", "prefix", 3)
    assert r.decide([H(1), H(2)]).replica in ("r0", "r1")
    # a prefix must start at the first block: r2's block 9 in the middle does not count
    assert r.decide([H(5), H(9)]).reason == "least_load"
    # removed from one medium but kept in another: still held
    r.apply_events("r1", 1, 2, KVEventBatch(0.0, [BlockStored([H(3)], None, [], 4, None, "DISK"),
                                                  BlockRemoved([H(3)], "GPU")]))  # fmt: skip
    assert r.decide([H(1), H(2), H(3)]).replica == "r1"
    r.apply_events("r1", 2, 3, KVEventBatch(0.0, [BlockRemoved([H(3)], "DISK")]))
    assert r.decide([H(1), H(2), H(3)]).prefix_blocks == 2


def test_load_threshold_overrides_prefix_and_session() -> None:
    r = router(2, load_ratio=2.0, load_floor=1)
    r.apply_events("r0", 0, 1, stored([H(1), H(2)]))
    for _ in range(2):  # r0: 2 in flight, r1 idle (counts as 1): 2 <= 2x1, still r0
        r.routed("r0", "s")
    assert r.decide([H(1)], "s").reason == "session"
    assert r.decide([H(1)]).replica == "r0"
    r.routed("r0")  # 3 > 2 x max(0, 1): over the threshold
    d = r.decide([H(1), H(2)], "s")
    assert (d.replica, d.reason) == ("r1", "least_load")
    for _ in range(2):
        r.routed("r1")  # r1: 2, r0: 3 <= 2 x 2: r0 is back under
    assert r.decide([H(1)]).replica == "r0"
    r.done("r0")
    with pytest.raises(ValueError, match="load_ratio"):
        PrefixRouter(load_ratio=0.5)
    with pytest.raises(ValueError, match="load_floor"):
        PrefixRouter(load_floor=0)
    with pytest.raises(ValueError, match="min_prefix_share"):
        PrefixRouter(min_prefix_share=1.5)


def test_load_floor_keeps_a_burst_together() -> None:
    r = router(2, load_ratio=2.0, load_floor=4)
    for _ in range(8):  # 8 <= 2 x max(0, 4): the session stays
        r.routed("r0", "s")
    assert r.decide([], "s").reason == "session"
    r.routed("r0")  # 9 > 8
    assert r.decide([], "s").replica == "r1"


def test_short_shared_prefix_does_not_pile_up() -> None:
    """A cached prefix under min_prefix_share of the prompt routes by load instead."""
    r = router(2, min_prefix_share=0.5)
    r.apply_events("r0", 0, 1, stored([H(1)]))
    r.routed("r0")  # r0 busier
    assert r.decide([H(1), H(2), H(3)]).reason == "least_load"  # 1 of 3 blocks
    assert r.decide([H(1), H(2)]).reason == "prefix"  # 1 of 2: the share is met


def test_dead_and_removed_replicas() -> None:
    r = router(2)
    r.apply_events("r0", 0, 1, stored([H(1)]))
    r.routed("r0", "s")
    r.mark_dead("r0")
    d = r.decide([H(1)], "s")
    assert d.replica == "r1" and d.reason == "least_load"
    assert H(1) not in r.index  # a replacement starts cold
    r.apply_events("r0", 1, 2, stored([H(2)]))  # late events of the dead one: ignored
    assert H(2) not in r.index
    r.set_replicas(["r1", "r2"])  # r0 replaced by r2
    assert sorted(r.replicas) == ["r1", "r2"]
    r.mark_dead("r1")
    r.mark_dead("r2")
    with pytest.raises(NoReplica):
        r.decide([], None)


def test_events_applied_once_in_order() -> None:
    r = router(1)
    batch1 = stored([H(1)])
    both = KVEventBatch(0.0, [*batch1.events, BlockRemoved([H(1)], "GPU")])
    r.apply_events("r0", 0, 2, both)  # events 0 and 1
    r.apply_events("r0", 0, 1, batch1)  # an older, overlapping batch arriving late: skipped
    assert H(1) not in r.index and r.cursors() == {"r0": 2}
    r.apply_events("r0", 1, 3, KVEventBatch(0.0, [BlockRemoved([H(1)], "GPU"),
                                                  *stored([H(7)]).events]))  # fmt: skip
    assert H(7) in r.index and r.cursors()["r0"] == 3
    r.apply_events("r0", 50, 52, KVEventBatch(0.0, [AllBlocksCleared(), *stored([H(8)]).events]))
    assert H(7) not in r.index and H(8) in r.index


def test_cli_flags_and_bad_values() -> None:
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from torch_topg.cluster.deploy import ClusterSpec, serve_cluster
    from torch_topg.cluster.replica import EngineSpec, RouterOptions
    from torch_topg.serve.cli import parser

    args = parser().parse_args(["--replicas", "3", "--route-load-ratio", "1.5",
                                "--route-load-floor", "2", "--route-min-prefix-share", "0.25"])  # fmt: skip
    assert (args.replicas, args.route_load_ratio, args.route_load_floor) == (3, 1.5, 2)
    assert args.route_min_prefix_share == 0.25 and parser().parse_args([]).replicas is None
    assert serve_cluster(["--replicas", "0"]) == 2  # refused before Ray is touched
    with pytest.raises(ValueError, match="replicas: expected an int >= 1, got 0"):
        ClusterSpec(EngineSpec(), replicas=0)
    with pytest.raises(ValueError, match="load_ratio"):
        ClusterSpec(EngineSpec(), router=RouterOptions(load_ratio=0.9))


def test_metrics_merge_adds_replicas_up() -> None:
    """The cluster's /metrics against the replicas' own texts (prometheus-client's)."""
    pytest.importorskip("prometheus_client", reason="the serve extra is not installed")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from torch_topg.cluster.metrics import merge_metrics

    texts = []
    for tokens, usage, waits in ((5, 0.2, [0.01, 0.3]), (7, 0.6, [2.0])):
        reg = CollectorRegistry()
        Counter("topg_generation_tokens", "t", registry=reg).inc(tokens)
        Gauge("topg_kv_cache_usage", "u", registry=reg).set(usage)
        Gauge("topg_num_requests_running", "r", registry=reg).set(tokens)
        h = Histogram("topg_ttft_seconds", "h", buckets=(0.1, 1.0), registry=reg)
        for w in waits:
            h.observe(w)
        texts.append(generate_latest(reg).decode())
    merged = merge_metrics(texts).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(merged) for s in f.samples}  # fmt: skip
    assert got[("topg_generation_tokens_total", ())] == 12
    assert got[("topg_num_requests_running", ())] == 12  # a count: the cluster's total
    assert got[("topg_kv_cache_usage", ())] == pytest.approx(0.4)  # a fraction: the mean
    assert got[("topg_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("topg_ttft_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("topg_ttft_seconds_sum", ())] == pytest.approx(2.31)
    assert not any(name.endswith("_created") for name, _ in got)
