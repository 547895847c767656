"""``torch_topg.Engine``: requests in, tokens out, continuous batching on a paged cache.

One background thread (the engine loop) owns the scheduler, the model runner and the
sampler: it takes new requests and aborts from a locked inbox, schedules a step, runs
it, samples, detokenises and pushes deltas to the requests' handles. Callers (any
thread, any asyncio loop) only touch the inbox and their handles, so a front end never
blocks a step and a step never waits for a caller.
"""

from __future__ import annotations

import functools
import itertools
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from torch_topg.engine.block_pool import BlockPool
from torch_topg.engine.config import EngineConfig
from torch_topg.engine.errors import EngineDeadError, ParameterError, QueueFull
from torch_topg.engine.inputs import eos_ids, new_token_limit, split_inputs, tokenize
from torch_topg.engine.kv_cache import KVCacheManager
from torch_topg.engine.kv_publisher import event_feed
from torch_topg.engine.model_runner import ModelRunner
from torch_topg.engine.options import runtime_names
from torch_topg.engine.outputs import Delta, RequestHandle, RequestOutput, TokenLogprob
from torch_topg.engine.pipelined import PipelinedSteps
from torch_topg.engine.prompt_logprobs import rows_asked, split_rows
from torch_topg.engine.proposer import Proposer
from torch_topg.engine.sampling import (
    Sampler,
    SamplerOutput,
    SamplingParams,
    argmax_rows,
    joined_rows,
    plain_greedy,
    rows_of,
    seed_tensor,
)
from torch_topg.engine.scheduler import Scheduler, SchedulerOutput
from torch_topg.engine.sequence import Request, Sequence, Status
from torch_topg.engine.setup import cache_salt, decode_plan_wanted, logits_width, tp_rank
from torch_topg.engine.stats import EngineStats, engine_stats
from torch_topg.engine.structured import GrammarCompiler, Structured
from torch_topg.engine.structured_step import Constraints
from torch_topg.modes import batch_invariant_mode
from torch_topg.utils import hugepages

__all__ = ["Engine", "QueueFull"]


class Engine:
    """An inference engine over a transformers causal LM. Build it with
    :meth:`from_pretrained` (or :meth:`from_model` for a model you already hold)."""

    @classmethod
    def from_pretrained(cls, model: Any = None, **options: Any) -> Engine:
        """Load ``model`` and start an engine; see :func:`torch_topg.engine.builder.from_pretrained`."""
        from torch_topg.engine.builder import from_pretrained

        return from_pretrained(cls, model, **options)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any = None, **options: Any) -> Engine:
        """An engine over a model already built (same options as :meth:`from_pretrained`)."""
        from torch_topg.engine.builder import from_model

        return from_model(cls, model, tokenizer, **options)

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: EngineConfig,
        *,
        runner: ModelRunner | None = None,
        on_shutdown: list[Any] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        args = config.args
        plan = decode_plan_wanted(config)
        self.runner = runner or ModelRunner(
            model,
            num_blocks=config.num_blocks,
            block_size=args.block_size,
            max_blocks_per_seq=-(-config.max_model_len // args.block_size),
            compile=args.compile,
            kv_cache_dtype=args.kv_cache_dtype,
            decode_plan=plan,
        )
        if runner is not None and isinstance(plan, str):  # a runner built elsewhere (TP)
            self.runner.plan_reason = plan
        self.pool = BlockPool(config.num_blocks, args.block_size)
        self.kv = KVCacheManager(
            self.pool,
            enabled=args.prefix_caching,
            salt=cache_salt(model, self.runner.kv_caches, args.block_size, tp_rank()),
            host_blocks=config.host_kv_blocks,
            disk_folder=config.disk_kv_path,
            disk_blocks=config.disk_kv_blocks,
            disk_shared=args.disk_kv_shared,
            disk_cap=config.disk_kv_bytes,
            kv_events=args.kv_events or args.kv_events_endpoint is not None,
            session_ttl=args.session_ttl,
            session_share=args.session_kv_share,
        )
        self.kv.bind(self.runner.kv_caches)
        self.scheduler = Scheduler(self.pool, args.max_batch_size, config.max_num_batched_tokens,
                                   cache=self.kv, max_model_len=config.max_model_len,
                                   policy=args.scheduling_policy)  # fmt: skip
        self.sampler = Sampler()
        self.proposer = Proposer()  # no proposals: the plain step
        if config.speculative is not None:
            from torch_topg.engine.speculative.speculator import Speculator

            self.proposer = Speculator(config.speculative, self.runner,
                                       max_model_len=config.max_model_len, compile=args.compile)  # fmt: skip
        self._eos = eos_ids(model, tokenizer)
        self.constraints = Constraints(GrammarCompiler(tokenizer, logits_width(model), self._eos))
        self._rng = random.Random(args.seed)
        self._ids = itertools.count()
        self._on_shutdown = [*(on_shutdown or []), self.kv.close, self.runner.wait_compiled]
        self._kv_feed = event_feed(self.kv.events, args.kv_events_endpoint, args.kv_events_topic)
        if self._kv_feed is not None:  # after the loop: its last events are sent
            self._on_shutdown.insert(0, self._kv_feed.close)
        # inbox (guarded by _cv)
        self._cv = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._closed_sessions: list[str] = []
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []  # run between steps
        self._stopping = False
        self._queued = 0  # requests submitted and not yet admitted to a step
        self._requests: dict[str, Request] = {}  # loop thread only
        self._stats = EngineStats()
        if args.deterministic:
            self._on_shutdown.append(batch_invariant_mode())
        t0 = time.perf_counter()
        # The decode step streams the weights: on the CPU they move into huge pages, on
        # the compile thread when the warm-up compiles in the background (a GGUF file's
        # mapped tensors serve the first steps meanwhile), else first.
        rehome = None
        if (
            runner is None
            and self.runner.device.type == "cpu"
            and "_topg_offload" not in model.__dict__
        ):
            rehome = functools.partial(hugepages.rehome_, model)
        self.runner.warmup(background=args.background_compile and not args.deterministic,
                           prepare=rehome)  # fmt: skip
        self.proposer.warmup(args.max_batch_size, config.max_num_batched_tokens)
        self._stats.time["warmup_s"] = time.perf_counter() - t0
        depth = getattr(self.runner, "pipeline_depth", 1)  # micro-batches in flight
        self._pipeline = PipelinedSteps(self, depth) if depth > 1 else None
        self._thread = threading.Thread(target=self._loop, name="topg-engine", daemon=True)
        self._thread.start()

    # --- configuration -----------------------------------------------------------------
    def configure(self, **changes: Any) -> None:
        """Change options marked changeable at run time (``max_batch_size``,
        ``batch_timeout``: ms) while serving; None leaves one as it is. Checked as
        ``from_pretrained`` checks them (``EngineArgs``)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        fixed = sorted(set(changes) - set(runtime_names()))
        if fixed:
            raise ParameterError(
                fixed[0], f"Engine.configure: {fixed} cannot change while serving; "
                f"changeable: {runtime_names()}",
            )  # fmt: skip
        with self._cv:
            self.config.args = self.config.args.replace(**changes)
            self.scheduler.max_batch_size = self.config.args.max_batch_size
            self._cv.notify_all()

    # --- the way in --------------------------------------------------------------------
    def submit(
        self, input: Any, *, session_id: str | None = None, priority: int = 0, **sampling: Any
    ) -> RequestHandle:
        """Queue one request; returns its handle at once (iterate it for deltas).

        ``session_id`` (any string, e.g. a conversation id) marks the request's KV blocks
        as the session's: they are kept in preference to others while the session is
        active (see ``session_ttl`` and :meth:`close_session`). ``priority`` (an int,
        lower is served first; vLLM's) needs ``scheduling_policy="priority"``."""
        if session_id is not None and not isinstance(session_id, str):
            raise ParameterError(
                "session_id", f"expected a string, got {type(session_id).__name__}"
            )
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ParameterError("priority", f"expected an int, got {priority!r:.40}")
        if priority != 0 and self.config.args.scheduling_policy != "priority":
            raise ParameterError(
                "priority", f"priority={priority} needs scheduling_policy='priority' "
                "(the engine serves in arrival order)",
            )  # fmt: skip
        params = SamplingParams.from_kwargs(**sampling)
        vocab = self.model.config.get_text_config().vocab_size
        prompt, ids = tokenize(input, self.tokenizer, vocab)
        max_tokens = new_token_limit(params, len(ids), self.config.max_model_len, self.pool)
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ParameterError(
                "logit_bias", f"token id {max(params.logit_bias)} outside [0, {vocab})"
            )
        grammar = self.compile_structured(params.structured) if params.structured else None
        rid = f"req-{next(self._ids)}"
        handle = RequestHandle(rid, self.abort)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Request(
            request_id=rid, prompt=prompt, prompt_token_ids=ids, params=params,
            max_tokens=max_tokens, eos_ids=frozenset() if params.ignore_eos else self._eos,
            tokenizer=self.tokenizer, handle=handle, seed=seed, session_id=session_id,
            grammar=grammar, priority=priority,
        )  # fmt: skip
        with self._cv:
            if self._stopping:
                raise RuntimeError("Engine: submit after shutdown()")
            if (lost := self.runner.broken) is not None:  # refused, not queued to fail
                raise EngineDeadError(f"Engine: refused, the engine is dead: {lost}")
            limit = self.config.args.max_queue
            if limit is not None and self._queued >= limit:
                raise QueueFull(
                    f"Engine: the queue is full ({self._queued} requests waiting, "
                    f"max_queue={limit}); retry later"
                )
            self._queued += 1
            self._inbox.append(req)
            self._cv.notify_all()
        return handle

    def compile_structured(self, spec: Structured) -> Any:
        """The compiled grammar of a structured-output spec, from the engine's cache
        (compiled now when new); a ``ParameterError`` naming ``structured`` when it does
        not compile. ``submit`` calls it; a front end may call it first, off its event
        loop, so a request's compile never runs on the engine loop."""
        return self.constraints.compiler.compile(spec)

    def embed(self, inputs: Any, *, pooling: str = "last", normalize: bool = True) -> torch.Tensor:
        """Embeddings of prompts (a string, token ids, or a list of them): float32
        ``[N, hidden]``, the model's final hidden states pooled per prompt (``"last"``
        token or ``"mean"``), L2-normalised unless ``normalize=False``; no KV kept
        (``embed.py``). Runs on the engine loop between steps: generation pauses while it
        runs."""
        from torch_topg.engine.embed import POOLINGS, embed

        if pooling not in POOLINGS:
            raise ParameterError("pooling", f"expected one of {POOLINGS}, got {pooling!r}")
        if self.config.args.tp_size > 1 or self.config.args.nnodes > 1:
            raise ParameterError(
                "embed", "embeddings are not implemented with tp_size > 1 or nnodes > 1"
            )
        vocab = self.model.config.get_text_config().vocab_size
        ids = [tokenize(x, self.tokenizer, vocab)[1] for x in split_inputs(inputs)]
        limit = self.config.max_model_len
        for i, x in enumerate(ids):
            if len(x) > limit:
                raise ParameterError("input", f"input {i}: {len(x)} tokens, the context is {limit}")
        budget = self.config.max_num_batched_tokens
        fut: Future[torch.Tensor] = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("Engine: embed after shutdown()")
            self._jobs.append((lambda: embed(self.model, ids, pooling=pooling,
                               normalize=normalize, max_batch_tokens=budget), fut))  # fmt: skip
            self._cv.notify_all()
        return fut.result()

    def generate(
        self, inputs: Any, *, session_id: str | None = None, **sampling: Any
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per input (a string, token ids, or chat messages,
        or a list of them), in order; waits for all."""
        handles = [self.submit(x, session_id=session_id, **sampling) for x in split_inputs(inputs)]
        return [h.result() for h in handles]

    def stream(
        self, input: Any, *, session_id: str | None = None, **sampling: Any
    ) -> Iterator[str]:
        """Text deltas of one request as they are produced (a plain iterator)."""
        for d in self.submit(input, session_id=session_id, **sampling):
            if d.text:
                yield d.text

    async def stream_generate(
        self, input: Any, *, session_id: str | None = None, **sampling: Any
    ) -> AsyncIterator[str]:
        """Text deltas of one request as they are produced (``async for``)."""
        async for d in self.submit(input, session_id=session_id, **sampling):
            if d.text:
                yield d.text

    def abort(self, request_id: str) -> None:
        """End a request now (``finish_reason="abort"``); unknown or finished ids are ignored."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify_all()

    def close_session(self, session_id: str) -> None:
        """Release a session at once: its blocks lose their priority and are the first
        evicted (they stay reusable until then). Unknown ids are ignored."""
        with self._cv:
            self._closed_sessions.append(session_id)
            self._cv.notify_all()

    def shutdown(self) -> None:
        """Abort what is running, stop the loop, release resources (idempotent)."""
        with self._cv:
            if self._stopping:
                return
            self._stopping = True
            self._cv.notify_all()
        self._thread.join()
        self.constraints.close()
        for fn in self._on_shutdown:
            fn()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._inbox
                    or self._aborts
                    or self._closed_sessions
                    or self._stopping
                    or self._jobs
                ) and not (self.scheduler.has_work()):
                    self._cv.wait()
                if self._stopping:
                    new, aborts = list(self._inbox), set(self._aborts)
                    self._inbox.clear()
                else:
                    self._wait_for_companions()
                    new, aborts = list(self._inbox), set(self._aborts)
                    self._inbox.clear()
                    self._aborts.clear()
                closed, self._closed_sessions = self._closed_sessions, []
                jobs, self._jobs = self._jobs, []
            for fn, fut in jobs:  # the model is the loop's: other uses run here
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # the caller gets it
                        fut.set_exception(e)
            for sid in closed:
                self.kv.close_session(sid)
            for req in new:
                self._requests[req.request_id] = req
                # n > 1: the first sample prefills the prompt, the others fork from it
                # (sharing its blocks) when it samples its first token.
                self.scheduler.add(req.seqs[0])
                self._stats.requests["submitted"] += 1
            if self._stopping:
                for rid in list(self._requests):
                    self._end_request(self._requests[rid], "abort")
                return
            for rid in aborts:
                if rid in self._requests:
                    self._end_request(self._requests[rid], "abort")
            if self.scheduler.has_work():
                try:
                    self._pipeline.step() if self._pipeline else self._step()
                except Exception as e:  # a bug outside the model call: never a silent hang
                    self._fail_all(e)
            if self._kv_feed is not None:  # never waits (kv_publisher.py)
                self._kv_feed.pump()

    def _fail_all(self, err: BaseException) -> None:
        """The loop itself raised: fail every request with the error (pool made whole)."""
        for req in list(self._requests.values()):
            self._fail(req, RuntimeError(f"Engine: step failed: {err!r}"))
        while self.scheduler.waiting:  # sequences of requests already failed
            self.scheduler.finish(self.scheduler.waiting[0], "error")

    def _wait_for_companions(self) -> None:
        """Idle engine, new request: let it wait ``batch_timeout`` ms for others (holds _cv)."""
        timeout = self.config.args.batch_timeout / 1000
        if timeout <= 0 or self.scheduler.running or not self._inbox:
            return
        deadline = time.perf_counter() + timeout
        while len(self._inbox) < self.scheduler.max_batch_size and not self._stopping:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._cv.wait(left)

    def _step(self) -> None:
        """One step: plan proposals, schedule, run the model, sample, update, emit."""
        st = self._stats
        t0 = time.perf_counter()
        cap = self.runner.step_token_cap  # while the graph compiles: steps the plan runs
        budget = self.config.max_num_batched_tokens
        self.scheduler.max_num_batched_tokens = budget if cap is None else min(budget, cap)
        self.proposer.plan(self.scheduler)
        out = self.scheduler.schedule()
        self.proposer.propose(out)
        self.constraints.start(out)  # the masks fill while the model runs
        t1 = time.perf_counter()
        st.time["schedule_s"] += t1 - t0
        if not out.scheduled:
            self.scheduler.wait_for_loads()
            return
        try:
            rows = self._run(out)
        except Exception:
            rows = self._run_isolated(out)
        self._finish_step(out, rows, t1)

    def _finish_step(self, out: SchedulerOutput, rows: list[Any], t1: float) -> None:
        """After the model ran the step ``out`` (from ``t1``): sample, update, emit."""
        st = self._stats
        t2 = time.perf_counter()
        st.time["model_s"] += t2 - t1
        self.scheduler.update(out)  # the scheduled tokens are in the cache
        st.count_step(out)  # before the requests it ends are handed back: their caller
        # reads stats() that include their last step
        sampled = [(s.seq, r) for s, r in zip(out.scheduled, rows, strict=True) if r is not None]
        if sampled:
            self._sample(self._fork(sampled))
        self.scheduler.commit([s.seq for s in out.scheduled])
        st.time["sample_s"] += time.perf_counter() - t2
        self.proposer.observe_step(out, time.perf_counter() - t1)
        with self._cv:
            self._queued = len(self._inbox) + sum(
                1 for r in self._requests.values()
                if all(s.num_computed == 0 and s.status is Status.WAITING for s in r.seqs)
            )  # fmt: skip

    def _run(self, out: SchedulerOutput) -> list[torch.Tensor | None]:
        """One model call for the whole step: the logits row of each scheduled sequence
        that samples (None for the others; ``[1 + num_spec, V]`` for a verify step)."""
        batch, samples = self._pack(out)
        return self._rows(out, self.runner.execute(batch), samples)

    def _pack(self, out: SchedulerOutput) -> tuple[Any, list[Any]]:
        """The step's packed batch, and the rows each scheduled sequence samples."""
        items = [
            (s.seq.token_ids + s.seq.spec_tokens if s.num_spec else s.seq.token_ids,
             s.seq.num_computed, s.num_new, s.seq.blocks)
            for s in out.scheduled
        ]  # fmt: skip
        samples = [rows_asked(s) for s in out.scheduled]
        return self.runner.pack(items, samples), samples

    @staticmethod
    def _rows(out: SchedulerOutput, logits: torch.Tensor, samples: list[Any]) -> list[Any]:
        rows = rows_of(logits, samples)
        return [split_rows(s, r) for s, r in zip(out.scheduled, rows, strict=True)]

    def _run_isolated(self, out: SchedulerOutput) -> list[torch.Tensor | None]:
        """The batched step raised: run each sequence alone; those that still raise fail
        (their requests end with the error), the others go on."""
        done: list[tuple[Any, torch.Tensor | None]] = []
        for s in out.scheduled:
            if s.seq.finished:  # a sibling's failure ended its request
                continue
            try:
                done.append((s, self._run(SchedulerOutput(scheduled=[s]))[0]))
            except Exception as e:  # this request's own failure
                self._fail(s.seq.request, e)
        done = [(s, r) for s, r in done if not s.seq.finished]
        out.scheduled[:] = [s for s, _ in done]
        return [r for _, r in done]

    def _fork(
        self, sampled: list[tuple[Sequence, torch.Tensor]]
    ) -> list[tuple[Sequence, torch.Tensor]]:
        """``n > 1``: a request's first sample reached its first token; the scheduler starts
        the other samples from its prompt blocks (as many as fit now), and they draw their
        first tokens from the same logits row."""
        for seq, row in list(sampled):
            req = seq.request
            if seq.index == 0 and len(req.seqs) > 1 and not req.forked:
                req.forked = True
                started, copies = self.scheduler.fork(seq, req.seqs[1:])
                if copies:
                    self.runner.copy_blocks(copies)
                sampled.extend((c, row) for c in started)
        return sampled

    def _sample(self, sampled: list[tuple[Sequence, torch.Tensor]]) -> None:
        """Draw the tokens of every sampled row; the scheduler appends them and ends the
        sequences they stop; the requests' handles get the deltas."""
        # One row per position: a verify step's rows draw each position with its own key,
        # as if the proposals before it were committed (speculative/rejection.py).
        props = [s.spec_tokens if r.dim() == 2 else [] for s, r in sampled]
        rows = [
            (s, p[:j]) for (s, _), p in zip(sampled, props, strict=True) for j in range(len(p) + 1)
        ]
        views = [r.view(-1, r.shape[-1]) for _, r in sampled]
        logits = joined_rows(views)  # a view of the runner's logits when rows are in order
        params = [s.request.params for s, _ in rows]
        masks = self.constraints.masks(rows)  # structured outputs: joins the mask worker
        if plain_greedy(params) and masks is None:  # the sampler's fast path, inputs unbuilt
            res = SamplerOutput(argmax_rows(logits))
        else:
            seeds = seed_tensor([s.seed for s, _ in rows])
            positions = torch.tensor([s.num_tokens + len(d) for s, d in rows], dtype=torch.long)
            needs_hist = any(p.has_penalties for p in params)
            banned = [s.banned_ids(len(d)) for s, d in rows]
            res = self.sampler(
                logits, params, seeds, positions,
                prompt_tokens=[s.token_ids[: s.prompt_len] for s, _ in rows] if needs_hist else None,
                output_tokens=[s.output_ids + d for s, d in rows] if needs_hist else None,
                banned=banned if any(banned) else None, bitmask=masks,
            )  # fmt: skip
        tokens = res.tokens.tolist()
        if masks is not None:
            self.constraints.applied(self.sampler.mask_s)
        now = time.perf_counter()
        i = 0
        for (seq, _), prop in zip(sampled, props, strict=True):
            first, i = i, i + len(prop) + 1
            drawn = tokens[first:i]
            if seq.finished:  # its request ended while the step ran (a sibling failed)
                continue
            keep = self.proposer.verify(self.scheduler, seq, drawn) if prop else 1
            ended = None
            if seq.request.grammar is not None:  # the grammar may end it, or refuse the rest
                keep, ended = self.constraints.commit(seq, drawn[:keep])
            lps = [self._logprob(res, first + j, tok, seq) for j, tok in enumerate(drawn[:keep])]
            n, reason = self.scheduler.update_from_output(seq, drawn[:keep], lps, now)
            if ended is not None and reason is None:
                self.scheduler.finish(seq, reason := ended)
            self._emit(seq, drawn[:n], lps[:n], reason)

    @staticmethod
    def _logprob(res: Any, i: int, tok: int, seq: Sequence) -> TokenLogprob | None:
        k = seq.request.params.logprobs
        if k is None or res.logprobs is None:
            return None
        top = {}
        if res.top_logprobs is not None and k > 0:
            vals, ids = res.top_logprobs
            top = dict(zip(ids[i, :k].tolist(), vals[i, :k].tolist(), strict=True))
        return TokenLogprob(tok, float(res.logprobs[i]), top)

    def _emit(
        self, seq: Sequence, tokens: list[int], lps: list[TokenLogprob | None], reason: str | None
    ) -> None:
        """The step's delta of ``seq`` to its request's handle (and the request's output
        when this ended its last sequence)."""
        req = seq.request
        self._stats.tokens["generated"] += len(tokens)
        seq.out.text = seq.detok.text
        text = seq.detok.pending(final=reason is not None)
        kept = [lp for lp in lps if lp is not None]
        d = Delta(req.request_id, seq.index, text, tokens, kept or None, reason)
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            d.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
            d.prompt_token_ids = req.prompt_token_ids
        if not req.finished:
            req.handle._push(d)
            return
        out = self._output(req)
        d.usage = out.usage
        req.handle._push(d)
        self._requests.pop(req.request_id, None)
        self._stats.requests["finished"] += 1
        req.handle._finish(out, None)

    def _output(self, req: Request) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[s.out for s in req.seqs],
            cached_prompt_tokens=req.cached_prompt_tokens,
            prompt_logprobs=req.prompt_logprobs,
        )

    def _end_request(self, req: Request, reason: str) -> None:
        for s in req.seqs:
            if not s.finished:
                self.scheduler.finish(s, reason)
                s.out.text = s.detok.text
                req.handle._push(
                    Delta(req.request_id, s.index, s.detok.pending(True), [], None, reason)
                )
        self._stats.requests["aborted"] += 1
        self._requests.pop(req.request_id, None)
        req.handle._finish(self._output(req), None)

    def _fail(self, req: Request, err: BaseException) -> None:
        for s in req.seqs:
            self.scheduler.finish(s, "error")
        self._stats.requests["failed"] += 1
        self._requests.pop(req.request_id, None)
        req.handle._finish(None, err)

    # --- introspection -----------------------------------------------------------------
    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait until the warm-up's background compile (``background_compile``) is done;
        whether it is. Requests are served meanwhile; a benchmark of the steady state
        waits first."""
        return self.runner.wait_compiled(timeout)

    def stats(self) -> dict[str, Any]:
        """What the engine did, one section per subsystem (the server's metrics read it)."""
        return engine_stats(self)
