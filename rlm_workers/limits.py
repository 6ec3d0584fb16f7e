"""Limits on untrusted input and output (docs/contract.md#limits): what a query, a tool call or a model's
reply may be at most.  Inputs over a limit are refused with a one-line error; model output over one is cut."""

MAX_QUERY_BYTES = 10 * 1024
MAX_REGEX_BYTES = 500
MAX_TOOL_ARGS_BYTES = 100 * 1024
MAX_FINDINGS_PER_BATCH = 200
MAX_FINDING_BYTES = 5 * 1024
MAX_FOLLOW_UPS = 10
#: tool calls the synthesizer may make in one turn; the rest get an error reply (MAX_TURNS bounds the turns)
MAX_TOOL_CALLS_PER_TURN = 8
#: how much of a tool call's arguments is kept in the job's record of it
MAX_TOOL_ARGS_SUMMARY_CHARS = 200
