"""The engine's resolved configuration: what the options (``EngineArgs``) imply for one
model on one device, computed once in :func:`resolve`.

``EngineArgs`` holds the options as given; :class:`EngineConfig` adds what follows from
them and the model: the device and dtype chosen, the context length and step budget, the
KV pool's size in blocks and the lower tiers' sizes.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from torch_topg.engine.errors import ParameterError
from torch_topg.engine.model_runner import ModelRunner
from torch_topg.engine.options import EngineArgs


@dataclass
class EngineConfig:
    args: EngineArgs  # the options as given (checked)
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    num_blocks: int  # the device KV pool
    host_kv_blocks: int = 0
    disk_kv_path: str | None = None  # the disk tier's folder (checked writable)
    disk_kv_blocks: int = 0
    disk_kv_bytes: int = 0  # the disk tier's size (a shared folder's cap)
    speculative: Any = None  # a resolved SpeculativeConfig (draft model loaded); None: off


def device_of(args: EngineArgs) -> torch.device:
    """``device``: as given, else CUDA when available, else the CPU."""
    if args.device is not None:
        return args.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dtype_of(args: EngineArgs, device: torch.device, model: Any = None) -> torch.dtype:
    """``dtype``: as given, else bfloat16 off the CPU; on the CPU float32, but bfloat16 for
    a BF16 GGUF file ``model`` served packed (``quantization="gguf"``): its weights'
    own dtype, as llama.cpp computes it (float32 would widen every weight at load and
    run the steps on fp32 weights: a 16-row step at 1B took 650 ms against 375 on a Zen 3,
    docs/real-size-cpus.md)."""
    if args.dtype is not None:
        return args.dtype
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if model is not None and _packed_bf16_file(args, model) else torch.float32


def _packed_bf16_file(args: EngineArgs, model: Any) -> bool:
    """Whether ``model`` is a GGUF file whose weights are BF16 (``general.file_type``
    MOSTLY_BF16), loaded with ``quantization="gguf"``."""
    from torch_topg.quant.loading import resolve_quantization

    if resolve_quantization(args.quantization)[0] != "gguf" or not str(model).endswith(".gguf"):
        return False
    from torch_topg.quant.gguf_arch import read_value

    try:
        file_type = read_value(model, "general.file_type")
    except (OSError, ValueError):  # the loader reports a missing or broken file
        return False
    return file_type == 32  # gguf.LlamaFileType.MOSTLY_BF16


def resolve(
    args: EngineArgs,
    model_config: Any,
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    kv_heads: int | None = None,
    speculative: Any = None,
    num_layers: int | None = None,
    reserved: int = 0,
) -> EngineConfig:
    """Everything the options imply for a model of ``model_config``.

    ``device`` / ``dtype``: where the model already is (default: :func:`device_of`,
    :func:`dtype_of`); ``kv_heads``: KV heads the pool holds per layer (tensor parallel:
    the ranks' sum on the CPU); ``num_layers``: layers whose KV the pool holds (a pipeline
    stage's; default all); ``speculative``: the resolved speculative config (a draft
    model's KV is counted in each block); ``reserved``: bytes the model will still take
    from the available memory (its file-mapped weights, copied into huge pages during the
    warm-up), left out of a budget given as a share of it.
    """
    device = device or device_of(args)
    dtype = dtype or dtype_of(args, device)
    text = model_config.get_text_config()
    max_model_len = args.max_model_len or getattr(text, "max_position_embeddings", None) or 2048
    # CPU: a 512-token chunk is ~2 s of a 135M model on 2 cores, the longest pause a
    # prefill should put between two decode steps of the others; CUDA: vLLM's 2048.
    budget_tokens = args.max_num_batched_tokens or (512 if device.type == "cpu" else 2048)
    per_block = ModelRunner.bytes_per_block(
        model_config, args.block_size, dtype, kv_heads, args.kv_cache_dtype, num_layers
    )
    if speculative is not None and speculative.method == "draft":  # its own KV per block
        per_block += ModelRunner.bytes_per_block(speculative.model.config, args.block_size, dtype)
    wanted = per_block * args.max_batch_size * -(-max_model_len // args.block_size)
    budget = kv_budget(args.kv_cache_memory, device, wanted, reserved)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ParameterError(
            "kv_cache_memory",
            f"{budget} bytes hold no KV block ({per_block} bytes per block of "
            f"{args.block_size} tokens)",
        )
    cfg = EngineConfig(args, device, dtype, max_model_len, budget_tokens, num_blocks,
                       speculative=speculative)  # fmt: skip
    if args.host_kv_memory is not None:
        host = kv_budget(args.host_kv_memory, torch.device("cpu"), 0)
        cfg.host_kv_blocks = _blocks("host_kv_memory", host, per_block)
    if args.disk_kv_path is not None:
        from torch_topg.engine.kv_tiers import check_disk_folder

        folder = check_disk_folder(args.disk_kv_path)
        free = shutil.disk_usage(folder).free
        spec = args.disk_kv_memory
        if spec is None:
            disk = int(0.1 * free)
        elif isinstance(spec, str):  # a percentage (checked by EngineArgs)
            disk = _percent_of(spec, free)
        else:
            disk = spec
            if disk > free:
                raise ParameterError(
                    "disk_kv_memory", f"{disk} bytes, but {folder!r} has {free} bytes free"
                )
        cfg.disk_kv_path = folder
        cfg.disk_kv_bytes = disk
        cfg.disk_kv_blocks = _blocks("disk_kv_memory", disk, per_block)
    return cfg


def _blocks(name: str, budget: int, per_block: int) -> int:
    n = budget // per_block
    if n < 1:
        raise ParameterError(name, f"{budget} bytes hold no KV block ({per_block} bytes per block)")
    return n


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool: MemAvailable on the CPU, free device memory on CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_budget(spec: int | str | None, device: torch.device, wanted: int, reserved: int = 0) -> int:
    """Bytes for a KV pool. ``spec`` (checked by ``EngineArgs``): bytes, ``"40%"`` of the
    available memory (less ``reserved`` bytes still to be taken), or None: ``wanted``
    (every sequence slot at full length) capped at 40% of it."""
    if spec is None:
        return min(wanted, int(0.4 * max(0, available_memory(device) - reserved)))
    if isinstance(spec, str):
        return _percent_of(spec, max(0, available_memory(device) - reserved))
    return spec


def _percent_of(spec: str, total: int) -> int:
    """``"40%"`` (checked by ``EngineArgs``) of ``total`` bytes."""
    return int(float(spec.strip()[:-1]) / 100 * total)
