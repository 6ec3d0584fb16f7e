"""Names shared by workers, API and CLI: queues, task names, key prefixes."""

QUEUE_CONTROL = "rlm.control"
QUEUE_ANALYST = "rlm.analyst"
QUEUE_INGEST = "rlm.ingest"
ALL_QUEUES = (QUEUE_CONTROL, QUEUE_ANALYST, QUEUE_INGEST)

#: Redis key prefixes (everything the project writes to Redis starts with "rlm:")
LIMITER_KEY_PREFIX = "rlm:limiter:"
RATE_KEY_PREFIX = "rlm:rate:"
#: held by the worker whose reconciler sweeps this interval
RECONCILE_LOCK_KEY = "rlm:reconcile:lock"
#: PostgreSQL NOTIFY channel: the id of every job that just ended (waiters wake without polling)
JOB_ENDED_CHANNEL = "rlm_job_ended"

SEARCH_MODES = ("hybrid", "semantic", "bm25")
RRF_K = 60
BM25_K1 = 1.5
BM25_B = 0.75

#: Limits on untrusted input (docs/contract.md#limits)
MAX_QUERY_BYTES = 10 * 1024
MAX_REGEX_BYTES = 500
MAX_TOOL_ARGS_BYTES = 100 * 1024
MAX_FINDINGS_PER_BATCH = 200
MAX_FINDING_BYTES = 5 * 1024
MAX_FOLLOW_UPS = 10
