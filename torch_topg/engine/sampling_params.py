"""A request's sampling parameters: vLLM's names and meanings, normalised on construction
and validated with errors that name the parameter (the sampler that applies them:
``torch_topg.engine.sampling``)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from torch_topg.engine.errors import ParameterError
from torch_topg.engine.structured import Structured

__all__ = ["GREEDY_EPS", "MAX_LOGPROBS", "SamplingParams"]

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # most alternatives a request may ask for


@dataclass
class SamplingParams:
    """How to sample one request (vLLM's names and meanings).

    Construction only normalises (``stop`` given as a string becomes a one-item list);
    :meth:`from_kwargs` also validates, and the engine calls :meth:`validate` on admission.
    When both ``max_new_tokens`` and ``max_length`` are set, the engine takes the tighter.
    """

    max_new_tokens: int | None = None  # new tokens at most
    max_length: int | None = None  # prompt + new tokens at most (as transformers)
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 (below GREEDY_EPS): greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off; on prompt + output tokens
    presence_penalty: float = 0.0  # on output tokens
    frequency_penalty: float = 0.0  # on output tokens
    stop: list[str] = field(default_factory=list)  # strings that end a sample (not returned)
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end a sample
    ignore_eos: bool = False
    seed: int | None = None  # None: the engine draws one
    logprobs: int | None = None  # None: none; k: the sampled token's and the top-k's
    # None: none; k: each prompt token's log-probability given the tokens before it, and
    # the top-k alternatives at its position (vLLM's); the first token has none
    prompt_logprobs: int | None = None
    speculative: bool = True  # False: no speculative proposals for this request
    # added to the logits (after the penalties), token id -> bias in [-100, 100]: OpenAI's
    # logit_bias; -100 all but bans a token, 100 all but forces it
    logit_bias: dict[int, float] | None = None
    # EOS and stop_token_ids cannot be drawn before this many new tokens (vLLM's)
    min_tokens: int = 0
    # the output must match this constraint (a JSON schema, a regex, a choice, a grammar:
    # engine/structured.py); a dict is read as Structured(**dict)
    structured: Structured | None = None
    # False: special tokens (e.g. Mistral's [TOOL_CALLS]) are kept in the text (vLLM's;
    # the token that ends a sample, EOS or a stop token id, is never in the text)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.structured, dict):
            try:
                self.structured = Structured(**self.structured)
            except TypeError as e:
                raise ParameterError(
                    "structured", f"structured must be a Structured or {{'kind', 'value'}}: {e}"
                ) from None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (tuple, set, frozenset)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (tuple, set, frozenset)):
            self.stop_token_ids = list(self.stop_token_ids)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build and validate; a keyword that is not a field raises ``ValueError``."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ParameterError(
                unknown[0],
                f"unknown sampling parameter(s): {', '.join(unknown)}; accepted: {', '.join(names)}",
            )
        params = cls(**kwargs)
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition, presence or frequency penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def has_processors(self) -> bool:
        """Whether the logits change before sampling (penalties, a bias, ``min_tokens``)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    def validate(self) -> None:
        """Raise a ``ParameterError`` naming the first bad parameter and its value."""

        def bad(name: str, rule: str) -> ParameterError:
            return ParameterError(name, f"{name} must be {rule}, got {getattr(self, name)!r}")

        for name in ("n", "top_k"):
            if not _is_int(getattr(self, name)):
                raise bad(name, "an int")
        for name in ("max_new_tokens", "max_length", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not _is_int(getattr(self, name)):
                raise bad(name, "an int or None")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise bad(name, "a number")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise bad("temperature", "a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "-1 or 0 (off) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "in [-2, 2]")
        if self.n < 1:
            raise bad("n", ">= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise bad("max_new_tokens", ">= 0")
        if self.max_length is not None and self.max_length < 1:
            raise bad("max_length", ">= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"in [0, {MAX_LOGPROBS}] or None")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a list of ints >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "a bool")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "a bool")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an int >= 0")
        if self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise bad("min_tokens", f"<= max_new_tokens ({self.max_new_tokens})")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(_is_int(k) and k >= 0 for k in self.logit_bias)
            and all(
                not isinstance(v, bool) and isinstance(v, numbers.Real) and -100 <= v <= 100
                for v in self.logit_bias.values()
            )
        ):
            raise bad("logit_bias", "a dict of token ids >= 0 to numbers in [-100, 100]")
        if self.structured is not None and not isinstance(self.structured, Structured):
            raise bad("structured", "a Structured (engine/structured.py) or None")


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
