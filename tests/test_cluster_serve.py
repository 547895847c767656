"""Replicas on Ray Serve (torch_topg.cluster): one local Ray instance for the module,
two replicas of the tiny chat model behind one endpoint. A session stays on its replica
turn after turn; a shared system prompt goes to the replica that cached it; greedy
answers equal a single engine's; metrics add up over the replicas; scaling keeps the
service answering; a replica killed mid-load loses no request silently (each completes
elsewhere or ends with an error event) and the service goes on."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip(
    "ray", reason="the cluster extra is not installed (pip install '.[cluster]')"
)
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from cluster_utils import tiny_chat_engine, tiny_tokenizer  # noqa: E402

from torch_topg.cluster.deploy import ClusterSpec, deploy, scale  # noqa: E402
from torch_topg.cluster.replica import EngineSpec, RouterOptions  # noqa: E402

pytestmark = pytest.mark.above_ops  # the reference lane deselects it (docs/build.md)

TESTS = Path(__file__).parent
GREEDY = {"temperature": 0, "ignore_eos": True}
TIMEOUT = 60  # seconds any one HTTP call may take: nothing may hang
DRAIN = 180  # seconds a draining replica waits for its streams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance and two replicas for every test of the module."""
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})  # fmt: skip
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # drain_timeout_s: a draining replica waits this long for its streams, which end
    # sooner on a quiet machine (the wait stops when they end); 8 s and 30 s each once
    # cut a stream short on a loaded machine (the reference lane, next to another worker)
    spec = ClusterSpec(
        EngineSpec(factory=tiny_chat_engine, served_name="tiny-llama", threads=1),
        replicas=2, cpus_per_replica=0.5, drain_timeout_s=DRAIN,
        router=RouterOptions(tokenizer=tiny_tokenizer),
    )  # fmt: skip
    deploy(spec)
    box = {"spec": spec, "url": f"http://127.0.0.1:{port}"}
    _wait_live(box["url"], 2)
    yield box
    serve.shutdown()
    ray.shutdown()


def _state(url: str) -> dict:
    return requests.get(f"{url}/cluster", timeout=TIMEOUT).json()


def _wait_live(url: str, n: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = _state(url)
            if sum(r["alive"] for r in st["replicas"].values()) == n:
                return st
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{n} live replicas not reached in {timeout} s")


def chat(url: str, messages: list[dict], **kw) -> requests.Response:
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 8, **GREEDY, **kw}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r


def sse(r: requests.Response) -> list:
    out = []
    for line in r.iter_lines():
        if line:
            data = line.decode()[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_session_lands_on_its_replica_every_turn(cluster) -> None:
    url = cluster["url"]
    seen: dict[str, set[str]] = {}
    history = {f"s{i}": [{"role": "user", "content": f"conversation {i}"}] for i in range(4)}
    for turn in range(3):
        for sid, msgs in history.items():  # interleaved: s0 s1 s2 s3 s0 s1 ...
            r = chat(url, msgs, session_id=sid)
            seen.setdefault(sid, set()).add(r.headers["x-topg-replica"])
            if turn:
                assert r.headers["x-topg-route"] == "session"
            msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    assert all(len(v) == 1 for v in seen.values()), seen
    # `user` names the session when there is no session_id
    a = chat(url, [{"role": "user", "content": "hi"}], user="alice").headers["x-topg-replica"]
    for _ in range(3):
        r = chat(url, [{"role": "user", "content": "hello again"}], user="alice")
        assert r.headers["x-topg-replica"] == a and r.headers["x-topg-route"] == "session"


def test_shared_system_prompt_goes_where_it_is_cached(cluster) -> None:
    url = cluster["url"]
    system = {"role": "system", "content": "You are a terse assistant. " * 6}
    first = chat(url, [system, {"role": "user", "content": "one"}])
    holder = first.headers["x-topg-replica"]
    for q in ("two", "three", "four"):
        r = chat(url, [system, {"role": "user", "content": q}])
        assert r.headers["x-topg-replica"] == holder, r.headers
        assert r.headers["x-topg-route"] == "prefix"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160


def test_greedy_answers_equal_one_engines(cluster) -> None:
    url = cluster["url"]
    prompts = ["The quick brown fox", "Hello there", "1 2 3 4 5 6 7 8", "zz"]
    with tiny_chat_engine() as eng:
        want = [o.outputs[0].text for o in eng.generate(prompts, max_new_tokens=12, **GREEDY)]
    got = []
    for p in prompts:
        body = {"model": "tiny-llama", "prompt": p, "max_tokens": 12, **GREEDY}
        got.append(requests.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json())
    assert [g["choices"][0]["text"] for g in got] == want
    # streamed through the router: the same text, chunk by chunk
    body = {"model": "tiny-llama", "prompt": prompts[0], "max_tokens": 12, "stream": True, **GREEDY}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT, stream=True)
    ev = sse(r)
    assert ev[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in ev[:-1]) == want[0]


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_metrics_add_up_over_replicas(cluster) -> None:
    url = cluster["url"]
    before = requests.get(f"{url}/metrics", timeout=TIMEOUT).text
    tokens = 0
    for i in range(6):
        r = chat(url, [{"role": "user", "content": f"count {i}"}], max_tokens=5 + i)
        tokens += r.json()["usage"]["completion_tokens"]
    after = requests.get(f"{url}/metrics", timeout=TIMEOUT).text
    name = "topg_generation_tokens_total"
    assert _metric(after, name) - _metric(before, name) == tokens == sum(range(5, 11))
    assert 'topg_router_replicas{state="alive"} 2' in after
    assert "topg_router_decisions_total" in after


def test_client_leaving_a_stream_aborts_it_on_the_replica(cluster) -> None:
    url = cluster["url"]
    name = 'topg_request_finished_total{finish_reason="abort"}'

    def aborted() -> float:
        return _metric(requests.get(f"{url}/metrics", timeout=TIMEOUT).text, name)

    before = aborted()
    body = {"model": "tiny-llama", "prompt": "a long story", "max_tokens": 3000, "stream": True,
            **GREEDY}  # fmt: skip
    with requests.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT, stream=True) as r:
        next(r.iter_lines())  # the stream is under way; then the client goes
    deadline = time.monotonic() + TIMEOUT
    while aborted() < before + 1:  # the replica's engine aborted it (not ran to 3000)
        assert time.monotonic() < deadline, "the replica never aborted the request"
        time.sleep(0.2)


def _stream_all(
    url: str, n: int, max_tokens: int, results: list, started: threading.Event, first: list
) -> list:
    def one(i: int) -> None:
        body = {"model": "tiny-llama", "prompt": f"stream {i} " * 4, "max_tokens": max_tokens,
                "stream": True, **GREEDY}  # fmt: skip
        try:
            r = requests.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT, stream=True)
            events = []
            for line in r.iter_lines():
                if line:
                    if not started.is_set():
                        first.append(r.headers["x-topg-replica"])
                        started.set()
                    data = line.decode()[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
            results[i] = (r.status_code, events, r.headers.get("x-topg-replica"))
        except Exception as e:  # recorded: the test says which request and why
            results[i] = ("exception", repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _check_ended(results: list) -> tuple[int, int]:
    """Every request completed, or (streaming) ended with an error event."""
    done = errors = 0
    for i, res in enumerate(results):
        assert res is not None, f"request {i} never ended"
        status, events, _ = res
        assert status == 200, (i, res)
        assert events and events[-1] == "[DONE]", (i, events[-3:])
        if any("error" in e for e in events[:-1] if isinstance(e, dict)):
            assert "replica" in events[-2]["error"]["message"]
            errors += 1
        else:
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            done += 1
    return done, errors


def test_scaling_up_and_down_keeps_serving(cluster) -> None:
    url, spec = cluster["url"], cluster["spec"]
    before = _state(url)
    cluster["spec"] = spec = scale(spec, 3)
    st = _wait_live(url, 3)
    # a scale, not a redeployment: the two replicas and the router (its sessions) stay
    assert (
        set(before["replicas"]) < set(st["replicas"]) and st["sessions"] == before["sessions"] > 0
    )
    results: list = [None] * 6
    started = threading.Event()
    threads = _stream_all(url, 6, 200, results, started, [])
    started.wait(TIMEOUT)
    assert any(r is None for r in results)  # streams in flight on every replica (least load)
    cluster["spec"] = scale(spec, 2)  # one replica drains: its streams finish
    deadline = time.monotonic() + DRAIN
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    done, errors = _check_ended(results)
    assert (done, errors) == (6, 0)
    _wait_live(url, 2)
    chat(url, [{"role": "user", "content": "still there?"}])


def test_killed_replica_loses_no_request(cluster) -> None:
    url = cluster["url"]
    results: list = [None] * 8
    started = threading.Event()
    first: list = []
    threads = _stream_all(url, 8, 400, results, started, first)
    plain: list = []  # non-streamed requests sent while the replica dies: retried elsewhere
    started.wait(TIMEOUT)
    victim = first[0]  # the replica of a stream under way
    os.kill(_state(url)["pids"][victim], signal.SIGKILL)
    for i in range(4):
        body = {"model": "tiny-llama", "prompt": f"after {i}", "max_tokens": 6, **GREEDY}
        plain.append(requests.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT))
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a request hung"
    done, errors = _check_ended(results)
    assert done + errors == 8 and errors >= 1
    for _, events, replica in results:  # the victim's streams ended with the error event
        assert ("error" in events[-2]) == (replica == victim), (replica, victim, events[-2])
    assert all(r.status_code == 200 for r in plain), [(r.status_code, r.text[:300]) for r in plain]
    assert all(r.json()["usage"]["completion_tokens"] == 6 for r in plain)
    chat(url, [{"role": "user", "content": "and now?"}])  # the service keeps answering
    assert not _state(url)["replicas"].get(victim, {"alive": False})["alive"]
