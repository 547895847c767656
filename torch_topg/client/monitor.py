"""``python -m torch_topg monitor URL``: a live terminal view of a running server.

It scrapes ``URL/metrics`` every ``--interval`` seconds (Prometheus text, parsed with
``prometheus_client.parser``) and redraws one screen with plain ANSI escapes (no curses):
requests running / waiting / finished, output tokens/s (the rate between the last two
scrapes), mean batch size (over that interval, else since start), TTFT / TPOT p50
(interpolated in the histogram buckets, since the server started), KV blocks used /
total and the share of prompt tokens read from the cache. ``--once`` scrapes twice,
``--interval`` apart, prints one frame and exits. Metrics a server does not export show
as ``-``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text page: name -> [(labels, value)]."""
    out: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)


def scrape(url: str, timeout: float = 5.0) -> Samples:
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels`` (None: absent)."""
    found = [
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    ]
    return sum(found) if found else None


def histogram_quantile(samples: Samples, name: str, q: float) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket holding rank ``q``;
    the upper bound of the last finite bucket when the rank falls in +Inf."""
    buckets = sorted((float(lab["le"]), v) for lab, v in samples.get(f"{name}_bucket", []))
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo_bound
            if count == lo_count:
                return bound
            return lo_bound + (bound - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = bound, count
    return None


def _delta(new: Samples, old: Samples | None, name: str, **labels: str) -> float | None:
    a, b = value(new, name, **labels), (value(old, name, **labels) if old else None)
    return None if a is None or b is None else a - b


def frame(url: str, cur: Samples, prev: Samples | None, dt: float) -> str:
    """The screen for the latest scrape ``cur`` and the one ``dt`` seconds before it."""
    gen = "topg_engine_tokens_total"
    tok = _delta(cur, prev, gen, kind="generated")
    if tok is None:  # another server: the per-request counter, moved when requests end
        tok = _delta(cur, prev, "topg_generation_tokens_total")
    steps = _delta(cur, prev, "topg_batch_size_count")
    if steps:
        batch = _delta(cur, prev, "topg_batch_size_sum") / steps  # type: ignore[operator]
        batch_when = f"last {dt:.1f} s"
    else:
        total, count = value(cur, "topg_batch_size_sum"), value(cur, "topg_batch_size_count")
        batch = total / count if total is not None and count else None
        batch_when = "since start"
    used, blocks = value(cur, "topg_kv_blocks_used"), value(cur, "topg_kv_blocks_total")
    prompt, cached = (
        value(cur, "topg_prompt_tokens_total"),
        value(cur, "topg_cached_prompt_tokens_total"),
    )
    fin = "topg_request_finished_total"
    ttft = histogram_quantile(cur, "topg_time_to_first_token_seconds", 0.5)
    tpot = histogram_quantile(cur, "topg_time_per_output_token_seconds", 0.5)

    def num(x: float | None, spec: str = ".0f", unit: str = "") -> str:
        return "-" if x is None else f"{x:{spec}}{unit}"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f} ms"

    kv = f"{num(used)} / {num(blocks)}"
    if used is not None and blocks:
        kv += f"  ({100 * used / blocks:.0f}%)"
    lines = [
        f"torch_topg monitor  {url}  {time.strftime('%H:%M:%S')}",
        "",
        f"requests   running {num(value(cur, 'topg_num_requests_running'))}"
        f"   waiting {num(value(cur, 'topg_num_requests_waiting'))}"
        f"   finished {num(value(cur, fin))}"
        f" (stop {num(value(cur, fin, finish_reason='stop'))},"
        f" length {num(value(cur, fin, finish_reason='length'))},"
        f" abort {num(value(cur, fin, finish_reason='abort'))})",
        f"output     {num(None if tok is None or dt <= 0 else tok / dt, '.1f')} tokens/s"
        + (f" (last {dt:.1f} s)" if dt > 0 else ""),
        f"batch      {num(batch, '.2f')} sequences per step ({batch_when})",
        f"latency    TTFT p50 {ms(ttft)}   TPOT p50 {ms(tpot)}  (since start)",
        f"KV blocks  {kv}",
        f"cached     {'-' if not prompt else f'{100 * (cached or 0) / prompt:.1f}%'}"
        f" of {num(prompt)} prompt tokens",
        *_feature_lines(cur, prev),
    ]
    return "\n".join(lines) + "\n"


def _labels(samples: Samples, name: str, label: str) -> list[str]:
    return sorted({lab[label] for lab, _ in samples.get(name, []) if label in lab})


def _feature_lines(cur: Samples, prev: Samples | None) -> list[str]:
    """KV tiers, prefix cache, sessions and speculative decoding: a line each, shown only
    when the server exports it (engines without the feature export nothing)."""
    lines = []
    tiers = _labels(cur, "topg_kv_tier_blocks_used", "tier")
    if tiers:
        parts = []
        for t in tiers:
            used, total = (
                value(cur, "topg_kv_tier_blocks_used", tier=t),
                value(cur, "topg_kv_tier_blocks_total", tier=t),
            )
            part = f"{t} {used:.0f}/{total:.0f}" if total is not None else f"{t} {used:.0f}"
            hits = value(cur, "topg_kv_tier_events_total", tier=t, event="hits")
            evicted = value(cur, "topg_kv_tier_events_total", tier=t, event="evicted")
            extra = [f"{k} {v:.0f}" for k, v in (("hits", hits), ("evicted", evicted)) if v]
            parts.append(part + (f" ({', '.join(extra)})" if extra else ""))
        lines.append("KV tiers   " + "   ".join(parts))
    rate = value(cur, "topg_prefix_cache_hit_rate")
    if rate is not None:
        hit = _delta(cur, prev, "topg_prefix_cache_hit_tokens_total")
        query = _delta(cur, prev, "topg_prefix_cache_query_tokens_total")
        recent = f", last interval {100 * hit / query:.1f}%" if hit is not None and query else ""
        lines.append(f"prefix     hit rate {100 * rate:.1f}% of looked-up tokens{recent}")
    sessions = value(cur, "topg_sessions_active")
    if sessions is not None:
        lines.append(f"sessions   {sessions:.0f} active")
    acc = value(cur, "topg_spec_acceptance_rate")
    if acc is not None:
        mean = value(cur, "topg_spec_mean_accepted_length")
        lines.append(
            f"speculative acceptance {100 * acc:.1f}%"
            + (f", {mean:.2f} tokens per verify" if mean is not None else "")
        )
    return lines


def monitor_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torch_topg monitor",
        description="A live terminal view of a torch_topg server, from its /metrics.",
    )
    p.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    p.add_argument("--once", action="store_true", help="print one frame (two scrapes) and exit")
    args = p.parse_args(argv)
    url = args.url.rstrip("/")
    interval = max(args.interval, 0.05)
    prev: Samples | None = None
    t_prev = 0.0
    try:
        while True:
            try:
                cur, t_cur = scrape(url), time.monotonic()
            except OSError as e:  # URLError, refused, timeout
                if args.once:
                    print(f"cannot scrape {url}/metrics: {e}", file=sys.stderr)
                    return 1
                sys.stdout.write(f"{CLEAR}torch_topg monitor  {url}: unreachable ({e}); retrying\n")
                sys.stdout.flush()
                prev = None
                time.sleep(interval)
                continue
            if prev is not None or not args.once:
                text = frame(url, cur, prev, t_cur - t_prev if prev else 0.0)
                sys.stdout.write(text if args.once else CLEAR + text)
                sys.stdout.flush()
                if args.once:
                    return 0
            prev, t_prev = cur, t_cur
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
