"""SQL persistence: tables, engine/session setup and every query the service runs."""
