"""Prometheus metrics, counted as the work happens and kept in Redis (docs/contract.md#metrics).

Workers run as separate processes on separate hosts and the API is what Prometheus scrapes, so a
process-local ``prometheus_client`` registry would only ever show the API's own share.  Every process
therefore adds its increments to two Redis hashes on the broker's server (one pipelined round trip per
event, ``HINCRBY`` / ``HINCRBYFLOAT``), and ``/metrics`` renders those hashes through a custom collector:
a scrape costs O(number of series), never a pass over ``jobs`` or ``llm_calls``.

Writing a metric never fails the work it describes: a Redis error is logged at debug level and the
increment is dropped, and after a failure this process stops trying for ``_BACKOFF_SECONDS`` so an
unreachable broker costs one short timeout, not one per event.  The counters live as long as the Redis
data does (a flushed or restarted broker starts them at zero again, which Prometheus reads as a counter
reset).

The counting is here; rendering the hashes for a scrape is ``metrics_render.py``, so a process that only
counts (a worker, a CLI command that writes a job) never loads the Prometheus client or kombu.

Label values are bounded by construction: stage names (the pipeline's ``Stage`` enum), job statuses, call
statuses and the models the settings name — never user text.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import get_settings
from .local_servers import broker_url

if TYPE_CHECKING:
    import redis

    from ..models import LLMCall

log = logging.getLogger("rlm.metrics")

#: hash of counters: field ``[family, [label values]]`` → value
COUNTERS_KEY = "rlm:metrics:counters"
#: hash of histograms: field ``[family, [label values], le | "sum"]`` → value (buckets not cumulative:
#: an observation adds 1 to the one bucket it falls in; the collector sums them up)
HISTOGRAMS_KEY = "rlm:metrics:histograms"

#: seconds: a stage is anything from a plan call to a long synthesis
STAGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: seconds per HTTP attempt to the provider
LLM_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: seconds one call waited for a concurrency slot and the rate budget; most waits are zero
LIMITER_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)

#: family → (label names, help): the rendered families, in this order
COUNTER_FAMILIES: dict[str, tuple[tuple[str, ...], str]] = {
    "rlm_jobs_finished_total": (("status",), "Jobs that ended, by final status (done, failed, cancelled)."),
    "rlm_llm_calls_total": (
        ("model", "status"),
        "LLM HTTP attempts by configured model and status (ok, retried, error).",
    ),
    "rlm_llm_tokens_total": (
        ("model", "direction"),
        "LLM tokens as the provider reported them: in, out, cached (of in).",
    ),
    "rlm_llm_cost_usd_total": (("model",), "LLM cost in USD, priced from RLM_PRICES when the call was logged."),
    "rlm_llm_parse_failures_total": (
        ("stage", "model"),
        "LLM replies the stage could not use as they came (parse_ok false): the stage re-asked or fell back.",
    ),
    "rlm_fair_deferrals_total": (
        (),
        "Tasks re-queued because their tenant held its share of the LLM slots while another tenant waited.",
    ),
}
HISTOGRAM_FAMILIES: dict[str, tuple[tuple[str, ...], tuple[float, ...], str]] = {
    "rlm_stage_seconds": (("stage",), STAGE_BUCKETS, "Wall time of each pipeline stage run (the job's timings)."),
    "rlm_llm_latency_seconds": (("model",), LLM_LATENCY_BUCKETS, "Latency of each LLM HTTP attempt."),
    "rlm_limiter_wait_seconds": ((), LIMITER_WAIT_BUCKETS, "Wait for a global LLM slot and the rate budget."),
}

_BACKOFF_SECONDS = 30.0
_TIMEOUT_SECONDS = 1.0
_lock = threading.Lock()
_clients: dict[str, redis.Redis] = {}
_down_until = 0.0


def client() -> redis.Redis:
    """A Redis client for the broker's server with short timeouts (one per URL: tests switch brokers)."""
    import redis  # the heavy edge: a command that reads jobs and counts nothing never loads the client

    url = broker_url(get_settings())
    found = _clients.get(url)
    if found is None:
        with _lock:
            found = _clients.setdefault(
                url,
                redis.Redis.from_url(url, socket_connect_timeout=_TIMEOUT_SECONDS, socket_timeout=_TIMEOUT_SECONDS),
            )
    return found


def _field(family: str, labels: Sequence[str], part: str | None = None) -> str:
    # JSON, not a joined string: a model name may contain any separator we could pick
    return json.dumps([family, list(labels)] if part is None else [family, list(labels), part])


def bucket_label(bound: float) -> str:
    """A bucket's ``le`` as Prometheus writes it (Go's float format): ``+Inf``, else Python's repr, which is the
    same for every bound here (positive, under 10^6; ``tests/test_metrics.py`` holds it to the client's own)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _update(fill: Callable[[Any], None]) -> None:
    """Queue ``fill``'s increments on one pipeline and send them; never raises."""
    global _down_until
    if time.monotonic() < _down_until:
        return
    try:
        pipe = client().pipeline(transaction=False)
        fill(pipe)
        pipe.execute()
    except Exception:  # metrics never fail (nor stall) the work they count
        _down_until = time.monotonic() + _BACKOFF_SECONDS
        log.debug("metrics update dropped", exc_info=True)


def _observe(pipe: Any, family: str, labels: Sequence[str], value: float) -> None:
    bounds = HISTOGRAM_FAMILIES[family][1]
    bucket = next((b for b in bounds if value <= b), math.inf)
    pipe.hincrby(HISTOGRAMS_KEY, _field(family, labels, bucket_label(bucket)), 1)
    pipe.hincrbyfloat(HISTOGRAMS_KEY, _field(family, labels, "sum"), value)


# --------------------------------------------------------------------------- hooks (writers)


def job_finished(status: str) -> None:
    """A job reached a final status (called once per job, where the status is written)."""
    _update(lambda p: p.hincrby(COUNTERS_KEY, _field("rlm_jobs_finished_total", [status]), 1))


def stage_timed(stage: str, seconds: float) -> None:
    _update(lambda p: _observe(p, "rlm_stage_seconds", [str(stage)], max(0.0, seconds)))


def llm_calls(model: str, calls: Sequence[LLMCall]) -> None:
    """The HTTP attempts of one logical call, as logged on the job.  ``model`` is the configured model the
    call asked for (a provider may answer with a dated variant; the label stays the configured name)."""

    def fill(p: Any) -> None:
        for c in calls:
            p.hincrby(COUNTERS_KEY, _field("rlm_llm_calls_total", [model, c.status]), 1)
            for direction, n in (("in", c.tokens_in), ("out", c.tokens_out), ("cached", c.cached_tokens)):
                if n:
                    p.hincrby(COUNTERS_KEY, _field("rlm_llm_tokens_total", [model, direction]), int(n))
            if c.cost_usd:
                p.hincrbyfloat(COUNTERS_KEY, _field("rlm_llm_cost_usd_total", [model]), float(c.cost_usd))
            _observe(p, "rlm_llm_latency_seconds", [model], max(0, c.latency_ms or 0) / 1000)
            if c.parse_ok is False:
                p.hincrby(COUNTERS_KEY, _field("rlm_llm_parse_failures_total", [c.stage, model]), 1)

    _update(fill)


def limiter_waited(seconds: float) -> None:
    _update(lambda p: _observe(p, "rlm_limiter_wait_seconds", [], max(0.0, seconds)))


def fair_deferred() -> None:
    """A task stepped aside for another tenant's (docs/contract.md#fair-share)."""
    _update(lambda p: p.hincrby(COUNTERS_KEY, _field("rlm_fair_deferrals_total", []), 1))
