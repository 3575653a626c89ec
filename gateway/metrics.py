"""Prometheus metrics under vLLM's names, so dashboards written for vLLM work unchanged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dflash_serve.speculative.types import SpecStats

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests generating", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", labels, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", labels, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token after the first",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency",
            labels,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.drafts = Counter(
            "vllm:spec_decode_num_drafts", "Verify steps that carried drafts", labels, registry=r
        )
        self.draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", labels, registry=r
        )
        self.accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=r
        )
        self.accepted_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the block",
            [*labels, "position"],
            registry=r,
        )

    def record_request(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
        stats: SpecStats,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(completion_tokens)
        self.request_success.labels(name, finish_reason).inc()
        self.e2e.labels(name).observe(e2e_s)
        if ttft_s is not None:
            self.ttft.labels(name).observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.labels(name).observe((e2e_s - ttft_s) / (completion_tokens - 1))
        self.drafts.labels(name).inc(stats.num_drafts)
        self.draft_tokens.labels(name).inc(stats.num_draft_tokens)
        self.accepted_tokens.labels(name).inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_position.labels(name, str(position)).inc(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
