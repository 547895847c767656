"""The playground page (``GET /``) in a real browser: headless Chromium driven over the
DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages ending in NUL on
file descriptors 3 and 4; no WebSocket library, no Node, no Playwright). The test loads
the page served on a loopback port by the tiny chat engine, types a message and presses
Enter, sees the answer grow chunk by chunk, and checks the finished answer (the
non-streamed greedy one) and its stats line (TTFT, tokens, tokens/s, prompt and cached
tokens); a second turn reads the first from the prefix cache; it saves a screenshot.
Skips, saying so, where no Chromium is installed (``.ci/run`` installs Debian's
``chromium``).

The committed ``docs/serve-playground.png`` is the same page on the real SmolLM2:

    .venv/bin/python tests/test_serve_playground.py docs/serve-playground.png
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import queue
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
    "--remote-debugging-pipe",
]  # fmt: skip
WIDTH, HEIGHT = 900, 720
# Puts fds 3 and 4 in place, then becomes Chromium (no preexec_fn in a threaded process).
_TRAMPOLINE = "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
_TRAMPOLINE += "os.execv(sys.argv[3], sys.argv[3:])"


def find_chromium() -> str | None:
    env = os.environ.get("TOPG_CHROMIUM")
    if env:
        return env
    return next((p for n in CHROMIUM_NAMES if (p := shutil.which(n))), None)


class Chromium:
    """A headless Chromium and one page, driven by DevTools protocol commands."""

    def __init__(self, binary: str, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="topg-chromium-")
        cmd_r, cmd_w = os.pipe()  # we write commands, Chromium reads fd 3
        out_r, out_w = os.pipe()  # Chromium writes fd 4, we read
        argv = [binary, *FLAGS, f"--user-data-dir={self._profile}",
                f"--window-size={WIDTH},{HEIGHT}", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TRAMPOLINE, str(cmd_r), str(out_w), *argv],
            pass_fds=(cmd_r, out_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        os.close(cmd_r)
        os.close(out_w)
        self._w = os.fdopen(cmd_w, "wb", buffering=0)
        self._r = os.fdopen(out_r, "rb", buffering=0)
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._stderr: list[bytes] = []
        threading.Thread(target=self._read, daemon=True, name="cdp-read").start()
        threading.Thread(target=self._drain_stderr, daemon=True, name="cdp-stderr").start()
        target = next(
            t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page"
        )
        self.session = self.call(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )["sessionId"]
        self.page(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip

    def _read(self) -> None:
        buf = b""
        while chunk := self._r.read(65536):
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for raw in messages:
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        q = self._replies.get(msg["id"])
                    if q is not None:
                        q.put(msg)

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-20]

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its result (a protocol error raises)."""
        i = next(self._ids)
        q: queue.Queue[dict[str, Any]] = queue.Queue()
        with self._lock:
            self._replies[i] = q
        msg: dict[str, Any] = {"id": i, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self._w.write(json.dumps(msg).encode() + b"\0")
        try:
            reply = q.get(timeout=self.timeout)
        except queue.Empty:
            tail = b"".join(self._stderr).decode(errors="replace")[-1500:]
            raise TimeoutError(f"Chromium did not answer {method}; its stderr:\n{tail}") from None
        finally:
            with self._lock:
                del self._replies[i]
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.call(method, self.session, **params)

    def eval(self, expression: str) -> Any:
        """The value of a JS expression in the page (awaited if a promise)."""
        r = self.page(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, what: str) -> Any:
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + self.timeout
        while not (v := self.eval(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page did not show {what} in {self.timeout:.0f} s")
            time.sleep(0.05)
        return v

    def goto(self, url: str) -> None:
        self.page("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", "its load")

    def press_enter(self) -> None:
        key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13}
        self.page("Input.dispatchKeyEvent", type="keyDown", **key, text="\r")
        self.page("Input.dispatchKeyEvent", type="keyUp", **key)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._w.close()
        shutil.rmtree(self._profile, ignore_errors=True)


@contextlib.contextmanager
def chromium(binary: str, timeout: float = 60.0) -> Iterator[Chromium]:
    browser = Chromium(binary, timeout)
    try:
        yield browser
    finally:
        browser.close()


# Records every state of the latest answer's text while it streams (a MutationObserver).
WATCH = """
window.__answers = [];
new MutationObserver(() => {
  const all = document.querySelectorAll('#log .assistant'), a = all[all.length - 1];
  if (a && a.textContent !== window.__answers.at(-1)) window.__answers.push(a.textContent);
}).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
"""
DONE = ("!document.getElementById('send').disabled && "
        "document.querySelectorAll('#log .stats').length === {turn}")  # fmt: skip
SHOWN = """(() => {
  const last = (sel) => [...document.querySelectorAll(sel)].at(-1);
  return JSON.stringify({
    model: document.getElementById('model').textContent,
    user: last('#log .user').textContent,
    answer: last('#log .assistant').textContent,
    cls: last('#log .assistant').className,
    stats: last('#log .stats').textContent,
    answers: window.__answers});
})()"""
STATS = r"TTFT (\d+) ms  ·  (\d+) tokens  ·  ([\d.]+) tokens/s  ·  prompt (\d+), cached (\d+)"


def open_page(browser: Chromium, url: str, max_tokens: int, temperature: float) -> None:
    """Load the page and set ``max_tokens`` and ``temperature`` in its settings."""
    browser.goto(url + "/")
    browser.wait_for("!document.getElementById('model').textContent.endsWith('...')", "a model")
    browser.eval(
        f"document.getElementById('max_tokens').value = '{max_tokens}';"
        f"document.getElementById('temperature').value = '{temperature}';" + WATCH
    )


def say(browser: Chromium, message: str, turn: int) -> dict:
    """Type ``message``, press Enter; what the page shows once the answer (the
    ``turn``-th) has finished streaming."""
    browser.eval("window.__answers = []; document.getElementById('input').focus()")
    browser.page("Input.insertText", text=message)
    browser.press_enter()
    browser.wait_for(DONE.format(turn=turn), f"answer {turn} finished")
    return json.loads(browser.eval(SHOWN))


def png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", png[16:24])


# --- the test ---------------------------------------------------------------------------
def test_playground_in_headless_chromium(tmp_path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip(
            "no Chromium installed (apt-get install chromium; .ci/run installs it): the "
            "playground's browser test needs one"
        )
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    pytest.importorskip("uvicorn", reason="the serve extra is not installed")
    from engine_utils import wait_idle
    from test_serve import chat_engine
    from test_serve_tools import serving

    from torch_topg.serve import create_app

    first, second, max_tokens = "Hello from Chromium!", "And again?", 256
    with chat_engine() as eng, serving(create_app(eng, "tiny-llama")) as url:
        with chromium(binary) as browser:
            open_page(browser, url, max_tokens, temperature=0)
            shown = say(browser, first, turn=1)
            again = say(browser, second, turn=2)  # the conversation so far is the prefix
            png = browser.screenshot()
        history = [{"role": "user", "content": first},
                   {"role": "assistant", "content": shown["answer"]},
                   {"role": "user", "content": second}]  # fmt: skip
        body = json.dumps({"messages": history[:1], "max_tokens": max_tokens,
                           "temperature": 0}).encode()  # fmt: skip
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req) as r:
            want = json.loads(r.read())
        prefix_cache = "hit_tokens" in eng.stats()["kv"]
        wait_idle(eng)
        eng.pool.check_whole()
    assert shown["model"] == "model: tiny-llama"
    assert shown["user"] == first and shown["cls"] == "msg assistant"
    assert shown["answer"] == want["choices"][0]["message"]["content"]
    # streamed: the answer grew through several states, each a prefix of the next
    answers = [a for a in shown["answers"] if a]
    assert len(answers) >= 2, answers
    assert all(b.startswith(a) for a, b in itertools.pairwise(answers))
    m = re.fullmatch(STATS, shown["stats"])
    assert m, shown["stats"]
    usage = want["usage"]
    assert int(m[2]) == usage["completion_tokens"] and int(m[4]) == usage["prompt_tokens"]
    assert float(m[3]) > 0 and int(m[5]) == 0  # a fresh engine: nothing cached yet
    # the second turn sends the whole conversation: its first turn comes from the cache
    m2 = re.fullmatch(STATS, again["stats"])
    assert m2 and again["user"] == second, again
    assert int(m2[4]) > int(m[4])
    if prefix_cache:
        assert 0 < int(m2[5]) < int(m2[4])
    (tmp_path / "playground.png").write_bytes(png)
    assert png_size(png) == (WIDTH, HEIGHT)


# --- the committed screenshot, on the real model ------------------------------------------
MESSAGES = ["What is the capital of France?", "Explain photosynthesis in two sentences."]


def main(out: str) -> int:
    """Serve SmolLM2 (``python -m torch_topg serve``), chat two turns in the page, save a
    screenshot to ``out``."""
    binary = find_chromium()
    if binary is None:
        print("no Chromium installed", file=sys.stderr)
        return 1
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "torch_topg", "serve", "--port", str(port), "--log-level", "warning"]
    )
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health") as r:
                    if r.status == 200:
                        break
            if server.poll() is not None or time.monotonic() > deadline:
                print("the server did not come up", file=sys.stderr)
                return 1
            time.sleep(1)
        with chromium(binary, timeout=600) as browser:
            open_page(browser, url, max_tokens=128, temperature=0)
            for turn, message in enumerate(MESSAGES, 1):
                shown = say(browser, message, turn)
                print(shown["answer"], "\n", shown["stats"], sep="")
            Path(out).write_bytes(browser.screenshot())
    finally:
        server.terminate()
        server.wait(60)
    print(f"screenshot: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "serve-playground.png"))
