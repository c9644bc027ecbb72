"""The native Inkling engine: continuous batching with a LoRA adapter per request (CPU or one GPU)."""
