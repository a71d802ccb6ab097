"""The server's Prometheus metrics, in a registry of its own per app (`GET /metrics`).

Names follow vLLM's (`vllm:spec_decode_num_draft_tokens_total` -> `hybridspec:spec_decode_num_draft_tokens_total`),
so dashboards and cross-checks carry over. Token counters add exactly the `usage` each finished request returned;
a request the client abandoned counts once in `hybridspec:requests_total{finish_reason="abort"}` and nowhere else
(one the engine failed: "error").
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def finish_reason(engine_reason: str | None, tool_calls: bool = False) -> str:
    """OpenAI's finish_reason for the engine's: "tool_calls" where the reply called tools, even where the length limit
    cut its end markup after the calls' arguments were complete (a client acts on them; a call cut before that stays
    text, and the reply "length"); else "length", or "stop" for "eos" and a stop string."""
    if tool_calls:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


class _PassSeconds:
    """The engine's pass times (`hybridspec.runtime.stats.PassTimes`) as counters, read when scraped."""

    def __init__(self, passes):
        self.passes = passes

    def collect(self):
        for kind, help_ in (("prompt", "passes that ran prompt tokens (other calls' decode rows beside)"),
                            ("decode", "passes of decode rows only")):
            family = CounterMetricFamily(f"hybridspec:{kind}_pass_seconds", f"Seconds of the target's {help_}")
            family.add_metric([], getattr(self.passes, f"{kind}_s"))
            yield family


class Metrics:
    """admission: the engine's (`hybridspec.runtime.admission.Admission`), whose state the gauges read when
    scraped; passes: its `PassTimes`."""

    def __init__(self, registry: CollectorRegistry | None = None, admission=None, passes=None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("hybridspec:http_requests", "HTTP responses by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.requests = Counter("hybridspec:requests", "Generation requests by endpoint and finish reason (stop, "
                                "length, tool_calls; abort: the client went away; error: the engine failed)",
                                ["endpoint", "finish_reason"], registry=r)
        self.running = Gauge("hybridspec:num_requests_running", "Requests running in the engine now", registry=r)
        self.waiting = Gauge("hybridspec:num_requests_waiting", "Requests waiting for a place to run", registry=r)
        self.kv_usage = Gauge("hybridspec:kv_cache_usage_perc", "The running requests' KV over the KV budget (0-1)",
                              registry=r)
        if admission is not None:
            self.running.set_function(lambda: admission.running)
            self.waiting.set_function(lambda: admission.waiting)
            self.kv_usage.set_function(lambda: admission.kv_bytes / admission.limits.kv_cache_memory)
        if passes is not None:
            r.register(_PassSeconds(passes))
        self.refused = Counter("hybridspec:requests_refused", "Requests answered 429: the queue was full",
                               registry=r)
        self.prompt_tokens = Counter("hybridspec:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("hybridspec:generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.cached_tokens = Counter("hybridspec:prefix_cache_hit_tokens", "Prompt tokens whose KV came from the "
                                     "prefix cache (usage.prompt_tokens_details.cached_tokens)", registry=r)
        self.steps = Counter("hybridspec:decode_steps", "Verification passes (one per step of each request)",
                             registry=r)
        self.ttft = Histogram("hybridspec:time_to_first_token_seconds", "From a request's start in the engine to "
                              "its first generated token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("hybridspec:inter_token_latency_seconds", "Per generated token after the first: the "
                             "request's mean time per token after its first", buckets=ITL_BUCKETS, registry=r)
        self.queue_time = Histogram("hybridspec:request_queue_time_seconds", "A request's time waiting for a place "
                                    "to run, until the engine's loop began it (the step in flight included)",
                                    buckets=E2E_BUCKETS, registry=r)
        self.e2e = Histogram("hybridspec:e2e_request_latency_seconds", "A request's time in the engine",
                             buckets=E2E_BUCKETS, registry=r)
        source = ["source"]
        # sources as the engine's stats name them: proposers ("suffix", "peagle", ...) and "grammar" (the tokens a
        # grammar forced, drafted after a proposer's draft)
        self.spec_won = Counter("hybridspec:spec_decode_num_steps_won", "Steps whose draft came from this source (a "
                                "hybrid's choice; grammar: steps with grammar-forced draft tokens)", source, registry=r)
        self.spec_drafts = Counter("hybridspec:spec_decode_num_drafts", "Steps that verified a draft from this "
                                   "source", source, registry=r)
        self.spec_draft_tokens = Counter("hybridspec:spec_decode_num_draft_tokens", "Draft tokens sent to "
                                         "verification, by source", source, registry=r)
        self.spec_accepted_tokens = Counter("hybridspec:spec_decode_num_accepted_tokens", "Draft tokens the target "
                                            "accepted, by source", source, registry=r)

    def ended(self, endpoint: str, reason: str, results=None) -> None:
        """Count a request that left the engine with a finish `reason` and its `GenerationResult`s (one per choice:
        the usage it returned, the call's stats), or with "abort" (the client went away) or "error" (the engine
        failed) and none, which count nothing else."""
        self.requests.labels(endpoint, reason).inc()
        if not results:
            return
        result, stats = results[0], results[0].stats
        n = sum(len(r.token_ids) for r in results)
        self.prompt_tokens.inc(len(result.prompt_token_ids))
        self.generation_tokens.inc(n)
        self.cached_tokens.inc(stats.cached_tokens)
        self.steps.inc(stats.steps)
        if n:
            self.ttft.observe(stats.first_token_s)
        for _ in range(n - 1):
            self.itl.observe((stats.total_s - stats.first_token_s) / (n - 1))
        self.e2e.observe(stats.total_s)
        self.queue_time.observe(stats.queue_s)
        for name, s in stats.by_source.items():
            self.spec_won.labels(name).inc(s.won)
            self.spec_drafts.labels(name).inc(s.drafts)
            self.spec_draft_tokens.labels(name).inc(s.draft_tokens)
            self.spec_accepted_tokens.labels(name).inc(s.accepted_tokens)
