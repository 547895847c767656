"""Pipeline parallelism across nodes: ``Engine.from_pretrained(model, nnodes=N, ...)``.

Every node runs the same command with its own ``node_rank`` (SGLang's ``--nnodes`` /
``--node-rank`` / ``--dist-init-addr``): node 0 (``node_rank=0``) builds the engine, the
others are headless (``from_pretrained`` runs their stage and returns None once node 0
shuts down; ``serve`` starts no HTTP server there). The decoder layers are split into
``nnodes`` consecutive stages, one per node, balanced by the weight bytes each reads per
decode step or as ``pp_layers`` says (:func:`plan_stages`); inside a
node, ``tp_size`` ranks shard the stage by tensor parallelism as on one machine
(``tp.py``). World: ``nnodes * tp_size`` ranks; node ``n`` holds ranks
``[n * tp_size, (n + 1) * tp_size)``; rank 0 is the engine.

Joining. Node 0 hosts a ``TCPStore`` at ``master_port`` (every interface) and starts its
own other ranks; each other node connects to ``master_addr:master_port``, announces itself
(``topg/pp/node/<n>``: host, tp_size, pid) and starts its ranks. Node 0 waits
``dist_timeout`` seconds for every node: one that does not join is a ``TimeoutError``
naming its ``node_rank``, the address it should reach and the timeout (the processes
started are stopped). Then ``init_process_group`` over the store (gloo on CPUs; NCCL for
the TP groups on GPUs), the groups of ``pp_node.make_groups``, the :class:`Spec`
broadcast, each rank builds its stage reading only its tensors, and one all-reduce says
every rank is ready.

A step. Rank 0 packs the batch as ``tp.py`` does (header + one int64 payload),
broadcasts it to its node's ranks, runs stage 0, and sends header, payload and hidden
states ``[1, T, H]`` to node 1's leader without waiting (``isend``); each leader passes
header and payload on at once, runs its stage on what it received, and sends its hidden
states on; the last stage's leader sends the sampled rows' logits ``[R, vocab]`` (fp32)
back to rank 0, which samples. :meth:`PipelineRunner.dispatch` returns as soon as stage
0 is done, so the engine (``pipelined.py``) dispatches the next micro-batch while the
other stages run this one; :meth:`PipelineRunner.collect` waits for its logits.

Failures. Rank 0 waits at most ``dist_timeout`` for a stage's answer; a node that closed
its sockets fails the wait at once. Either way the step raises ``RuntimeError`` naming
the stage it waited for (and the failure a rank published, ``failure_guard``), the
engine is broken and later steps raise the same error, as with ``tp.py``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torch_topg.engine.batch import PackedBatch
from torch_topg.engine.pp_node import (
    CMD_STATS,
    STAT_FIELDS,
    Groups,
    Spec,
    StageRunner,
    StageTimes,
    Topology,
    build_stage,
    check_checkpoint,
    make_groups,
    node_key,
    signature,
    spawn_local,
    up_key,
    wait_keys,
)
from torch_topg.engine.tp import CMD_COPY, CMD_STOP, TPGroup, _active, encode
from torch_topg.parallel.pipeline import Stage, balance_layers, byte_table, stages_of


@dataclass
class Ticket:
    """A micro-batch in flight: the rows its logits will have."""

    rows: int
    sent: list[Any] = field(default_factory=list)  # (work, tensor) of its sends


class PipelineGroup(TPGroup):
    """Rank 0's side: node 0's own processes (TPGroup's), the groups, and a STOP that
    goes down the pipeline too."""

    def __init__(self, args: Any, topo: Topology) -> None:
        super().__init__(args.tp_size, [], owns_world=True)
        self.args, self.topo = args, topo
        self.label = f"Engine(nnodes={args.nnodes}, tp_size={args.tp_size})"
        self.workers = "pipeline's nodes"
        self.timeout_s = args.dist_timeout
        self.timeout_name = "dist_timeout"
        self.groups: Groups | None = None
        self.spec_stages: list[tuple[int, int]] = []  # each stage's layers [start, end)

    def close(self, graceful: bool = True, timeout_s: float = 30.0) -> None:
        with self.lock:
            stop = graceful and not self._closed and self.broken is None
            stop = stop and self.groups is not None and not self.dead()
        if stop:
            try:  # the other nodes stop; node 0's own ranks get TPGroup's STOP
                h = torch.tensor([CMD_STOP, 0, 0, 0, 0], dtype=torch.long)
                w = dist.isend(h, self.topo.leader(1), group=self.groups.pipe)
                w.wait(timedelta(seconds=self.timeout_s))
            except Exception:
                pass
        super().close(graceful, timeout_s)


class PipelineRunner(StageRunner):
    """Rank 0's runner: stage 0, and the engine's end of the pipeline
    (:meth:`dispatch` / :meth:`collect`; :meth:`execute` is both, for warm-up)."""

    def __init__(self, model: torch.nn.Module, *, group: PipelineGroup, vocab: int,
                 **kw: Any) -> None:  # fmt: skip
        super().__init__(model, **kw)
        self.group = group
        self.vocab = vocab
        self.pipeline_depth = group.args.nnodes  # micro-batches in flight (pipelined.py)
        self.times = StageTimes()
        self._pending: list[tuple[Any, torch.Tensor]] = []

    @property
    def broken(self) -> str | None:
        return self.group.broken

    # --- the pipe -------------------------------------------------------------------
    def _check(self) -> None:
        g = self.group
        if g.broken is not None:
            raise RuntimeError(g.broken)
        if g.closed:
            raise RuntimeError(f"{g.label}: the pipeline's nodes are stopped")
        gone = g.dead()
        if gone:
            raise g.failure(RuntimeError(gone), "a step")

    def _send(self, t: torch.Tensor, node_too: bool = True) -> None:
        """To node 0's ranks (a bounded broadcast) and on to node 1 (not waiting)."""
        g = self.group
        if node_too and g.groups.cmd is not None:
            w = dist.broadcast(t, 0, group=g.groups.cmd, async_op=True)
            g.wait(w, "sending a step to node 0's ranks", g.timeout_s)
        self._pending = [(w, x) for w, x in self._pending if not w.is_completed()]
        self._pending.append((dist.isend(t, g.topo.leader(1), group=g.groups.pipe), t))

    def _recv(self, t: torch.Tensor, what: str) -> None:
        """From the last stage's leader, bounded by ``dist_timeout`` (a gloo receive is
        complete only once waited for: no polling, one bounded wait)."""
        g = self.group
        last = g.topo.nnodes - 1
        w = dist.irecv(t, g.topo.leader(last), group=g.groups.pipe)
        try:
            w.wait(timedelta(seconds=g.timeout_s))
        except Exception as e:
            raise RuntimeError(f"{what}: {lost_node(e, last, g.topo, g.timeout_s)}") from e

    def dispatch(self, b: PackedBatch) -> Ticket:
        """Send the step down the pipeline and run stage 0; returns at once after."""
        g = self.group
        with g.lock:
            self._check()
            try:
                # node 0's ranks get the batch first (they run stage 0 too); node 1 gets
                # it with the hidden states, so its wait for them is idle time, not
                # transfer time
                t0 = time.perf_counter()
                header, payload = encode(b)
                if g.groups.cmd is not None:
                    for t in (header, payload):
                        w = dist.broadcast(t, 0, group=g.groups.cmd, async_op=True)
                        g.wait(w, "sending a step to node 0's ranks", g.timeout_s)
                t1 = time.perf_counter()
                hidden = self.run_stage(b, None)
                t2 = time.perf_counter()
                for t in (header, payload, hidden.cpu().contiguous()):
                    self._send(t, node_too=False)
                self.times.comm_s += (t1 - t0) + (time.perf_counter() - t2)
                self.times.compute_s += t2 - t1
                self.times.steps += 1
                return Ticket(b.logits_indices.numel())
            except Exception as e:
                raise g.failure(e, "a step") from e

    def collect(self, ticket: Ticket) -> torch.Tensor:
        """The logits ``[R, vocab]`` (fp32) of the oldest micro-batch in flight."""
        g = self.group
        with g.lock:
            self._check()
            try:
                t0 = time.perf_counter()
                self._recv(torch.empty(1), "waiting for a step's logits")
                t1 = time.perf_counter()
                logits = torch.empty(ticket.rows, self.vocab)
                self._recv(logits, "receiving a step's logits")
                self.times.idle_s += t1 - t0
                self.times.comm_s += time.perf_counter() - t1
            except Exception as e:
                raise g.failure(e, "a step") from e
        return logits.to(self.device)

    def execute(self, b: PackedBatch) -> torch.Tensor:
        return self.collect(self.dispatch(b))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Every rank of every stage copies its layers' blocks, in order with the steps."""
        if not pairs:
            return
        g = self.group
        with g.lock:
            self._check()
            header = torch.tensor([CMD_COPY, len(pairs), 0, 0, 0], dtype=torch.long)
            try:
                self._send(header)
                self._send(torch.tensor([x for p in pairs for x in p], dtype=torch.long))
            except Exception as e:
                raise g.failure(e, "a block copy") from e
            super().copy_blocks(pairs)

    def pipeline_stats(self, reset: bool = False) -> dict[str, Any]:
        """Each stage's figures since the last reset (``STAT_FIELDS``), asked of every
        node down the pipeline: ``{"stages": [{field: value, "idle_fraction": ...}]}``.
        Call it between steps (the engine idle), e.g. around a benchmark."""
        g = self.group
        n = g.topo.nnodes
        with g.lock:
            self._check()
            table = torch.zeros(n, len(STAT_FIELDS), dtype=torch.float64)
            table[0] = torch.tensor(self.times.row(), dtype=torch.float64)
            try:
                self._send(torch.tensor([CMD_STATS, int(reset), 0, 0, 0], dtype=torch.long))
                self._send(table, node_too=False)
                self._recv(table, "collecting the stages' figures")
            except Exception as e:
                raise g.failure(e, "collecting figures") from e
            if reset:
                self.times.reset()
        stages = []
        for i, row in enumerate(table.tolist()):
            d = dict(zip(STAT_FIELDS, row, strict=True))
            d["stage"], d["layers"] = i, list(g.spec_stages[i])
            d["idle_fraction"] = d["idle_s"] / d["wall_s"] if d["wall_s"] else 0.0
            d["comm_s_per_step"] = d["comm_s"] / d["steps"] if d["steps"] else 0.0
            stages.append(d)
        return {"stages": stages}


def lost_node(err: BaseException, node: int, topo: Topology, timeout_s: float) -> str:
    """What a failed wait on ``node`` says: it did not answer within ``dist_timeout`` (a
    node that hangs, or a host gone without closing its connections), or it is lost (its
    connection closed: the process died, ``SIGKILL`` included, or its host rebooted).
    gloo's own words follow, without its source path and advice."""
    who = f"node_rank {node} (rank {topo.leader(node)})"
    text = str(err)
    if "timed out" in text.lower() or isinstance(err, TimeoutError):
        return f"{who} did not answer within {timeout_s:g} s (dist_timeout)"
    short = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0].strip()
    return f"{who} is lost: its connection closed ({short})"


def start_pp_engine(cls: type, model: Any, args: Any) -> Any:
    """Node 0 of a pipeline-parallel engine (see the module docstring)."""
    from torch_topg.engine.config import device_of, dtype_of, resolve
    from torch_topg.engine.loading import has_tokenizer
    from torch_topg.engine.setup import logits_width
    from torch_topg.engine.tp import _kv_split, _load_generation_config

    folder, config = check_checkpoint(model, args)
    nnodes, tp = args.nnodes, args.tp_size
    kv = _kv_split(config, tp) if tp > 1 else (None,)
    device = device_of(args)
    dtype = dtype_of(args, device)
    stages = plan_stages(config, args, dtype)
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            f"Engine: nnodes={nnodes} starts its own process group; this process already "
            "has one (torchrun): launch one process per node instead"
        )
    if _active:
        raise ValueError("Engine: this process already runs a multi-process engine; shut it down first")  # fmt: skip
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    # One block id space on every rank; the budget is node 0's (its stage's layers).
    heads = (sum(kv) if device.type == "cpu" else max(kv)) if tp > 1 else None
    longest = max(s.end - s.start for s in stages)
    cfg = resolve(args, config, device=device, dtype=dtype, kv_heads=heads, num_layers=longest)
    max_blocks = -(-cfg.max_model_len // args.block_size)
    topo = Topology(nnodes, tp, 0)
    world = nnodes * tp
    group = PipelineGroup(args, topo)
    group.spec_stages = [(s.start, s.end) for s in stages]
    _active.append(group)
    timeout = timedelta(seconds=args.dist_timeout)
    try:
        store = dist.TCPStore(args.master_addr, args.master_port, world, is_master=True,
                              timeout=timeout, wait_for_workers=False)  # fmt: skip
        group.store = store
        threads = None
        if device.type == "cpu" and tp > 1:
            prev = torch.get_num_threads()
            threads = max(1, prev // tp)
            torch.set_num_threads(threads)
            group._restore.append(lambda: torch.set_num_threads(prev))
        spawn_local(group.procs, topo, "127.0.0.1", store.port, device, threads,
                    args.dist_timeout, str(folder))  # fmt: skip
        _wait_for_nodes(group, store, args, world)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=store, rank=0, world_size=world, timeout=timeout)
        group.groups = make_groups(topo, args.dist_timeout)
        group.cmd = group.groups.cmd  # TPGroup's STOP to node 0's ranks
        spec = Spec(device.type, str(dtype), cfg.num_blocks, args.block_size, max_blocks,
                    args.compile, args.deterministic, args.quantization, nnodes, tp,
                    group.spec_stages, signature(config))  # fmt: skip
        dist.broadcast_object_list([asdict(spec)], src=0)
        m = build_stage(folder, config, stages[0], dtype, device, args.quantization,
                        group.groups.tp)  # fmt: skip
        _load_generation_config(m, folder)
        tok = None
        if has_tokenizer(folder):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(folder)
        kv_heads = m.topg_tp.heads.kv[0] if tp > 1 else None
        vocab = logits_width(m) if stages[0].last else config.get_text_config().vocab_size
        runner = PipelineRunner(
            m, group=group, vocab=vocab, num_blocks=cfg.num_blocks, block_size=args.block_size,
            max_blocks_per_seq=max_blocks, kv_heads=kv_heads, compile=args.compile,
        )  # fmt: skip
        ready = dist.all_reduce(torch.ones(1, dtype=torch.long), async_op=True)
        group.wait(ready, "loading the model on the nodes", max(600.0, args.dist_timeout))
        runner.times.reset()
        return cls(m, tok, cfg, runner=runner, on_shutdown=[group.close])
    except BaseException:
        group.close(graceful=False)
        raise


def plan_stages(config: Any, args: Any, dtype: torch.dtype) -> list[Stage]:
    """The stages: ``pp_layers`` as given (checked against the model), else balanced by
    the bytes each stage reads per decode step (``balance_layers`` over the model's
    ``byte_table``, measured on a meta copy: no weights read)."""
    from torch_topg.engine.errors import ParameterError
    from torch_topg.parallel import empty_model

    num_layers = config.get_text_config().num_hidden_layers
    if args.pp_layers is not None:
        try:
            return stages_of(args.pp_layers, num_layers)
        except ValueError as e:
            raise ParameterError("pp_layers", str(e).removeprefix("pp_layers: ")) from None
    layer_bytes, head_bytes = byte_table(empty_model(config, dtype))
    return balance_layers(layer_bytes, head_bytes, args.nnodes)


def _wait_for_nodes(group: PipelineGroup, store: Any, args: Any, world: int) -> None:
    """Every node announced itself within ``dist_timeout``, with node 0's ``tp_size``,
    and every rank reached the store; else an error naming who is missing."""
    t = args.dist_timeout
    nodes = [node_key(n) for n in range(1, args.nnodes)]
    missing = wait_keys(store, nodes, group.procs, t)
    where = f"{args.master_addr}:{args.master_port}"
    if missing:
        ranks = ", ".join(k.rsplit("/", 1)[1] for k in missing)
        raise TimeoutError(
            f"{group.label}: node_rank {ranks} did not join within {t:g} s (dist_timeout): "
            f"node 0 waits at {where} (master_addr:master_port); start each missing node "
            f"with --nnodes {args.nnodes} --node-rank <n> --master-addr {args.master_addr} "
            f"--master-port {args.master_port}"
        )
    for n in range(1, args.nnodes):
        info = json.loads(store.get(node_key(n)))
        if info["tp_size"] != args.tp_size:
            raise ValueError(
                f"{group.label}: node_rank {n} ({info['host']}) has tp_size={info['tp_size']}, "
                f"node 0 has tp_size={args.tp_size}; every node must run the same tp_size"
            )
    ranks = [up_key(r) for r in range(world) if r % args.tp_size != 0]
    missing = wait_keys(store, ranks, group.procs, t)
    if missing:
        raise TimeoutError(
            f"{group.label}: ranks {[k.rsplit('/', 1)[1] for k in missing]} did not start "
            f"within {t:g} s (dist_timeout)"
        )
