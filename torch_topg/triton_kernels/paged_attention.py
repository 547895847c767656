"""Triton kernels for ``topg::paged_attention``: decode (split-KV flash-decoding) and
several new tokens per sequence (``cu_seqlens_q``: a prefill chunk, speculative tokens to
verify), over a paged KV cache in the query's dtype or int8 with per-token scales.

Semantics are those of ``torch_topg.reference.paged_attention`` (block tables, bottom-right
aligned causal rows, ``window_left``, ``softcap``, default scale ``1 / sqrt(D)``, zeros for
a row that sees no key, the query's dtype out). Math in fp32 (online softmax); the dot
products run on the query's dtype (fp32 dots in IEEE precision, never TF32), with ``P``
rounded to the query's dtype before ``P @ V`` for bf16 / fp16, as flash-attention does.

Public functions: :func:`paged_attention` (launches the kernels), :func:`supports` (can
this kernel take the call? a reason when not), :func:`decode_num_splits` (the decode
grid's split axis) and :data:`DEFAULT_CONFIG` (the tuning parameters ``config`` overrides).

Decode (``cu_seqlens_q`` None), two kernels:

* ``_decode_kernel``, grid ``(num_seqs, Hkv * group_chunks, num_splits)``: a program
  takes one sequence, one KV head and the query heads of its GQA group (up to 64 of them,
  a ``[BLOCK_G, D]`` query tile, so each K/V tile is read once for the whole group) and
  handles the row's partitions ``j, j + num_splits, ...``. A row's visible keys ``[lo, n)``
  are cut into partitions of ``split_keys`` keys (a multiple of it past ``max_splits``
  partitions), a function of the row's own length only, so a sequence's result is bitwise
  the same whatever else is in the batch and however many programs share its partitions
  (``num_splits`` only spreads them over more programs). Per partition, ``[BLOCK_N, D]``
  K/V tiles gathered through the block table, online softmax in fp32, then the partition's
  ``(max, sum, normalised acc)`` is written to scratch.
* ``_reduce_kernel``, grid ``(num_seqs, Hq)``: merges a row's partitions in order (weights
  ``sum_p * exp(max_p - max)``); a row with one partition takes its normalised output as
  it is, the value a table with a single partition slot writes directly (``DIRECT``: no
  scratch, no second kernel), so the bits do not depend on the table's width either.

Several new tokens per sequence (``cu_seqlens_q``), one kernel: ``_multi_query_kernel``,
grid ``(Tq // BLOCK_Q + num_seqs, Hkv * group_chunks)``: a program takes ``BLOCK_Q`` query
tokens of one sequence times the query heads of one KV head (``BLOCK_M = BLOCK_Q * group``
packed rows) and walks the keys its rows see; row ``i`` of a sequence of ``q_len`` new
tokens over ``n`` cached ones sees keys ``max(0, p - window_left) .. p``,
``p = n - q_len + i``. A program finds its sequence by a binary search over
``cu_seqlens_q`` (program ``b`` belongs to the last ``s`` with
``cu_seqlens_q[s] // BLOCK_Q + s <= b``; no host sync); programs past a sequence's rows do
no work. Its rounding differs from the decode kernel's: a ragged row equals the decode of
its token within tolerance, not bitwise (the native CUDA kernel gives both the same bits).

No kernel reads a length, offset or block id back to the host: block ids are clamped to
``[0, num_blocks)`` and lengths to the table, so a bad value cannot reach memory out of
range. The value checks (the reference's errors: block ids, lengths, offsets) run on the
host when ``check_indices`` asks, by default only for CPU tensors (the interpreter).

Importing this module imports ``triton`` (an ``ImportError`` saying so when it is
missing). ``TRITON_INTERPRET=1`` must be set before that import for the kernels to run
under Triton's interpreter on CPU tensors (how the tests run them); the interpreter
gives wrong bf16 ``tl.dot`` results, so :func:`supports` turns bf16 away there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, NoReturn

import torch

try:
    import triton  # noqa: F401  (a clear error below when it is missing)
except ImportError as e:  # pragma: no cover - exercised only without triton
    raise ImportError(
        "torch_topg.triton_kernels.paged_attention needs triton (the test extra pins "
        f"triton 3.8.0): {e}"
    ) from e

OP = "paged_attention"
MAX_HEAD_DIM = 256
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Tuning parameters (``config`` overrides any of them). Block sizes are powers of two
#: >= 16 (``tl.dot``'s minimum on a GPU).
#:
#: * ``decode_block_n``: keys per K/V tile in the decode kernel;
#: * ``decode_max_rows``: query heads of one KV head per decode program (GQA groups larger
#:   than this take several programs, each reading the K/V again);
#: * ``split_keys``, ``max_splits``: decode partitions of ``split_keys`` keys, at most
#:   ``max_splits`` of them per row (longer rows get partitions of a multiple of
#:   ``split_keys``); they size the scratch (``num_seqs * Hq * min(ceil(capacity /
#:   split_keys), max_splits) * (D + 2)`` floats, in launches of at most
#:   ``scratch_bytes``);
#: * ``num_splits``: programs along the decode grid's split axis; None:
#:   :func:`decode_num_splits`;
#: * ``target_programs``: None: 4 x the device's SM count (132 off CUDA); the programs
#:   :func:`decode_num_splits` aims at;
#: * ``multi_block_m``, ``multi_block_n``: packed query rows (tokens x heads) and keys per
#:   tile of the multi-query kernel;
#: * ``num_warps``, ``num_stages``: launch options of the decode / multi-query kernels.
#:
#: ``decode_block_n``, ``split_keys``, ``max_splits`` and ``multi_block_n`` set the order of
#: the sums, hence the rounding: a tuning table that changes them with the batch size
#: gives up batch invariance. ``num_splits``, ``target_programs`` and the launch options
#: never change which keys a partition holds.
DEFAULT_CONFIG: dict[str, Any] = {
    "decode_block_n": 64,
    "decode_max_rows": 64,
    "split_keys": 256,
    "max_splits": 16,
    "num_splits": None,
    "target_programs": None,
    "multi_block_m": 64,
    "multi_block_n": 64,
    "num_warps": 4,
    "num_stages": 2,
    "scratch_bytes": 64 << 20,
}

_POW2_KEYS = ("decode_block_n", "decode_max_rows", "multi_block_m", "multi_block_n")


from torch_topg.triton_kernels.paged_attention_kernels import (  # noqa: E402
    _decode_kernel,
    _multi_query_kernel,
    _reduce_kernel,
)


def _interpreted() -> bool:
    """Were the kernels built for Triton's interpreter (TRITON_INTERPRET=1 at import)?"""
    return type(_decode_kernel).__name__ == "InterpretedFunction"


INTERPRETED = _interpreted()


# --- host side -----------------------------------------------------------------------


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _describe(t: torch.Tensor) -> str:
    shape = ", ".join(map(str, t.shape))
    return f"(shape [{shape}], dtype {_dtype_name(t.dtype)}, device {t.device})"


class _Arg:
    """One tensor argument's checks, worded as ``torch_topg.ops._checks.Arg``:
    ``topg::<op>: argument '<name>' (shape .., dtype .., device ..) expected <what>``."""

    def __init__(self, name: str, t: object) -> None:
        if not isinstance(t, torch.Tensor):
            _fail(f"argument '{name}' expected a Tensor, got {type(t).__name__}")
        self.name, self.t = name, t

    def fail(self, what: str) -> NoReturn:
        _fail(f"argument '{self.name}' {_describe(self.t)} expected {what}")

    def dim(self, n: int) -> _Arg:
        if self.t.dim() != n:
            self.fail(f"{n} dimensions")
        return self

    def size(self, d: int, expected: int, what: str) -> _Arg:
        if self.t.shape[d] != expected:
            self.fail(f"size {expected} at dim {d} ({what})")
        return self

    def dtype(self, dtypes: tuple[torch.dtype, ...]) -> _Arg:
        if self.t.dtype not in dtypes:
            self.fail("dtype " + " or ".join(_dtype_name(d) for d in dtypes))
        return self

    def same_dtype(self, other: torch.Tensor, other_name: str) -> _Arg:
        if self.t.dtype != other.dtype:
            self.fail(f"dtype {_dtype_name(other.dtype)} (the dtype of '{other_name}')")
        return self

    def same_device(self, other: torch.Tensor, other_name: str) -> _Arg:
        if self.t.device != other.device:
            self.fail(f"device {other.device} (the device of '{other_name}')")
        return self

    def contiguous(self) -> _Arg:
        if not self.t.is_contiguous():
            self.fail("a contiguous tensor")
        return self

    def last_dim_contiguous(self) -> _Arg:
        if self.t.dim() > 0 and self.t.shape[-1] != 1 and self.t.stride(-1) != 1:
            self.fail("stride 1 in the last dimension")
        return self


def _fail(message: str) -> NoReturn:
    raise RuntimeError(f"topg::{OP}: {message}")


def _check_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    window_left: int,
    softcap: float,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
) -> None:
    """The op's argument checks (``torch_topg.ops.attention._check_paged_attention``),
    in its wording: shapes, dtypes, devices, layouts."""
    _Arg("query", query).dim(3).dtype(_FLOAT_DTYPES).last_dim_contiguous()
    kc = _Arg("key_cache", key_cache).dim(4)
    if key_cache.dtype not in (query.dtype, torch.int8):
        kc.fail(
            f"dtype {_dtype_name(query.dtype)} (the dtype of 'query') or int8 (with "
            "'key_scale' and 'value_scale')"
        )
    kc.same_device(query, "query").size(3, query.shape[-1], "head_dim of 'query'").contiguous()
    vc = _Arg("value_cache", value_cache).dim(4).same_dtype(key_cache, "key_cache")
    vc.same_device(query, "query")
    for d in range(3):
        vc.size(d, key_cache.shape[d], "the shape of 'key_cache'")
    vc.size(3, query.shape[-1], "head_dim of 'query'").contiguous()
    hq, hkv = query.shape[1], key_cache.shape[2]
    if hkv == 0 or hq % hkv:
        _fail(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if key_cache.shape[1] == 0:
        kc.fail("a block size (size at dim 1) of at least one token")
    bt = _Arg("block_tables", block_tables).dim(2).dtype((torch.int32,))
    bt.same_device(query, "query")
    sl = _Arg("seq_lens", seq_lens).dim(1).dtype((torch.int32,)).same_device(query, "query")
    if cu_seqlens_q is None:  # one query token per sequence
        bt.size(0, query.shape[0], "num_seqs of 'query'")
        sl.size(0, query.shape[0], "num_seqs of 'query'")
    else:
        ns = seq_lens.shape[0]
        bt.size(0, ns, "num_seqs of 'seq_lens'")
        cu = _Arg("cu_seqlens_q", cu_seqlens_q).dim(1).dtype((torch.int32,))
        cu.same_device(query, "query").size(0, ns + 1, "num_seqs + 1, from 'seq_lens'")
    if window_left < -1:
        _fail(f"window_left must be >= -1, got {window_left}")
    if not softcap >= 0:
        _fail(f"softcap must be >= 0, got {softcap:g}")
    quant = key_cache.dtype == torch.int8
    for name, sc in (("key_scale", key_scale), ("value_scale", value_scale)):
        if sc is None:
            if quant:
                _fail(
                    f"argument '{name}' expected a float32 tensor [num_blocks, block_size, "
                    "kv_heads] with int8 caches, got None"
                )
            continue
        a = _Arg(name, sc)
        if not quant:
            a.fail(f"None with {_dtype_name(key_cache.dtype)} caches (scales go with int8)")
        a.dim(3).dtype((torch.float32,)).same_device(key_cache, "key_cache").contiguous()
        for d in range(3):
            a.size(d, key_cache.shape[d], "the shape of 'key_cache'")


def _check_indices(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    num_blocks: int,
    block_size: int,
    rows: int,
) -> None:
    """The reference's value checks (lengths, offsets, used block ids), same messages; on
    host copies (a device sync for CUDA tensors)."""
    lens = seq_lens.tolist()
    max_blocks = block_tables.shape[1]
    cap = max_blocks * block_size
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.tolist()
        ok = cu[0] == 0 and cu[-1] == rows and all(a <= b for a, b in itertools.pairwise(cu))
        if not ok:
            _fail(
                f"argument 'cu_seqlens_q' expected non-decreasing offsets from 0 to {rows} "
                f"(the query rows), got {cu}"
            )
    used_blocks = (seq_lens.cpu().clamp(0, cap) + block_size - 1) // block_size
    used = torch.arange(max_blocks)[None, :] < used_blocks[:, None]
    table = block_tables.cpu()
    bad_block = (used & ((table < 0) | (table >= num_blocks))).any(1).tolist()
    for s, n in enumerate(lens):
        if n < 0 or n > cap:
            _fail(
                f"argument 'seq_lens' expected values in [0, {cap}] (max_blocks_per_seq * "
                f"block_size), got {n}"
            )
        if cu_seqlens_q is not None and cu[s + 1] - cu[s] > n:
            _fail(
                f"argument 'cu_seqlens_q' expected at most seq_lens[{s}] = {n} query tokens "
                f"for sequence {s} (its last tokens), got {cu[s + 1] - cu[s]}"
            )
        if bad_block[s]:
            blocks = table[s, : -(-n // block_size)].tolist()
            _fail(
                f"argument 'block_tables' expected block ids in [0, {num_blocks}), got "
                f"{blocks} for sequence {s}"
            )


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    cfg = dict(DEFAULT_CONFIG)
    for key, value in (config or {}).items():
        if key not in DEFAULT_CONFIG:
            _fail(f"config key '{key}' unknown (known: {', '.join(DEFAULT_CONFIG)})")
        cfg[key] = value
    for key in _POW2_KEYS:
        v = cfg[key]
        if not (isinstance(v, int) and v >= 16 and v & (v - 1) == 0):
            _fail(f"config '{key}' expected a power of two >= 16, got {v!r}")
    for key in ("split_keys", "max_splits", "num_warps", "num_stages", "scratch_bytes"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 1):
            _fail(f"config '{key}' expected an integer >= 1, got {cfg[key]!r}")
    for key in ("num_splits", "target_programs"):
        v = cfg[key]
        if v is not None and not (isinstance(v, int) and v >= 1):
            _fail(f"config '{key}' expected None or an integer >= 1, got {v!r}")
    return cfg


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4 * 132  # an H100's SM count: off CUDA (the interpreter) any value will do


def decode_num_splits(
    capacity: int,
    num_seqs: int,
    programs_per_split: int,
    *,
    split_keys: int = DEFAULT_CONFIG["split_keys"],
    max_splits: int = DEFAULT_CONFIG["max_splits"],
    target_programs: int = 4 * 132,
) -> int:
    """Programs along the decode grid's split axis, from the context length and the batch.

    ``capacity``: the longest context a row can have (``max_blocks_per_seq * block_size``,
    known on the host: no sync); ``programs_per_split``: ``num_seqs * Hkv * group_chunks``,
    the programs one split index adds. A row has at most ``slots = min(ceil(capacity /
    split_keys), max_splits)`` partitions; the grid gets as many split programs as bring
    the launch to ``target_programs`` (a few per SM), and never more than ``slots``. A
    program takes partitions ``j, j + num_splits, ...`` of its row, so a big batch (enough
    programs already) takes 1 and a single long sequence up to ``slots``. The count changes
    only which program computes a partition, never the partition: results do not depend
    on it.
    """
    slots = min(-(-capacity // split_keys), max_splits)
    want = -(-target_programs // max(num_seqs * programs_per_split, 1))
    return max(1, min(slots, want))


def supports(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> str | None:
    """None when :func:`paged_attention` can take this call, else a short reason.

    Reasons are the kernels' limits (device, dtype, head_dim), not argument errors: a call
    with bad arguments it could otherwise take gets None, and :func:`paged_attention`
    raises the op's error for it.
    """
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor):
            return f"'{name}' is not a Tensor"
    if sinks is not None:
        return "attention sinks (the Triton kernels have no sink term)"
    dev = query.device
    if dev.type == "cpu":
        if not INTERPRETED:
            return "device cpu without TRITON_INTERPRET=1 (set before triton is imported)"
    elif dev.type != "cuda":
        return f"device {dev.type}"
    dtype = query.dtype
    if dtype not in _FLOAT_DTYPES:
        return f"dtype {_dtype_name(dtype)}"
    if dtype == torch.bfloat16:
        if INTERPRETED:
            return "bfloat16 under the Triton interpreter (its bf16 tl.dot is wrong)"
        if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 0):
            return "bfloat16 needs sm_80+"
    if key_cache.dtype not in (dtype, torch.int8):
        return f"key_cache dtype {_dtype_name(key_cache.dtype)}"
    if query.dim() == 3:
        d = query.shape[-1]
        if d > MAX_HEAD_DIM:
            return f"head_dim {d} > {MAX_HEAD_DIM}"
        if d == 0:
            return "head_dim 0"
    return None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    config: Mapping[str, Any] | None = None,
    check_indices: bool | None = None,
) -> torch.Tensor:
    """``topg::paged_attention`` on Triton kernels: the op's arguments and result
    (``torch_topg.ops.paged_attention``), plus:

    Args:
        config: tuning parameters, overriding :data:`DEFAULT_CONFIG` (block sizes,
            partitions, split programs, warps).
        check_indices: check the values of ``seq_lens``, ``block_tables`` and
            ``cu_seqlens_q`` on the host (the reference's errors). None: for CPU tensors
            only (a CUDA call then never syncs; a bad value is clamped, never read out
            of range, and gives wrong values instead of an error).

    Raises:
        RuntimeError: bad arguments (the op's wording), or a call :func:`supports`
            turns away.
    """
    _check_args(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, window_left,
        softcap, key_scale, value_scale,
    )  # fmt: skip
    reason = supports(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q=cu_seqlens_q,
        scale=scale, window_left=window_left, softcap=softcap, key_scale=key_scale,
        value_scale=value_scale, sinks=sinks,
    )  # fmt: skip
    if reason is not None:
        _fail(f"the Triton kernel cannot take this call: {reason}")
    cfg = _config(config)
    num_blocks, block_size, hkv, d = key_cache.shape
    rows, hq = query.shape[0], query.shape[1]
    if check_indices is None:
        check_indices = query.device.type == "cpu"
    if check_indices:
        _check_indices(block_tables, seq_lens, cu_seqlens_q, num_blocks, block_size, rows)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    quant = key_cache.dtype == torch.int8
    ks = key_scale if quant else key_cache  # unused pointers without int8 caches
    vs = value_scale if quant else value_cache
    common = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        capacity=block_tables.shape[1] * block_size,
        window=int(window_left),
        scale=scale,
        softcap=float(softcap),
        BLOCK_D=max(16, _next_pow2(d)),
        QUANT=quant,
        SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee",  # fp32: no TF32 (bf16 / fp16 ignore it)
    )
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    group = hq // hkv
    if cu_seqlens_q is None:
        _decode(query, key_cache, value_cache, ks, vs, block_tables, seq_lens, out, group,
                cfg, common, launch)  # fmt: skip
    else:
        _multi_query(query, key_cache, value_cache, ks, vs, block_tables, seq_lens,
                     cu_seqlens_q, out, group, cfg, common, launch)  # fmt: skip
    return out


def _decode(query, key_cache, value_cache, ks, vs, block_tables, seq_lens, out, group, cfg,
            common, launch) -> None:  # fmt: skip
    num_seqs, hq, d = query.shape
    hkv = key_cache.shape[2]
    block_m = max(16, min(_next_pow2(group), cfg["decode_max_rows"]))
    chunks = -(-group // block_m)
    split_keys, max_splits = cfg["split_keys"], cfg["max_splits"]
    slots = min(-(-common["capacity"] // split_keys), max_splits)
    direct = slots == 1
    if cfg["num_splits"] is not None:
        num_progs = min(cfg["num_splits"], slots)
    else:
        target = cfg["target_programs"] or _target_programs(query.device)
        num_progs = decode_num_splits(
            common["capacity"], num_seqs, hkv * chunks, split_keys=split_keys,
            max_splits=max_splits, target_programs=target,
        )  # fmt: skip
    if direct:
        per_launch = num_seqs
        pm = pl = po = out  # unused
    else:  # scratch: (max, sum) and the normalised output of every partition slot
        row_bytes = hq * slots * (d + 2) * 4
        per_launch = max(1, min(num_seqs, cfg["scratch_bytes"] // row_bytes))
        pm = torch.empty(per_launch * hq * slots, dtype=torch.float32, device=query.device)
        pl = torch.empty_like(pm)
        po = torch.empty(per_launch * hq * slots * d, dtype=torch.float32, device=query.device)
    for seq0 in range(0, num_seqs, per_launch):
        n_seqs = min(per_launch, num_seqs - seq0)
        _decode_kernel[(n_seqs, hkv * chunks, 1 if direct else num_progs)](
            query, key_cache, value_cache, ks, vs, block_tables, seq_lens, out, pm, pl, po,
            seq0, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0), hq, hkv, group, chunks, d,
            common["num_blocks"], common["block_size"], common["capacity"], common["window"],
            common["scale"], common["softcap"], split_keys, max_splits, slots, num_progs,
            BLOCK_M=block_m, BLOCK_N=cfg["decode_block_n"], BLOCK_D=common["BLOCK_D"],
            QUANT=common["QUANT"], SOFTCAP=common["SOFTCAP"], DIRECT=direct,
            DOT_PRECISION=common["DOT_PRECISION"], **launch,
        )  # fmt: skip
        if not direct:
            _reduce_kernel[(n_seqs, hq)](
                out, pm, pl, po, seq_lens, seq0, out.stride(0), out.stride(1), hq, d,
                common["capacity"], common["window"], split_keys, max_splits, slots,
                BLOCK_S=max(2, _next_pow2(max_splits)), BLOCK_D=common["BLOCK_D"],
            )  # fmt: skip


def _multi_query(query, key_cache, value_cache, ks, vs, block_tables, seq_lens, cu_seqlens_q,
                 out, group, cfg, common, launch) -> None:  # fmt: skip
    total_q, _, d = query.shape
    hkv = key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    block_m = cfg["multi_block_m"]
    chunk_heads = min(group, block_m)  # query heads of one KV head per program
    chunks = -(-group // chunk_heads)
    block_q = block_m // chunk_heads  # query tokens per program
    grid = (total_q // block_q + num_seqs, hkv * chunks)
    _multi_query_kernel[grid](
        query, key_cache, value_cache, ks, vs, block_tables, seq_lens, cu_seqlens_q, out,
        num_seqs, total_q, max(1, num_seqs.bit_length()), query.stride(0), query.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), hkv, group, chunks,
        chunk_heads, block_q, d, common["num_blocks"], common["block_size"],
        common["capacity"], common["window"], common["scale"], common["softcap"],
        BLOCK_M=block_m, BLOCK_N=cfg["multi_block_n"], BLOCK_D=common["BLOCK_D"],
        QUANT=common["QUANT"], SOFTCAP=common["SOFTCAP"],
        DOT_PRECISION=common["DOT_PRECISION"], **launch,
    )  # fmt: skip
