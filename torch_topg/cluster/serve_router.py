"""The router's core (:class:`~torch_topg.cluster.router.PrefixRouter`) as Ray Serve's
request router of the ``engine`` deployment.

Serve calls :meth:`TopgRequestRouter.choose_replicas` for each request sent through the
ingress's handle; the request's :class:`~torch_topg.cluster.replica.Route` (a keyword
argument) carries its prompt hashes and session. The core is one object per process
and application (:func:`torch_topg.cluster.router.core_for`; not here: Serve ships this
module to the handle's process by value, with copies of its globals): the ingress feeds it the KV events and reads its
state; Serve's callbacks keep its membership (replicas added, removed, dead) and its
loads (a request routed, a request completed) exact.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from torch_topg.cluster.router import NoReplica, PrefixRouter, core_for


def _route(pending: PendingRequest | None) -> Any:
    return pending.kwargs.get("route") if pending is not None else None


class TopgRequestRouter(RequestRouter):
    """Session-, prefix- and load-aware choice (the core's), in Serve's router."""

    @property
    def core(self) -> PrefixRouter:
        return core_for(self._deployment_id.app_name)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        route = _route(pending_request)
        if route is None:
            return [candidate_replicas]
        if route.pin is not None:  # a call for one replica: it or nothing
            return [[by_id[route.pin]]] if route.pin in by_id else []
        try:
            d = self.core.decide(route.hashes, route.session, candidates=list(by_id))
        except NoReplica:
            return [candidate_replicas]  # the core knows none alive yet: Serve's list
        route.reason = d.reason
        first = by_id[d.replica]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:  # fmt: skip
        route = _route(pending_request)
        rid = replica_id.unique_id
        if route is not None:
            route.replica = rid
        self.core.routed(rid, route.session if route is not None and route.pin is None else None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.core.done(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.core.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.core.mark_dead(replica_id.unique_id)
