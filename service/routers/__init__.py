"""Thin HTTP routers: parse, authorize, call repo/registry, shape the response."""
