"""Structured outputs: what a request's answer must match, and the grammars that enforce it.

A request's :class:`Structured` spec (``SamplingParams.structured``) names one constraint:

- ``json_schema``: JSON matching a JSON schema (a dict, or its JSON text);
- ``json_object``: any JSON object;
- ``regex``: text matching a regular expression (the whole answer);
- ``choice``: exactly one of a list of strings;
- ``grammar``: text of an EBNF grammar in the GBNF dialect xgrammar reads (``root ::= ...``).

:class:`GrammarCompiler` turns a spec into an xgrammar compiled grammar for one engine's
tokenizer and logits width (ids past the tokenizer's vocabulary, a padded ``lm_head``,
are never allowed), keeping the last ``capacity`` results in an LRU keyed by a hash of
(kind, text); a spec that does not compile is a :class:`ParameterError` naming
``structured``. The per-step side (matchers, masks, overlap with the forward) is
``structured_step.py``.

xgrammar (the ``hf`` extra) is imported on first use, so an engine that never sees a
constrained request never loads it.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from torch_topg.engine.errors import ParameterError

__all__ = [
    "KINDS",
    "GrammarCompiler",
    "Structured",
    "allowed_mask",
    "apply_bitmask",
]

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_WHITESPACE = 24  # blanks allowed between two JSON tokens (a newline and an indent)


@dataclass(frozen=True)
class Structured:
    """One output constraint: ``kind`` (one of :data:`KINDS`) and its ``value``.

    Normalised on construction: a ``json_schema`` dict becomes its JSON text (key order
    kept: it is the order the answer's keys take), a ``choice`` list a tuple; the value
    is checked for its type (a dict / JSON text, a string, a non-empty list of non-empty
    strings, None for ``json_object``) with a :class:`ParameterError` naming
    ``structured``. Whether it compiles is checked by the engine's compiler.
    """

    kind: str
    value: Any = None

    def __post_init__(self) -> None:
        def bad(rule: str) -> ParameterError:
            return ParameterError(
                "structured", f"structured {self.kind!r} needs {rule}, got {self.value!r:.120}"
            )

        if self.kind not in KINDS:
            raise ParameterError(
                "structured",
                f"structured kind must be one of {', '.join(KINDS)}, got {self.kind!r}",
            )
        v = self.value
        if self.kind == "json_object":
            if v is not None:
                raise bad("no value")
        elif self.kind == "json_schema":
            if isinstance(v, (dict, bool)):
                object.__setattr__(self, "value", json.dumps(v))
            elif isinstance(v, str):
                try:
                    doc = json.loads(v)
                except ValueError as e:
                    raise bad(f"a schema (a dict or its JSON text): {e}") from None
                if not isinstance(doc, (dict, bool)):
                    raise bad("a schema: a JSON object")
            else:
                raise bad("a schema (a dict or its JSON text)")
        elif self.kind == "choice":
            if isinstance(v, str) or not isinstance(v, Iterable):
                raise bad("a non-empty list of non-empty strings")
            v = tuple(v)
            if not v or not all(isinstance(c, str) and c for c in v):
                raise bad("a non-empty list of non-empty strings")
            object.__setattr__(self, "value", v)
        elif not isinstance(v, str) or not v:
            raise bad("a non-empty string")

    # -- constructors --------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Structured:
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> Structured:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Structured:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Iterable[str]) -> Structured:
        return cls("choice", tuple(options))

    @classmethod
    def grammar(cls, ebnf: str) -> Structured:
        return cls("grammar", ebnf)

    @property
    def text(self) -> str:
        """The constraint as one string (what the cache key hashes)."""
        if self.kind == "choice":
            return json.dumps(list(self.value))
        return self.value or ""

    @property
    def key(self) -> str:
        """A hash of (kind, text): the compiled-grammar cache's key."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()


def choice_ebnf(options: Iterable[str]) -> str:
    """An EBNF grammar whose language is exactly ``options`` (JSON string literals are
    EBNF string literals: the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


SAFE_INTEGER = 2**53 - 1  # I-JSON (RFC 7493): the integers every JSON reader holds exactly
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def bounded_integers(schema: Any) -> Any:
    """``schema`` with every integer type given the bounds it lacks, +-(2**53 - 1).

    An unbounded integer lets a model write digits until ``max_tokens`` (SmolLM2 wrote
    a population of 100 ones); llama.cpp's schema grammars cap integers at 16 digits for
    the same reason. Values under the keywords that hold data (``enum``, ``const``, ...)
    are left alone."""
    if isinstance(schema, list):
        return [bounded_integers(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else bounded_integers(v) for k, v in schema.items()}
    t = out.get("type")
    if t == "integer" or (isinstance(t, list) and "integer" in t):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _reason(err: BaseException) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    return _XGR_PREFIX.sub("", str(err)).strip() or repr(err)


class GrammarCompiler:
    """Compiled grammars for one engine: a tokenizer, the model's logits width and its
    stop ids. Thread safe; xgrammar's tokenizer info is built on the first compile (a
    49152-token vocabulary: ~0.2 s). Results are kept in an LRU of ``capacity`` entries
    keyed by :attr:`Structured.key`."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        capacity: int = 256,
        threads: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.capacity = capacity
        self.threads = threads
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.compile_s = 0.0

    def _xgr_compiler(self) -> Any:
        with self._init_lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise ParameterError(
                        "structured", "structured outputs need a tokenizer; this engine has none"
                    )
                try:
                    import xgrammar as xgr
                except ImportError as e:
                    raise ParameterError(
                        "structured",
                        f"structured outputs need the xgrammar package (the hf extra): {e}",
                    ) from None
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
            return self._compiler

    def compile(self, spec: Structured) -> Any:
        """The compiled grammar of ``spec`` (cached); a ``ParameterError`` naming
        ``structured`` when it does not compile."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        comp = self._xgr_compiler()
        t0 = time.perf_counter()
        try:
            if spec.kind in ("json_schema", "json_object"):
                # json_object: any object; a schema's objects take no keys beyond its own
                # (OpenAI's strict mode). Whitespace between tokens is bounded, so a model
                # cannot spend its budget on blanks.
                strict = spec.kind == "json_schema"
                schema = json.dumps(bounded_integers(json.loads(spec.value))) if strict else None
                grammar = comp.compile_json_schema(
                    schema or '{"type": "object"}', strict_mode=strict,
                    any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE,
                )  # fmt: skip
            elif spec.kind == "regex":
                grammar = comp.compile_regex(spec.value)
            elif spec.kind == "choice":
                grammar = comp.compile_grammar(choice_ebnf(spec.value))
            else:
                grammar = comp.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ParameterError(
                "structured", f"structured {spec.kind} does not compile: {_reason(e)}"
            ) from None
        with self._lock:
            self.compile_s += time.perf_counter() - t0
            self.misses += 1
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return grammar

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "grammars_cached": len(self._cache),
                "cache_hits": self.hits,
                "compiled": self.misses,
                "compile_s": self.compile_s,
            }


# --------------------------------------------------------------------------- masks

_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _table(dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8]``: the 8 bits of each byte value, as bool, or as 0 / -inf (float)."""
    t = _TABLES.get((dev, dtype))
    if t is None:
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        bits = ((byte >> torch.arange(8, dtype=torch.int32)) & 1).bool()
        t = bits if dtype == torch.bool else torch.where(bits, 0.0, float("-inf")).to(dtype)
        t = _TABLES[dev, dtype] = t.to(dev)
    return t


def _expand(
    bitmask: torch.Tensor, vocab: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The packed words' bits as ``[R, vocab]`` of ``dtype`` (see :func:`allowed_mask`):
    the words read as little-endian bytes (byte ``b`` of word ``w`` holds tokens
    ``32 w + 8 b ..``), each byte's 8 entries one row of a lookup table. ``out``: a
    buffer of ``R * words * 32`` entries to write them into."""
    R = bitmask.shape[0]
    data = bitmask.contiguous().view(torch.uint8)
    if sys.byteorder == "big":  # the words' bytes, least significant first
        data = data.view(R, -1, 4).flip(-1).reshape(R, -1)
    idx = data.reshape(-1).long()
    if out is not None:
        out = torch.index_select(_table(bitmask.device, dtype), 0, idx, out=out.view(-1, 8))
    else:
        out = _table(bitmask.device, dtype).index_select(0, idx)
    return out.view(R, -1)[:, :vocab]


def allowed_mask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[R, vocab]`` from xgrammar's packed int32 bitmask ``[R, ceil(vocab / 32)]``
    (bit ``j % 32`` of word ``j // 32`` set: token ``j`` allowed). Any device."""
    return _expand(bitmask, vocab, torch.bool)


Scratch = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _fresh(
    slot: str, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device
) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=dev)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], scratch: Scratch | None = None
) -> torch.Tensor:
    """fp32 copy of ``logits [B, V]`` with the tokens each of ``rows`` may not take set to
    -inf (``bitmask[i]`` is row ``rows[i]``'s); the input is never written.

    The mask is added as 0 / -inf (one lookup and one add: a boolean ``masked_fill`` of
    8 x 49152 took 4x as long on the CPU). ``scratch(slot, shape, dtype, device)``: where
    the mask and the copy go (the sampler's reused buffers: fresh multi-megabyte
    temporaries page-fault on every step: 1.9 -> 0.47 ms for 16 x 49152, 2 threads); the
    result is then valid until the next call with the same ``scratch``."""
    B, V = logits.shape
    dev = logits.device
    bitmask = bitmask.to(dev, non_blocking=True)
    buf = scratch or _fresh
    add = _expand(
        bitmask, V, torch.float32, buf("bitmask_add", (bitmask.numel() * 32,), torch.float32, dev)
    )
    out = buf("bitmask_logits", (B, V), torch.float32, dev)
    if len(rows) == B and rows == list(range(B)):
        return torch.add(logits.float(), add, out=out)
    x = out.copy_(logits)
    idx = torch.tensor(rows, device=x.device)
    x[idx] = x[idx] + add
    return x
