"""``python -m torch_topg serve --replicas N``: N engines behind one OpenAI endpoint.

One Ray Serve application (default name ``topg``) of two deployments:

- ``engine``: ``N`` replicas of :class:`~torch_topg.cluster.replica.EngineReplica`, routed
  by :class:`~torch_topg.cluster.serve_router.TopgRequestRouter`; scaling down drains
  (Serve stops routing to a replica, waits for its requests up to ``drain_timeout_s``,
  then stops it);
- ``router``: one :class:`~torch_topg.cluster.ingress.ClusterIngress`, the HTTP endpoint.

Ray: the cluster at ``--ray-address`` (or ``RAY_ADDRESS``, or one started with ``ray
start`` on this machine); when there is none, a local Ray instance for this command
alone. Against a running cluster the command deploys and returns (the application keeps
serving; run it again with another ``--replicas`` to scale in place); with a local
instance it serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from torch_topg.cluster.replica import EngineSpec, RouterOptions
from torch_topg.cluster.router import PrefixRouter

log = logging.getLogger("torch_topg.cluster")


@dataclass
class ClusterSpec:
    engine: EngineSpec
    replicas: int = 2
    router: RouterOptions = field(default_factory=RouterOptions)
    app_name: str = "topg"
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    max_ongoing_requests: int = 256
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.replicas, bool)
            or not isinstance(self.replicas, int)
            or self.replicas < 1
        ):
            raise ValueError(f"replicas: expected an int >= 1, got {self.replicas!r}")
        r = self.router
        PrefixRouter().configure(r.load_ratio, r.load_floor, r.min_prefix_share)  # the checks


def build_app(spec: ClusterSpec) -> Any:
    """The Serve application of ``spec`` (not yet running)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from torch_topg.cluster.ingress import ClusterIngress
    from torch_topg.cluster.replica import EngineReplica

    engines = serve.deployment(
        EngineReplica, name="engine", num_replicas=spec.replicas,
        max_ongoing_requests=spec.max_ongoing_requests,
        ray_actor_options={"num_cpus": spec.cpus_per_replica, "num_gpus": spec.gpus_per_replica},
        graceful_shutdown_timeout_s=spec.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        # by name: imported where the handle routes (the ingress's process)
        request_router_config=RequestRouterConfig(
            request_router_class="torch_topg.cluster.serve_router.TopgRequestRouter"
        ),
    )  # fmt: skip
    ingress = serve.deployment(
        ClusterIngress, name="router", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4096,
    )  # fmt: skip
    return ingress.bind(engines.bind(spec.engine), spec.router)


def deploy(spec: ClusterSpec, *, blocking: bool = False) -> Any:
    """Run (or update in place: scale) the application of ``spec`` on the connected Ray;
    returns the ingress's handle."""
    from ray import serve

    # external_scaler_enabled: the number of replicas can then change alone (scale());
    # running serve.run again would be a new version: a rolling restart of every replica
    # and of the router (its sessions and prefix index lost)
    return serve.run(build_app(spec), name=spec.app_name, route_prefix="/", blocking=blocking,
                     external_scaler_enabled=True)  # fmt: skip


def scale(spec: ClusterSpec, replicas: int, timeout: float = 600.0) -> ClusterSpec:
    """``replicas`` engines for the running application of ``spec``: Serve starts new
    ones, or drains and stops the ones it removes; the others and the router keep
    serving. Returns when the deployment has exactly ``replicas`` running replicas.

    Through the Serve controller's external-scaling call (``update_deployment_replicas``,
    what Serve's REST scaling endpoint calls; no public Python wrapper in Ray 2.60)."""
    from dataclasses import replace

    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    new = replace(spec, replicas=replicas)  # checks the number
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    target = DeploymentID(name="engine", app_name=spec.app_name)
    ray.get(controller.update_deployment_replicas.remote(target, replicas))
    wait_for_replicas(spec.app_name, replicas, timeout)
    return new


def wait_for_replicas(app: str, replicas: int, timeout: float) -> None:
    """Until the ``engine`` deployment of ``app`` has ``replicas`` running replicas and
    no other (starting, stopping); a TimeoutError naming the states otherwise."""
    from ray import serve

    deadline = time.monotonic() + timeout
    states: dict[Any, int] = {}
    while time.monotonic() < deadline:
        states = serve.status().applications[app].deployments["engine"].replica_states
        named = {str(getattr(s, "value", s)): n for s, n in states.items()}
        present = sum(n for s, n in named.items() if s != "STOPPED")
        if named.get("RUNNING", 0) == replicas and present == replicas:
            return
        time.sleep(0.25)
    raise TimeoutError(
        f"deployment 'engine' of {app!r}: {replicas} replicas not reached in {timeout:g} s; now {states}"
    )


# --- the command line ----------------------------------------------------------------
def serve_cluster(argv: list[str]) -> int:
    """``python -m torch_topg serve --replicas N ...`` (the server's flags, plus the
    cluster's: ``serve --help``)."""
    from torch_topg.engine.options import from_cli_args
    from torch_topg.serve.cli import api_keys, chat_options, parser, served_name

    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    try:
        app_options = {"api_key": api_keys(args), "chat": chat_options(args),
                       "allowed_origins": args.allowed_origins or (), "pooling": args.pooling}  # fmt: skip
    except (OSError, ValueError) as e:
        print(e)
        return 2
    return cluster_main(args, from_cli_args(args), served_name(args), app_options)


def cluster_main(
    args: argparse.Namespace,
    engine_options: dict[str, Any],
    served: str,
    app_options: dict[str, Any],
) -> int:
    if args.replicas < 1:
        print(f"--replicas: expected an int >= 1, got {args.replicas}")
        return 2
    if engine_options.get("kv_events_endpoint") is not None:  # one endpoint, N publishers
        print("--kv-events-endpoint: not with --replicas (every replica would publish on the "
              "same endpoint); the router reads the replicas' events itself (docs/cluster.md)")  # fmt: skip
        return 2
    try:
        import ray
        from ray import serve
    except ImportError:
        print("--replicas needs the cluster extra: pip install 'torch_topg[cluster]'")
        return 2
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    local = False
    try:
        ray.init(address=address or "auto", log_to_driver=False)
    except ConnectionError:
        if address:
            raise
        ray.init(log_to_driver=False)  # no cluster running: a local instance for this command
        local = True
    model = args.model

    def tokenizer() -> tuple[Any, int]:
        from torch_topg.engine.loading import load_config

        config, tok = load_config(model)
        return tok, config.get_text_config().vocab_size

    chat = app_options.get("chat")
    spec = ClusterSpec(
        EngineSpec(model=model, options=engine_options, served_name=served, app_options=app_options),
        replicas=args.replicas, app_name=args.app_name,
        router=RouterOptions(load_ratio=args.route_load_ratio, load_floor=args.route_load_floor,
                             min_prefix_share=args.route_min_prefix_share, tokenizer=tokenizer,
                             chat_template=getattr(chat, "template", None)),
        cpus_per_replica=args.replica_cpus, gpus_per_replica=args.replica_gpus,
    )  # fmt: skip
    if not local and args.app_name in serve.status().applications:  # running: scale it
        log.info("%s is running: scaling it to %d replicas (other flags are not applied; "
                 "`serve shutdown` first to redeploy)", args.app_name, args.replicas)  # fmt: skip
        scale(spec, args.replicas)
        return 0
    serve.start(http_options={"host": args.host, "port": args.port})
    deploy(spec)
    log.info("serving %s: %d replicas on http://%s:%d", served, args.replicas, args.host, args.port)
    if not local:
        return 0  # the application keeps running on the cluster
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
