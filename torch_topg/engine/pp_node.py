"""Every rank of a multi-node engine but rank 0: the rendezvous, the process groups, the
stage model and the loop that runs one stage (see ``pp.py`` for the whole picture).

A node's *leader* (its local rank 0, global rank ``node_rank * tp_size``) talks to the
neighbouring stages over the *pipe* group (gloo point-to-point between the leaders) and
hands what it receives to its node's other ranks over the node's *command* group (a gloo
broadcast), as ``tp.py`` does on one machine. Both groups wait indefinitely (an idle
engine sends nothing); the tensor-parallel all-reduces inside a step run on the node's
*TP* group, bounded by ``dist_timeout``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch_topg.engine.batch import PackedBatch
from torch_topg.engine.model_runner import ModelRunner, _fresh_copy, _mark_dynamic
from torch_topg.engine.tp import (
    CMD_COPY,
    CMD_STEP,
    CMD_STOP,
    HEADER,
    IDLE_TIMEOUT,
    decode,
    payload_size,
)
from torch_topg.parallel.pipeline import Stage, check_pipeline_family

CMD_STATS = 4  # header [CMD_STATS, reset, 0, 0, 0]: each leader adds its row, in order
#: per stage: compute_s, idle_s (waiting for work), comm_s (sends, receives after the
#: first bytes arrived), steps, wall_s (since the last reset)
STAT_FIELDS = ("compute_s", "idle_s", "comm_s", "steps", "wall_s")


@dataclass
class Spec:
    """What rank 0 tells every rank (``broadcast_object_list`` on the world group)."""

    device_type: str
    dtype: str
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    compile: bool
    deterministic: bool
    quantization: Any
    nnodes: int
    tp_size: int
    stages: list[tuple[int, int]]
    signature: str  # the checkpoint's shape, checked against each node's own


@dataclass
class Topology:
    """Who is who: ``world = nnodes * tp_size`` ranks, node ``n`` holds ranks
    ``[n * tp_size, (n + 1) * tp_size)`` and runs stage ``n``."""

    nnodes: int
    tp_size: int
    rank: int

    @property
    def node(self) -> int:
        return self.rank // self.tp_size

    @property
    def local(self) -> int:
        return self.rank % self.tp_size

    def leader(self, node: int) -> int:
        return node * self.tp_size


@dataclass
class Groups:
    """This rank's process groups (every rank creates all of them, in this order)."""

    tp: Any  # this node's TP group (None: tp_size 1)
    cmd: Any  # this node's command group (None: tp_size 1)
    pipe: Any  # the leaders' point-to-point group (NON_GROUP_MEMBER off the leaders)


def make_groups(topo: Topology, timeout_s: float) -> Groups:
    tp = cmd = None
    if topo.tp_size > 1:
        nodes = [list(range(n * topo.tp_size, (n + 1) * topo.tp_size)) for n in range(topo.nnodes)]
        tps = [dist.new_group(r, timeout=timedelta(seconds=timeout_s)) for r in nodes]
        cmds = [dist.new_group(r, backend="gloo", timeout=IDLE_TIMEOUT) for r in nodes]
        tp, cmd = tps[topo.node], cmds[topo.node]
    leaders = [topo.leader(n) for n in range(topo.nnodes)]
    pipe = dist.new_group(leaders, backend="gloo", timeout=IDLE_TIMEOUT)
    return Groups(tp, cmd, pipe)


def signature(config: Any) -> str:
    """What must match between the nodes' checkpoints (each node loads its own copy)."""
    t = config.get_text_config()
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "intermediate_size")  # fmt: skip
    return json.dumps({k: getattr(t, k, None) for k in keys}, sort_keys=True)


def hidden_size(config: Any) -> int:
    return config.get_text_config().hidden_size


# --- the stage model and its runner ---------------------------------------------------
def build_stage(
    folder: str | Path, config: Any, stage: Stage, dtype: torch.dtype, device: torch.device,
    quantization: Any, tp_group: Any,
) -> torch.nn.Module:  # fmt: skip
    """The stage's model, reading only its parameters (its layers', and the embedding /
    norm / LM head it holds) from the checkpoint; tensor parallel over ``tp_group``."""
    from torch_topg.parallel import empty_model, tensor_parallel
    from torch_topg.parallel.pipeline import load_stage, pipeline_stage
    from torch_topg.quant.loading import apply_quantization

    model = pipeline_stage(empty_model(config, dtype), stage)
    if tp_group is not None:
        tensor_parallel(model, process_group=tp_group, checkpoint=folder, device=device)
    else:
        load_stage(model, folder, dtype, device)
    return apply_quantization(model, quantization).eval()


def stage_step(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    hidden: torch.Tensor | None,
    positions: torch.Tensor,
    logits_indices: torch.Tensor,
    kv_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> torch.Tensor:
    """One stage of the step: hidden states ``[1, T, H]`` out (the last stage: logits
    ``[R, vocab]``); the first stage starts from the token ids, the others from
    ``hidden``, the previous stage's output."""
    kw: dict[str, Any] = dict(
        position_ids=positions, use_cache=False, topg_kv_caches=kv_caches,
        topg_slot_mapping=slot_mapping, topg_block_tables=block_tables,
        topg_seq_lens=seq_lens, topg_cu_seqlens_q=cu_seqlens_q,
    )  # fmt: skip
    if hidden is None:
        kw["input_ids"] = input_ids
    else:
        kw["inputs_embeds"] = hidden
    if model.topg_pp.last:
        return model(logits_to_keep=logits_indices, **kw).logits[0]
    return getattr(model, model.base_model_prefix)(**kw).last_hidden_state


class StageRunner(ModelRunner):
    """A :class:`ModelRunner` over one stage: KV caches for its layers only;
    :meth:`run_stage` runs the stage's part of a step."""

    def __init__(self, model: torch.nn.Module, **kw: Any) -> None:
        self.stage: Stage = model.topg_pp
        super().__init__(model, layers=self.stage.layers, decode_plan=False, **kw)
        self._stage_step = stage_step
        if self.compiled:
            self._stage_step = torch.compile(
                _fresh_copy(stage_step), backend=self._counting_backend()
            )

    def run_stage(self, b: PackedBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        args = (self.model, b.input_ids, hidden, b.positions, b.logits_indices, self.kv_caches,
                b.slot_mapping, b.block_tables, b.seq_lens, b.cu_seqlens_q)  # fmt: skip
        if self.compiled:
            _mark_dynamic(b)
            if hidden is not None and hidden.shape[1] >= 2:
                torch._dynamo.maybe_mark_dynamic(hidden, 1)
        with torch.inference_mode():
            out = self._stage_step(*args)
        return out.float() if self.stage.last else out


class StageTimes:
    """A leader's figures for ``CMD_STATS`` (see ``STAT_FIELDS``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.compute_s = self.idle_s = self.comm_s = 0.0
        self.steps = 0
        self.since = time.perf_counter()

    def row(self) -> list[float]:
        wall = time.perf_counter() - self.since
        return [self.compute_s, self.idle_s, self.comm_s, float(self.steps), wall]


# --- the loop of every rank > 0 ---------------------------------------------------------
class StageLoop:
    """Runs the commands rank 0 sends until ``CMD_STOP``."""

    def __init__(self, topo: Topology, groups: Groups, runner: StageRunner, spec: Spec,
                 device: torch.device, hidden: int) -> None:  # fmt: skip
        self.topo, self.g, self.runner, self.spec = topo, groups, runner, spec
        self.device, self.hidden = device, hidden
        self.dtype = getattr(torch, spec.dtype.rsplit(".", 1)[-1])  # the hidden states'
        self.leader = topo.local == 0
        st = runner.stage
        self.prev = topo.leader(st.index - 1) if st.index > 0 else None
        self.next = topo.leader(st.index + 1) if not st.last else 0  # the last: to rank 0
        self.pending: list[tuple[Any, torch.Tensor]] = []  # sends in flight
        self.times = StageTimes()

    def take(self, t: torch.Tensor, idle: bool = False) -> None:
        """Receive ``t``: a leader from the previous stage's leader (node 0's ranks get
        everything from rank 0's broadcast), then the node's broadcast."""
        t0 = time.perf_counter()
        if self.leader and self.prev is not None:
            dist.recv(t, self.prev, group=self.g.pipe)
        if self.g.cmd is not None:
            dist.broadcast(t, self.topo.leader(self.topo.node), group=self.g.cmd)
        spent = time.perf_counter() - t0
        if idle:
            self.times.idle_s += spent
        else:
            self.times.comm_s += spent

    def give(self, t: torch.Tensor) -> None:
        """A leader sends ``t`` on (the last stage: to rank 0) without waiting."""
        if not self.leader:
            return
        t0 = time.perf_counter()
        self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(t, self.next, group=self.g.pipe), t))
        self.times.comm_s += time.perf_counter() - t0

    def forward(self, t: torch.Tensor) -> None:
        """Commands go down the pipeline (not back from the last stage)."""
        if not self.runner.stage.last:
            self.give(t)

    def run(self) -> None:
        header = torch.empty(HEADER, dtype=torch.long)
        while True:
            # node 0's ranks follow rank 0's broadcast; other stages wait on their leader
            self.take(header, idle=True)
            code = int(header[0])
            if code != CMD_STEP:  # a step's header goes on with its hidden states
                self.forward(header.clone())
            if code == CMD_STOP:
                break
            if code == CMD_COPY:
                pairs = torch.empty(2 * int(header[1]), dtype=torch.long)
                self.take(pairs)
                self.forward(pairs)
                self.runner.copy_blocks([tuple(p) for p in pairs.view(-1, 2).tolist()])
            elif code == CMD_STATS:
                self.stats(reset=bool(header[1]))
            elif code == CMD_STEP:
                self.step(header)
            else:
                raise RuntimeError(f"pipeline: unknown command {code} from rank 0")
        for w, _ in self.pending:
            w.wait()

    def step(self, header: torch.Tensor) -> None:
        payload = torch.empty(payload_size(header), dtype=torch.long)
        self.take(payload)
        hidden = None
        if not self.runner.stage.first:
            hidden = torch.empty(1, int(header[1]), self.hidden, dtype=self.dtype)
            self.take(hidden)
        t0 = time.perf_counter()
        out = self.runner.run_stage(decode(header, payload, self.device), hidden)
        self.times.compute_s += time.perf_counter() - t0
        self.times.steps += 1
        if self.runner.stage.last:  # a one-element "ready", then the logits
            self.give(torch.ones(1))
        else:
            self.give(header.clone())
            self.give(payload)
        self.give(out.cpu().contiguous())

    def stats(self, reset: bool) -> None:
        """Leaders fill their row of the table and pass it on (the last: to rank 0)."""
        if not self.leader:
            return
        table = torch.empty(self.topo.nnodes, len(STAT_FIELDS), dtype=torch.float64)
        dist.recv(table, self.prev, group=self.g.pipe)
        table[self.runner.stage.index] = torch.tensor(self.times.row(), dtype=torch.float64)
        self.give(table)
        if reset:
            self.times.reset()


def serve_rank(topo: Topology, folder: str | Path, device: Any, timeout_s: float) -> None:
    """A rank > 0 after ``init_process_group``: groups, spec, stage model, ready, loop."""
    from transformers import AutoConfig

    from torch_topg.engine.tp import _dtype
    from torch_topg.parallel.pipeline import Stage

    groups = make_groups(topo, timeout_s)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    spec = Spec(**box[0])
    config = AutoConfig.from_pretrained(folder)
    if signature(config) != spec.signature:
        raise ValueError(
            f"Engine(nnodes={topo.nnodes}): node_rank {topo.node}'s checkpoint {folder} is "
            f"not node 0's: {signature(config)} != {spec.signature}"
        )
    if device is None:
        device = f"cuda:{topo.local}" if spec.device_type == "cuda" else "cpu"
    device = torch.device(device)
    start, end = spec.stages[topo.node]
    stage = Stage(topo.node, topo.nnodes, start, end)
    model = build_stage(folder, config, stage, _dtype(spec.dtype), device, spec.quantization,
                        groups.tp)  # fmt: skip
    kv_heads = model.topg_tp.heads.kv[model.topg_tp.rank] if groups.tp is not None else None
    runner = StageRunner(
        model, num_blocks=spec.num_blocks, block_size=spec.block_size,
        max_blocks_per_seq=spec.max_blocks_per_seq, kv_heads=kv_heads, compile=spec.compile,
    )  # fmt: skip
    restore = None
    if spec.deterministic:
        from torch_topg.modes import batch_invariant_mode

        restore = batch_invariant_mode()
    dist.all_reduce(torch.ones(1, dtype=torch.long))  # ready (see pp.py)
    try:
        StageLoop(topo, groups, runner, spec, device, hidden_size(config)).run()
    finally:
        if restore is not None:
            restore()


# --- joining ----------------------------------------------------------------------------
def node_key(node: int) -> str:
    return f"topg/pp/node/{node}"


def up_key(rank: int) -> str:
    return f"topg/pp/up/{rank}"


def connect(args: Any, world: int) -> Any:
    """A node's client of node 0's store; a clear error when node 0 is not reachable."""
    timeout = timedelta(seconds=args.dist_timeout)
    try:
        return dist.TCPStore(args.master_addr, args.master_port, world, is_master=False,
                             timeout=timeout)  # fmt: skip
    except Exception as e:
        raise TimeoutError(
            f"Engine(nnodes={args.nnodes}): node_rank {args.node_rank} could not reach node 0 "
            f"at {args.master_addr}:{args.master_port} within {args.dist_timeout:.0f} s "
            f"(dist_timeout): {type(e).__name__}: {e}"
        ) from None


def worker(rank: int, topo: tuple[int, int], host: str, port: int, backend: str, device: str,
           threads: int | None, timeout_s: float, folder: str) -> None:  # fmt: skip
    """A spawned rank (local rank > 0 of any node): join, then :func:`serve_rank`."""
    from torch_topg.parallel import failure_guard

    if threads:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    nnodes, tp = topo
    world = nnodes * tp
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        store.set(up_key(rank), "1")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)  # fmt: skip
        with failure_guard():
            serve_rank(Topology(nnodes, tp, rank), folder, device, timeout_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_local(procs: list[Any], topo: Topology, host: str, port: int, device: torch.device,
                threads: int | None, timeout_s: float, folder: str) -> None:  # fmt: skip
    """Start this node's ranks ``local 1 .. tp_size - 1`` (this process is local 0)."""
    import multiprocessing as mp

    backend = "nccl" if device.type == "cuda" else "gloo"
    ctx = mp.get_context("spawn")
    base = device.index or 0
    for local in range(1, topo.tp_size):
        rank = topo.rank + local
        dev = f"cuda:{base + local}" if device.type == "cuda" else "cpu"
        p = ctx.Process(
            target=worker,
            args=(
                rank,
                (topo.nnodes, topo.tp_size),
                host,
                port,
                backend,
                dev,
                threads,
                timeout_s,
                folder,
            ),
            name=f"topg-pp-rank{rank}",
            daemon=True,
        )
        p.start()
        procs.append(p)


def wait_keys(store: Any, keys: list[str], procs: list[Any], timeout_s: float) -> list[str]:
    """Wait until the store has ``keys`` (or a local process died, or ``timeout_s``);
    returns the keys still missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [k for k in keys if not store.check([k])]
        dead = [p for p in procs if p.exitcode is not None]
        if not missing or dead or time.monotonic() > deadline:
            if dead:
                p = dead[0]
                raise RuntimeError(f"pipeline: local rank process {p.name} (pid {p.pid}) "
                                   f"exited with code {p.exitcode} while joining")  # fmt: skip
            return missing
        time.sleep(0.02)


def run_node(model: Any, args: Any) -> None:
    """Node ``args.node_rank > 0``: join node 0, start the node's other ranks, run the
    node's stage until node 0's engine stops it (``from_pretrained`` on a node > 0)."""
    from torch_topg.engine.config import device_of
    from torch_topg.parallel import failure_guard

    folder, _ = check_checkpoint(model, args)
    topo = Topology(args.nnodes, args.tp_size, args.node_rank * args.tp_size)
    world = args.nnodes * args.tp_size
    device = device_of(args)
    store = connect(args, world)
    me = {"host": socket.gethostname(), "tp_size": args.tp_size, "pid": os.getpid()}
    store.set(node_key(args.node_rank), json.dumps(me))
    procs: list[Any] = []
    threads = None
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        if device.type == "cpu" and args.tp_size > 1:
            threads = max(1, torch.get_num_threads() // args.tp_size)
            torch.set_num_threads(threads)
        spawn_local(procs, topo, args.master_addr, args.master_port, device, threads,
                    args.dist_timeout, str(folder))  # fmt: skip
        timeout = timedelta(seconds=args.dist_timeout)
        dist.init_process_group(backend, store=store, rank=topo.rank, world_size=world,
                                timeout=timeout)  # fmt: skip
        with failure_guard():
            serve_rank(topo, folder, args.device, args.dist_timeout)
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.terminate()
                p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()


def check_checkpoint(model: Any, args: Any) -> tuple[Path, Any]:
    """A safetensors folder of a family that can be cut into stages (each node reads
    only its layers' tensors); its config."""
    from transformers import AutoConfig

    from torch_topg.engine.loading import check_supported, resolve

    where = f"Engine: nnodes={args.nnodes}"
    folder, gguf = resolve(model)
    if gguf:
        raise ValueError(
            f"{where} needs a safetensors checkpoint folder (each node reads only its "
            f"layers); {folder / gguf} is a GGUF file"
        )
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{where} needs safetensors weights; {folder} has none")
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    try:
        check_pipeline_family(config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return folder, config
