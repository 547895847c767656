"""``speculative=`` of ``Engine.from_pretrained``: parsed and checked once.

Key names follow vLLM's ``speculative_config``::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4}
    {"method": "draft", "model": <anything from_pretrained loads>, "num_speculative_tokens": 4}
    {"method": "self", "num_layers": 8, "num_speculative_tokens": 4}

``num_speculative_tokens`` is the most proposals per sequence and step (k); the adaptive
rule picks each sequence's k in ``[0, num_speculative_tokens]`` unless ``adaptive`` is
False (then every decoding sequence gets the full k whenever a proposal exists).
``disable_by_batch_size``: no speculation in a step with at least that many sequences
(vLLM's key; the adaptive rule usually stops earlier on its own).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft", "self")
DEFAULT_K = 4
MAX_K = 16

_KEYS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "draft": {"model"},
    "self": {"num_layers"},
}
_COMMON = {"method", "num_speculative_tokens", "adaptive", "disable_by_batch_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked ``speculative=`` dict (see the module docstring)."""

    method: str
    num_speculative_tokens: int = DEFAULT_K
    # 1, as transformers' prompt lookup and llama.cpp's lookup decoding: one-token matches
    # lifted the batch-1 input-grounded tasks by 9-13% (docs/speculative.md, "Prompt lookup from one
    # token"); the adaptive rule prices them apart (acceptance per match length)
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: Any = None  # "draft": a path, Hub id or nn.Module
    num_layers: int | None = None  # "self": the target's first n layers
    adaptive: bool = True
    disable_by_batch_size: int | None = None

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


def _int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"speculative: {name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"speculative: {name} must be {rng}, got {value!r}")
    return int(value)


def parse_speculative(spec: Any) -> SpeculativeConfig | None:
    """``speculative=`` as given to ``from_pretrained`` -> a config (None: off).

    Raises ``ValueError`` naming the key for an unknown method or key, a missing
    required key, or a value out of range.
    """
    if spec is None or spec is False:
        return None
    if isinstance(spec, SpeculativeConfig):
        return spec
    if not isinstance(spec, dict):
        raise ValueError(
            f"speculative: expected a dict like {{'method': 'ngram', "
            f"'num_speculative_tokens': 4}} or None, got {type(spec).__name__}"
        )
    method = spec.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative: unknown method {method!r}; expected one of {list(METHODS)}")
    allowed = _COMMON | _KEYS[method]
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValueError(
            f"speculative: key(s) {unknown} do not apply to method {method!r}; "
            f"accepted: {sorted(allowed)}"
        )
    k = _int("num_speculative_tokens", spec.get("num_speculative_tokens", DEFAULT_K), 1, MAX_K)
    adaptive = spec.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative: adaptive must be a bool, got {adaptive!r}")
    disable = spec.get("disable_by_batch_size")
    if disable is not None:
        disable = _int("disable_by_batch_size", disable, 1)
    kw: dict[str, Any] = {}
    if method == "ngram":
        lo = _int("prompt_lookup_min", spec.get("prompt_lookup_min", 1), 1)
        hi = _int("prompt_lookup_max", spec.get("prompt_lookup_max", max(lo, 4)), 1)
        if hi < lo:
            raise ValueError(
                f"speculative: prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})"
            )
        kw.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
    elif method == "draft":
        if spec.get("model") is None:
            raise ValueError("speculative: method 'draft' needs 'model' (a path or Hub id)")
        kw["model"] = spec["model"]
    else:
        if "num_layers" not in spec:
            raise ValueError("speculative: method 'self' needs 'num_layers' (the draft's depth)")
        kw["num_layers"] = _int("num_layers", spec["num_layers"], 1)
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        adaptive=adaptive,
        disable_by_batch_size=disable,
        **kw,
    )


def check_num_layers(cfg: SpeculativeConfig, target_layers: int) -> None:
    """``self``: the draft must be shallower than the target."""
    if cfg.method == "self" and not 1 <= (cfg.num_layers or 0) < target_layers:
        raise ValueError(
            f"speculative: num_layers must be in [1, {target_layers - 1}] for a target of "
            f"{target_layers} layers, got {cfg.num_layers}"
        )


def resolve_speculative(
    spec: Any, model: Any, tokenizer: Any, device: Any, dtype: Any
) -> SpeculativeConfig | None:
    """``speculative=`` of ``from_pretrained`` checked against the target: ``self``'s depth,
    and for ``draft`` the model loaded (a path or Hub id through the engine's loader, or
    an ``nn.Module``) on ``device`` / ``dtype`` with the target's tokenizer checked."""
    import dataclasses

    import torch

    cfg = parse_speculative(spec)
    if cfg is None:
        return None
    check_num_layers(cfg, model.config.get_text_config().num_hidden_layers)
    if cfg.method != "draft":
        return cfg
    from torch_topg.engine.loading import check_supported, load
    from torch_topg.engine.speculative.draft import check_same_vocabulary

    if isinstance(cfg.model, torch.nn.Module):
        draft, draft_tok = cfg.model, None
        check_supported(draft.config, draft)
        draft = draft.to(device=device, dtype=dtype).eval()
    else:
        draft, draft_tok, _ = load(cfg.model, dtype, device)
    check_same_vocabulary(model, tokenizer, draft, draft_tok)
    return dataclasses.replace(cfg, model=draft)
