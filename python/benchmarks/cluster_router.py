"""The cluster's figures (docs/cluster.md, "Measured here").

1. The router's decision time (``PrefixRouter.decide``) with 10,000 prefixes indexed over
   2 (or ``--replicas``) replicas: p50 / p99 over requests whose prompts share a cached
   prefix, miss it, or carry a known session. Plain Python, no Ray.
2. (unless ``--router-only``) With a tiny random Llama on the byte tokenizer of the
   server tests: the time to first token of streamed chat requests through Ray Serve
   (2 replicas x 1 thread) against a direct ``python -m torch_topg serve``-style server
   (1 engine x 2 threads), one request at a time; then the session hit rate of 32
   interleaved conversations of ``--turns`` turns on the 2 replicas: the share of later
   turns answered by their conversation's replica, and the prompt tokens read from
   the KV cache.

    python python/benchmarks/cluster_router.py [--router-only] [--requests 30] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from torch_topg.cluster.router import PrefixRouter, block_hashes  # noqa: E402
from torch_topg.engine.kv_events import BlockStored, KVEventBatch  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_decision(prefixes: int, replicas: int, blocks: int, trials: int) -> dict[str, float]:
    """Index ``prefixes`` chains of ``blocks`` blocks (16 tokens each) over the replicas,
    then time decisions for prompts that hit one, miss all, or carry a session."""
    rng = random.Random(0)
    core = PrefixRouter()
    names = [f"r{i}" for i in range(replicas)]
    core.set_replicas(names)
    root = b"\0" * 16
    chains = []
    for p in range(prefixes):
        toks = [rng.randrange(50_000) for _ in range(blocks * 16 + 1)]
        hs = block_hashes(root, toks, 16)
        chains.append(hs)
        r = names[p % replicas]
        core.apply_events(r, core.cursors()[r], core.cursors()[r] + 1,
                          KVEventBatch(0.0, [BlockStored(hs, None, [], 16, None, "GPU")]))  # fmt: skip
    for i in range(200):
        core.routed(names[i % replicas], f"s{i}")
    out: dict[str, float] = {"indexed_blocks": len(core.index)}
    cases = {
        "hit": lambda i: (chains[i % prefixes] + [os.urandom(16)] * 4, None),
        "miss": lambda i: ([os.urandom(16) for _ in range(blocks)], None),
        "session": lambda i: (chains[i % prefixes], f"s{i % 200}"),
    }
    for name, make in cases.items():
        reqs = [make(i) for i in range(trials)]
        times = []
        for hs, sid in reqs:
            t0 = time.perf_counter()
            core.decide(hs, sid)
            times.append(time.perf_counter() - t0)
        out[f"{name}_p50_us"] = pct(times, 0.5) * 1e6
        out[f"{name}_p99_us"] = pct(times, 0.99) * 1e6
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ttft(url: str, messages: list[dict], **kw) -> tuple[float, dict]:
    import requests

    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 8, "stream": True,
            "temperature": 0, "ignore_eos": True, **kw}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line and first is None:
                first = time.perf_counter() - t0
        return first or float("nan"), dict(r.headers)


def direct_server(port: int):
    import torch
    import uvicorn
    from cluster_utils import tiny_chat_engine

    from torch_topg.serve import create_app

    torch.set_num_threads(2)
    eng = tiny_chat_engine()
    server = uvicorn.Server(uvicorn.Config(create_app(eng, "tiny-llama"), host="127.0.0.1",
                                           port=port, log_level="error"))  # fmt: skip
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, eng


def bench_serving(requests_n: int, turns: int) -> dict[str, float]:
    import ray
    import requests
    from cluster_utils import tiny_chat_engine, tiny_tokenizer
    from ray import serve

    from torch_topg.cluster.deploy import ClusterSpec, deploy
    from torch_topg.cluster.replica import EngineSpec, RouterOptions

    out: dict[str, float] = {}
    prompts = [[{"role": "user", "content": f"question number {i}: what is {i} + {i}?"}]
               for i in range(requests_n)]  # fmt: skip
    port = _free_port()
    server, eng = direct_server(port)
    direct = f"http://127.0.0.1:{port}"
    ttft(direct, prompts[0])  # warm
    d = [ttft(direct, p)[0] for p in prompts]
    server.should_exit = True
    eng.shutdown()

    path = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})  # fmt: skip
    sport = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": sport})
    deploy(ClusterSpec(EngineSpec(factory=tiny_chat_engine, served_name="tiny-llama", threads=1),
                       replicas=2, router=RouterOptions(tokenizer=tiny_tokenizer)))  # fmt: skip
    url = f"http://127.0.0.1:{sport}"
    while requests.get(f"{url}/health", timeout=30).status_code != 200:
        time.sleep(0.5)
    ttft(url, prompts[0])
    c = [ttft(url, p)[0] for p in prompts]
    out.update(direct_ttft_p50_ms=pct(d, 0.5) * 1e3, direct_ttft_p90_ms=pct(d, 0.9) * 1e3,
               ray_ttft_p50_ms=pct(c, 0.5) * 1e3, ray_ttft_p90_ms=pct(c, 0.9) * 1e3)  # fmt: skip

    # 32 interleaved conversations: turn t of every conversation, then turn t + 1; one at
    # a time, then all 32 of a turn at once (the load threshold then spreads them)
    for mode in ("sequential", "concurrent"):
        out.update({f"{mode}_{k}": v for k, v in conversations(url, turns, mode, requests).items()})
    serve.shutdown()
    ray.shutdown()
    return out


def conversations(url: str, turns: int, mode: str, requests) -> dict[str, float]:
    from concurrent.futures import ThreadPoolExecutor

    convs = {f"{mode}-{i}": [{"role": "system", "content": f"You help user {i} ({mode})."},
                             {"role": "user", "content": f"Hello, I am user {i}."}]
             for i in range(32)}  # fmt: skip
    home: dict[str, str] = {}
    last: dict[str, str] = {}
    same = stayed = sticky = later = cached = prompt = 0

    def send(sid: str) -> tuple[dict, str, str]:
        body = {"model": "tiny-llama", "messages": convs[sid], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True, "session_id": sid}  # fmt: skip
        r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        return r.json(), r.headers["x-topg-replica"], r.headers["x-topg-route"]

    with ThreadPoolExecutor(32 if mode == "concurrent" else 1) as pool:
        for turn in range(turns):
            for sid, (js, rep, why) in zip(convs, pool.map(send, list(convs)), strict=True):
                if turn:
                    later += 1
                    same += home[sid] == rep
                    stayed += last[sid] == rep
                    sticky += why == "session"
                    cached += js["usage"]["prompt_tokens_details"]["cached_tokens"]
                    prompt += js["usage"]["prompt_tokens"]
                home.setdefault(sid, rep)
                last[sid] = rep
                convs[sid] += [js["choices"][0]["message"],
                               {"role": "user", "content": f"turn {turn}, go on"}]  # fmt: skip
    split = sorted(list(home.values()).count(r) for r in set(home.values()))
    return {"on_first_turns_replica": same / later, "on_previous_turns_replica": stayed / later,
            "routed_by_session": sticky / later, "later_turn_kv_hit_rate": cached / prompt,
            "first_turn_split": split}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--router-only", action="store_true")
    p.add_argument("--prefixes", type=int, default=10_000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--blocks", type=int, default=32, help="blocks per indexed prefix")
    p.add_argument("--trials", type=int, default=5000)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    res = {"decision": bench_decision(args.prefixes, args.replicas, args.blocks, args.trials)}
    if not args.router_only:
        res["serving"] = bench_serving(args.requests, args.turns)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
