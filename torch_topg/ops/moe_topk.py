"""MoE routing: ``moe_topk`` (router logits -> top-k expert ids and weights)."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.ops._checks import Arg, check_op
from torch_topg.ops._library import eager_entry, register

_OP = "moe_topk"
_moe_topk = eager_entry(_OP)


def moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selects ``top_k`` experts per token.

    Scores are ``softmax(logits)`` (Mixtral, Qwen-MoE) or ``sigmoid(logits)``
    (DeepSeek-V3 style). Experts are ranked by ``score + correction_bias`` (bias
    optional); the returned weights are the unbiased scores of the chosen experts,
    divided by their sum when ``renormalize``. Ties go to the lower expert index.

    Args:
        router_logits: ``[T, E]`` float32 / bfloat16 / float16.
        top_k: ``1 <= top_k <= E``.
        scoring: ``"softmax"`` or ``"sigmoid"``.
        renormalize: make each token's ``top_k`` weights sum to 1.
        correction_bias: ``[E]`` added to the scores for selection only, or ``None``.

    Returns:
        ``(topk_weights [T, top_k] float32, topk_ids [T, top_k] int32)``, best first.
    """
    kwargs = dict(scoring=scoring, renormalize=renormalize, correction_bias=correction_bias)
    if torch.compiler.is_compiling():
        return torch.ops.topg.moe_topk.default(router_logits, top_k, **kwargs)
    return _moe_topk(router_logits, top_k, **kwargs)


def _check(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
) -> None:
    Arg(_OP, "router_logits", router_logits).dim(2).floating()
    experts = router_logits.shape[1]
    check_op(
        1 <= top_k <= experts,
        _OP,
        f"argument 'top_k' expected a value in [1, {experts}] (the number of experts), got {top_k}",
    )
    check_op(
        scoring in ("softmax", "sigmoid"),
        _OP,
        f"argument 'scoring' expected 'softmax' or 'sigmoid', got '{scoring}'",
    )
    if correction_bias is not None:
        Arg(_OP, "correction_bias", correction_bias).dim(1).floating().same_device(
            router_logits, "router_logits"
        ).size(0, experts, "the number of experts")


def _fake(router_logits: torch.Tensor, top_k: int, **kwargs: object):
    t = router_logits.shape[0]
    return (
        router_logits.new_empty((t, top_k), dtype=torch.float32),
        router_logits.new_empty((t, top_k), dtype=torch.int32),
    )


register(_OP, check=_check, fake=_fake, reference=reference.moe_topk, wrapper=moe_topk)
