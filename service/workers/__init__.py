"""Job workers: processes that claim queued jobs, train them and publish their adapters."""
