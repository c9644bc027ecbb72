# The two commands a newcomer runs: `make demo` and `make test`.
# Both build .venv from Python 3.12 themselves.

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Python 3.12: the first of these that really is 3.12 (pyenv shims refuse unless selected).
PYTHON312 ?= $(shell for p in $${PYTHON312_CANDIDATES:-$$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python 2>/dev/null) $$(command -v python3.12) /usr/bin/python3.12 /usr/local/bin/python3.12}; do \
	"$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && echo "$$p" && break; done)

.PHONY: venv test demo lint clean

$(STAMP): pyproject.toml setup.py
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it (e.g. pyenv install 3.12) or set PYTHON312=/path/to/python3.12"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# SGLang 0.5.23 is the oracle of the `sglang` adapter layout (tests/adapters/test_sglang_layout.py).
# Its full dependency tree is GPU-only: install it without deps, plus what its LoRA loader and
# Inkling LoRA layers import on a CPU host (torchvision must match torch 2.14.1).
SGLANG_STAMP := $(VENV)/.sglang
SGLANG_TEST_DEPS := pybase64 triton pillow starlette IPython aiohttp torchvision==0.29.1 dill sentencepiece \
	apache-tvm-ffi==0.1.11 compressed-tensors==0.20.1 gguf==0.19.0 orjson psutil pyzmq msgspec pydantic requests einops \
	partial-json-parser

.PHONY: sglang-test-deps
sglang-test-deps: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	$(PY) -m pip install -q $(SGLANG_TEST_DEPS)
	touch $(SGLANG_STAMP)

# tinker-cookbook 0.6.1 drives the Tinker door in tests/tinker (its own training loops). It requires
# tml-renderers>=0.4.1, which the package index does not have and which only its Thinking Machines model
# tokenizers import (lazily): install it without deps, plus the dependencies its loops import.
COOKBOOK_STAMP := $(VENV)/.cookbook
COOKBOOK_TEST_DEPS := aiohttp anyio blobfile chz cloudpickle datasets huggingface-hub pillow pyrage termcolor tiktoken

$(COOKBOOK_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps tinker-cookbook==0.6.1
	$(PY) -m pip install -q $(COOKBOOK_TEST_DEPS)
	touch $(COOKBOOK_STAMP)

# Debian's chromium and chromium-driver run the web console's end-to-end tests (tests/console, through Selenium).
CHROMIUM_STAMP := $(VENV)/.chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(CHROMIUM_STAMP): $(STAMP)
	(command -v chromium && command -v chromedriver) >/dev/null || \
		($(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver)
	touch $(CHROMIUM_STAMP)

test: $(STAMP) $(SGLANG_STAMP) $(COOKBOOK_STAMP) $(CHROMIUM_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

demo: $(STAMP)
	$(PY) demo/run_demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .demo
