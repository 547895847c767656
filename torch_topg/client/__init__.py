"""Clients of an OpenAI-compatible server, over HTTP only: the load generator
(``python -m torch_topg bench serve``, :mod:`torch_topg.client.loadgen`, with its request
sets in :mod:`torch_topg.client.datasets`) and the terminal monitor
(``python -m torch_topg monitor``, :mod:`torch_topg.client.monitor`).

Nothing here imports the server (:mod:`torch_topg.serve`): they work against any
OpenAI-compatible server (llama.cpp's ``llama-server``, vLLM) as well as ours."""
