"""SGLang 0.5.23 for the tests that use it as an oracle: imported by name, skipped on request, loud if missing."""

import importlib
import os
from types import SimpleNamespace

import pytest

WHERE = {  # the names the tests use, and where SGLang 0.5.23 defines them ("module:attr")
    "InklingMMConfig": "sglang.srt.configs.inkling:InklingMMConfig",
    "LoadConfig": "sglang.srt.configs.load_config:LoadConfig",
    "LoRAAdapter": "sglang.srt.lora.lora:LoRAAdapter",
    "LoRAConfig": "sglang.srt.lora.lora_config:LoRAConfig",
    "normalize_targets": "sglang.srt.lora.utils:get_normalized_target_modules",
    "SamplingParams": "sglang.srt.sampling.sampling_params:SamplingParams",
    "ServerArgs": "sglang.srt.server_args:ServerArgs",
    "Sink": "sglang.srt.models.inkling_common.lora:InklingBatchDenseMLPWithLoRA",
}


def import_sglang(*names: str) -> SimpleNamespace:
    """The `names` (keys of WHERE), imported; a missing install fails the test (the Makefile installs it)
    unless INKWELL_SKIP_SGLANG=1 skips it."""
    if os.environ.get("INKWELL_SKIP_SGLANG") == "1":
        pytest.skip("INKWELL_SKIP_SGLANG=1")
    found = {}
    for name in names:
        module, attr = WHERE[name].split(":")
        try:
            found[name] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            pytest.fail(f"SGLang 0.5.23 is not importable ({exc}); run `make sglang-test-deps`")
    return SimpleNamespace(**found)


def sglang_fixture(names: str, doc: str):
    """A module-scoped fixture `sgl`: `import_sglang` of the space-separated `names`, once per test module.
    Assign it as `sgl = sglang_fixture(...)`."""

    def sgl() -> SimpleNamespace:
        return import_sglang(*names.split())

    sgl.__doc__ = doc
    return pytest.fixture(scope="module", name="sgl")(sgl)
