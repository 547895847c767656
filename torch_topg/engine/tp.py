"""Tensor parallelism for the engine: ``Engine.from_pretrained(model, tp_size=N)``.

Rank 0 is the calling process: it owns the :class:`~torch_topg.engine.Engine`
(scheduler, sampler, handles) and runs a :class:`TPModelRunner`. Ranks 1..N-1 are
followers: worker processes the engine starts itself (``multiprocessing`` "spawn"), or,
under ``torchrun``, processes that call :func:`follow`. Every rank holds its shard of
the model (``torch_topg.parallel.tensor_parallel`` reading only its slices of the
safetensors checkpoint) and its own paged KV cache, sized for its own KV heads, with the
same number of blocks and the same block ids on every rank.

Every step, rank 0 broadcasts the packed batch (a header ``[command, T, S, max_blocks,
R]``, then the batch's seven tensors as one int64 payload) on a gloo *command group*;
then every rank runs ``ModelRunner.execute`` on its shard, the model's collectives
(the TP plan's all-reduces) running on the default group (gloo on CPU, NCCL on CUDA).
The LM head is vocab-parallel and all-reduces zero-padded logits, so rank 0 (every rank)
gets the full-vocabulary logits and samples from them.

Two groups because they wait differently: a follower of an idle engine waits for the
next command indefinitely (the command group's timeout is a year), while a collective
inside a step is bounded (``TOPG_TP_TIMEOUT_S``, default 120 s), so a hung rank is an
error, not a hang. A worker that dies closes its sockets: rank 0's next collective
fails, and rank 0 checks its workers' exit codes before every step; either way the step
raises ``RuntimeError("Engine(tp_size=N): ... worker rank r ... exited ...")``. After a
failed step the group is stopped (the ranks may be inside different collectives) and
every later step raises the same error.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_topg.engine.batch import PackedBatch
from torch_topg.engine.model_runner import ModelRunner

CMD_STEP, CMD_STOP, CMD_COPY = 1, 2, 3
HEADER = 5  # [command, T, S, max_blocks, R]; CMD_COPY: [command, pairs, 0, 0, 0]
#: the command group's timeout: how long a follower waits for rank 0's next command
IDLE_TIMEOUT = timedelta(days=365)
#: the tensor-parallel engine of this process (at most one: it uses the default group)
_active: list[TPGroup] = []


def collective_timeout_s() -> float:
    """Seconds a collective inside a step (or the start-up) may wait for a peer."""
    return float(os.environ.get("TOPG_TP_TIMEOUT_S", "120"))


@dataclass
class Spec:
    """What rank 0 tells the followers (``broadcast_object_list`` on the command group)."""

    folder: str
    device_type: str
    dtype: str
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    compile: bool
    deterministic: bool
    quantization: Any = None  # Engine quantization= ("int8", "int4" or their dict form)


# --- the wire format ---------------------------------------------------------------------
def encode(b: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload): int64 CPU tensors."""
    t = b.input_ids.shape[1]
    s, mb = b.block_tables.shape
    r = b.logits_indices.numel()
    header = torch.tensor([CMD_STEP, t, s, mb, r], dtype=torch.long)
    parts = [b.input_ids.reshape(-1), b.positions.reshape(-1), b.slot_mapping,
             b.block_tables.reshape(-1), b.seq_lens, b.cu_seqlens_q, b.logits_indices]  # fmt: skip
    payload = torch.cat([p.to(device="cpu", dtype=torch.long) for p in parts])
    return header, payload


def payload_size(header: torch.Tensor) -> int:
    _, t, s, mb, r = header.tolist()
    return 3 * t + s * mb + s + (s + 1) + r


def decode(header: torch.Tensor, payload: torch.Tensor, device: torch.device) -> PackedBatch:
    """The :class:`PackedBatch` of ``encode`` (fresh contiguous tensors on ``device``)."""
    _, t, s, mb, r = header.tolist()
    ids, pos, slots, table, lens, cu, idx = payload.split([t, t, t, s * mb, s, s + 1, r])

    def make(x: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return x.to(dtype).reshape(shape).clone().to(device)

    return PackedBatch(
        input_ids=make(ids, torch.long, (1, t)),
        positions=make(pos, torch.long, (1, t)),
        slot_mapping=make(slots, torch.long, (t,)),
        block_tables=make(table, torch.int32, (s, mb)),
        seq_lens=make(lens, torch.int32, (s,)),
        cu_seqlens_q=make(cu, torch.int32, (s + 1,)),
        logits_indices=make(idx, torch.long, (r,)),
    )


# --- rank 0 ------------------------------------------------------------------------------
class TPGroup:
    """Rank 0's side of the group: the command group, the worker processes (none under
    torchrun), and the teardown."""

    def __init__(self, tp_size: int, procs: list[Any], owns_world: bool) -> None:
        self.tp_size = tp_size
        self.procs = procs  # index i: rank i + 1
        self.owns_world = owns_world
        self.cmd: Any = None
        self.broken: str | None = None
        self.lock = threading.Lock()
        self._closed = False
        self._restore: list[Any] = []
        self.store: Any = None  # spawned workers: rank 0's TCPStore (its server)
        # how errors name the engine, its workers and the step timeout (pp.py: nnodes)
        self.label = f"Engine(tp_size={tp_size})"
        self.workers = "tensor-parallel workers"
        self.timeout_s = collective_timeout_s()
        self.timeout_name = "TOPG_TP_TIMEOUT_S"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the workers are stopped)."""
        return self._closed

    def dead(self) -> str | None:
        """Which workers have exited, or None."""
        gone = [
            f"worker rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, p in enumerate(self.procs, start=1)
            if p.exitcode is not None
        ]
        return "; ".join(gone) or None

    def poll(
        self, done: Any, what: str, timeout_s: float, late: str, interval_s: float = 0.01
    ) -> None:
        """Wait until ``done()``, checking the workers meanwhile: a dead one raises
        ``RuntimeError`` naming it, ``timeout_s`` without an answer ``TimeoutError(late)``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            gone = self.dead()
            if gone:
                raise RuntimeError(f"{self.label}: {what}: {gone}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label}: {late}")
            time.sleep(interval_s)

    def wait(self, work: Any, what: str, timeout_s: float) -> None:
        """Wait for an async collective, checking the workers while it runs."""
        late = f"{what}: no answer from the workers after {timeout_s:.0f} s ({self.timeout_name})"
        self.poll(work.is_completed, what, timeout_s, late)
        work.wait()

    def failure(self, err: BaseException, what: str) -> RuntimeError:
        """The group is unusable: remember why, stop the workers; the error to raise."""
        from torch_topg.utils.distributed import peer_failure

        timed_out = "timed out" in str(err).lower() or isinstance(err, TimeoutError)
        # A peer that closed its sockets is exiting: give it a moment to be reaped, so the
        # error names it. Also after a "timeout": the all-reduce's own message says "left
        # or timed out", and on a loaded machine the dead worker's exit is seen late (a
        # real timeout has waited TOPG_TP_TIMEOUT_S already; 5 s more is nothing).
        deadline = time.monotonic() + 5.0
        while self.procs and not self.dead() and time.monotonic() < deadline:
            time.sleep(0.02)
        why = [x for x in (self.dead(), peer_failure()) if x]
        if why:
            detail = "; ".join(why)
        elif timed_out:
            detail = (
                f"a worker did not answer within {self.timeout_s:.0f} s "
                f"({self.timeout_name}): {type(err).__name__}: {err}"
            )
        else:
            detail = f"{type(err).__name__}: {err}"
        self.broken = (
            f"{self.label}: {what} failed ({detail}); the {self.workers} are stopped, "
            "start a new engine"
        )
        self._terminate()
        return RuntimeError(self.broken)

    def send(self, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        """Broadcast a command. A gloo broadcast's root waits for every receiver: bounded
        here (the command group's own timeout is the followers' idle wait)."""
        timeout = timedelta(seconds=self.timeout_s)
        for t in (header, payload):
            if t is not None:
                dist.broadcast(t, 0, group=self.cmd, async_op=True).wait(timeout)

    def _terminate(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        for p in self.procs:
            p.join(2)
            if p.exitcode is None:  # a stopped (SIGSTOP) process ignores SIGTERM
                p.kill()
                p.join(5)

    def close(self, graceful: bool = True, timeout_s: float = 30.0) -> None:
        """Stop the followers (STOP), join them (terminate those that hang), destroy the
        process groups this engine created. Idempotent."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            if graceful and self.broken is None and self.cmd is not None and not self.dead():
                try:
                    self.send(torch.tensor([CMD_STOP, 0, 0, 0, 0], dtype=torch.long), None)
                except Exception:  # a worker already gone: terminate below
                    pass
            deadline = time.monotonic() + (timeout_s if graceful else 0)
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            self._terminate()
            if dist.is_available() and dist.is_initialized():
                if self.cmd is not None:
                    try:
                        dist.destroy_process_group(self.cmd)
                    except Exception:
                        pass
                if self.owns_world:
                    dist.destroy_process_group()
            for fn in self._restore:
                fn()
            if self in _active:
                _active.remove(self)


class TPModelRunner(ModelRunner):
    """Rank 0's runner: ``execute`` broadcasts the batch to the followers, then runs its
    own shard (so :meth:`warmup` compiles on every rank in lock step)."""

    def __init__(self, model: torch.nn.Module, *, group: TPGroup, **kw: Any) -> None:
        super().__init__(model, **kw)
        self.group = group

    @property
    def broken(self) -> str | None:
        return self.group.broken

    def execute(self, b: PackedBatch) -> torch.Tensor:
        g = self.group
        with g.lock:
            if g.broken is not None:
                raise RuntimeError(g.broken)
            if g.closed:
                raise RuntimeError(f"Engine(tp_size={g.tp_size}): the workers are stopped")
            gone = g.dead()
            if gone:
                raise g.failure(RuntimeError(gone), "a step")
            header, payload = encode(b)
            try:
                g.send(header, payload)
                return super().execute(b)
            except Exception as e:
                raise g.failure(e, "a step") from e

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Every rank copies its own shard of the blocks (a fork's partial last block)."""
        if not pairs:
            return
        g = self.group
        with g.lock:
            if g.broken is not None:
                raise RuntimeError(g.broken)
            header = torch.tensor([CMD_COPY, len(pairs), 0, 0, 0], dtype=torch.long)
            payload = torch.tensor([x for p in pairs for x in p], dtype=torch.long)
            try:
                g.send(header, payload)
            except Exception as e:
                raise g.failure(e, "a block copy") from e
            super().copy_blocks(pairs)


# --- followers ---------------------------------------------------------------------------
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.rsplit(".", 1)[-1])


def _build_model(
    folder: str | Path, dtype: torch.dtype, device: torch.device, quantization: Any = None
) -> torch.nn.Module:
    from transformers import AutoConfig

    from torch_topg.parallel import empty_model, tensor_parallel
    from torch_topg.quant.loading import apply_quantization

    config = AutoConfig.from_pretrained(folder)
    model = tensor_parallel(empty_model(config, dtype), checkpoint=folder, device=device)
    # each rank packs its own shards (a row-parallel shard's K: its input features)
    return apply_quantization(model, quantization).eval()


def local_kv_heads(model: torch.nn.Module) -> int:
    """This rank's KV heads of a sharded model."""
    lay = model.topg_tp
    return lay.heads.kv[lay.rank]


def _ready(cmd: Any) -> Any:
    """Start-up handshake: every rank joins once its model and cache are built (a rank
    that fails to load raises instead, and its exit breaks the others' wait)."""
    return dist.all_reduce(torch.ones(1, dtype=torch.long), group=cmd, async_op=True)


def follow(device: str | torch.device | None = None) -> None:
    """Run a follower rank of a tensor-parallel engine until the engine shuts down.

    For ranks > 0 of a job whose process group is already initialised (``torchrun``):
    rank 0 calls ``Engine.from_pretrained(model, tp_size=WORLD_SIZE)`` and the others
    ``torch_topg.engine.tp.follow()``. The model folder rank 0 loaded must exist at the
    same path on every machine. ``device``: default ``cuda:LOCAL_RANK`` when rank 0
    runs on CUDA, else the CPU.
    """
    from torch_topg.parallel import failure_guard

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "follow: torch.distributed is not initialised (launch with torchrun and call "
            "torch_topg.parallel.init_distributed() first)"
        )
    if dist.get_rank() == 0:
        raise RuntimeError(
            "follow: rank 0 runs the engine (Engine.from_pretrained(..., tp_size=N)); "
            "follow() is for ranks > 0"
        )
    cmd = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    try:
        with failure_guard():
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=cmd)
            spec = Spec(**box[0])
            if device is None:
                local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
                device = f"cuda:{local}" if spec.device_type == "cuda" else "cpu"
            _follow(spec, cmd, torch.device(device))
    finally:
        dist.destroy_process_group(cmd)


def _follow(spec: Spec, cmd: Any, device: torch.device) -> None:
    model = _build_model(spec.folder, _dtype(spec.dtype), device, spec.quantization)
    runner = ModelRunner(
        model, num_blocks=spec.num_blocks, block_size=spec.block_size,
        max_blocks_per_seq=spec.max_blocks_per_seq, kv_heads=local_kv_heads(model),
        compile=spec.compile,
    )  # fmt: skip
    restore = None
    if spec.deterministic:
        from torch_topg.modes import batch_invariant_mode

        restore = batch_invariant_mode()
    _ready(cmd).wait()
    header = torch.empty(HEADER, dtype=torch.long)
    try:
        while True:
            dist.broadcast(header, 0, group=cmd)
            code = int(header[0])
            if code == CMD_STOP:
                return
            if code == CMD_COPY:
                pairs = torch.empty(2 * int(header[1]), dtype=torch.long)
                dist.broadcast(pairs, 0, group=cmd)
                runner.copy_blocks([tuple(p) for p in pairs.view(-1, 2).tolist()])
                continue
            if code != CMD_STEP:
                raise RuntimeError(f"follow: unknown command {code} from rank 0")
            payload = torch.empty(payload_size(header), dtype=torch.long)
            dist.broadcast(payload, 0, group=cmd)
            runner.execute(decode(header, payload, device))
    finally:
        if restore is not None:
            restore()


def _worker(rank: int, world: int, host: str, port: int, backend: str, device: str,
            threads: int | None, timeout_s: float) -> None:  # fmt: skip
    """A spawned follower: join the group through rank 0's store, then :func:`follow`."""
    if threads:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        store.set(f"topg/engine/up/{rank}", "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)  # fmt: skip
        follow(device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A clean stop: skip the interpreter's teardown (over a second of unloading torch
    # and transformers, which Engine.shutdown() would wait for).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- start ---------------------------------------------------------------------------
def _check_model(model: Any, tp_size: int) -> tuple[Path, Any]:
    from transformers import AutoConfig

    from torch_topg.engine.loading import check_supported, resolve
    from torch_topg.parallel import PLANS

    folder, gguf = resolve(model)
    if gguf:
        raise ValueError(
            f"Engine: tp_size={tp_size} needs a safetensors checkpoint folder (each rank reads "
            f"only its slices); {folder / gguf} is a GGUF file. Convert it first (load it "
            "with transformers and save_pretrained) or use tp_size=1"
        )
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"Engine: tp_size={tp_size} needs safetensors weights; {folder} has none")
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    if config.model_type not in PLANS:
        raise ValueError(
            f"Engine: tp_size={tp_size}: no tensor-parallel plan for model_type "
            f"{config.model_type!r}; supported: {sorted(PLANS)}"
        )
    return folder, config


def _kv_split(config: Any, tp_size: int) -> tuple[int, ...]:
    from torch_topg.engine.model_runner import kv_layout
    from torch_topg.parallel import split_heads
    from torch_topg.parallel.sharding import normalize_ratios

    text = config.get_text_config()
    _, kv, head_dim = kv_layout(config)
    heads = split_heads(text.num_attention_heads, kv, head_dim, normalize_ratios(None, tp_size))
    return heads.kv


def _spawn(group: TPGroup, tp_size: int, device: torch.device, threads: int | None) -> None:
    """Start ranks 1..N-1 and the process group (this process is rank 0)."""
    import multiprocessing as mp

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout_s = collective_timeout_s()
    timeout = timedelta(seconds=timeout_s)
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, tp_size, is_master=True, timeout=timeout,
                          wait_for_workers=False)  # fmt: skip
    ctx = mp.get_context("spawn")
    base = device.index or 0
    for rank in range(1, tp_size):
        dev = f"cuda:{base + rank}" if device.type == "cuda" else "cpu"
        p = ctx.Process(
            target=_worker,
            args=(rank, tp_size, host, store.port, backend, dev, threads, timeout_s),
            name=f"topg-tp-rank{rank}",
            daemon=True,
        )
        p.start()
        group.procs.append(p)
    # Wait for every worker to reach the store (a worker that dies while importing is
    # reported now, by its exit code, not after the rendezvous timeout).
    keys = [f"topg/engine/up/{r}" for r in range(1, tp_size)]
    group.poll(
        lambda: store.check(keys),
        "starting the workers",
        timeout_s,
        f"the workers did not start within {timeout_s:.0f} s",
        interval_s=0.02,
    )
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=0, world_size=tp_size, timeout=timeout)
    group.store = store  # keep the store's server alive with the group


def start_tp_engine(cls: type, model: Any, args: Any) -> Any:
    """Rank 0 of a tensor-parallel engine over the checkpoint ``model`` with the options
    ``args`` (an ``EngineArgs``; see the module docstring)."""
    from torch_topg.engine.config import device_of, dtype_of, resolve
    from torch_topg.engine.loading import has_tokenizer

    tp_size, quantization = args.tp_size, args.quantization
    device = device_of(args)
    dtype = dtype_of(args, device, model)
    folder, config = _check_model(model, tp_size)
    kv = _kv_split(config, tp_size)  # raises when tp_size > KV heads
    if _active:
        raise ValueError(
            "Engine: this process already runs a tensor-parallel engine (one per process: "
            "its process group is the default group); shut it down first"
        )
    torchrun = dist.is_available() and dist.is_initialized()
    if torchrun:
        if dist.get_world_size() != tp_size:
            raise ValueError(
                f"Engine: tp_size={tp_size} but the initialised process group has "
                f"{dist.get_world_size()} ranks (under torchrun, tp_size must be the world size)"
            )
        if dist.get_rank() != 0:
            raise ValueError(
                "Engine: under torchrun only rank 0 builds the engine; ranks > 0 call "
                "torch_topg.engine.tp.follow()"
            )
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if torchrun else 0)
        if not torchrun and (device.index or 0) + tp_size > torch.cuda.device_count():
            raise ValueError(
                f"Engine: tp_size={tp_size} on {device} needs GPUs {device.index}.."
                f"{device.index + tp_size - 1}; this machine has {torch.cuda.device_count()}"
            )
    # One block id space: every rank holds num_blocks blocks of its own KV heads. CPU
    # ranks share the host's memory (the budget covers all of them); GPUs have their own
    # (the budget is per device, sized for the rank with the most KV heads).
    budget_heads = sum(kv) if device.type == "cpu" else max(kv)
    cfg = resolve(args, config, device=device, dtype=dtype, kv_heads=budget_heads)
    block_size = args.block_size
    max_blocks = -(-cfg.max_model_len // block_size)

    threads = None
    group = TPGroup(tp_size, [], owns_world=not torchrun)
    _active.append(group)
    try:
        if not torchrun:
            if device.type == "cpu":
                prev = torch.get_num_threads()
                threads = max(1, prev // tp_size)
                torch.set_num_threads(threads)
                group._restore.append(lambda: torch.set_num_threads(prev))
            _spawn(group, tp_size, device, threads)
        group.cmd = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        spec = Spec(str(folder), device.type, str(dtype), cfg.num_blocks, block_size,
                    max_blocks, args.compile, args.deterministic, quantization)  # fmt: skip
        dist.broadcast_object_list([asdict(spec)], src=0, group=group.cmd)
        m = _build_model(folder, dtype, device, quantization)
        _load_generation_config(m, folder)
        tok = None
        if has_tokenizer(folder):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(folder)
        runner = TPModelRunner(
            m, group=group, num_blocks=cfg.num_blocks, block_size=block_size,
            max_blocks_per_seq=max_blocks, kv_heads=local_kv_heads(m), compile=args.compile,
        )  # fmt: skip
        what = "loading the model on the workers"
        group.wait(_ready(group.cmd), what, max(600.0, collective_timeout_s()))
        return cls(m, tok, cfg, runner=runner, on_shutdown=[group.close])
    except BaseException:
        group.close(graceful=False)
        raise


def _load_generation_config(model: torch.nn.Module, folder: Path) -> None:
    """The checkpoint's generation config (EOS ids), as ``from_pretrained`` would read it."""
    if not (folder / "generation_config.json").exists():
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except Exception:  # a malformed file: keep the config's defaults
        pass
