"""The tuning table (measured times per op and shape class on one GPU model) and the fixed
order used without one.

A table is a JSON file::

    {
      "format": "torch_topg.tuning", "version": 1,
      "gpu": {"name": "NVIDIA H200", "capability": [9, 0]},
      "date": "2027-01-05T10:00:00Z", "commit": "f87479f",
      "torch": "2.11.0+cu130", "triton": "3.8.0", "cuda": "13.0",
      "entries": [
        {"op": "attention", "class": "bf16 d128 g4 s4096",
         "times_us": {"sdpa_flash": 540.1, "topg": 3068.0},
         "configs": {"triton": {"BLOCK_M": 32}},     # optional: tuned Triton settings
         "pick": "sdpa_flash",
         "case": "llama-3-8b prefill S=4096",        # optional: what was measured
         "excluded": {"triton": "max error 0.5"}}    # optional: candidates left out, why
      ]
    }

Where it is looked for (the first file that exists is *the* table; a refused one is not
replaced by the next):

1. ``$TOPG_TUNING_TABLE`` (a path), when set;
2. the user's cache, ``$XDG_CACHE_HOME/torch_topg/tuning/<gpu slug>.json``
   (``~/.cache/...``), which ``python -m torch_topg tune`` writes;
3. the package's ``torch_topg/ops/tables/<gpu slug>.json`` (shipped for the GPUs measured).

A file that is not valid JSON, lacks a field, has another format version or was measured
on another GPU (name or compute capability) is refused: one warning naming the file and
the reason, and the fixed order runs.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

FORMAT = "torch_topg.tuning"
VERSION = 1
TABLES_DIR = pathlib.Path(__file__).resolve().parents[1] / "tables"


class TableError(ValueError):
    """A table that cannot be used; the message says why."""


def slug(gpu_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (the table's file name)."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") or "unknown-gpu"


def user_cache_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/torch_topg/tuning`` (default ``~/.cache/torch_topg/tuning``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "torch_topg" / "tuning"


def table_paths(gpu_name: str) -> list[tuple[str, pathlib.Path]]:
    """``(source, path)`` in the order they are looked for (see the module docstring)."""
    out = []
    env = os.environ.get("TOPG_TUNING_TABLE")
    if env:
        out.append(("TOPG_TUNING_TABLE", pathlib.Path(env)))
    name = f"{slug(gpu_name)}.json"
    out.append(("user cache", user_cache_dir() / name))
    out.append(("package", TABLES_DIR / name))
    return out


@dataclass(frozen=True)
class Entry:
    """The measurements of one (op, shape class)."""

    op: str
    cls: str
    times_us: dict[str, float]
    pick: str
    configs: dict[str, dict] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    case: str = ""

    def ranked(self) -> list[str]:
        """The measured candidates, fastest first."""
        return sorted(self.times_us, key=lambda n: (self.times_us[n], n))


@dataclass(frozen=True)
class Table:
    """A loaded, validated table."""

    path: str
    gpu_name: str
    capability: tuple[int, int]
    header: dict[str, Any]
    entries: dict[tuple[str, str], Entry]

    def entry(self, op: str, cls: str) -> Entry | None:
        return self.entries.get((op, cls))


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise TableError(what)


def _entry(i: int, e: Any, ops: tuple[str, ...]) -> Entry:
    where = f"entry {i}"
    _need(isinstance(e, dict), f"{where} is not an object")
    for key in ("op", "class", "times_us", "pick"):
        _need(key in e, f"{where} has no '{key}'")
    _need(e["op"] in ops, f"{where}: op {e['op']!r} is not one of {list(ops)}")
    _need(isinstance(e["class"], str) and e["class"], f"{where}: 'class' is not a string")
    times = e["times_us"]
    _need(isinstance(times, dict) and times, f"{where}: 'times_us' is not a non-empty object")
    for name, t in times.items():
        ok = isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
        _need(ok, f"{where}: time of {name!r} is not a positive number: {t!r}")
    _need(e["pick"] in times, f"{where}: pick {e['pick']!r} has no time")
    configs = e.get("configs", {})
    _need(isinstance(configs, dict), f"{where}: 'configs' is not an object")
    _need(all(isinstance(c, dict) for c in configs.values()), f"{where}: a config is not an object")
    excluded = e.get("excluded", {})
    _need(isinstance(excluded, dict), f"{where}: 'excluded' is not an object")
    return Entry(
        e["op"], e["class"], {k: float(v) for k, v in times.items()}, e["pick"],
        dict(configs), {k: str(v) for k, v in excluded.items()}, str(e.get("case", "")),
    )  # fmt: skip


def parse_table(
    data: Any, path: str, gpu_name: str, capability: tuple[int, int], ops: tuple[str, ...]
) -> Table:
    """Validate ``data`` (a parsed table) for this GPU; :class:`TableError` says why not."""
    _need(isinstance(data, dict), "not a JSON object")
    _need(data.get("format") == FORMAT, f"'format' is {data.get('format')!r}, not {FORMAT!r}")
    _need(
        data.get("version") == VERSION,
        f"format version {data.get('version')!r}; this torch_topg reads version {VERSION}",
    )
    gpu = data.get("gpu")
    _need(
        isinstance(gpu, dict) and "name" in gpu and "capability" in gpu, "no 'gpu' name/capability"
    )
    cap = gpu["capability"]
    _need(
        isinstance(cap, list) and len(cap) == 2 and all(isinstance(c, int) for c in cap),
        f"gpu capability {cap!r} is not [major, minor]",
    )
    their = f"{gpu['name']} (sm_{cap[0]}{cap[1]})"
    ours = f"{gpu_name} (sm_{capability[0]}{capability[1]})"
    _need(
        gpu["name"] == gpu_name and tuple(cap) == tuple(capability),
        f"measured on {their}, this GPU is {ours}",
    )
    raw = data.get("entries")
    _need(isinstance(raw, list), "no 'entries' list")
    entries: dict[tuple[str, str], Entry] = {}
    for i, e in enumerate(raw):
        ent = _entry(i, e, ops)
        _need((ent.op, ent.cls) not in entries, f"entry {i}: ({ent.op}, {ent.cls}) twice")
        entries[(ent.op, ent.cls)] = ent
    header = {k: v for k, v in data.items() if k != "entries"}
    return Table(path, gpu["name"], (cap[0], cap[1]), header, entries)


def load_table(
    path: str | os.PathLike, gpu_name: str, capability: tuple[int, int], ops: tuple[str, ...]
) -> Table:
    """Read and validate the table at ``path`` (:class:`TableError` with the reason)."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as exc:
        raise TableError(f"cannot be read: {exc}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise TableError(f"not valid JSON: {exc}") from exc
    return parse_table(data, str(path), gpu_name, capability, ops)


def new_table(gpu_name: str, capability: tuple[int, int], **header: Any) -> dict[str, Any]:
    """An empty table for this GPU (``tune`` fills ``entries``); ``header`` adds or
    overrides fields (``commit``, ``torch``, ``triton``, ``cuda``, ``date``)."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "format": FORMAT,
        "version": VERSION,
        "gpu": {"name": gpu_name, "capability": list(capability)},
        "date": date,
        **header,
        "entries": [],
    }


def write_table(data: dict[str, Any], path: str | os.PathLike) -> pathlib.Path:
    """Write ``data`` as JSON (atomically: a reader never sees half a file)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


# --- without a table ------------------------------------------------------------------


def _moe_order(cls: str) -> tuple[list[str], str]:
    e = t = 0
    for part in cls.split():
        if part[:1] == "e" and part[1:].isdigit():
            e = int(part[1:])
        if part[:1] == "t" and part[1:].isdigit():
            t = int(part[1:])
    if e >= 64:  # many small experts (Qwen3-MoE 128x8 on the H200)
        if t <= 1:
            return [
                "topg",
                "grouped_mm",
                "expert_loop",
            ], "many experts, 1 token: topg 0.21 ms, grouped_mm 0.32"
        return [
            "grouped_mm",
            "topg",
            "expert_loop",
        ], "many experts: grouped_mm 0.34-0.65 ms, topg 0.40-1.12, loop 4.9-21"
    if t <= 1:
        return [
            "expert_loop",
            "grouped_mm",
            "topg",
        ], "few experts, 1 token: loop 0.46 ms, grouped_mm 0.50, topg 1.36"
    return [
        "grouped_mm",
        "expert_loop",
        "topg",
    ], "few experts: grouped_mm 1.06-1.28 ms, loop 1.18-1.62, topg 2.2-2.6"


#: Without a table: per op, the candidates measured on a GPU (H200, 2026-12-04,
#: docs/gpu.md "Results") in the order of those measurements, then the ones never
#: measured (so no untimed kernel runs by default), then the reference.
_FIXED: dict[str, tuple[list[str], str]] = {
    "attention": (
        ["sdpa_flash", "topg", "sdpa_cudnn", "sdpa_efficient"],
        "H200 2026-12-04: SDPA flash 4.7-6.1x faster than topg (bf16, D=128, S=2k-8k); "
        "cuDNN and memory-efficient not measured",
    ),
    "paged_attention": (
        ["topg", "triton"],
        "H200 2026-12-04: only topg measured (22-24% of the copy bandwidth); Triton not measured",
    ),
    "linear": (
        ["torch_linear", "topg"],
        "H200 2026-12-04: cuBLAS (F.linear) 1.2-1.4x faster than topg at M=1-4",
    ),
}

#: With ``deterministic=True`` (``torch_topg.modes.batch_invariant_mode``): one fixed
#: candidate per op, whatever the batch or the table. topg's kernels split work by each
#: row's own sizes (paged attention's partitions, prefill's query tiles); see docs/gpu.md
#: for what is and is not batch-invariant on CUDA yet.
DETERMINISTIC: dict[str, str] = {
    "attention": "topg",
    "paged_attention": "topg",
    "fused_moe": "topg",
    "linear": "topg",
}


def fixed_order(op: str, cls: str) -> tuple[list[str], str]:
    """``(candidate names, why)``: the order used without a table entry (``triton`` and
    other unmeasured candidates after the measured ones; ``reference`` always last)."""
    if op == "fused_moe":
        order, why = _moe_order(cls)
        return [*order, "triton", "reference"], f"H200 2026-12-04: {why}; Triton not measured"
    order, why = _FIXED[op]
    return [*order, "reference"], why
