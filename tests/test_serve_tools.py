"""The server's tools: the load generator (``bench serve``), the monitor and the playground
page. The math on synthetic timings; then the tools end to end against the app served by
uvicorn on a free loopback port (a background thread) over the tiny engine of
test_serve.py."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")
pytest.importorskip("prometheus_client", reason="the serve extra is not installed")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")

import uvicorn
from engine_utils import wait_idle
from test_serve import chat_engine

from torch_topg.__main__ import main
from torch_topg.client import datasets, loadgen, monitor
from torch_topg.serve import create_app

MODEL = "tiny-llama"
needs_httpx = pytest.mark.skipif(loadgen.httpx is None, reason="neither httpx nor httpx2 installed")


def test_client_tools_do_not_import_the_server() -> None:
    """The client tools talk HTTP only: importing them loads neither torch_topg.serve nor
    fastapi (they run against any OpenAI-compatible server)."""
    code = (
        "import sys, torch_topg.client.loadgen, torch_topg.client.monitor, "
        "torch_topg.client.datasets; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch_topg.serve', 'fastapi'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- math on synthetic timings --------------------------------------------------------
def test_request_timings_from_chunks() -> None:
    r = loadgen.chunk_times_to_result(10.0, [10.5, 10.6, 10.8, 11.1], 11.2, tokens=None)
    assert r.ok and r.output_tokens == 4  # no usage: one token per content chunk
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)
    # usage wins over chunk counting (a chunk may carry several tokens)
    assert loadgen.chunk_times_to_result(0.0, [1.0, 2.0], 3.0, tokens=7).output_tokens == 7
    one = loadgen.chunk_times_to_result(0.0, [1.0], 1.0, tokens=None)
    assert one.itl == [] and one.tpot is None
    empty = loadgen.chunk_times_to_result(0.0, [], 1.0, tokens=0)
    assert empty.ttft is None and empty.tpot is None


def test_latency_summary_percentiles() -> None:
    xs = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    s = loadgen.latency_summary(xs)
    assert s["n"] == 100
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)  # linear between order statistics (numpy's)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert loadgen.latency_summary([]) is None
    assert loadgen.latency_summary([0.002])["p99"] == pytest.approx(2.0)


def test_summarize_level_counts() -> None:
    ok = loadgen.chunk_times_to_result(0.0, [0.1, 0.2, 0.4], 0.5, tokens=3)
    ok2 = loadgen.chunk_times_to_result(0.0, [0.3, 0.4], 0.6, tokens=None)
    bad = loadgen.RequestResult(ok=False, error="HTTP 500: boom")
    lv = loadgen.summarize_level([ok, ok2, bad], concurrency=2, duration=2.0)
    assert (lv["requests"], lv["completed"], lv["failed"]) == (3, 2, 1)
    assert lv["errors"] == ["HTTP 500: boom"]
    assert lv["output_tokens"] == 5 and lv["output_tokens_per_s"] == pytest.approx(2.5)
    assert lv["request_throughput"] == pytest.approx(1.0)
    lat = lv["latency_ms"]
    assert lat["itl"]["n"] == 3 and lat["ttft"]["n"] == 2 and lat["e2e"]["n"] == 2
    assert lat["ttft"]["mean"] == pytest.approx(200.0)
    assert lat["tpot"]["p50"] == pytest.approx(((0.5 - 0.1) / 2 + (0.6 - 0.3) / 1) / 2 * 1e3)
    table = loadgen.markdown_table([lv])
    assert table.count("\n") == 3 and "| 2 | 2/3 | 1.00 | 2.5 |" in table


def test_histogram_quantile() -> None:
    text = (
        "# TYPE h histogram\n"
        'h_bucket{le="0.1"} 2\nh_bucket{le="0.2"} 6\nh_bucket{le="0.5"} 10\n'
        'h_bucket{le="+Inf"} 10\nh_count 10\nh_sum 2.0\n'
    )
    s = monitor.parse_metrics(text)
    assert monitor.histogram_quantile(s, "h", 0.5) == pytest.approx(0.1 + 0.1 * 3 / 4)
    assert monitor.histogram_quantile(s, "h", 0.1) == pytest.approx(0.05)
    assert monitor.histogram_quantile(s, "missing", 0.5) is None
    inf = monitor.parse_metrics(text.replace('le="+Inf"} 10', 'le="+Inf"} 20'))
    assert monitor.histogram_quantile(inf, "h", 0.9) == pytest.approx(0.5)  # last finite bound


def test_datasets_are_seeded() -> None:
    for name in datasets.DATASETS:
        a = datasets.make_requests(name, 5, seed=1, input_len=20, prefix_len=30)
        assert a == datasets.make_requests(name, 5, seed=1, input_len=20, prefix_len=30)
        assert len(a) == 5 and all(m[-1]["role"] == "user" for m in a)
    rand = datasets.make_requests("random", 3, input_len=20)
    assert len(rand[0][0]["content"].split()) == 20 and rand[0] != rand[1]
    shared = datasets.make_requests("shared-prefix", 3, prefix_len=30)
    assert len({m[0]["content"] for m in shared}) == 1  # one system prompt
    assert len({m[1]["content"] for m in shared}) == 3
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.make_requests("nope", 1)


# --- against a real server --------------------------------------------------------------
@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread; yields its base URL."""
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            pytest.fail("uvicorn did not start")
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server():
    """``(base_url, engine)``: the app on a free loopback port, uvicorn in a thread."""
    with chat_engine() as eng, serving(create_app(eng, MODEL)) as url:
        yield url, eng


def test_playground_page(server) -> None:
    import urllib.request

    url, _ = server
    with urllib.request.urlopen(url + "/") as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/html")
        page = r.read().decode()
    assert "/v1/chat/completions" in page and "include_usage" in page
    assert "getReader" in page  # streams with fetch + ReadableStream
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", page, re.I), "external URL"
    assert "<script src" not in page and "<link" not in page


@needs_httpx
def test_bench_serve_end_to_end(server, tmp_path, capsys) -> None:
    url, engine = server
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--url", url, "--concurrency", "1,2", "--requests", "4",
            "--dataset", "chat", "--max-tokens", "8", "--ignore-eos", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| conc |" in text and "| 1 | 4/4 |" in text and "| 2 | 4/4 |" in text
    rec = json.loads(out.read_text())
    assert rec["schema"] == "torch_topg.bench/1" and rec["benchmark"] == "serve"
    assert rec["date"] and rec["commit"] and rec["machine"]["logical_cpus"]
    assert [r["concurrency"] for r in rec["rows"]] == [1, 2]
    for row in rec["rows"]:
        assert (row["requests"], row["completed"], row["failed"]) == (4, 4, 0)
        assert row["output_tokens"] == 4 * 8  # from usage, ignore_eos: exact
        assert row["prompt_tokens"] > 0 and row["cached_tokens"] is not None
        lat = row["latency_ms"]
        assert lat["ttft"]["n"] == 4 and lat["e2e"]["n"] == 4 and lat["tpot"]["n"] == 4
        assert lat["itl"]["n"] <= 4 * 7  # a chunk may carry more than one token
        for k in loadgen.LATENCIES:
            s = lat[k]
            assert 0 <= s["p50"] <= s["p90"] <= s["p99"]
        assert row["output_tokens_per_s"] > 0 and row["request_throughput"] > 0
        assert set(row["figures"]) >= {"ttft", "tpot", "itl", "e2e", "output_tokens_per_s"}
    wait_idle(engine)
    engine.pool.check_whole()
    # `bench compare` still works, on two such records
    assert main(["bench", "compare", str(out), str(out)]) == 0


@needs_httpx
def test_bench_serve_other_datasets_and_errors(server, capsys) -> None:
    url, _ = server
    base = ["bench", "serve", "--url", url, "--concurrency", "2", "--requests", "2",
            "--max-tokens", "4", "--input-len", "8", "--prefix-len", "16"]  # fmt: skip
    assert main([*base, "--dataset", "random"]) == 0
    assert main([*base, "--dataset", "shared-prefix"]) == 0
    assert main([*base, "--model", "no-such-model"]) == 1  # every request refused: 400
    assert "0/2" in capsys.readouterr().out
    assert main(["bench", "serve", "--url", url, "--concurrency", "0"]) == 2


def test_monitor_once(server, capsys) -> None:
    url, _ = server
    import urllib.request

    body = json.dumps({"prompt": "abc", "max_tokens": 3, "ignore_eos": True}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req) as r:
        assert r.status == 200
    finished = monitor.value(monitor.scrape(url), "topg_request_finished_total")
    assert finished and finished >= 1
    assert main(["monitor", url, "--once", "--interval", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # --once: no screen control
    assert re.search(rf"finished {finished:.0f} \(stop \d+, length \d+, abort \d+\)", out), out
    assert re.search(r"running \d+\s+waiting \d+", out)
    assert re.search(r"KV blocks\s+\d+ / \d+", out)
    assert re.search(r"TTFT p50 [\d.]+ ms", out) and "tokens/s" in out
    assert main(["monitor", "http://127.0.0.1:9", "--once"]) == 1  # nothing listens


# The page's script run by Node (fetch, ReadableStream and TextDecoder are Node's own) on
# a stub DOM: not a browser, but the streaming code path end to end. argv: script, base
# URL, message; prints what the page shows.
NODE_DRIVER = r"""
const vm = require("vm"), fs = require("fs");
const [script, base, message] = process.argv.slice(2);
const els = {};
let fresh = 0;
function el(id) {
  return els[id] ??= {id, value: "", textContent: "", className: "", disabled: false,
    scrollTop: 0, scrollHeight: 0, children: [], appendChild(c) { this.children.push(c); return c; },
    addEventListener() {}, requestSubmit() {}};
}
el("max_tokens").value = "8"; el("temperature").value = "0";
const ctx = {document: {getElementById: el, createElement: () => el("new" + fresh++)},
             fetch: (u, o) => fetch(base + u, o), performance, TextDecoder, AbortController, console};
vm.createContext(ctx);
vm.runInContext(fs.readFileSync(script, "utf8"), ctx);
(async () => {
  await ctx.loadModel();
  await ctx.send(message);
  const [user, answer, stats] = el("log").children;
  console.log(JSON.stringify({model: el("model").textContent, user: user.textContent,
    answer: answer.textContent, cls: answer.className, stats: stats.textContent}));
})();
"""


def test_playground_script_streams_in_node(server, tmp_path) -> None:
    import shutil
    import subprocess
    import urllib.request

    from torch_topg.serve.playground import PAGE

    node = shutil.which("node")
    if node is None:
        pytest.skip("no Node.js to run the page's script (nor a browser: see docs/serve.md)")
    url, _ = server
    script = tmp_path / "page.js"
    script.write_text(re.search(r"<script>(.*)</script>", PAGE, re.S).group(1))
    driver = tmp_path / "driver.js"
    driver.write_text(NODE_DRIVER)
    proc = subprocess.run(
        [node, str(driver), str(script), url, "Hello!"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout.strip().splitlines()[-1])
    body = json.dumps({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8,
                       "temperature": 0}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req) as r:
        want = json.loads(r.read())
    assert shown["model"] == f"model: {MODEL}"
    assert shown["user"] == "Hello!" and shown["cls"] == "msg assistant"
    assert shown["answer"] == want["choices"][0]["message"]["content"]
    n = want["usage"]["completion_tokens"]
    assert re.fullmatch(
        rf"TTFT \d+ ms  ·  {n} tokens  ·  ([\d.]+|-) tokens/s  ·  prompt \d+, cached \d+",
        shown["stats"],
    ), shown["stats"]


def test_serve_cli_failures_exit_1() -> None:
    """``python -m torch_topg serve``: a model that does not load, or a port already taken,
    ends the process with exit code 1 and says why (the HTTP server in its thread stops)."""
    import socket
    import subprocess
    import sys

    serve = [sys.executable, "-m", "torch_topg", "serve", "--host", "127.0.0.1"]
    p = subprocess.run([*serve, "--port", "0", "--model", "/nonexistent/model"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "loading the model failed" in p.stderr and "Finished server process" in p.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([*serve, "--port", str(port), "--model", "/nonexistent/model"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "the HTTP server did not start" in p.stderr and "loading" not in p.stderr
