"""The engine's options, each declared once: name, type, default, check and help.

:class:`EngineArgs` is the one list (in the manner of vLLM's ``EngineArgs``). Everything
else is derived from it:

* ``Engine.from_pretrained(model, **options)`` / ``Engine.from_model`` build an
  ``EngineArgs`` (:meth:`EngineArgs.from_options`: unknown names and bad values are a
  :class:`~torch_topg.engine.errors.ParameterError` naming the option, before any weight
  loads);
* ``Engine.configure(...)`` changes the options marked ``runtime`` through the same checks;
* ``python -m torch_topg serve`` has one flag per option (:func:`add_cli_args`,
  :func:`from_cli_args`);
* the options table of docs/engine.md is :func:`markdown_table` (a test holds the two
  equal; ``python -m torch_topg options --write docs/engine.md`` rewrites it), and
  the docstring of ``from_pretrained`` ends with :func:`docstring`.

What the options imply (the KV pool's blocks, the tiers' sizes, the resolved device,
dtype and context length) is computed once, in :func:`torch_topg.engine.config.resolve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import numbers
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torch_topg.engine.errors import ParameterError

#: KV cache dtypes: "auto" = the model's dtype; "int8" = int8 K/V with float32 scales per
#: token and kv head (reference.quantize_kv), about half the bytes of bf16.
KV_CACHE_DTYPES = ("auto", "int8")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip

Check = Callable[[str, Any], Any]


# --- checks: (option name, value) -> the value as the engine keeps it -----------------
def _int(lo: int, allow_none: bool = False) -> Check:
    def check(name: str, v: Any) -> Any:
        if v is None and allow_none:
            return None
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
            raise ParameterError(name, f"expected an int >= {lo}, got {v!r}")
        return int(v)

    return check


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ParameterError(name, f"expected True or False, got {v!r}")
    return v


def _number(lo: float, hi: float | None = None, what: str = "") -> Check:
    def check(name: str, v: Any) -> float:
        ok = not isinstance(v, bool) and isinstance(v, numbers.Real)
        if not ok or not (v > lo if hi is None else lo <= v <= hi):
            rng = f"> {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ParameterError(name, f"expected {what}{rng}, got {v!r}")
        return float(v)

    return check


def _batch_timeout(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v >= 0:
        raise ParameterError(name, f"expected >= 0 ms, got {v!r}")
    return float(v)


def _memory(max_percent: float) -> Check:
    """None, a byte count, or a percentage string like ``"40%"`` (checked, kept as given)."""

    def check(name: str, v: Any) -> Any:
        if v is None:
            return None
        if isinstance(v, str):
            s = v.strip()
            if not s.endswith("%"):
                raise ParameterError(name, f"expected bytes or a percentage like '40%', got {v!r}")
            try:
                frac = float(s[:-1])
            except ValueError:
                raise ParameterError(name, f"not a percentage: {v!r}") from None
            if not 0 < frac <= max_percent:
                raise ParameterError(
                    name, f"expected a percentage in (0, {max_percent:g}], got {v!r}"
                )
            return s
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
            raise ParameterError(name, f"expected a positive byte count, got {v!r}")
        return int(v)

    return check


def _device(name: str, v: Any) -> Any:
    if v is None:
        return None
    try:
        return torch.device(v)
    except (RuntimeError, TypeError):
        raise ParameterError(name, f"expected a device like 'cpu' or 'cuda:0', got {v!r}") from None


def _dtype(name: str, v: Any) -> torch.dtype | None:
    if v is None:
        return None
    if isinstance(v, str):
        if v not in DTYPES:
            raise ParameterError(name, f"expected one of {sorted(DTYPES)}, got {v!r}")
        return DTYPES[v]
    if v not in (torch.float32, torch.bfloat16, torch.float16):
        raise ParameterError(name, f"expected float32, bfloat16 or float16, got {v}")
    return v


def _host(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ParameterError(name, f"expected a host name or IP address, got {v!r}")
    return v.strip()


def _port(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 1 <= v <= 65535:
        raise ParameterError(name, f"expected a TCP port in [1, 65535], got {v!r}")
    return int(v)


def _seed(name: str, v: Any) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
        raise ParameterError(name, f"expected an int or None, got {v!r}")
    return None if v is None else int(v)


def _kv_cache_dtype(name: str, v: Any) -> str:
    if v not in KV_CACHE_DTYPES:
        raise ParameterError(name, f"expected one of {list(KV_CACHE_DTYPES)}, got {v!r}")
    return v


def _choice(choices: tuple[str, ...]) -> Check:
    def check(name: str, v: Any) -> str:
        if v not in choices:
            raise ParameterError(name, f"expected one of {list(choices)}, got {v!r}")
        return v

    return check


def _path(name: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise ParameterError(name, f"expected a folder path, got {v!r}")
    return str(v)


def _speculative(name: str, v: Any) -> Any:
    if v is None or v is False:
        return None
    # imported only when speculation is asked for: the plain engine never loads it
    from torch_topg.engine.speculative.config import parse_speculative

    try:
        return parse_speculative(v)
    except ParameterError:
        raise
    except ValueError as e:
        raise ParameterError(name, str(e).removeprefix(f"{name}: ")) from None


def _quantization(name: str, v: Any) -> Any:
    from torch_topg.quant.loading import resolve_quantization

    try:
        resolve_quantization(v)
    except ValueError as e:
        raise ParameterError(name, str(e).removeprefix("Engine: ")) from None
    return v


def _layer_counts(name: str, v: Any) -> list[int] | None:
    if v is None:
        return None
    ok = isinstance(v, (list, tuple)) and len(v) > 0
    ok = ok and all(
        not isinstance(c, bool) and isinstance(c, numbers.Integral) and c >= 1 for c in v
    )
    if not ok:
        raise ParameterError(name, f"expected a list of layer counts >= 1, one per node, got {v!r}")
    return [int(c) for c in v]


def _zmq_endpoint(name: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v.startswith(("tcp://", "ipc://", "inproc://")):
        raise ParameterError(name, f"expected a ZMQ endpoint like 'tcp://*:5557', got {v!r}")
    from torch_topg.engine.kv_publisher import zmq_available

    if not zmq_available():
        raise ParameterError(
            name, "needs pyzmq, in the cluster extra: pip install 'torch_topg[cluster]'"
        )
    return v


def _text(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ParameterError(name, f"expected a string, got {v!r}")
    return v


# --- command-line parsers: a flag's text -> the option's value ----------------------------
def _parse_memory(s: str) -> int | str:
    return int(s) if s.strip().isdigit() else s


def _parse_spec(s: str) -> Any:
    """JSON for a dict (``'{"method": "ngram"}'``), else the text (``gguf``, ``none``)."""
    if s.strip().startswith("{"):
        try:
            return json.loads(s)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    return None if s.strip().lower() in ("none", "") else s


def _parse_counts(s: str) -> list[int] | None:
    """``19,11`` or ``[19, 11]``; ``none``: the byte-balanced split."""
    text = s.strip().strip("[]")
    if text.lower() in ("none", ""):
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts like 19,11, got {s!r}") from None


def option(
    default: Any,
    help: str,
    check: Check,
    *,
    shown: str | None = None,
    parse: Callable[[str], Any] | None = None,
    runtime: bool = False,
) -> Any:
    """One option: ``default``, what it means (``help``), its ``check``; ``shown``: the
    default as the docs state it (when it depends on the model or device); ``parse``: how
    a command-line flag's text becomes a value (bool flags get ``--x/--no-x``);
    ``runtime``: ``Engine.configure`` may change it while serving."""
    meta = {"help": help, "check": check, "shown": shown, "parse": parse, "runtime": runtime}
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """The engine's options as given (checked and normalised; see the module docstring)."""

    device: Any = option(None, "the device the model runs on.", _device,
                         shown="CUDA if available, else CPU", parse=str)  # fmt: skip
    dtype: Any = option(
        None,
        "`float32`, `bfloat16`, `float16` or a torch dtype. float32 on the CPU: outputs "
        "equal transformers' fp32 token for token; a BF16 GGUF file with "
        "`quantization=\"gguf\"` computes in bfloat16, its weights' dtype.",
        _dtype, shown="float32 on the CPU (a BF16 GGUF file served packed: bfloat16), bfloat16 on CUDA",
        parse=str,
    )  # fmt: skip
    tp_size: int = option(
        1,
        "ranks of tensor parallelism: worker processes the engine starts, or the ranks of a "
        "`torchrun` job whose ranks > 0 call `torch_topg.engine.tp.follow()`; needs a "
        "safetensors folder ([parallel.md](parallel.md)).",
        _int(1),
    )
    nnodes: int = option(
        1,
        "nodes of a pipeline-parallel engine: the decoder layers are split into `nnodes` "
        "consecutive stages, one per node, each running `tp_size` ranks; node 0 runs the "
        "scheduler (and `serve`'s HTTP), the others are headless ([cluster.md](cluster.md)).",
        _int(1),
    )
    node_rank: int = option(
        0,
        "this node's index in `[0, nnodes)`. On a node > 0 `from_pretrained` runs the "
        "node's stage until node 0's engine shuts down, then returns None; `serve` starts "
        "no HTTP server there.",
        _int(0),
    )
    master_addr: str = option(
        "127.0.0.1",
        "node 0's address as the other nodes reach it (node 0's rendezvous store listens "
        "on every interface).",
        _host, parse=str,
    )  # fmt: skip
    master_port: int = option(29500, "node 0's rendezvous port (TCP).", _port)
    dist_timeout: float = option(
        120.0,
        "seconds node 0 waits for the other nodes to join (one that does not is an error "
        "naming it), and a step waits for another node's answer.",
        _number(0, what="seconds "),
    )  # fmt: skip
    pp_layers: list[int] | None = option(
        None,
        "decoder layers of each node's stage, in node order (`[19, 11]`; a flag takes "
        "`19,11`), read on node 0. None: split so that each stage reads about the same "
        "weight bytes per decode step, the LM head counted on the last stage "
        "([cluster.md](cluster.md)).",
        _layer_counts, shown="byte-balanced", parse=_parse_counts,
    )  # fmt: skip
    prefetch_depth: int = option(
        0,
        "> 0: the decoder layers' weights stream from disk that many layers ahead of use "
        "(`torch_topg.offload`, [offload.md](offload.md)).",
        _int(0),
    )
    max_batch_size: int = option(16, "sequences per step.", _int(1), runtime=True)
    batch_timeout: float = option(
        0.0,
        "ms an idle engine lets a new request wait for companions (never delays a running "
        "batch).",
        _batch_timeout, runtime=True,
    )  # fmt: skip
    max_num_batched_tokens: int | None = option(
        None,
        "token budget of one step (chunked prefill). On the CPU a 512-token chunk of a 135M "
        "model is about 2 s on 2 cores: the longest pause a prefill puts between two decode "
        "steps of the other requests.",
        _int(1, allow_none=True), shown="512 (CPU), 2048 (CUDA)", parse=int,
    )  # fmt: skip
    max_queue: int | None = option(
        None,
        "requests allowed to wait for admission; beyond it `submit` raises `QueueFull` "
        "(the server answers 429).",
        _int(1, allow_none=True), parse=int,
    )  # fmt: skip
    kv_cache_memory: int | str | None = option(
        None,
        "the KV pool: bytes, or a percentage of the available memory (`\"40%\"`: "
        "MemAvailable on the CPU, free device memory on CUDA). None: enough for "
        "`max_batch_size` sequences of `max_model_len` tokens, capped at 40% of it.",
        _memory(95), parse=_parse_memory,
    )  # fmt: skip
    block_size: int = option(16, "tokens per KV block.", _int(1))
    max_model_len: int | None = option(
        None, "context limit (prompt + output).", _int(1, allow_none=True),
        shown="the model's `max_position_embeddings`", parse=int,
    )  # fmt: skip
    seed: int | None = option(
        None, "the engine's random stream: requests without a seed draw theirs from it.", _seed,
        parse=int,
    )  # fmt: skip
    deterministic: bool = option(
        False,
        "a sequence's logits are bitwise independent of its batch-mates (needs `compile`).",
        _bool,
    )
    compile: bool = option(True, 'compile the step with `backend="topg"` (once, at load).', _bool)
    background_compile: bool = option(
        True,
        "where the decode plan runs one-token steps (CPU, not `deterministic`), compile the "
        "multi-token step on a thread of its own, meanwhile running every step on the plan "
        "(prompts in chunks of 15 tokens): the engine is ready seconds sooner "
        "([engine.md](engine.md)).",
        _bool,
    )  # fmt: skip
    decode_plan: bool = option(
        True,
        "run steps of at most 16 tokens as one native call ([decode-step.md](decode-step.md)) "
        "or, on CUDA, as CUDA graphs; off with `tp_size > 1`, `prefetch_depth` and "
        "`deterministic` (the reason is in `stats()[\"decode_plan\"]`).",
        _bool,
    )  # fmt: skip
    kv_cache_dtype: str = option(
        "auto",
        "`\"auto\"`: the KV cache in the model's dtype; `\"int8\"`: int8 K/V with a float32 "
        "scale per token and kv head, counted in `kv_cache_memory`.",
        _kv_cache_dtype, parse=str,
    )  # fmt: skip
    prefix_caching: bool = option(
        True, "reuse the KV of cached prefixes across requests ([kv-cache.md](kv-cache.md)).",
        _bool,
    )  # fmt: skip
    host_kv_memory: int | str | None = option(
        None,
        "the host-memory KV tier (evicted prefix blocks are demoted there): bytes or a "
        "percentage of host memory; None: no host tier.",
        _memory(95), parse=_parse_memory,
    )  # fmt: skip
    disk_kv_path: str | None = option(
        None, "a folder for the disk KV tier's file; None: no disk tier.", _path, parse=str
    )
    disk_kv_memory: int | str | None = option(
        None, "the disk tier's size: bytes or a percentage of the folder's free space.",
        _memory(90), shown="10% of the free space", parse=_parse_memory,
    )  # fmt: skip
    disk_kv_shared: bool = option(
        False,
        "the disk tier is `disk_kv_path` shared by every engine of the host (one file per "
        "block, named by its hash and the cache's fingerprint; `disk_kv_memory` caps the "
        "folder, least recently used files go first) ([cluster.md](cluster.md)).",
        _bool,
    )  # fmt: skip
    kv_events: bool = option(
        False,
        "record which prefix blocks each KV tier holds, as vLLM's KV events "
        "(`BlockStored` / `BlockRemoved`), for a prefix-aware router "
        "([cluster.md](cluster.md)).",
        _bool,
    )  # fmt: skip
    kv_events_endpoint: str | None = option(
        None,
        "publish the KV events on a ZMQ PUB socket, as vLLM's `\"zmq\"` publisher "
        "(`\"tcp://*:5557\"` binds; a host's address connects to a collector); turns "
        "`kv_events` on; needs the `cluster` extra ([cluster.md](cluster.md)).",
        _zmq_endpoint, parse=str,
    )  # fmt: skip
    kv_events_topic: str = option(
        "", "the ZMQ topic (first frame) of the published KV events.", _text, parse=str
    )
    scheduling_policy: str = option(
        "fcfs",
        "`\"fcfs\"`: requests are served in arrival order; `\"priority\"`: by each request's "
        "`priority` (lower first, then arrival), preempting lower priorities for a waiting "
        "higher one and parking their KV in the host tier instead of recomputing it "
        "([scheduling.md](scheduling.md)).",
        _choice(("fcfs", "priority")), parse=str,
    )  # fmt: skip
    session_ttl: float = option(
        600.0,
        "seconds a session (`session_id=`) keeps its eviction priority after its last "
        "request.",
        _number(0, what="seconds "),
    )  # fmt: skip
    session_kv_share: float = option(
        0.5, "the largest share of each tier that active sessions' blocks keep.",
        _number(0, 1, what="a fraction "),
    )  # fmt: skip
    speculative: Any = option(
        None,
        "speculative decoding, vLLM's `speculative_config` keys: `{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4}`, `{\"method\": \"draft\", \"model\": ...}` or "
        "`{\"method\": \"self\", \"num_layers\": 8}` ([speculative.md](speculative.md)); a "
        "flag takes JSON.",
        _speculative, parse=_parse_spec,
    )  # fmt: skip
    quantization: Any = option(
        None,
        "None (weights in `dtype`; a GGUF file de-quantised), `\"gguf\"` (a GGUF file's "
        "quantised tensors run packed, activations rounded to int8 as llama.cpp does), "
        "`\"int8\"` / `\"int4\"` (linears quantised at load), or `{\"method\": ..., "
        "\"int8_activations\": false, \"group_size\": 128}` "
        "([quantization.md](quantization.md)); a flag takes a name or JSON.",
        _quantization, parse=_parse_spec,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        self._check_together()

    def _check_together(self) -> None:
        """The rules that tie options to each other."""
        if self.deterministic and not self.compile:
            raise ParameterError(
                "deterministic",
                "needs compile=True (the compiled step runs every linear on topg kernels, "
                "whose batch-invariant mode it relies on)",
            )
        tiered = any(x is not None for x in (self.host_kv_memory, self.disk_kv_path,
                                             self.disk_kv_memory))  # fmt: skip
        if tiered and not self.prefix_caching:
            raise ParameterError(
                "host_kv_memory",
                "the lower KV tiers keep cached prefixes, so they need prefix_caching=True",
            )
        if self.disk_kv_shared and self.disk_kv_path is None:
            raise ParameterError("disk_kv_shared", "needs disk_kv_path (the shared folder)")
        if self.disk_kv_memory is not None and self.disk_kv_path is None:
            raise ParameterError("disk_kv_memory", "needs disk_kv_path (the folder of the tier's file)")  # fmt: skip
        if self.node_rank >= self.nnodes:
            raise ParameterError(
                "node_rank",
                f"expected a node index in [0, nnodes={self.nnodes}), got {self.node_rank}",
            )
        if self.pp_layers is not None and len(self.pp_layers) != self.nnodes:
            raise ParameterError(
                "pp_layers",
                f"expected one layer count per node (nnodes={self.nnodes}), got "
                f"{len(self.pp_layers)}: {self.pp_layers}",
            )
        if self.tp_size == 1 and self.nnodes == 1:
            return
        multi = f"tp_size={self.tp_size}" if self.nnodes == 1 else f"nnodes={self.nnodes}"
        method = self.quantization.get("method") if isinstance(self.quantization, dict) else self.quantization  # fmt: skip
        refusals = [
            ("kv_cache_dtype", self.kv_cache_dtype != "auto", f"'int8' is not supported with {multi} yet"),
            ("host_kv_memory", tiered, f"not supported with {multi} yet (each rank would have to copy its own shard of a block); use the device tier only"),
            ("speculative", self.speculative is not None, f"not supported with {multi} yet"),
            ("prefetch_depth", self.prefetch_depth != 0, f"not supported with {multi} (use one or the other)"),
            ("quantization", self.nnodes > 1 and self.quantization is not None, f"not supported with {multi} yet"),
            ("quantization", method == "gguf", f"'gguf' is not supported with {multi} (a GGUF file runs in one process; quantise a safetensors folder with 'int8' / 'int4' instead)"),
        ]  # fmt: skip
        for name, refused, why in refusals:
            if refused:
                raise ParameterError(name, why)

    @classmethod
    def from_options(
        cls, options: dict[str, Any], where: str = "Engine.from_pretrained"
    ) -> EngineArgs:
        """``EngineArgs(**options)``, an unknown name refused with the list of known ones."""
        unknown = sorted(set(options) - set(names()))
        if unknown:
            raise ParameterError(
                unknown[0], f"{where}: unknown option(s) {unknown}; accepted: {names()}"
            )
        return cls(**options)

    def replace(self, **changes: Any) -> EngineArgs:
        """A copy with ``changes``, checked as at construction."""
        return dataclasses.replace(self, **changes)


def names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineArgs)]


def runtime_names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineArgs) if f.metadata["runtime"]]


# --- derived views: the command line, the docs table, the docstring ----------------------
def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# vLLM's names for the same options, accepted too, so a `vllm serve` command line's
# flags for them work unchanged (the values take vLLM's forms already).
VLLM_FLAGS: dict[str, tuple[str, ...]] = {
    "tp_size": ("--tensor-parallel-size",),
    "max_batch_size": ("--max-num-seqs",),
    "prefix_caching": ("--enable-prefix-caching",),
    "speculative": ("--speculative-config",),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """One flag per option (and vLLM's name for it, :data:`VLLM_FLAGS`); a flag not given
    leaves the option at its default."""
    group = parser.add_argument_group("engine options (docs/engine.md)")
    for f in dataclasses.fields(EngineArgs):
        help = _plain(f.metadata["help"])
        spellings = (flag(f.name), *VLLM_FLAGS.get(f.name, ()))
        if len(spellings) > 1:
            help += f" (vLLM's {', '.join(spellings[1:])} too)"
        if f.metadata["parse"] is None and isinstance(f.default, bool):
            group.add_argument(*spellings, action=argparse.BooleanOptionalAction, dest=f.name,
                               default=None, help=help)  # fmt: skip
            continue
        parse = f.metadata["parse"] or type(f.default)
        if parse is type(None):  # a None default says nothing of the type: declare parse=
            raise TypeError(f"EngineArgs.{f.name}: an option defaulting to None needs parse=")
        group.add_argument(*spellings, type=parse, default=None, metavar=f.name.upper(),
                           dest=f.name, help=help.replace("%", "%%"))  # fmt: skip


def from_cli_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options given on the command line, as ``from_pretrained`` keywords."""
    return {n: getattr(args, n) for n in names() if getattr(args, n, None) is not None}


def _plain(text: str) -> str:
    """Help text without markdown links: ``[a.md](a.md)`` -> ``docs/a.md``."""
    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r"docs/\2", text).replace("`", "")


def _shown(f: dataclasses.Field) -> str:
    if f.metadata["shown"] is not None:
        return f.metadata["shown"]
    return f"`{f.default!r}`" if isinstance(f.default, str) else str(f.default)


TABLE_BEGIN = "<!-- options:begin (generated from torch_topg/engine/options.py) -->"
TABLE_END = "<!-- options:end -->"


def markdown_table() -> str:
    """The options table of docs/engine.md (between ``TABLE_BEGIN`` and ``TABLE_END``)."""
    rows = ["| option | server flag | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(EngineArgs):
        note = " Changeable with `configure()`." if f.metadata["runtime"] else ""
        rows.append(f"| `{f.name}` | `{flag(f.name)}` | {_shown(f)} | {f.metadata['help']}{note} |")
    return "\n".join(rows)


def docstring() -> str:
    """The options as a docstring section (``from_pretrained``'s)."""
    lines = ["Options (:class:`torch_topg.engine.options.EngineArgs`, docs/engine.md):"]
    for f in dataclasses.fields(EngineArgs):
        lines.append(f"    {f.name} (default {_plain(_shown(f))}): {_plain(f.metadata['help'])}")
    return "\n".join(lines)


def rewrite_table(text: str) -> str:
    """``text`` with the block between the markers replaced by :func:`markdown_table`."""
    start, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    return text[:start] + "\n" + markdown_table() + "\n" + text[end:]
