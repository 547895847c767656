"""The server's metrics also under vLLM's names (``vllm:...``, with a ``model_name``
label), so dashboards and autoscalers written for vLLM read this server unchanged.

Each alias is a copy of one topg family at scrape time: the same samples, renamed (and
``finish_reason`` -> vLLM's ``finished_reason``); nothing is measured twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import Metric

#: topg family -> vLLM's name for the same figure
VLLM_NAMES = {
    "topg_num_requests_running": "vllm:num_requests_running",
    "topg_num_requests_waiting": "vllm:num_requests_waiting",
    "topg_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",  # vLLM's is a fraction too
    "topg_engine_preemptions": "vllm:num_preemptions",
    "topg_prompt_tokens": "vllm:prompt_tokens",
    "topg_generation_tokens": "vllm:generation_tokens",
    "topg_request_finished": "vllm:request_success",
    "topg_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "topg_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "topg_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "topg_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "topg_prefix_cache_query_tokens": "vllm:prefix_cache_queries",
    "topg_prefix_cache_hit_tokens": "vllm:prefix_cache_hits",
}
_LABELS = {"finish_reason": "finished_reason"}


class VllmAliases:
    """A collector emitting, for each family of ``sources`` (collectors) that
    :data:`VLLM_NAMES` lists, a copy under vLLM's name; with ``include_sources`` the
    families themselves too (a source registered only through this wrapper is collected
    once a scrape, so a family and its alias hold the same values)."""

    def __init__(
        self,
        sources: Iterable[object],
        model_name: Callable[[], str],
        include_sources: bool = False,
    ) -> None:
        self._sources = list(sources)
        self._model = model_name
        self._include = include_sources

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        model = self._model()
        for source in self._sources:
            for family in source.collect():
                if self._include:
                    yield family
                alias = VLLM_NAMES.get(family.name)
                if alias is None:
                    continue
                out = Metric(alias, family.documentation, family.type)
                for s in family.samples:
                    labels = {_LABELS.get(k, k): v for k, v in s.labels.items()}
                    name = alias + s.name[len(family.name) :]  # _total, _bucket, _sum, ...
                    out.add_sample(name, {"model_name": model, **labels}, s.value, s.timestamp)
                yield out
