"""A property-based fuzz of the whole HTTP API (issue 21): no request, however malformed, is answered with a 5xx.

schemathesis reads the app's OpenAPI document, so every route in it is fuzzed, those added later included, and
sends each a bounded number of generated requests (valid and invalid ones), derandomized so that every run sends
the same ones. They go to the real app (SQLite, embedded SeaweedFS, a CPU serving worker on inkling-tiny) with a
real tenant's key, as the HTTP API and the Tinker door each take it. The tenant has a dataset, a cancelled job and
an adapter with two versions and an alias, whose ids and names are drawn for path, query and body fields half the
time, so that requests get past the 404s into the handlers, the registry and the serving engine.
"""

from collections.abc import Iterator

import pytest
import schemathesis

from inkwell.service.app import create_app
from inkwell.service.settings import Settings
from inkwell.service.storage.seaweed import EmbeddedSeaweed
from inkwell.service.tinker.auth import TINKER_KEY_PREFIX
from tests.service.helpers import (
    CHAT,
    Service,
    import_dir,
    jsonl,
    make_adapter_dir,
    make_settings,
    start_service,
    upload,
)

# Generated requests per route, besides schemathesis's boundary cases (wrong methods, missing and extreme
# values): about 5,000 requests to 66 routes, two minutes of CPU on two cores.
MAX_EXAMPLES = 15
SEED = 21
# The serving tier sized so that any generated request is cheap: a 64-token context (a longer ask is a 400),
# at most 4 prompts in flight and 4 choices per prompt.
SERVING_ENV = {
    "INKWELL_SERVING_MAX_CONTEXT": "64",
    "INKWELL_SERVING_MAX_INFLIGHT_PER_WORKER": "4",
    "INKWELL_SERVING_MAX_SEQS": "4",
}
# What the tenant has, drawn from half the time. The ids of its dataset and job are made by the service: the
# requests carry these stand-ins, swapped for the real ids as they are sent.
KNOWN = {
    "names": ["fz", "inkling-tiny"],
    "refs": ["1", "2", "prod", "latest"],
    "versions": [1, 2],
    "aliases": ["prod"],
    "files": ["adapter_config.json", "adapter_model.safetensors", "manifest.json"],
    "datasets": ["<dataset>"],
    "jobs": ["<job>"],
    "models": ["inkling-tiny", "inkling-tiny:fz", "inkling-tiny:fz@prod", "inkling-tiny:fz@1"],
}
BINDINGS = {
    "path.name": "names",
    "path.ref": "refs",
    "path.version": "versions",
    "path.alias": "aliases",
    "path.path": "files",
    "path.dataset_id": "datasets",
    "path.job_id": "jobs",
    "query.base_model": "names",
    "query.adapter_name": "names",
    "body.model": "models",
    "body.base_model": "names",
    "body.dataset_id": "datasets",
    "body.eval_dataset_id": "datasets",
    "body.adapter_name": "names",
    "body.name": "names",
}
# The document /openapi.json serves (the test below checks that it is), read from the app without starting it:
# schemathesis makes one test per route when this module is collected, before any fixture runs.
OPENAPI = create_app(Settings()).openapi()
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": SEED,
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none"},
        "phases": {"stateful": {"enabled": False}},
        "dictionaries": {name: {"values": values} for name, values in KNOWN.items()},
        "parameters": {field: {"dictionary": name, "probability": 0.5} for field, name in BINDINGS.items()},
    }
)
schema = schemathesis.openapi.from_dict(OPENAPI, config=CONFIG)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, seaweed: EmbeddedSeaweed) -> Iterator[tuple[Service, str, dict[str, str]]]:
    """The app, a tenant's key, and the real id for each stand-in of `KNOWN`."""
    root = tmp_path_factory.mktemp("fuzz")
    with pytest.MonkeyPatch.context() as env:
        for name, value in SERVING_ENV.items():
            env.setenv(name, value)
        svc = start_service(make_settings(root / "svc", None, seaweed))
    try:
        _, key = svc.new_tenant()
        with svc.client(key) as client:
            dataset = upload(client, jsonl(CHAT)).json()["id"]
            body = {"base_model": "inkling-tiny", "dataset_id": dataset, "adapter_name": "fz"}
            job = client.post("/v1/jobs", json=body).json()["id"]
            assert client.post(f"/v1/jobs/{job}/cancel").json()["state"] == "cancelled"  # its event stream ends
            for seed in (0, 1):
                directory = make_adapter_dir(svc, root / f"adapter-{seed}", "sglang", seed=seed)
                assert import_dir(client, directory, "fz", "sglang").status_code == 201
            assert client.put("/v1/adapters/fz/aliases/prod", json={"version": 1}).status_code == 200
        yield svc, key, {"<dataset>": dataset, "<job>": job}
    finally:
        svc.stop()


def _real_ids(value: object, ids: dict[str, str]) -> object:
    """`value` with every stand-in id replaced by the real one, at any depth."""
    if isinstance(value, str):
        return ids.get(value, value)
    if isinstance(value, dict):
        return {k: _real_ids(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_real_ids(v, ids) for v in value]
    return value


def _credentials(key: str) -> dict[str, str]:
    """The tenant's key as each door of the API takes it: the HTTP API's bearer key, the Tinker door's X-API-Key."""
    return {"Authorization": f"Bearer {key}", "X-API-Key": f"{TINKER_KEY_PREFIX}{key}"}


def test_the_fuzzed_schema_is_the_served_one(fuzzed) -> None:
    svc, _, _ = fuzzed
    with svc.client(None) as client:
        assert client.get("/openapi.json").json() == OPENAPI


@schema.parametrize()
def test_no_request_gets_a_5xx(case, fuzzed) -> None:
    svc, key, ids = fuzzed
    for part in ("path_parameters", "query", "body"):
        setattr(case, part, _real_ids(getattr(case, part), ids))
    response = case.call(base_url=svc.url, headers=_credentials(key), timeout=60)
    assert response.status_code < 500, f"{response.status_code} {response.content[:500]!r}\n{case.as_curl_command()}"
