"""Names shared by workers, API and CLI: queues, Redis keys, PostgreSQL channels.

Only names live here; limits on untrusted input are in ``limits.py``, search tuning next to its code."""

QUEUE_CONTROL = "rlm.control"
QUEUE_ANALYST = "rlm.analyst"
QUEUE_INGEST = "rlm.ingest"
ALL_QUEUES = (QUEUE_CONTROL, QUEUE_ANALYST, QUEUE_INGEST)

#: Redis key prefixes (everything the project writes to Redis starts with "rlm:")
LIMITER_KEY_PREFIX = "rlm:limiter:"
RATE_KEY_PREFIX = "rlm:rate:"
#: code mode's sub-model calls in flight: prompts, replies and the chord's done signal (pipeline/subcalls.py)
CODE_KEY_PREFIX = "rlm:code:"
#: the code stages waiting on child jobs now (a sorted set: job id → when its claim lapses unless renewed)
CODE_CHILD_WAITS_KEY = "rlm:code-child-waits"
#: held by the worker whose reconciler sweeps this interval
RECONCILE_LOCK_KEY = "rlm:reconcile:lock"
#: PostgreSQL NOTIFY channel: the id of every job that just ended (waiters wake without polling)
JOB_ENDED_CHANNEL = "rlm_job_ended"
#: PostgreSQL NOTIFY channel: the id of every upload that just ended (`rlm load --queue --wait` wakes at once)
UPLOAD_ENDED_CHANNEL = "rlm_upload_ended"
