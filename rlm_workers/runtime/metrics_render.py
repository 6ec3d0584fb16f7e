"""``/metrics``: the Redis hashes ``metrics.py`` counts into, rendered in the Prometheus text format, with the
queue depths and the jobs in flight (docs/contract.md#metrics)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kombu.transport.redis import PRIORITY_STEPS, Channel
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .metrics import COUNTER_FAMILIES, COUNTERS_KEY, HISTOGRAM_FAMILIES, HISTOGRAMS_KEY, client

log = logging.getLogger("rlm.metrics")


def _le(bound: float) -> str:
    return floatToGoString(bound)


class Collector:
    """Yields every family from the Redis hashes, the queue lengths and the in-flight job counts given.

    Register it on a private ``CollectorRegistry`` per scrape.  When Redis cannot be read, the families are
    still described (HELP/TYPE) with no samples, beside the in-flight jobs that come from PostgreSQL."""

    def __init__(self, jobs_in_flight: Mapping[str, int], queues: Sequence[str]) -> None:
        self.jobs_in_flight = jobs_in_flight
        self.queues = queues

    def _read(self) -> tuple[dict[bytes, bytes], dict[bytes, bytes], list[int]]:
        try:
            pipe = client().pipeline(transaction=False)
            pipe.hgetall(COUNTERS_KEY)
            pipe.hgetall(HISTOGRAMS_KEY)
            # kombu keeps one list per priority step (``name\x06\x16<p>``) and batch work is sent at a
            # lower priority, so the plain list alone would miss it
            for q in self.queues:
                for step in PRIORITY_STEPS:
                    pipe.llen(f"{q}{Channel.sep}{step}" if step else q)
            counters, histograms, *lengths = pipe.execute()
        except Exception:
            log.debug("metrics: Redis unreadable; rendering without its families", exc_info=True)
            return {}, {}, []
        n = len(PRIORITY_STEPS)
        return counters, histograms, [sum(lengths[i * n : (i + 1) * n]) for i in range(len(self.queues))]

    def collect(self) -> Iterator[Any]:
        counters, histograms, depths = self._read()

        jobs = GaugeMetricFamily("rlm_jobs", "Jobs in flight by status (queued, running).", labels=["status"])
        for status in ("queued", "running"):
            jobs.add_metric([status], self.jobs_in_flight.get(status, 0))
        yield jobs

        values: dict[str, dict[tuple[str, ...], float]] = {f: {} for f in COUNTER_FAMILIES}
        for raw, stored in counters.items():
            family, labels = _parse(raw)[:2]
            if family in values:
                values[family][labels] = float(stored)
        for family, (label_names, help_) in COUNTER_FAMILIES.items():
            metric = CounterMetricFamily(family, help_, labels=list(label_names))
            for labels, value in sorted(values[family].items()):
                metric.add_metric(list(labels), value)
            yield metric
        # kept from the hand-written format: the failed attempts alone, by model
        errors = CounterMetricFamily(
            "rlm_llm_errors_total", "Failed LLM attempts (retried or final) by model.", labels=["model"]
        )
        failed: dict[str, float] = {}
        for (model, status), value in values["rlm_llm_calls_total"].items():
            if status != "ok":
                failed[model] = failed.get(model, 0.0) + value
        for model, value in sorted(failed.items()):
            errors.add_metric([model], value)
        yield errors

        buckets: dict[str, dict[tuple[str, ...], dict[str, float]]] = {f: {} for f in HISTOGRAM_FAMILIES}
        for raw, stored in histograms.items():
            family, labels, part = _parse(raw)
            if family in buckets and part is not None:
                try:
                    key = part if part == "sum" else _le(float(part))
                except ValueError:
                    continue  # not a bucket we wrote
                buckets[family].setdefault(labels, {})[key] = float(stored)
        for family, (label_names, bounds, help_) in HISTOGRAM_FAMILIES.items():
            histogram = HistogramMetricFamily(family, help_, labels=list(label_names))
            for labels, parts in sorted(buckets[family].items()):
                total = parts.pop("sum", 0.0)
                # the current bounds plus any a stored series was written with (bounds changed in an upgrade)
                les = sorted({float(b) for b in bounds} | {float(le) for le in parts} | {math.inf})
                running, cumulative = 0.0, []
                for le in les:
                    running += parts.get(_le(le), 0.0)
                    cumulative.append((_le(le), running))
                histogram.add_metric(list(labels), cumulative, total)
            yield histogram

        queue = GaugeMetricFamily(
            "rlm_queue_depth", "Messages waiting per Celery queue (all priority levels).", labels=["queue"]
        )
        for q, depth in zip(self.queues, depths, strict=False):
            queue.add_metric([q], depth)
        yield queue


def _parse(raw: bytes | str) -> tuple[str, tuple[str, ...], str | None]:
    try:
        parts = json.loads(raw)
        return str(parts[0]), tuple(str(v) for v in parts[1]), (str(parts[2]) if len(parts) > 2 else None)
    except (ValueError, TypeError, IndexError, KeyError):
        return "", (), None  # not ours: skipped


def render(jobs_in_flight: Mapping[str, int], queues: Sequence[str]) -> bytes:
    """The Prometheus text format (0.0.4) of everything above."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(jobs_in_flight, queues))
    return generate_latest(registry)
