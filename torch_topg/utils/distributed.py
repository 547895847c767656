"""Small torch.distributed helpers shared by the collective ops and ``torch_topg.parallel``.

A failing rank publishes its error in the process group's store
(:func:`publish_failure`); a rank whose collective then fails (the peer's sockets
closed) or times out reads it back (:func:`peer_failure`) so that it reports *why* the
group broke, not only that a connection closed.
"""

from __future__ import annotations

import torch.distributed as dist

#: Store key a failing rank writes ``"rank <r>: <Type>: <message>"`` under.
FAILURE_KEY = "topg/failure"


def _store():  # type: ignore[no-untyped-def]
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not initialised, or the store is gone
        return None


def publish_failure(exc: BaseException) -> None:
    """Records ``exc`` as this rank's failure in the default store (best effort)."""
    store = _store()
    if store is None:
        return
    rank = dist.get_rank() if dist.is_initialized() else -1
    text = f"rank {rank}: {type(exc).__name__}: {exc}"
    try:
        store.set(FAILURE_KEY, text[:2000])
    except Exception:  # the store's server (rank 0) may already be gone
        pass


def peer_failure() -> str | None:
    """The failure another rank published, if any (non-blocking)."""
    store = _store()
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode(errors="replace")
    except Exception:
        return None
    return None
