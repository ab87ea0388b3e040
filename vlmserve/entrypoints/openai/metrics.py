"""Prometheus metrics of one server app, in its own registry (several apps never collide).

With several front ends (`--api-server-count N`), the supervisor sets `PROMETHEUS_MULTIPROC_DIR`
before spawning them: prometheus_client then keeps every value in a file of that directory per
process, and `/metrics` renders all front ends' files at once (counters and histograms summed,
gauges as their `multiprocess_mode` says), whichever front end the scrape reaches."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from vlmserve.frontend.async_llm import AsyncLLM, RequestTiming

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 2.5)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                 0.1, 0.2, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    """Gauges read from the engine core's stats at scrape time; counters and latency
    histograms fed by the front end's I/O thread as each request finishes (aborted ones
    included) and, for the core's step time, as each step's tokens arrive."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        # read now, like prometheus_client (which chose its value class at import)
        self.multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        r = self.registry = CollectorRegistry()
        # the engine core's values, set by whichever front end is scraped: the latest one counts
        core = dict(registry=r, multiprocess_mode="mostrecent")
        self.running = Gauge("vlmserve_num_requests_running", "Requests being computed.", **core)
        self.waiting = Gauge("vlmserve_num_requests_waiting", "Requests waiting to run.", **core)
        self.kv_usage = Gauge("vlmserve_kv_cache_usage_ratio",
                              "Share of KV cache blocks in use (0-1).", **core)
        self.enc_rows = Gauge("vlmserve_encoder_cache_usage_rows",
                              "Image-embedding rows held by the encoder cache.", **core)
        self.enc_entries = Gauge("vlmserve_encoder_cache_entries",
                                 "Images held by the encoder cache.", **core)
        self.prefix_queried = Gauge("vlmserve_prefix_cache_queried_tokens",
                                    "Prompt tokens looked up in the prefix cache.", **core)
        self.prefix_hits = Gauge("vlmserve_prefix_cache_hit_tokens",
                                 "Prompt tokens found in the prefix cache.", **core)
        self.prefix_hit_rate = Gauge("vlmserve_prefix_cache_hit_rate",
                                     "Share of looked-up prompt tokens found cached (0-1).",
                                     **core)
        # embedding handles from encoder servers (--encoder-url), opened by the engine core
        self.handles = {k: Gauge(f"vlmserve_encoder_handles_{k}", text, **core) for k, text in (
            ("opened", "Embedding handles from encoder servers opened."),
            ("released", "Embedding handles released to their encoder server."),
            ("failed", "Embedding handles that could not be read (expired, gone)."),
            ("refused", "Second opens of a handle, refused."),
            ("live", "Embedding handles opened and not released yet."))}
        self.prompt_tokens = Counter("vlmserve_prompt_tokens",
                                     "Prompt tokens of finished requests (images included).",
                                     registry=r)
        self.generation_tokens = Counter("vlmserve_generation_tokens",
                                         "Tokens generated for finished requests.", registry=r)
        self.finished = Counter("vlmserve_requests_finished", "Finished requests by reason.",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("vlmserve_time_to_first_token_seconds",
                              "Arrival to first output token.", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("vlmserve_inter_token_latency_seconds",
                             "Time between consecutive output tokens.", buckets=_ITL_BUCKETS,
                             registry=r)
        self.frontend = Histogram(
            "vlmserve_request_frontend_seconds",
            "Arrival to hand-over to the engine core (HTTP, images, template, tokenization).",
            buckets=_TTFT_BUCKETS, registry=r)
        self.step_time = Histogram(
            "vlmserve_engine_step_seconds",
            "Host time of an engine-core loop iteration that produced this front end's tokens.",
            buckets=_STEP_BUCKETS, registry=r)
        # each front end's own count, summed over the live ones
        self.streams = Gauge("vlmserve_num_streams", "Requests the front ends are serving.",
                             registry=r, multiprocess_mode="livesum")
        # with --data-parallel-size N: each engine core's values, and this front end's routing
        per_core = dict(registry=r, labelnames=["core"], multiprocess_mode="mostrecent")
        self.core_gauges = {key: Gauge(name, text, **per_core) for key, name, text in (
            ("alive", "vlmserve_core_alive", "1 while the engine core serves, 0 once it died."),
            ("num_running", "vlmserve_core_num_requests_running",
             "Requests being computed by the core."),
            ("num_waiting", "vlmserve_core_num_requests_waiting",
             "Requests waiting to run on the core."),
            ("kv_cache_usage", "vlmserve_core_kv_cache_usage_ratio",
             "Share of the core's KV cache blocks in use (0-1)."),
            ("prefix_cache_queried_tokens", "vlmserve_core_prefix_cache_queried_tokens",
             "Prompt tokens the core looked up in its prefix cache."),
            ("prefix_cache_hit_tokens", "vlmserve_core_prefix_cache_hit_tokens",
             "Prompt tokens the core found in its prefix cache."))}
        self.routed = Gauge("vlmserve_dp_routed_requests",
                            "Requests routed to each engine core, by reason (affinity, busy, "
                            "balance, random), summed over front ends.",
                            ["core", "reason"], registry=r, multiprocess_mode="livesum")
        self.e2e = Histogram("vlmserve_e2e_request_latency_seconds",
                             "Arrival to finish.", buckets=_E2E_BUCKETS, registry=r)
        engine.client.add_finish_callback(self.observe_finished)
        engine.client.add_step_callback(self.step_time.observe)
        if self.multiproc_dir is not None:
            # a scrape renders the other front ends' last written counts: keep ours current
            engine.client.add_step_callback(self._count_streams)

    def _count_streams(self, _: object = None) -> None:  # on the engine's I/O thread
        self.streams.set(self.engine.num_streams)

    def observe_finished(self, t: RequestTiming) -> None:
        if self.multiproc_dir is not None:
            self._count_streams()
        self.prompt_tokens.inc(t.num_prompt_tokens)
        self.generation_tokens.inc(len(t.token_times))
        self.finished.labels(finish_reason=t.finish_reason or "unknown").inc()
        if t.frontend_time is not None:
            self.frontend.observe(t.frontend_time)
        if t.ttft is not None:
            self.ttft.observe(t.ttft)
        for dt in t.inter_token_latencies:
            self.itl.observe(dt)
        if t.e2e_latency is not None:
            self.e2e.observe(t.e2e_latency)

    async def render(self) -> bytes:
        """The Prometheus text exposition, gauges refreshed from the engine core now."""
        s = await self.engine.get_stats()
        self.streams.set(s.get("num_streams", 0))
        self.running.set(s.get("num_running", 0))
        self.waiting.set(s.get("num_waiting", 0))
        self.kv_usage.set(s.get("kv_cache_usage", 0.0))
        self.enc_rows.set(s.get("encoder_cache_rows", 0))
        self.enc_entries.set(s.get("encoder_cache_entries", 0))
        self.prefix_queried.set(s.get("prefix_cache_queried_tokens", 0))
        self.prefix_hits.set(s.get("prefix_cache_hit_tokens", 0))
        self.prefix_hit_rate.set(s.get("prefix_cache_hit_rate", 0.0))
        for k, gauge in self.handles.items():
            gauge.set(s.get(f"encoder_handles_{k}", 0))
        for core in s.get("cores", ()):
            for key, gauge in self.core_gauges.items():
                gauge.labels(core=str(core["core"])).set(float(core.get(key) or 0))
        for i, counts in enumerate(s.get("routing", {}).get("replicas", ())):
            for reason in ("affinity", "busy", "balance", "random"):
                self.routed.labels(core=str(i), reason=reason).set(counts[reason])
        if self.multiproc_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiproc_dir)
        return generate_latest(registry)
