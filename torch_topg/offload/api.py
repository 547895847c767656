"""``torch_topg.offload(model, ...)``: the entry point and the handle it returns."""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_topg.offload import direct
from torch_topg.offload.engine import Engine, FaultHooks, LayerInfo, placeholder
from torch_topg.offload.pool import SlotLayout
from torch_topg.offload.reader import CpuBackend
from torch_topg.offload.source import (
    MemorySource,
    SafetensorsSource,
    WeightSource,
    checkpoint_files,
    write_safetensors,
)

__all__ = ["OffloadHandle", "find_layers", "offload"]


def find_layers(model: nn.Module, layers: str = "auto") -> tuple[str, nn.ModuleList]:
    """The repeated block list to offload: ``"auto"`` picks the largest ``nn.ModuleList``
    (or ``nn.Sequential``) whose children all have one type; otherwise a module path."""
    if not isinstance(layers, str):
        raise TypeError(f"offload: layers must be 'auto' or a module path, got {layers!r}")
    if layers != "auto":
        try:
            found = model.get_submodule(layers)
        except AttributeError as e:
            raise ValueError(f"offload: layers={layers!r} names no submodule ({e})") from None
        if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) == 0:
            raise ValueError(
                f"offload: layers={layers!r} is a {type(found).__name__}, not a non-empty "
                "nn.ModuleList or nn.Sequential of blocks"
            )
        return layers, found  # type: ignore[return-value]
    best: tuple[int, str, Any] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            if len({type(m) for m in mod}) != 1:
                continue
            size = sum(p.numel() for p in mod.parameters())
            if best is None or size > best[0]:
                best = (size, name, mod)
    if best is None:
        raise ValueError(
            "offload: layers='auto' found no nn.ModuleList of repeated blocks; "
            "name the block list with layers='<module path>'"
        )
    return best[1], best[2]


IO_MODES = ("auto", "mmap", "direct")


def _check_args(source: Any, depth: Any, resident: Any, n: int, bandwidth: Any, io: Any) -> None:
    if not isinstance(io, str) or io not in IO_MODES:
        raise ValueError(f"offload: io must be 'auto', 'mmap' or 'direct', got {io!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"offload: prefetch_depth must be an int >= 0, got {depth!r}")
    if isinstance(resident, bool) or not isinstance(resident, int) or not 0 <= resident <= n:
        raise ValueError(f"offload: resident_layers must be an int in [0, {n}], got {resident!r}")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"offload: source must be 'cpu', 'disk' or a path, got {source!r}")
    if bandwidth is not None and (
        isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or bandwidth <= 0
    ):
        raise ValueError(f"offload: read_bandwidth must be None or > 0 bytes/s, got {bandwidth!r}")


def _device(device: Any) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"offload: device {device!r} is not a device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"offload: device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"offload: device={device!r} but no CUDA device is available")
    return dev


def _owners(model: nn.Module, prefix: str, offloaded: set[int]) -> dict[int, set[object]]:
    """id(tensor) -> the owners of the memory it lies in: an offloaded layer index, or
    "R" for anything resident (outside the block list, or a resident layer). Tensors whose
    byte ranges overlap (the same parameter registered twice, views of one another) form
    one group with the union of their owners; views of one large buffer that do not
    overlap (e.g. every tensor of a memory-mapped file) stay separate."""
    items = list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    )
    spans = []
    for name, t in items:
        if t.numel() == 0:
            continue
        owner: object = "R"
        if name.startswith(prefix + "."):
            idx = int(name[len(prefix) + 1 :].split(".", 1)[0])
            if idx in offloaded:
                owner = idx
        start = t.data_ptr()
        spans.append((t.device.type, start, start + t.numel() * t.element_size(), owner, id(t)))
    spans.sort(key=lambda sp: (sp[0], sp[1]))
    groups: list[tuple[set[object], list[int]]] = []
    end = -1
    dev = None
    for d, s, e, owner, tid in spans:
        if groups and d == dev and s < end:
            groups[-1][0].add(owner)
            groups[-1][1].append(tid)
            end = max(end, e)
        else:
            groups.append(({owner}, [tid]))
            dev, end = d, e
    return {tid: owners for owners, tids in groups for tid in tids}


class OffloadHandle:
    """What :func:`offload` returns: a context manager; ``close()`` is idempotent.

    When the handle is garbage-collected (with its model: the model keeps its handle in
    ``model._topg_offload``) it is closed the same way.
    """

    def __init__(self, model: nn.Module, engine: Engine, wsrc: WeightSource, **info: Any):
        self._engine = engine
        self._model = weakref.ref(model)
        self._source = wsrc
        self.info = info
        self.device: torch.device = info["device"]
        self.layers: list[int] = sorted(engine.layers)  # offloaded layer indices
        self._undo: list[Any] = []  # hook handles and forward wrappers to remove on close
        self._finalizer = weakref.finalize(self, OffloadHandle._shutdown, engine, self._undo)

    # custom loops -------------------------------------------------------------------
    def prefetch(self, i: int) -> None:
        """Start reading layer ``i`` (returns at once)."""
        self._engine.prefetch(i)

    def wait(self, i: int) -> None:
        """Block until layer ``i``'s weights are in the pool and bind them (the forward
        wrapper of each offloaded layer calls this before it runs)."""
        self._engine.wait(i)

    def release(self, i: int) -> None:
        """Unbind layer ``i`` (placeholders) and let the prefetcher reuse its slot."""
        self._engine.release(i)

    # stats ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``bytes_moved``, ``read_s`` (reader busy time), ``stall_s`` (compute thread
        blocked in ``wait``), ``overlap`` (1 - stall_s / read_s, clamped to [0, 1]),
        ``peak_resident_bytes`` and its bound, per-layer ``fetches``, ``sync_fetches``
        (layers used out of the predicted order), the learned ``order``, and ``io``: how
        layers are read ("direct", "mmap", or "memory" for source="cpu"), with
        ``io_reason`` saying why direct I/O is not used ("" when it is)."""
        return {**self._engine.stats(), "io": self.info["io"], "io_reason": self.info["io_reason"]}

    def reset_stats(self) -> None:
        self._engine.reset_stats()

    # lifetime -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._engine.closed

    def close(self) -> None:
        """Stop and join the reader, remove the hooks, and point every offloaded tensor
        at its host source tensor (zero-copy: the original tensors for source="cpu",
        views of the memory-mapped file otherwise). On the CPU the model then runs as
        an ordinary model; after a CUDA offload those layers' weights are on the host."""
        self._finalizer()
        model = self._model()
        if model is not None and model.__dict__.get("_topg_offload") is self:
            del model.__dict__["_topg_offload"]

    @staticmethod
    def _shutdown(engine: Engine, undo: list[Any]) -> None:
        engine.close()
        for u in reversed(undo):
            u()
        undo.clear()
        for info in engine.layers.values():
            for t, src in zip(info.tensors, info.sources, strict=True):
                t.data = src.view(t.shape)
            info.slot = None

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"OffloadHandle({state}, layers={self.info['layers_path']}[{len(self.layers)} "
            f"offloaded], device={self.device}, source={self.info['source']!r}, "
            f"prefetch_depth={self._engine.depth})"
        )


def offload(
    model: nn.Module,
    device: str | torch.device | None = None,
    source: str | os.PathLike[str] = "cpu",
    layers: str = "auto",
    prefetch_depth: int = 1,
    resident_layers: int = 0,
    pin_memory: bool = True,
    *,
    read_bandwidth: float | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    io: str = "mmap",
    _hooks: FaultHooks | None = None,
    _backend: Any = None,
) -> OffloadHandle:
    """Run ``model`` with the weights of its decoder layers streamed in ahead of use.

    Args:
        model: the module (its weights on the host, or already on ``device``).
        device: where compute runs: ``"cpu"`` or ``"cuda[:i]"``; default CUDA if present.
        source: where offloaded weights live: ``"cpu"`` (host memory; pinned for CUDA
            when ``pin_memory``), ``"disk"`` (written once as safetensors to
            ``cache_dir``, or to an unlinked temporary file, then memory-mapped), or the
            path of a safetensors file or folder holding the model's tensors by name.
        layers: ``"auto"`` (the largest list of identical blocks) or a module path.
        prefetch_depth: layers read ahead of the one computing (0: fetch on use).
        resident_layers: keep the first k layers of the list resident.
        pin_memory: pin host memory for CUDA copies (ignored on the CPU).
        read_bandwidth: throttle the reader to this many bytes/s (emulates slower
            storage; all copies, prefetch or synchronous, share it).
        cache_dir: folder for source="disk"'s file (kept there; default: a temporary
            file removed when the last view of it is gone).
        io: how layers are read from a file source on the CPU: ``"mmap"`` (default:
            copied out of a memory map by the reader thread), ``"direct"`` (``O_DIRECT`` reads
            into the pool: the storage device's DMA, no CPU copy, no page cache), or
            ``"auto"``: ``"direct"`` when every file accepts ``O_DIRECT`` (probed once
            per file) and the offloaded tensors lie at 64-byte file offsets, else
            ``"mmap"`` (``stats()["io_reason"]`` says why). ``"direct"`` raises if the
            file system refuses ``O_DIRECT``; it needs a file source and device="cpu".
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload: model must be an nn.Module, got {type(model).__name__}")
    if "_topg_offload" in model.__dict__:
        raise RuntimeError("offload: model is already offloaded; close() its handle first")
    # `_backend`: a stand-in device backend (tests of the CUDA schedule without a GPU)
    dev = _backend.device if _backend is not None else _device(device)
    if dev.type == "cpu" and _backend is None:
        elsewhere = {t.device.type for t in model.parameters()} - {"cpu"}
        if elsewhere:
            raise ValueError(
                f"offload: device='cpu' but the model has weights on {sorted(elsewhere)}; "
                "move it to the host first (model.cpu())"
            )
    path, blocks = find_layers(model, layers)
    n = len(blocks)
    _check_args(source, prefetch_depth, resident_layers, n, read_bandwidth, io)
    if io == "direct" and (dev.type != "cpu" or _backend is not None):
        raise ValueError(f"offload: io='direct' is supported on device='cpu' only, not {dev}")
    if io == "direct" and source == "cpu":
        raise ValueError("offload: io='direct' needs a file source (source='disk' or a path)")
    offloaded = list(range(resident_layers, n))
    owners = _owners(model, path, set(offloaded))

    # the tensors each offloaded layer owns alone (shared ones stay resident)
    per_layer: dict[int, list[tuple[str, torch.Tensor]]] = {}
    moving: set[int] = set()
    for i in offloaded:
        seen: set[int] = set()
        named = []
        items = list(blocks[i].named_parameters(remove_duplicate=False)) + list(
            blocks[i].named_buffers(remove_duplicate=False)
        )
        for name, t in items:
            if id(t) in seen or t.numel() == 0 or owners.get(id(t)) != {i}:
                continue
            seen.add(id(t))
            named.append((f"{path}.{i}.{name}", t))
            moving.add(id(t))
        per_layer[i] = named
    resident_bytes = sum(
        t.numel() * t.element_size()
        for i in range(resident_layers)
        for t in {id(t): t for t in blocks[i].parameters()}.values()
    )

    backend: Any = _backend
    if backend is not None:
        pass
    elif dev.type == "cuda":
        from torch_topg.offload.cuda import CudaBackend

        backend = CudaBackend(dev, pin_memory=pin_memory)
    else:
        backend = CpuBackend(dev)

    # weights -> source
    src_label = str(source)
    wsrc: WeightSource
    io_used, io_reason = ("memory" if source == "cpu" else "mmap"), ""
    all_named = {name: t for i in offloaded for name, t in per_layer[i]}
    if source == "cpu":
        wsrc = MemorySource(
            {
                k: backend.prepare_source(t.detach().to("cpu").contiguous())
                for k, t in all_named.items()
            }
        )
    elif source == "disk":
        if cache_dir is not None:
            folder = Path(cache_dir)
            folder.mkdir(parents=True, exist_ok=True)
            file = (
                folder / f"offload-{type(model).__name__}-{os.getpid()}-{id(model):x}.safetensors"
            )
        else:
            folder = Path(tempfile.mkdtemp(prefix="topg-offload-"))
            file = folder / "weights.safetensors"
        write_safetensors(file, {k: t.detach() for k, t in all_named.items()})
        wsrc = SafetensorsSource([file])
        backend, io_used, io_reason = _choose_io(io, backend, wsrc, per_layer, fresh=True)
        if cache_dir is None:  # the map keeps the data alive; the name is not needed
            file.unlink()
            folder.rmdir()
    else:
        wsrc = SafetensorsSource(checkpoint_files(source))
        for k, t in all_named.items():
            if k not in wsrc.names():
                raise ValueError(f"offload: source {src_label!r} has no tensor named {k!r}")
            s = wsrc.tensor(k)
            if s.shape != t.shape or s.dtype != t.dtype:
                raise ValueError(
                    f"offload: source tensor {k!r} is {tuple(s.shape)} {s.dtype}; the model "
                    f"has {tuple(t.shape)} {t.dtype}"
                )
        backend, io_used, io_reason = _choose_io(io, backend, wsrc, per_layer, fresh=False)

    infos = []
    for i in offloaded:
        named = per_layer[i]
        sources = [wsrc.tensor(k) for k, _ in named]
        tensors = [t for _, t in named]
        infos.append(
            LayerInfo(
                index=i,
                name=f"{path}.{i}",
                tensors=tensors,
                sources=sources,
                layout=(
                    direct.layout(named, wsrc.extent)  # type: ignore[attr-defined]
                    if io_used == "direct"
                    else SlotLayout.of(named, getattr(backend, "align", 64))
                ),
                placeholders=[placeholder(t, dev) for t in tensors],
                check=functools.partial(wsrc.check, [k for k, _ in named]),
            )
        )
    # everything else stays (or becomes) resident on the device
    if dev.type != "cpu":
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in moving and t.device != dev:
                t.data = t.data.to(dev)
    for info in infos:
        for t, p in zip(info.tensors, info.placeholders, strict=True):
            t.data = p

    engine = Engine(infos, n, backend, prefetch_depth, read_bandwidth, resident_bytes, _hooks)
    total = sum(info.layout.payload for info in infos)
    handle = OffloadHandle(
        model,
        engine,
        wsrc,
        device=dev,
        source=src_label,
        layers_path=path,
        offloaded_bytes=total,
        io=io_used,
        io_reason=io_reason,
    )
    _install(model, blocks, engine, handle)
    _warn_if_fits(dev, source, total)
    model.__dict__["_topg_offload"] = handle
    engine.start()  # the first layers start reading now
    return handle


def _choose_io(
    io: str,
    backend: Any,
    wsrc: SafetensorsSource,
    per_layer: dict[int, list[tuple[str, torch.Tensor]]],
    fresh: bool,
) -> tuple[Any, str, str]:
    """(backend, io mode, why not "direct") for a file source. ``fresh``: we just wrote
    the file (its pages are dirty in the page cache: flushed and dropped for direct I/O,
    so the data is held once, on disk)."""
    if io == "mmap" or not isinstance(backend, CpuBackend) or type(backend) is not CpuBackend:
        return backend, "mmap", "io='mmap'" if io == "mmap" else "not a CPU device"
    for f in wsrc.files:
        why = direct.probe(f)
        if why:
            if io == "direct":
                raise ValueError(f"offload: io='direct' but {why}")
            return backend, "mmap", why
    named = [nt for layer in per_layer.values() for nt in layer]
    why = direct.misaligned(named, wsrc.extent)
    if why:
        if io == "direct":
            warnings.warn(f"offload: io='direct' falls back to 'mmap': {why}", stacklevel=3)
        return backend, "mmap", why
    new = direct.DirectBackend(backend.device, wsrc.files)
    if fresh:
        for fd in new.fds:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return new, "direct", ""


def _install(
    model: nn.Module, blocks: nn.ModuleList, engine: Engine, handle: OffloadHandle
) -> None:
    """Wrap each offloaded layer's forward (wait before, release after) and mark the
    top-level forward's start and end (the order is learned per forward)."""
    for i in engine.layers:
        block = blocks[i]
        had = block.__dict__.get("forward")
        orig = block.forward

        def forward(*args: Any, _i: int = i, _orig: Any = orig, **kwargs: Any) -> Any:
            engine.wait(_i)
            try:
                return _orig(*args, **kwargs)
            finally:
                engine.release(_i)

        # dynamo must not trace into a layer: its weights change between calls (and
        # topg's weight fusion would freeze them); the layer runs eagerly between graphs
        block.forward = torch._dynamo.disable(forward)

        def undo(_b: nn.Module = block, _had: Any = had) -> None:
            if _had is None:
                _b.__dict__.pop("forward", None)
            else:
                _b.forward = _had

        handle._undo.append(undo)

    def pre(_m: nn.Module, _args: Any) -> None:
        engine.begin_forward()

    def post(_m: nn.Module, _args: Any, _out: Any) -> None:
        engine.end_forward()

    h1 = model.register_forward_pre_hook(torch._dynamo.disable(pre))
    h2 = model.register_forward_hook(torch._dynamo.disable(post), always_call=True)
    handle._undo += [h1.remove, h2.remove]


def _warn_if_fits(dev: torch.device, source: Any, total: int) -> None:
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if total < 0.5 * free:
            warnings.warn(
                f"offload: the offloaded weights ({total / 2**20:.0f} MiB) fit in the "
                f"device's free memory ({free / 2**20:.0f} MiB): model.to({str(dev)!r}) "
                "would run faster",
                stacklevel=3,
            )
    elif source == "cpu":
        warnings.warn(
            "offload: source='cpu' on device='cpu' keeps the weights in host memory and "
            "only adds copies; use source='disk' or a checkpoint path to save memory",
            stacklevel=3,
        )
