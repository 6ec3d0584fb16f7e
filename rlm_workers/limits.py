"""Limits on untrusted input and output (docs/contract.md#limits): what a query, a tool call or a model's
reply may be at most.  Inputs over a limit are refused with a one-line error; model output over one is cut."""

MAX_QUERY_BYTES = 10 * 1024
MAX_REGEX_BYTES = 500
MAX_TOOL_ARGS_BYTES = 100 * 1024
MAX_FINDINGS_PER_BATCH = 200
MAX_FINDING_BYTES = 5 * 1024
MAX_FOLLOW_UPS = 10
#: how far ahead a batch's run_at / --at may be: later is a typo, and far enough out cannot even be read back
MAX_RUN_AT_AHEAD_DAYS = 365
#: how far in the past: a past time means "now", but one years back is a mistake worth saying
MAX_RUN_AT_BEHIND_DAYS = 365
#: `rlm doctor` reads at most this many messages of a queue to tell delayed (ETA) ones from ready ones
DOCTOR_QUEUE_SCAN = 1000

#: characters per chunk: one bound for the chunker, `rlm load --chunk-size` and the API's chunk_size
MIN_CHUNK_SIZE = 200
MAX_CHUNK_SIZE = 1_000_000
#: one path component (file or directory name), as most file systems allow
MAX_NAME_COMPONENT_BYTES = 255
#: widest vector pgvector's HNSW index can hold for the ``halfvec`` type we store; wider embeddings cannot be searched
MAX_INDEXED_EMBEDDING_DIM = 4000
#: tool calls the synthesizer may make in one turn; the rest get an error reply (MAX_TURNS bounds the turns)
MAX_TOOL_CALLS_PER_TURN = 8
#: how much of a tool call's arguments is kept in the job's record of it
MAX_TOOL_ARGS_SUMMARY_CHARS = 200
#: the largest integer PostgreSQL bigint holds: any count or budget a client sends stays below it
MAX_BIGINT = 2**63 - 1
#: uploads up to this size load in the request by default (POST /v1/buffers); larger ones go to an ingest worker
MAX_INLINE_UPLOAD_BYTES = 256 * 1024

# Documents (docs/contract.md#documents): what one converted file may cost the ingest process.
#: pages (PDF), slides (PPTX) or sheets (XLSX) converted; a 2,000-page manual is large, more is an archive or a scan
MAX_DOCUMENT_PAGES = 2000
#: characters of converted text kept (~10 MB, about what the page limit holds): bounds the memory one file can
#: take and the embedding after it; a file cut here took 6 minutes to load on 2 cores, most of it embedding
#: (bench/RESULTS.md, hostile documents), and the old 20,000,000 would have doubled that
MAX_DOCUMENT_CHARS = 10_000_000
#: embedding windows one converted document may add (~2 minutes of encoding on 2 cores at ~490 windows/s): the
#: character limit alone let a file of short paragraphs (~67 characters a window) take 6 minutes to load, most of
#: it embedding (bench/RESULTS.md, hostile documents); about 4-8 million characters of prose fit
MAX_DOCUMENT_WINDOWS = 60_000
#: declared uncompressed size of a zip container (DOCX/PPTX/XLSX/EPUB), checked before anything is unpacked
MAX_UNPACKED_BYTES = 500 * 1024 * 1024
#: compression ratio allowed per zip member over 1 MiB: real documents' XML packs under ~100:1, zip bombs ~1000:1
MAX_ZIP_RATIO = 200
#: seconds of conversion per file, checked between pages and elements and inside a PDF page's content stream and
#: a DOCX body; a slow file must not hold a worker for long (a large file's child process is killed at this age)
MAX_CONVERT_SECONDS = 300
#: address space a large file's conversion may add to its child process: a bound that holds whatever a document
#: library does with hostile bytes (lxml trees take ~10 bytes of memory per byte of XML)
MAX_CONVERT_MEMORY_BYTES = 1024 * 1024 * 1024

# The code sandbox (docs/architecture.md#sandbox): what one model-written program may cost its worker.
#: seconds a round may run, not counting the time its API calls wait on the worker (search, sub-model calls)
MAX_CODE_ROUND_SECONDS = 60
#: address space of the sandbox process: the interpreter takes ~100 MB of it, the program the rest
MAX_CODE_MEMORY_BYTES = 1024 * 1024 * 1024
#: CPU seconds of one sandbox process over all its rounds (the kernel stops it there)
MAX_CODE_CPU_SECONDS = 600
#: characters of a round's printed output kept and shown to the model; printing ten times this stops the round
MAX_CODE_OUTPUT_CHARS = 20_000
#: bytes of one message from the sandbox (a round's result, an API call's arguments): more is refused
MAX_CODE_FRAME_BYTES = 8 * 1024 * 1024
