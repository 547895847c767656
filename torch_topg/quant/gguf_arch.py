"""The config of a GGUF file whose architecture transformers' GGUF reader does not read.

transformers converts a GGUF file's metadata into a config only for the architectures its
reader lists; for the others (``olmoe`` among them) ``AutoConfig.from_pretrained(...,
gguf_file=...)`` raises before reading a tensor. Their metadata names the same sizes as
every decoder's (``<arch>.block_count``, ``<arch>.embedding_length``, ...), so the config
is built here from a small table per architecture, :data:`FILE_ARCHITECTURES`:

* ``config_class``: the transformers config class (its causal LM is the model);
* ``keys``: metadata key (after ``<arch>.``) -> config field, for what the file states;
* ``defaults``: config fields the file does not state, with the value the architecture's
  published models use (a stated key overrides its default).

The rest comes from the file's tokenizer and tensor list, for every architecture:
``vocab_size`` is the number of ``tokenizer.ggml.tokens``; ``bos_token_id`` /
``eos_token_id`` / ``pad_token_id`` are the tokenizer's; ``tie_word_embeddings`` is whether
``output.weight`` is absent; ``attention_bias`` (where the class has the field) whether
``blk.0.attn_q.bias`` is present.

Adding an architecture is one entry: a dense one takes :data:`DECODER_KEYS`, a mixture of
experts adds :data:`MOE_KEYS` (and whatever its class names differently), and its tensor
names go to ``torch_topg.quant.gguf_direct`` (``ARCHITECTURES``), which builds the model.

:func:`read_metadata` reads a file's metadata and tensor names, :func:`read_file` its
tensors too (memory-mapped), without gguf-py's reader, which parses a 50k-token vocabulary
element by element: 4-8 s a pass on two cores, here 0.1-0.2 s.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Metadata of every decoder: key after ``<arch>.`` -> config field.
DECODER_KEYS: dict[str, str] = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}
#: Metadata of a mixture of experts (``expert_weights_norm``: the top-k weights are
#: renormalised to sum to one; llama.cpp's graph does so only when the file says so).
MOE_KEYS: dict[str, str] = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_weights_norm": "norm_topk_prob",
}


@dataclass(frozen=True)
class FileArchitecture:
    """How one GGUF architecture's metadata becomes a transformers config (see the module
    docstring)."""

    config_class: str
    keys: Mapping[str, str]
    defaults: Mapping[str, Any] = field(default_factory=dict)


#: GGUF ``general.architecture`` -> its config, for architectures transformers' GGUF
#: reader does not read.
FILE_ARCHITECTURES: dict[str, FileArchitecture] = {
    # OLMoE: QK-norm over the whole q / k projection width, 64 experts of which 8 are
    # used, top-k weights not renormalised (llama.cpp's converter writes no
    # expert_weights_norm for it and its graph does not renormalise; the published
    # config says norm_topk_prob false); clip_qkv is llama.cpp's attention.clamp_kqv.
    "olmoe": FileArchitecture(
        "OlmoeConfig",
        {**DECODER_KEYS, **MOE_KEYS, "attention.clamp_kqv": "clip_qkv"},
        {"norm_topk_prob": False, "clip_qkv": None, "hidden_act": "silu"},
    ),
}

# GGUF metadata value types: fixed-size scalars (numpy dtype), 8 a string, 9 an array.
_SCALAR = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
           10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class _Truncated(ValueError):
    pass


class _Cursor:
    """Reads GGUF values off the start of a file from a position that moves on; raises
    _Truncated where a value runs past the bytes read."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> int:
        """The current position, then moves ``n`` bytes on."""
        if self.pos + n > len(self.buf):
            raise _Truncated
        self.pos += n
        return self.pos - n

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        start = self.take(n)
        return self.buf[start : start + n].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALAR:
            dt = np.dtype(_SCALAR[kind])
            v = np.frombuffer(self.buf, dt, 1, self.take(dt.itemsize))[0]
            # a float32 as the shortest decimal that reads back to it (1e-05, not
            # 9.999999747378752e-06): the value the file's writer was given
            return float(str(v)) if kind == 6 else v.item()
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            sub, count = self.unpack("<IQ")
            if sub in _SCALAR:
                dt = np.dtype(_SCALAR[sub])
                return np.frombuffer(self.buf, dt, count, self.take(dt.itemsize * count)).copy()
            return [self.value(sub) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos}")

    def skip(self, kind: int) -> None:
        """Moves past a value as :meth:`value` reads it, building nothing."""
        if kind in _SCALAR:
            self.take(np.dtype(_SCALAR[kind]).itemsize)
        elif kind == _STRING:
            self.take(self.unpack("<Q")[0])
        elif kind == _ARRAY:
            sub, count = self.unpack("<IQ")
            if sub in _SCALAR:
                self.take(np.dtype(_SCALAR[sub]).itemsize * count)
            else:
                for _ in range(count):
                    self.skip(sub)
        else:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos}")


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: as the file names it (``blk.0.attn_q.weight``).
        tensor_type: its ``gguf.GGMLQuantizationType``.
        shape: its dimensions, outermost first (``[rows, k]``; GGUF lists them reversed).
        data: a read-only view of its bytes in the memory-mapped file, laid out as gguf-py's
            reader gives it: F32 / F16 elements of ``shape``, any other type ``uint8``
            ``[*shape[:-1], row_bytes]``.
    """

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray


def _header(c: _Cursor, path: str) -> tuple[int, int]:
    """(tensor count, metadata count) after checking the file's magic and version."""
    magic, version, n_tensors, n_kv = c.unpack("<4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(
            f"{path}: not a little-endian GGUF v2/v3 (magic {magic!r}, version {version})"
        )
    return n_tensors, n_kv


def _parse(buf: bytes, path: str, infos: list | None = None) -> tuple[dict[str, Any], list[str]]:
    """(metadata, tensor names); with ``infos``, also appends (name, dims innermost
    first, type, data offset) per tensor, then the offset where the data begins."""
    c = _Cursor(buf)
    n_tensors, n_kv = _header(c, path)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        (kind,) = c.unpack("<I")
        meta[key] = c.value(kind)
    names = []
    for _ in range(n_tensors):
        names.append(c.string())
        (dims,) = c.unpack("<I")
        if infos is None:
            c.take(8 * dims + 12)  # dimensions, type (u32), data offset (u64)
            continue
        shape = c.unpack(f"<{dims}Q")
        kind, offset = c.unpack("<IQ")
        infos.append((names[-1], shape, kind, offset))
    if infos is not None:
        align = int(meta.get("general.alignment", 32))
        infos.append(c.pos + (-c.pos) % align)
    return meta, names


def _from_head(path: str | os.PathLike[str], parse: Callable[[bytes], Any]) -> Any:
    """``parse`` of the file's first bytes: 4 MiB, then 4x more while it runs past them."""
    size = 4 << 20
    with open(path, "rb") as f:
        while True:
            f.seek(0)
            head = f.read(size)
            try:
                return parse(head)
            except _Truncated:
                if len(head) < size:
                    raise ValueError(
                        f"{os.fspath(path)}: the file ends inside its metadata"
                    ) from None
                size *= 4


def read_metadata(
    path: str | os.PathLike[str], infos: list | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(metadata, tensor names) of the GGUF file ``path`` (little-endian, version 2 or 3),
    read off the file's start. Values: Python scalars and strings; arrays of numbers as
    numpy arrays, of strings as lists. Raises ValueError if ``path`` is not such a file.
    (``infos``: see :func:`_parse`.)"""

    def parse(head: bytes) -> tuple[dict[str, Any], list[str]]:
        if infos is not None:
            infos.clear()
        return _parse(head, os.fspath(path), infos)

    return _from_head(path, parse)


def read_value(path: str | os.PathLike[str], key: str) -> Any:
    """The metadata value ``key`` of the GGUF file ``path`` (None if absent), the other
    entries skipped, not built (building the tokenizer's string arrays is most of
    :func:`read_metadata`'s time)."""

    def parse(head: bytes) -> Any:
        c = _Cursor(head)
        _, n_kv = _header(c, os.fspath(path))
        for _ in range(n_kv):
            name = c.string()
            (kind,) = c.unpack("<I")
            if name == key:
                return c.value(kind)
            c.skip(kind)
        return None

    return _from_head(path, parse)


def read_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[FileTensor]]:
    """(metadata, tensors) of the GGUF file ``path``: the metadata as :func:`read_metadata`
    gives it, the tensors' data memory-mapped (read-only views; nothing is read yet)."""
    import gguf

    infos: list = []
    meta, _ = read_metadata(path, infos)
    start = infos.pop()
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        shape = tuple(int(d) for d in reversed(dims))
        n = int(np.prod(shape, dtype=np.int64))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = mm[start + offset : start + offset + n * type_size // block]
        if qtype.name in ("F32", "F16"):
            data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] * type_size // block)
        tensors.append(FileTensor(name, qtype, shape, data))
    return meta, tensors


def file_architecture(metadata: Mapping[str, Any]) -> str | None:
    """The file's ``general.architecture`` if :data:`FILE_ARCHITECTURES` configures it."""
    arch = metadata.get("general.architecture")
    return arch if arch in FILE_ARCHITECTURES else None


def configured_here(config: Any) -> bool:
    """Whether ``config`` is of a class :data:`FILE_ARCHITECTURES` builds (a GGUF file with
    such a config was configured here: transformers does not read its tensors either)."""
    return type(config).__name__ in {a.config_class for a in FILE_ARCHITECTURES.values()}


def config_from_metadata(metadata: Mapping[str, Any], tensor_names: list[str]) -> Any:
    """The transformers config of a file whose architecture is in
    :data:`FILE_ARCHITECTURES` (``metadata`` and ``tensor_names`` as :func:`read_metadata`
    gives them). Raises ValueError for another architecture, a missing size, or a stated
    key the config class has no field for."""
    import transformers

    arch = metadata.get("general.architecture")
    spec = FILE_ARCHITECTURES.get(arch)  # type: ignore[arg-type]
    if spec is None:
        raise ValueError(
            f"GGUF architecture {arch!r} has no config table here "
            f"(known: {', '.join(sorted(FILE_ARCHITECTURES))})"
        )
    cls = getattr(transformers, spec.config_class)
    known = set(cls().to_dict()) | {"rope_theta"}
    kw: dict[str, Any] = dict(spec.defaults)
    for key, attr in spec.keys.items():
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            continue
        if attr not in known:
            raise ValueError(f"GGUF {arch}.{key} has no field in {spec.config_class}")
        kw[attr] = value
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in kw]  # fmt: skip
    if missing:
        raise ValueError(f"GGUF file of architecture {arch!r} states no {missing}")
    if "rope_theta" in kw:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(kw.pop("rope_theta"))}
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        kw["vocab_size"] = len(tokens)
    for which in ("bos", "eos", "pad"):
        token_id = metadata.get(f"tokenizer.ggml.{'padding' if which == 'pad' else which}_token_id")  # fmt: skip
        if token_id is not None:
            kw[f"{which}_token_id"] = int(token_id)
    names = set(tensor_names)
    kw["tie_word_embeddings"] = "output.weight" not in names
    if "attention_bias" in known:
        kw["attention_bias"] = "blk.0.attn_q.bias" in names
    config = cls(**kw)
    config.architectures = [spec.config_class.replace("Config", "ForCausalLM")]
    return config
