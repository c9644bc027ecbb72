"""Bearer API keys. Keys are stored as sha256; each belongs to one tenant, and everything a
request can reach is filtered by that tenant (another tenant's object is simply not found).
"""

from dataclasses import dataclass

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from inkwell.service.db import repo
from inkwell.service.errors import APIError

_bearer = HTTPBearer(auto_error=False, description="an inkwell API key (`inkwell admin create-key`)")


@dataclass(frozen=True)
class Principal:
    tenant_id: str
    key_id: str


def current_principal(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> Principal:
    if credentials is None:
        raise APIError(401, "unauthorized", "missing API key: send the header `Authorization: Bearer <key>`")
    if credentials.scheme.lower() != "bearer" or not credentials.credentials.startswith(repo.KEY_PREFIX):
        raise APIError(401, "unauthorized", "malformed API key: inkwell keys start with 'ink_'")
    with request.app.state.read_sessionmaker() as s:
        key = repo.find_api_key(s, credentials.credentials)
    if key is None:
        raise APIError(401, "unauthorized", "unknown or revoked API key; create one with `inkwell admin create-key`")
    return Principal(tenant_id=key.tenant_id, key_id=key.id)
