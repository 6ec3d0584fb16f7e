"""Limits on untrusted input and output (docs/contract.md#limits): what a query, a tool call or a model's
reply may be at most.  Inputs over a limit are refused with a one-line error; model output over one is cut."""

MAX_QUERY_BYTES = 10 * 1024
MAX_REGEX_BYTES = 500
MAX_TOOL_ARGS_BYTES = 100 * 1024
MAX_FINDINGS_PER_BATCH = 200
MAX_FINDING_BYTES = 5 * 1024
MAX_FOLLOW_UPS = 10

#: characters per chunk: one bound for the chunker, `rlm load --chunk-size` and the API's chunk_size
MIN_CHUNK_SIZE = 200
MAX_CHUNK_SIZE = 1_000_000
#: one path component (file or directory name), as most file systems allow
MAX_NAME_COMPONENT_BYTES = 255
#: the largest integer PostgreSQL bigint holds: any count or budget a client sends stays below it
MAX_BIGINT = 2**63 - 1
#: uploads up to this size load in the request by default (POST /v1/buffers); larger ones go to an ingest worker
MAX_INLINE_UPLOAD_BYTES = 256 * 1024
