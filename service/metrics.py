"""Prometheus metrics: request counts/latency by route template, job/version/job-worker gauges read
from the database at scrape time (so every API process reports the same numbers), and the serving workers'
prefix caches as they last reported them (`PrefixCacheCollector`, registered by the serving routes)."""

import time
from datetime import timedelta
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inkwell.service.db import repo
from inkwell.service.schemas import JobState

if TYPE_CHECKING:  # the tier is the serving routes' (torch, transformers); the metrics only read it
    from inkwell.serving.tier import ServingTier


class _DatabaseCollector:
    def __init__(self, sm: sessionmaker[Session], lease: timedelta) -> None:
        self.sm, self.lease = sm, lease

    def collect(self):
        jobs = GaugeMetricFamily("inkwell_jobs", "jobs by state", labels=["state"])
        versions = GaugeMetricFamily("inkwell_adapter_versions", "published adapter versions not deleted")
        workers = GaugeMetricFamily("inkwell_job_workers", "job workers alive (heartbeat within the lease), any host")
        try:
            with self.sm() as s:
                counts = repo.job_counts(s)
                versions.add_metric([], repo.count_versions(s))
                workers.add_metric([], repo.count_live_workers(s, self.lease))
        except Exception:  # noqa: BLE001 - a scrape must not fail because the DB is down
            return
        for state in JobState.__args__:
            jobs.add_metric([state], counts.get(state, 0))
        yield jobs
        yield versions
        yield workers


class PrefixCacheCollector:
    """Each serving worker's prefix cache (native engine): tokens looked up and served from it, its hit rate,
    bytes and evictions, labelled by worker."""

    def __init__(self, tier: "ServingTier") -> None:
        self.tier = tier

    def collect(self):
        prefix, label = "inkwell_prefix_cache", ["worker"]
        prompt = CounterMetricFamily(
            f"{prefix}_prompt_tokens", "prompt tokens looked up in the prefix cache", labels=label
        )
        cached = CounterMetricFamily(f"{prefix}_cached_tokens", "prompt tokens served from the cache", labels=label)
        lookups = CounterMetricFamily(f"{prefix}_lookups", "prompts looked up", labels=label)
        hits = CounterMetricFamily(f"{prefix}_hits", "prompts that found a cached prefix", labels=label)
        evictions = CounterMetricFamily(f"{prefix}_evictions", "cached nodes evicted", labels=label)
        rate = GaugeMetricFamily(f"{prefix}_hit_rate", "cached over looked-up prompt tokens", labels=label)
        size = GaugeMetricFamily(f"{prefix}_bytes", "device memory the prefix cache holds", labels=label)
        for worker, stats in self.tier.cache_stats().items():
            prompt.add_metric([worker], stats.prompt_tokens)
            cached.add_metric([worker], stats.cached_tokens)
            lookups.add_metric([worker], stats.lookups)
            hits.add_metric([worker], stats.hits)
            evictions.add_metric([worker], stats.evictions)
            rate.add_metric([worker], stats.hit_rate)
            size.add_metric([worker], stats.bytes)
        yield from (prompt, cached, lookups, hits, evictions, rate, size)


class Metrics:
    def __init__(self, sm: sessionmaker[Session], lease: timedelta) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "inkwell_http_requests", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "inkwell_http_request_seconds", "HTTP request latency", ["method", "route"], registry=self.registry
        )
        self.registry.register(_DatabaseCollector(sm, lease))


class MetricsMiddleware:
    """Times every HTTP request; the label is the route template, never the raw path."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            metrics: Metrics | None = getattr(scope["app"].state, "metrics", None)
            route = scope.get("route")
            label = getattr(route, "path", "unmatched")
            if metrics is not None:
                metrics.requests.labels(scope["method"], label, str(status[0])).inc()
                metrics.latency.labels(scope["method"], label).observe(time.perf_counter() - start)
