"""The gateway's Prometheus metrics (``GET /metrics``), in a registry of its own.

Requests and their latency by route and status; tokens in and out by API key id (never the
key); time to first token of streams; requests refused by the rate limiter; requests in flight.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    """The gateway's metrics, in a registry of their own (not the process-wide default)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests", "HTTP requests answered, by route and status", ("route", "status"), registry=r
        )
        self.latency = Histogram(
            "gateway_request_duration_seconds",
            "Time from request to the last byte of the response, by route and status",
            ("route", "status"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens in (prompt) and out (completion) by API key id and model",
            ("key_id", "model", "direction"),
            registry=r,
        )
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Streams: time from request to the first text",
            ("model",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rate_limited = Counter("gateway_rate_limited", "Requests refused by the per-key rate limit", ("key_id",), registry=r)
        self.rate_limit_redis_errors = Counter(
            "gateway_rate_limit_redis_errors", "Rate limit checks Redis did not answer (the fail mode applied)", registry=r
        )
        self.cancelled = Counter(
            "gateway_cancelled",
            "Requests whose client went away before the answer; their Triton requests were cancelled",
            ("route",),
            registry=r,
        )
        self.coalesced = Histogram(
            "gateway_embedding_requests_per_triton_request",
            "Embeddings requests sent to Triton together as one request (coalescing)",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.in_flight = Gauge("gateway_requests_in_flight", "Requests being answered", registry=r)
        self.triton_ready = Gauge("gateway_triton_ready", "1 when Triton and the served models are ready", registry=r)
        self.batches = Gauge("gateway_batches", "Batches of the Batch API store, by status", ("status",), registry=r)
        self.batch_lines = Counter(
            "gateway_batch_lines",
            "Batch lines answered and committed here, by endpoint and outcome",
            ("endpoint", "outcome"),
            registry=r,
        )

    def observe(self, route: str, status: int, seconds: float) -> None:
        """Count one answered request and its latency."""
        s = str(status)
        self.requests.labels(route, s).inc()
        self.latency.labels(route, s).observe(seconds)

    def count_tokens(self, key_id: str, model: str, prompt: int, completion: int = 0) -> None:
        """Add a request's prompt and completion tokens to its key's and model's counts."""
        if prompt:
            self.tokens.labels(key_id, model, "in").inc(prompt)
        if completion:
            self.tokens.labels(key_id, model, "out").inc(completion)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
