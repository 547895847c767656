"""Replicas of the engine behind one OpenAI endpoint, on Ray Serve (docs/cluster.md).

:mod:`torch_topg.cluster.router` is the routing core (plain Python); the Ray pieces
(``replica``, ``ingress``, ``serve_router``, ``deploy``) import Ray, which the
``cluster`` extra installs.
"""
