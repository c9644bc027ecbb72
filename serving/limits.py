"""The bounds of a sampling request, with no imports: the API's schemas and the SDK read them without loading an
engine (or torch), and the engine contract checks requests against the same numbers."""

MAX_LOGPROBS = 20
# a request's seed: any 64-bit integer, read signed or unsigned (OpenAI's clients send either)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
