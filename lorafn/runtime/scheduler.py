"""Pure scheduling policy of the worker (no torch): continuous batching with chunked prefill."""
