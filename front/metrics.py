"""/metrics: the daemon's status snapshot as Prometheus series, plus the front's own.

Where /metrics lives: here, in the HTTP front, reading the daemon's StatusReply at scrape
time. The daemon already keeps every number (status detail, daemon/engine_thread/stats.py's counters and
histograms), so the daemon gains no listener, no HTTP stack and no metrics library, and a
scrape costs it one Status message. Daemon-wide series (councild_*) cover every client,
ZeroMQ ones included; councild_http_* are this front's own (its requests, its TTFT as an
HTTP client sees it). When the daemon does not answer, councild_up is 0 and the daemon
series are absent for that scrape.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from protocol import messages as m

PRESSURE_LEVEL = {"normal": 0, "warn": 1, "critical": 2}
# The prefix cache's cumulative numbers (the rest of its stats are gauges: entries, bytes).
PREFIX_CACHE_COUNTERS = {"hits": "lookups that found a stored prefix", "misses": "lookups that found none",
                         "cached_tokens": "prompt tokens taken from the cache instead of computed",
                         "evicted": "snapshots evicted (LRU or memory pressure)",
                         "ram_hits": "lookups served from RAM", "disk_hits": "lookups served from the disk tier",
                         "continuations": "finished requests' states kept for the seat's next turn",
                         "promoted": "snapshots taken before the chunk-split verdict that it made exact"}
PREFIX_DISK_COUNTERS = {"hits": "snapshot files read back at a hit", "corrupt": "files that did not check out (misses)",
                        "writes": "snapshot files written", "write_failures": "snapshot writes that failed",
                        "skipped": "snapshot writes skipped (disk full or too much pending)",
                        "evicted": "snapshot files deleted by the disk budget"}


def _histogram(name: str, doc: str, h: dict) -> HistogramMetricFamily:
    buckets, acc = [], 0
    for bound, n in zip(h["buckets"], h["counts"]):
        acc += n
        buckets.append((repr(float(bound)), acc))
    buckets.append(("+Inf", h["count"]))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])


class DaemonCollector:
    """Builds the councild_* series from the last StatusReply handed to it."""

    def __init__(self):
        self.status: m.StatusReply | None = None

    def collect(self):
        st = self.status
        up = GaugeMetricFamily("councild_up", "1 when the daemon answered this scrape's status request")
        up.add_metric([], 1.0 if st is not None else 0.0)
        yield up
        if st is None:
            return
        d = st.detail
        stats = d.get("stats", {})
        seats = d.get("seats", {})

        tokens = CounterMetricFamily("councild_tokens", "output tokens generated, by seat", labels=["seat"])
        for seat, s in seats.items():
            tokens.add_metric([seat], s.get("tokens", 0))
        yield tokens
        reqs = CounterMetricFamily("councild_requests", "requests ended, by seat and outcome (finish reason or error code)",
                                   labels=["seat", "outcome"])
        for seat, by in stats.get("requests", {}).items():
            for outcome, n in by.items():
                reqs.add_metric([seat, outcome], n)
        yield reqs
        for name, key, doc in (("councild_drafted_tokens", "drafted", "tokens drafted by the MTP head"),
                               ("councild_accepted_tokens", "accepted", "drafted tokens the base model accepted")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], stats.get(key, 0))
            yield c
        if "ttft_seconds" in stats:
            yield _histogram("councild_ttft_seconds", "receipt to first output token, every request", stats["ttft_seconds"])
            yield _histogram("councild_inter_token_seconds", "time between output tokens (a cycle's gap shared by its tokens)",
                             stats["inter_token_seconds"])

        queue = GaugeMetricFamily("councild_queue_depth", "requests accepted and waiting, by seat", labels=["seat"])
        active = GaugeMetricFamily("councild_active_requests", "requests being decoded, by seat", labels=["seat"])
        for seat, s in seats.items():
            queue.add_metric([seat], s.get("queued", 0))
            active.add_metric([seat], s.get("active", 0))
        yield queue
        yield active

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            return g

        gov = d.get("governor") or {}
        mem = d.get("memory") or {}
        yield gauge("councild_in_flight_requests", "requests accepted and not yet ended", d.get("in_flight", 0))
        yield gauge("councild_speculation_depth", "current speculation depth (0: serial)", d.get("depth", 0))
        yield gauge("councild_head_resident", "1 when the MTP head is in memory", bool(d.get("head_resident")))
        yield gauge("councild_head_bytes", "bytes of the MTP head when resident", d.get("head_bytes", 0))
        if "decode_path" in d:
            compiled = GaugeMetricFamily("councild_compiled_step", "1 where decode steps and verifies run the "
                                         "mx.compile'd forward (its start-up self-check passed), by rows: one or batch",
                                         labels=["rows"])
            compiled.add_metric(["one"], float(d["decode_path"] == "compiled"))
            compiled.add_metric(["batch"], float(d.get("batch_decode_path") == "compiled"))
            yield compiled
        rows = d.get("rows") or {}
        if rows.get("limit") is not None:  # how many requests decode at once (scheduler.max_active)
            limit = GaugeMetricFamily("councild_max_active", "requests decoded at once at most: the governor's with "
                                      "max_active = \"auto\" (decision: its last, e.g. rows_keep), else the config's",
                                      labels=["mode", "decision"])
            limit.add_metric([str(rows.get("mode")), str(rows.get("decision") or "")], float(rows["limit"]))
            yield limit
            if rows.get("ceiling") is not None:
                yield gauge("councild_max_active_ceiling", "the most rows the governor may admit (max_active_ceiling)",
                            rows["ceiling"])
        warming = d.get("warming") or {}
        if warming:
            yield gauge("councild_warming_parts", "start-up checks still to run between requests (0: all done)",
                        len(warming.get("pending") or ()))
            parts = GaugeMetricFamily("councild_warm_part_switched_in", "1 where a start-up part's check passed and "
                                      "its path was switched in, 0 where it was left out", labels=["part"])
            for part, result in (warming.get("parts") or {}).items():
                parts.add_metric([part], float(bool(result.get("switched_in"))))
            yield parts
        yield gauge("councild_tokens_per_second", "output tokens per second over the last 10 s", d.get("recent_tokens_per_s", 0))
        yield gauge("councild_draining", "1 while the daemon drains for shutdown", bool(d.get("draining")))
        yield gauge("councild_loading", "1 while the daemon reads the model's weights", d.get("state") == "loading")
        yield gauge("councild_clients", "connected clients", d.get("clients", 0))
        yield gauge("councild_uptime_seconds", "seconds since the daemon started", st.uptime_s)
        for key, name in (("active_bytes", "active"), ("cache_bytes", "cache"), ("peak_bytes", "peak")):
            if key in mem:
                yield gauge(f"councild_memory_{name}_bytes", f"MLX {name} memory", mem[key])
        if gov.get("available_bytes") is not None:
            yield gauge("councild_memory_available_bytes", "memory that could be allocated now without pressure",
                        gov["available_bytes"])
        if gov.get("pressure") in PRESSURE_LEVEL:
            yield gauge("councild_memory_pressure_level", "memory pressure: 0 normal, 1 warn, 2 critical",
                        PRESSURE_LEVEL[gov["pressure"]])
        if gov:
            yield gauge("councild_shedding", "1 while the governor refuses new work", bool(gov.get("shedding")))
        cache = d.get("prefix_cache")
        if isinstance(cache, dict) and cache:  # the prefix cache, when the daemon has one
            disk = cache.get("disk")
            if isinstance(disk, dict):  # its disk tier
                for key, value in disk.items():
                    if not isinstance(value, (int, float)) or isinstance(value, bool):
                        continue
                    if key in PREFIX_DISK_COUNTERS:
                        c = CounterMetricFamily(f"councild_prefix_cache_disk_{key}", PREFIX_DISK_COUNTERS[key])
                        c.add_metric([], value)
                        yield c
                    else:
                        yield gauge(f"councild_prefix_cache_disk_{key}", f"prefix cache disk tier: {key}", value)
            for key, value in cache.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                if key in PREFIX_CACHE_COUNTERS:
                    c = CounterMetricFamily(f"councild_prefix_cache_{key}", PREFIX_CACHE_COUNTERS[key])
                    c.add_metric([], value)
                    yield c
                else:
                    yield gauge(f"councild_prefix_cache_{key}", f"prefix cache: {key}", value)
        if "prefill_tokens_total" in d:
            c = CounterMetricFamily("councild_prefill_tokens", "prompt tokens computed (not taken from the prefix cache)")
            c.add_metric([], d["prefill_tokens_total"])
            yield c
        yield from _engine_step(d.get("step") or {}, seats)


def _engine_step(step: dict, seats: dict):
    """The engine step (OPERATIONS.md, "The engine step"): the token budget and its use, the
    prefill queue, and per seat what waits."""
    if step:
        for key, doc in (("steps", "engine iterations (a decode phase then a prefill phase)"),
                         ("decode_tokens", "tokens the iterations' decode phases forwarded"),
                         ("prefill_tokens", "prompt tokens the iterations' prefill phases forwarded"),
                         ("steps_with_prefill", "engine iterations that ran prefill chunks")):
            c = CounterMetricFamily(f"councild_step_{key}", doc)
            c.add_metric([], step.get(key, 0))
            yield c
        g = GaugeMetricFamily("councild_step_token_budget", "tokens one engine iteration may spend (scheduler.step_token_budget)")
        g.add_metric([], float(step.get("budget", 0)))
        yield g
        if "budget_use" in step:
            yield _histogram("councild_step_budget_use_ratio", "an iteration's tokens over the budget", step["budget_use"])
        pacing = step.get("pacing") or {}
        if pacing:
            g = GaugeMetricFamily("councild_step_decode_gap_bound",
                                  "an iteration's time in quiet iterations while others decode (scheduler.decode_gap_bound; 0: off)")
            g.add_metric([], float(pacing.get("bound", 0.0)))
            yield g
            g = GaugeMetricFamily("councild_prefill_piece_tokens",
                                  "the latest paced prefill piece (0: whole chunks, nobody decoding)")
            g.add_metric([], float(pacing.get("last_piece") or 0))
            yield g
            c = CounterMetricFamily("councild_step_paced", "engine iterations whose prefill the pacer cut to a piece")
            c.add_metric([], pacing.get("paced_iterations", 0))
            yield c
        for part, prefix, counts in (
                ("together", "councild_prefill_together", (("forwards", "prefill forwards that carried several prompts' pieces"),
                                                           ("rows", "prompts' pieces those forwards carried"))),
                ("mixed", "councild_step_mixed", (("forwards", "decode forwards that carried a prompt's paced piece (mixed steps)"),
                                                  ("tokens", "prompt tokens those forwards carried")))):
            for key, doc in counts:
                c = CounterMetricFamily(f"{prefix}_{key}", doc)
                c.add_metric([], (step.get(part) or {}).get(key, 0))
                yield c
        cycles = step.get("batch_cycles")
        if cycles:
            c = CounterMetricFamily("councild_batch_cycles", "the speculating batch's cycles")
            c.add_metric([], cycles.get("cycles", 0))
            yield c
            c = CounterMetricFamily("councild_batch_cycles_ahead", "the speculating batch's cycles queued before the "
                                    "host read the one before them (depth 0, or drafting), by outcome: run, or "
                                    "undone as a row joined or left", labels=["depth", "outcome"])
            for label, key in (("0", "depth0"), ("drafting", "drafting")):
                c.add_metric([label, "run"], cycles.get(f"{key}_ahead", 0))
                c.add_metric([label, "undone"], cycles.get(f"{key}_undone", 0))
            yield c
            c = CounterMetricFamily("councild_batch_lookup", "the speculating batch's prompt-lookup cycles, and the "
                                    "blocks' tokens drafted and accepted", labels=["count"])
            for label in ("cycles", "drafted", "accepted"):
                c.add_metric([label], cycles.get("lookup" if label == "cycles" else f"lookup_{label}", 0))
            yield c
        queue = step.get("prefill_queue", [])
        g = GaugeMetricFamily("councild_prefill_queue_requests", "prompts being prefilled")
        g.add_metric([], float(len(queue)))
        yield g
        g = GaugeMetricFamily("councild_prefill_queue_tokens", "prompt tokens left to prefill")
        g.add_metric([], float(sum(q.get("left", 0) for q in queue)))
        yield g
    for key, doc in (("waiting", "requests waiting for a slot, by seat"),
                     ("longest_wait_s", "seconds the seat's longest-waiting request has waited for a slot"),
                     ("prefilling", "requests being prefilled, by seat"),
                     ("prefill_left", "prompt tokens left to prefill, by seat")):
        g = GaugeMetricFamily(f"councild_seat_{key.removesuffix('_s')}{'_seconds' if key.endswith('_s') else ''}", doc,
                              labels=["seat"])
        for seat, s in seats.items():
            g.add_metric([seat], float(s.get(key, 0)))
        yield g


class FrontMetrics:
    def __init__(self, front):
        self.registry = CollectorRegistry()
        self.daemon = DaemonCollector()
        self.registry.register(self.daemon)
        self.requests = Counter("councild_http_requests", "HTTP completion requests by route, seat, status and outcome",
                                ["route", "seat", "status", "outcome"], registry=self.registry)
        self.ttft = Histogram("councild_http_ttft_seconds", "HTTP receipt to the first streamed token, as the front sees it",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
                              registry=self.registry)
        self.chunk_gap = Histogram("councild_http_chunk_gap_seconds", "time between streamed SSE chunks",
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
                                   registry=self.registry)

    def request(self, route: str, seat: str, status: int, outcome: str) -> None:
        self.requests.labels(route, seat, str(status), outcome).inc()

    def render(self, status: m.StatusReply | None) -> tuple[bytes, str]:
        self.daemon.status = status
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
