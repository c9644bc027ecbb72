"""Tinker API keys: the client sends `X-API-Key` and refuses keys that do not start with `tml-`, so an inkwell key
`ink_...` is sent as `tml-ink_...` (`inkwell admin create-key` prints both forms). It maps to the key's tenant,
exactly as `Authorization: Bearer ink_...` does on `/v1`."""

from fastapi import Header, Request

from inkwell.service.auth import Principal
from inkwell.service.db import repo
from inkwell.service.errors import APIError

TINKER_KEY_PREFIX = "tml-"


def tinker_key(inkwell_key: str) -> str:
    return TINKER_KEY_PREFIX + inkwell_key


def tinker_principal(request: Request, x_api_key: str | None = Header(None)) -> Principal:
    if not x_api_key:
        raise APIError(401, "unauthorized", "missing API key: send X-API-Key: tml-<inkwell key> (TINKER_API_KEY)")
    inkwell_key = x_api_key.removeprefix(TINKER_KEY_PREFIX)
    if inkwell_key == x_api_key or not inkwell_key.startswith(repo.KEY_PREFIX):
        raise APIError(
            401, "unauthorized", f"malformed API key: send 'tml-' followed by an inkwell key ({repo.KEY_PREFIX}...)"
        )
    with request.app.state.read_sessionmaker() as s:
        key = repo.find_api_key(s, inkwell_key)
    if key is None:
        raise APIError(401, "unauthorized", "unknown or revoked API key; create one with `inkwell admin create-key`")
    return Principal(tenant_id=key.tenant_id, key_id=key.id)
