"""The model runner: a packed batch in, the sampled rows' logits out.

It owns the paged KV cache tensors (one K and one V per layer, allocated once) and the
model, run as its own transformers code with ``attn_implementation="topg_paged"`` (see
``attention.py``). A step is one call of the model on all scheduled tokens packed into
one row ``[1, T]``; the LM head runs only on the rows that are sampled
(``logits_to_keep`` with their indices).

With ``compile=True`` the step is ``torch.compile(..., backend="topg")`` with the token
and sequence dimensions dynamic, compiled in :meth:`warmup` for the two shape classes a
step can have (a single decode token; anything else), so nothing compiles while
serving; :attr:`compilations` counts the graphs dynamo produced. ``warmup(background=True)``
compiles the multi-token class on a thread of its own, where the decode plan runs the
one-token steps; meanwhile steps are held to the plan's size (:attr:`step_token_cap`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from torch_topg.compile.decode_plan import StalePlan
from torch_topg.compile.decode_plan import run as run_plan
from torch_topg.engine.attention import ATTN_IMPLEMENTATION, register_attention
from torch_topg.engine.batch import PackedBatch
from torch_topg.engine.cuda_graphs import CaptureFailed, DecodeGraphs
from torch_topg.utils import hugepages

log = logging.getLogger(__name__)

#: Tokens a step may have to run on the decode plan (csrc/cpu/decode_plan.h kMaxTokens).
PLAN_MAX_TOKENS = 16


def kv_layout(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) of a transformers decoder config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return layers, kv, head_dim


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        kv_heads: int | None = None,
        compile: bool = True,
        kv_cache_dtype: str = "auto",
        decode_plan: bool | str = False,
        layers: range | None = None,
    ) -> None:
        register_attention()
        self.model = model
        self.config = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        num_layers, kv, head_dim = kv_layout(model.config)
        kv = kv_heads or kv
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_blocks = num_blocks
        # Per layer [K, V] (auto) or [K, V, K scale, V scale] (int8), every tensor with the
        # block as dim 0, so `for t in kv_caches: t[dst] = t[src]` copies whole blocks.
        # Uninitialised: pages are committed as blocks are first written, so the RSS
        # grows with the blocks in use up to the budget, never beyond it. On the CPU in
        # transparent huge pages (torch_topg.utils.hugepages: the decode step reads the
        # KV it attends over every step).
        self.kv_cache_dtype = kv_cache_dtype
        # A pipeline stage (``layers``: its own) holds no cache for the other stages'
        # layers: empty placeholders keep the list indexed by the global layer_idx.
        self.kv_caches = []
        for i in range(num_layers):
            tensors = _kv_tensors(num_blocks, block_size, kv, head_dim, self.dtype, kv_cache_dtype)
            if layers is not None and i not in layers:
                self.kv_caches += [torch.empty(0, dtype=t, device=self.device) for _, t in tensors]
            else:
                self.kv_caches += [_empty(s, t, self.device) for s, t in tensors]
        self.kv_tensors_per_layer = len(self.kv_caches) // max(1, num_layers)
        self.kv_bytes = sum(t.numel() * t.element_size() for t in self.kv_caches)
        self._set_attention(model)
        self.compilations = 0
        self.compiled = compile
        # A step holds the lock; the compile's passes take it too, since they re-point
        # weights (fused QKV / gate-up buffers) that a step running meanwhile could read.
        self._lock = threading.RLock()
        self._background: threading.Thread | None = None  # compiling (warmup(background=True))
        self._background_error: BaseException | None = None
        self._background_state = "off"  # "compiling", "done", "failed: ..."
        self.warm_compilations = 0  # graphs compiled by the warm-up (background included)
        self._prepare: Callable[[threading.RLock], Any] | None = None
        # The decode plan: True = lower after warm-up; a string = off, and why.
        self._plan_wanted = decode_plan
        self._plan_tried = False
        self._warming = False  # warm-up compiles the graph: no plan until it is done
        self.plan: Any = None
        self.plan_reason = decode_plan if isinstance(decode_plan, str) else "not lowered yet"
        self.plan_steps = 0
        self._step = model_step
        if compile:
            # The experts substitution (compile/experts.py) must be in place before dynamo
            # traces the first step: importing torch_topg.compile installs it only for the
            # transformers modules already imported then, and the model's are by now.
            from torch_topg.compile import experts

            experts.install()
            # A code object of its own: dynamo's cache (and its size limit) is per code
            # object, so engines in one process never share or evict each other's graphs.
            self._step = torch.compile(_fresh_copy(model_step), backend=self._counting_backend())

    @staticmethod
    def bytes_per_block(
        config: Any,
        block_size: int,
        dtype: torch.dtype,
        kv_heads=None,
        kv_cache_dtype="auto",
        num_layers: int | None = None,
    ) -> int:
        """Bytes of one block in every layer (``num_layers``: a pipeline stage's count):
        K and V (and with int8, their scales)."""
        layers, kv, head_dim = kv_layout(config)
        tensors = _kv_tensors(1, block_size, kv_heads or kv, head_dim, dtype, kv_cache_dtype)
        per_layer = sum(torch.Size(s).numel() * t.itemsize for s, t in tensors)
        return (num_layers or layers) * per_layer

    # --- the decode plan (decode_plan.py) ------------------------------------------------
    def relower(self) -> None:
        """(Re)build the decode plan from the model's current tensors, or keep the reason
        it does not lower in :attr:`plan_reason`."""
        from torch_topg.compile.decode_plan import Unsupported, lower

        self.plan, self._plan_tried = None, True
        if self._plan_wanted is not True:
            self.plan_reason = self._plan_wanted or "decode_plan=False"
            return
        if self.device.type == "cuda":  # the step as CUDA graphs, captured on first use
            self.plan, self.plan_reason = DecodeGraphs(self), ""
            return
        try:
            self.plan = lower(self.model, self.kv_caches, block_size=self.block_size,
                              max_positions=self.max_blocks_per_seq * self.block_size)  # fmt: skip
            self.plan_reason = ""
        except Unsupported as e:
            self.plan_reason = str(e)

    def _run_plan(self, b: PackedBatch) -> torch.Tensor | None:
        if not self._plan_tried:
            self.relower()
        if self.plan is None:
            return None
        if isinstance(self.plan, DecodeGraphs):  # CUDA (cuda_graphs.py)
            try:
                logits = self.plan.run(b)
            except CaptureFailed as e:
                self.plan, self.plan_reason = None, str(e)
                return None
            self.plan_steps += logits is not None
            return logits
        args = (b.input_ids, b.positions, b.slot_mapping, b.block_tables, b.seq_lens,
                b.cu_seqlens_q, b.logits_indices)  # fmt: skip
        try:
            logits = run_plan(self.plan, *args)
        except StalePlan:
            self.relower()  # weights converted or moved: lower again, or fall back
            if self.plan is None:
                return None
            logits = run_plan(self.plan, *args)
        self.plan_steps += 1
        return logits

    def _set_attention(self, model: torch.nn.Module) -> None:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:  # pragma: no cover - transformers < 5
            model.config._attn_implementation = ATTN_IMPLEMENTATION

    def _counting_backend(self):
        from torch_topg.compile import topg_backend

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]):
            self.compilations += 1
            with self._lock:  # between steps (the passes may re-point weights)
                return topg_backend(gm, example_inputs)

        return backend

    def execute(self, b: PackedBatch) -> torch.Tensor:
        """Run one step; returns float32 logits ``[R, vocab]`` of the sampled rows.
        A step of at most 16 tokens runs on the decode plan when there is one, else on
        the graph."""
        with self._lock:
            if self._background is not None and not self._background.is_alive():
                self._background_finished()
            if b.fits_plan and self._plan_wanted is True and not self._warming:
                logits = self._run_plan(b)
                if logits is not None:
                    return logits
            return self.execute_graph(b)

    def execute_graph(self, b: PackedBatch) -> torch.Tensor:
        """One step on the (compiled) model graph, whatever the batch; on the model
        un-compiled while the graph compiles in the background."""
        args = (self.model, b.input_ids, b.positions, b.logits_indices, self.kv_caches, b.slot_mapping,
                b.block_tables, b.seq_lens, b.cu_seqlens_q)  # fmt: skip
        step = model_step if self._background is not None else self._step
        if self.compiled and step is self._step:
            _mark_dynamic(b)
        with torch.inference_mode():
            logits = step(*args)
        return logits.float()

    # --- compiling in the background (warmup(background=True)) --------------------------
    def _compile_in_background(self, b: PackedBatch) -> None:
        """The compile thread: ``prepare`` (the weights into huge pages), then the warm-up
        batch through the compiled step, its KV written to caches of its own (uncommitted
        memory but for the few blocks it writes), so the steps running meanwhile keep
        theirs."""
        try:
            if self._prepare is not None:
                self._prepare(self._lock)
            caches = [
                _empty(t.shape, t.dtype, t.device) if t.numel() else t for t in self.kv_caches
            ]
            args = (self.model, b.input_ids, b.positions, b.logits_indices, caches, b.slot_mapping,
                    b.block_tables, b.seq_lens, b.cu_seqlens_q)  # fmt: skip
            _mark_dynamic(b)
            with torch.inference_mode():
                self._step(*args)
        except BaseException as e:  # reported by the step that finds the thread done
            self._background_error = e

    def _background_finished(self) -> None:
        """On the stepping thread, between steps: the compiled graph takes over, and the
        decode plan is lowered again (the compile's passes may have re-pointed weights)."""
        assert self._background is not None
        self._background.join()
        self._background = None
        self.warm_compilations = self.compilations
        if self._background_error is not None:  # compiles on first use instead, and raises there
            e, self._background_error = self._background_error, None
            self._background_state = f"failed: {type(e).__name__}: {e}"
            log.warning("topg engine: the background compile failed (%s); the step compiles "
                        "on first use instead", self._background_state)  # fmt: skip
        else:
            self._background_state = "done"
        if self._plan_wanted is True:
            self.relower()

    @property
    def background_state(self) -> str:
        """``"off"`` (no background compile), ``"compiling"``, ``"done"`` or ``"failed: ..."``
        (the thread's outcome as soon as it ends; the graph takes over at the next step)."""
        t = self._background
        if t is not None and not t.is_alive():
            e = self._background_error
            return "done" if e is None else f"failed: {type(e).__name__}: {e}"
        return self._background_state

    @property
    def step_token_cap(self) -> int | None:
        """Tokens a step should hold at most now, or None (any): while the graph compiles
        in the background and the decode plan runs, steps that fit the plan (a long prompt
        in chunks of PLAN_MAX_TOKENS - 1; the engine lowers its token budget to this), so
        no step runs the model un-compiled beside the compile thread. Measured through
        ``serve`` (1B BF16 GGUF, 2 threads, Ice Lake-class Xeon): a first chat request's
        prefill took 1.7-2.4 s un-compiled, fighting the compile thread for the
        interpreter and the cores, and 0.8-1.0 s on the plan in chunks."""
        t = self._background
        if t is None or not t.is_alive() or self.plan is None:
            return None
        return PLAN_MAX_TOKENS - 1

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compile (if any) to end; whether it has. The compiled
        graph takes over at the next step."""
        t = self._background
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    @property
    def broken(self) -> str | None:
        """Why this runner can run no more steps (a lost worker or node), or None. A
        one-process runner never breaks; the multi-process ones say what their group
        lost."""
        return None

    @property
    def compilations_while_serving(self) -> int:
        """Graphs compiled since the warm-up ended (0 while it compiles in the background)."""
        if self._background is not None:
            return 0
        return self.compilations - self.warm_compilations

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV block ``src`` to ``dst`` in every layer (copy-on-write of a fork)."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], device=self.device)
        dst = torch.tensor([b for _, b in pairs], device=self.device)
        with torch.inference_mode():
            for cache in self.kv_caches:
                if cache.numel() == 0:  # another pipeline stage's layer
                    continue
                cache.index_copy_(0, dst, cache.index_select(0, src))

    # --- packing -----------------------------------------------------------------------
    def pack(
        self, items: list[tuple[list[int], int, int, list[int]]], samples: list[bool] | list[int]
    ) -> PackedBatch:
        """Pack ``(token_ids, start, num_new, blocks)`` per sequence into a step batch.

        Tokens ``token_ids[start : start + num_new]`` are computed; the last ``samples[i]``
        rows of each sequence (True: 1; a speculative verify step: 1 + proposals) are in
        ``logits_indices`` (at least one row, so the step's shape class never has an empty
        LM head).
        """
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        cu = [0]
        lens: list[int] = []
        table = torch.zeros(len(items), self.max_blocks_per_seq, dtype=torch.int32)
        for s, (tokens, start, n, blocks) in enumerate(items):
            end = start + n
            ids.extend(tokens[start:end])
            rng = range(start, end)
            pos.extend(rng)
            slots.extend(blocks[p // bs] * bs + p % bs for p in rng)
            cu.append(cu[-1] + n)
            lens.append(end)
            if blocks:
                table[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        dev = self.device
        # The decode plan's steps: at most 16 tokens (topg::linear's dot path) and fewer
        # than 16 a sequence (paged attention, not the dense prefill kernel): decode
        # batches, speculative verify steps, short prefill chunks.
        fits_plan = 0 < len(ids) <= PLAN_MAX_TOKENS and all(
            n < PLAN_MAX_TOKENS for _, _, n, _ in items
        )
        decode = all(n == 1 for _, _, n, _ in items) and all(int(f) == 1 for f in samples)
        last = [
            c - j for c, f in zip(cu[1:], samples, strict=True) for j in range(int(f), 0, -1)
        ] or [cu[-1] - 1]
        if len(ids) > 1:
            # Two shape classes only (see warmup): a multi-token step always has S >= 2
            # (an empty sequence: no tokens, no keys, no blocks) and R >= 2 (the last
            # row again; callers read the first rows).
            if len(items) == 1:
                cu.append(cu[-1])
                lens.append(0)
                table = torch.cat([table, torch.zeros_like(table)])
            if len(last) == 1:
                last.append(last[0])
        return PackedBatch(
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            positions=torch.tensor([pos], dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=table.to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(last, dtype=torch.long, device=dev),
            fits_plan=fits_plan,
            decode=decode and fits_plan,
        )

    def warmup(
        self, background: bool = False, prepare: Callable[[threading.RLock], Any] | None = None
    ) -> None:
        """Run (and with ``compile``, compile) both shape classes a step can have.

        Dynamo specialises sizes 0 and 1, so a step with one token (a batch-1 decode: T,
        S and R all 1) is one class; :meth:`pack` pads every other step to S >= 2 and
        R >= 2, which makes it the second class. Its example has pairwise different
        sizes (T=15, S=3, R=2) so that dynamo's duck sizing gives each its own symbol.

        The multi-token class compiles first; when the decode plan lowers after it, every
        one-token step runs on the plan and that class is not compiled (about half of the
        warm-up, seconds of a 1B model's load; it compiles on first use if the plan is
        ever dropped).

        ``background``: where the one-token class runs on the plan, the multi-token class
        compiles on a thread of its own (:meth:`_compile_in_background`) and this returns
        at once; until it is done, the engine holds steps to the plan's size
        (:attr:`step_token_cap`), and a step the plan cannot run (the plan dropped) runs
        the model un-compiled (its rounding eager PyTorch's). Only for this class
        itself (a subclass's ``execute`` may run collectives the thread could not join).
        ``prepare(lock)``: work on the weights before the compile (the engine: moving them
        into huge pages), on the compile thread where there is one (swapping tensors under
        ``lock``, between steps), else first, here.
        """
        bs = self.block_size
        one, multi = [(3, 2, 1, True)], [(7, 0, 7, True), (5, 0, 5, False), (3, 0, 3, True)]
        # The other order only where the plan will run the one-token steps: a model the
        # plan refuses, or offloaded layers (their weights move between steps, so the plan
        # is dropped at the first step), compile the one-token class first, as before (with
        # offloaded layers the other order recompiled three times while serving).
        offloaded = "_topg_offload" in self.model.__dict__
        may_skip = self._plan_wanted is True and self.device.type == "cpu" and not offloaded
        if may_skip:
            self.relower()  # whether the model lowers at all (again after compiling)
            may_skip = self.plan is not None
        own = type(self).execute is ModelRunner.execute
        background = background and may_skip and self.compiled and own
        multi_fits = sum(-(-(s + n) // bs) for _, s, n, _ in multi) <= self.num_blocks
        background = background and multi_fits
        self._prepare = prepare if background else None
        if prepare is not None and not background:
            prepare(self._lock)
            if may_skip:
                self.relower()  # the weights may have moved
        cases = [multi, one] if may_skip else [one, multi]
        for case in cases:
            if case is one and may_skip:
                self.relower()
                if self.plan is not None:
                    self.warm_compilations = self.compilations
                    return
            items, samples, nxt = [], [], 0
            for length, start, n, sample in case:
                k = -(-(start + n) // bs)
                items.append((list(range(1, length + 1)), start, n, list(range(nxt, nxt + k))))
                samples.append(sample)
                nxt += k
            if nxt > self.num_blocks:
                continue  # a pool this small is a test's; it compiles on first use
            if background and may_skip and case is multi:
                b = self.pack(items, samples)
                self._background = threading.Thread(
                    target=self._compile_in_background, args=(b,), name="topg-compile", daemon=True
                )
                self._background_state = "compiling"
                # an interpreter that exits mid-compile aborts: wait for the thread first
                atexit.register(self._background.join)
                self._background.start()  # the plan (lowered above) runs the one-token steps
                return
            # execute (not execute_graph): a subclass's execute may do more (TP: send the
            # batch to the other ranks first)
            self._warming = True
            try:
                self.execute(self.pack(items, samples))
            finally:
                self._warming = False
        self.warm_compilations = self.compilations
        if self._plan_wanted is True:
            self.relower()  # after compiling: the passes may re-point weights


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return hugepages.empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _kv_tensors(
    blocks: int, block_size: int, kv: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of one layer's cache tensors: K, V in ``dtype``, or int8 K, V and
    their float32 scales (one per token and kv head)."""
    shape = (blocks, block_size, kv, head_dim)
    if kv_cache_dtype == "int8":
        return [(shape, torch.int8)] * 2 + [(shape[:3], torch.float32)] * 2
    return [(shape, dtype)] * 2


def model_step(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_indices: torch.Tensor,
    kv_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> torch.Tensor:
    """The step: the model's own forward on the packed batch; logits ``[R, vocab]``."""
    out = model(
        input_ids=input_ids,
        position_ids=positions,
        use_cache=False,
        logits_to_keep=logits_indices,
        topg_kv_caches=kv_caches,
        topg_slot_mapping=slot_mapping,
        topg_block_tables=block_tables,
        topg_seq_lens=seq_lens,
        topg_cu_seqlens_q=cu_seqlens_q,
    )
    return out.logits[0]


_copies = itertools.count()


def _fresh_copy(fn: Any) -> Any:
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _mark_dynamic(b: PackedBatch) -> None:
    """Token / sequence dims dynamic (only sizes >= 2: dynamo specialises 0 and 1)."""
    for t, dim in ((b.input_ids, 1), (b.positions, 1), (b.slot_mapping, 0), (b.block_tables, 0),
                   (b.seq_lens, 0), (b.cu_seqlens_q, 0), (b.logits_indices, 0)):  # fmt: skip
        if t.shape[dim] >= 2:
            torch._dynamo.maybe_mark_dynamic(t, dim)
