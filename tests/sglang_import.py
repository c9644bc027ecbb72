"""SGLang 0.5.23 for the tests that use it as an oracle: imported by name, skipped on request, loud if missing."""

import importlib
import os
from types import SimpleNamespace

import pytest


def import_sglang(**names: str) -> SimpleNamespace:
    """`name="module:attr"` pairs, imported; a missing install fails the test (the Makefile installs it)
    unless INKWELL_SKIP_SGLANG=1 skips it."""
    if os.environ.get("INKWELL_SKIP_SGLANG") == "1":
        pytest.skip("INKWELL_SKIP_SGLANG=1")
    found = {}
    for name, where in names.items():
        module, attr = where.split(":")
        try:
            found[name] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            pytest.fail(f"SGLang 0.5.23 is not importable ({exc}); run `make sglang-test-deps`")
    return SimpleNamespace(**found)
