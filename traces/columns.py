"""The trace schema's column names (``schema.TRACE_SCHEMA`` gives their types).

Standard library only, so that a scenario's column map is checked (``kvtwin plan``, the
command line's help) without loading pyarrow.
"""

from __future__ import annotations

REQUEST_ID = "request_id"
ARRIVAL_TIME_S = "arrival_time_s"
PROMPT_TOKENS = "prompt_tokens"
OUTPUT_TOKENS = "output_tokens"
SESSION_ID = "session_id"
TURN = "turn"
PRIORITY = "priority"
BLOCK_HASHES = "block_hashes"
HASH_BLOCK_TOKENS = "hash_block_tokens"
PROMPT_TOKEN_IDS = "prompt_token_ids"

# The columns a source file may feed, by the schema's name or through a column map.
# hash_block_tokens is not among them: it is one number per trace (an option, or a
# schema-named column holding one value).
MAPPABLE = (ARRIVAL_TIME_S, PROMPT_TOKENS, OUTPUT_TOKENS, REQUEST_ID, SESSION_ID, TURN, PRIORITY, BLOCK_HASHES,
            PROMPT_TOKEN_IDS)
# What a source must give: the rest is optional (ids default to row numbers).
MAP_REQUIRED = (ARRIVAL_TIME_S, PROMPT_TOKENS, OUTPUT_TOKENS)
