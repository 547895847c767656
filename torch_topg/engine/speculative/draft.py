"""Draft-model proposals: a second model ("draft") or the target's own first layers
("self"), run through the engine's paged-cache machinery.

The draft runs as a :class:`~torch_topg.engine.model_runner.ModelRunner` over the same
block tables as the target (the scheduler has already given each sequence the blocks
for its verify step, which cover every position the draft writes):

- ``"self"``: the target's first ``n`` decoder layers, its final norm and LM head (a
  shallow copy of the module tree sharing the weights). Its KV cache *is* the target's
  for those layers: layer ``i < n`` of the target computes exactly what layer ``i`` of
  the draft computes for the same tokens, so every committed position the target has
  computed is valid for the draft, and the draft's writes at proposal positions are
  overwritten by the verify step. No extra memory, no catch-up.
- ``"draft"``: its own KV cache (its own layers and heads, the target's number of
  blocks, the same block ids). It tracks per sequence how many tokens it has computed
  and catches up on the others (the whole prompt on its first proposal; one or two
  tokens after each verify step) in the first of its steps. A prefix-cache hit or a
  preemption gives the target KV the draft never wrote, so the draft starts that
  sequence from 0.

A proposal is drawn with the request's own sampling parameters and the key the target
uses at that position (``SALT_SAMPLE``): the coupled verification of ``rejection.py``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from torch_topg.engine.model_runner import ModelRunner
from torch_topg.engine.sampling import Sampler, seed_tensor
from torch_topg.engine.speculative.adaptive import CostModel

if TYPE_CHECKING:
    from torch_topg.engine.sequence import Sequence


def truncated_model(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The first ``num_layers`` decoder layers of a transformers causal LM with its final
    norm and LM head: a shallow copy sharing every weight (no memory)."""
    inner = model.base_model
    prefix = model.base_model_prefix
    cfg = copy.deepcopy(model.config)
    text = cfg.get_text_config()
    text.num_hidden_layers = num_layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:num_layers]
    new_inner = copy.copy(inner)
    new_inner._modules = dict(inner._modules)
    new_inner.layers = torch.nn.ModuleList(list(inner.layers)[:num_layers])
    new_inner.config = cfg
    new = copy.copy(model)
    new._modules = dict(model._modules)
    new._modules[prefix] = new_inner
    new.config = cfg
    return new


def check_same_vocabulary(target: Any, target_tok: Any, draft: Any, draft_tok: Any) -> None:
    """Draft and target must share the tokenizer: a clear ``ValueError`` otherwise."""
    tv = target.config.get_text_config().vocab_size
    dv = draft.config.get_text_config().vocab_size
    if tv != dv:
        raise ValueError(
            f"speculative: the draft model's vocabulary ({dv} tokens) differs from the "
            f"target's ({tv}); draft and target must share the tokenizer"
        )
    if target_tok is not None and draft_tok is not None:
        if target_tok.get_vocab() != draft_tok.get_vocab():
            raise ValueError(
                "speculative: the draft model's tokenizer maps tokens to other ids than the "
                "target's; draft and target must share the tokenizer"
            )


class DraftProposer:
    """Runs the draft for the sequences that speculate in a step (module docstring)."""

    def __init__(
        self,
        target_runner: ModelRunner,
        *,
        method: str,
        model: torch.nn.Module | None = None,
        num_layers: int | None = None,
        compile: bool = True,
    ) -> None:
        tr = target_runner
        if method == "self":
            assert num_layers is not None
            module = truncated_model(tr.model, num_layers)
            # a one-block cache, replaced by the target's first layers at once
            self.runner = ModelRunner(module, num_blocks=1, block_size=tr.block_size,
                                      max_blocks_per_seq=tr.max_blocks_per_seq, compile=compile)  # fmt: skip
            per_layer = getattr(tr, "kv_tensors_per_layer", 2)  # K, V (and int8 scales)
            self.runner.kv_caches = tr.kv_caches[: per_layer * num_layers]
            self.runner.num_blocks = tr.num_blocks
            self.runner.kv_bytes = 0
        else:
            assert model is not None
            self.runner = ModelRunner(model, num_blocks=tr.num_blocks, block_size=tr.block_size,
                                      max_blocks_per_seq=tr.max_blocks_per_seq, compile=compile)  # fmt: skip
        self.shared = method == "self"
        self.sampler = Sampler()
        self.cost = CostModel()  # seconds of a draft step by the sequences in it
        self._computed: dict[Sequence, tuple[int, int]] = {}  # seq -> (tokens, preemptions)

    @property
    def kv_bytes(self) -> int:
        return self.runner.kv_bytes

    def warmup(self) -> None:
        self.runner.warmup()

    def _start(self, seq: Sequence) -> int:
        """First position the draft has not computed for ``seq``."""
        if self.shared:
            return seq.num_computed
        done, pre = self._computed.get(seq, (0, -1))
        if pre != seq.num_preemptions:
            return 0
        return min(done, seq.num_computed)

    def propose(self, work: Seq[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """``k`` proposed tokens for each ``(seq, k)`` (``k >= 1``), ``k`` draft steps."""
        props: dict[Sequence, list[int]] = {seq: [] for seq, _ in work}
        kmax = max((k for _, k in work), default=0)
        for j in range(kmax):
            active = [(s, k) for s, k in work if k > j]
            items, pos = [], []
            for seq, _ in active:
                L = seq.num_tokens
                if j == 0:
                    start = self._start(seq)
                    items.append((seq.token_ids, start, L - start, seq.blocks))
                else:
                    items.append((seq.token_ids + props[seq], L + j - 1, 1, seq.blocks))
                pos.append(L + j)
            t0 = time.perf_counter()
            logits = self.runner.execute(self.runner.pack(items, [True] * len(items)))
            seqs = [s for s, _ in active]
            params = [s.request.params for s in seqs]
            hist = any(p.has_penalties for p in params)
            banned = [s.banned_ids(len(props[s])) for s in seqs]
            drawn = self.sampler(
                logits[: len(seqs)], params, seed_tensor([s.seed for s in seqs]),
                torch.tensor(pos, dtype=torch.long),
                prompt_tokens=[s.token_ids[: s.prompt_len] for s in seqs] if hist else None,
                output_tokens=[s.output_ids + props[s] for s in seqs] if hist else None,
                banned=banned if any(banned) else None,
            ).tokens.tolist()  # fmt: skip
            if j > 0:
                self.cost.observe(len(seqs), time.perf_counter() - t0)
            for s, t in zip(seqs, drawn, strict=True):
                props[s].append(t)
        for seq, k in work:  # computed: up to the last proposal's input
            self._computed[seq] = (seq.num_tokens + k - 1, seq.num_preemptions)
        return props

    def verified(self, seq: Sequence, accepted: int, proposed: int, committed_before: int) -> None:
        """After the verify step: the draft's KV is valid up to the last accepted proposal."""
        if self.shared or seq not in self._computed:
            return
        done, pre = self._computed[seq]
        self._computed[seq] = (min(done, committed_before + accepted), pre)

    def forget(self, seq: Sequence) -> None:
        self._computed.pop(seq, None)
