"""A request and its sequences: tokens, block table, progress and output bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch_topg.engine.detokenize import IncrementalDetokenizer
from torch_topg.engine.outputs import CompletionOutput, TokenLogprob

if TYPE_CHECKING:
    from torch_topg.engine.outputs import RequestHandle
    from torch_topg.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample of a request: its tokens (prompt + output) and its KV blocks.

    ``num_computed`` tokens have their K/V in the cache; a step computes the next
    ``num_new`` of the rest and samples a token when it reaches the end. Preemption
    drops the blocks and sets ``num_computed`` back to 0 (recompute), so the sequence
    resumes with the same tokens and the same keyed random draws.
    """

    def __init__(self, request: Request, index: int, seed: int) -> None:
        self.request = request
        self.index = index
        self.seed = seed
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_computed = 0
        self.blocks: list[int] = []  # owned by the scheduler
        # speculation (engine/speculative): proposals for the next step, not committed
        self.num_spec = 0
        self.spec_tokens: list[int] = []
        self.session_id: str | None = request.session_id
        self.block_hashes: list[bytes] = []  # prefix hashes of full blocks (kv_cache.py)
        self.num_committed_blocks = 0  # leading blocks already offered to the prefix cache
        self.kv_load: Any = None  # a lower-tier copy in flight (kv_cache.py)
        # preempted under the priority policy: (host slots, tokens) of its parked KV
        self.parked: tuple[list[int], int] | None = None
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.detok = IncrementalDetokenizer(
            request.tokenizer, request.prompt_token_ids, request.params.stop,
            skip_special_tokens=request.params.skip_special_tokens,
        )  # fmt: skip
        self.out = CompletionOutput(index=index)
        if request.params.logprobs is not None:
            self.out.logprobs = []
        self.num_preemptions = 0
        self.matcher: Any = None  # structured outputs: the grammar matcher (structured_step.py)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether prompt positions whose logprobs are not recorded yet remain (the
        request asked for ``prompt_logprobs``; only the first sample records them)."""
        got = self.request.prompt_logprobs
        return got is not None and self.index == 0 and len(got) < self.prompt_len

    def banned_ids(self, drafted: int = 0) -> list[int]:
        """The ids the next token may not be (``drafted`` tokens past the committed ones):
        the request's EOS and stop token ids while it is short of ``min_tokens``."""
        p = self.request.params
        if self.num_tokens - self.prompt_len + drafted >= p.min_tokens:
            return []
        return sorted({*self.request.eos_ids, *p.stop_token_ids})

    def append(
        self, token: int, logprob: TokenLogprob | None, now: float, text: bool = True
    ) -> None:
        """One sampled token; ``text=False``: not detokenised (the EOS or stop token id
        that ends the sample: not part of the text, as in vLLM)."""
        self.token_ids.append(token)
        self.out.token_ids.append(token)
        self.out.token_times.append(now - self.request.arrival)
        if logprob is not None and self.out.logprobs is not None:
            self.out.logprobs.append(logprob)
        if text:
            self.detok.add(token)


@dataclass
class Request:
    """A submitted input and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # output tokens allowed (from max_new_tokens / max_length / context)
    eos_ids: frozenset[int]
    tokenizer: Any
    handle: RequestHandle
    seed: int
    arrival: float = field(default_factory=time.perf_counter)
    seqs: list[Sequence] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    session_id: str | None = None
    error: BaseException | None = None
    grammar: Any = None  # structured outputs: the compiled grammar (structured.py)
    priority: int = 0  # the priority policy: lower is served first (vLLM's)
    forked: bool = False  # n > 1: the other samples have started from the first one
    # prompt_logprobs: filled by the prefill (prompt_logprobs.py); sent with the first delta
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        # Sample i's key: the request seed for sample 0, a distinct odd-step offset after.
        self.seqs = [
            Sequence(self, i, (self.seed + i * 0x9E3779B97F4A7C15) % 2**64)
            for i in range(self.params.n)
        ]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
