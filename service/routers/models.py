"""`/v1/models`: the registered base models, in OpenAI's list shape."""

from fastapi import APIRouter, Depends
from sqlalchemy.orm import Session

from inkwell.service.auth import Principal, current_principal
from inkwell.service.db import repo
from inkwell.service.db.models import BaseModelRow
from inkwell.service.deps import get_session
from inkwell.service.errors import APIError
from inkwell.service.schemas import BaseModelInfo, ModelList

router = APIRouter(prefix="/v1/models", tags=["models"])


def model_info(row: BaseModelRow) -> BaseModelInfo:
    return BaseModelInfo(
        id=row.name,
        created=int(row.created_at.timestamp()),
        config_sha256=row.config_sha256,
        hidden_size=row.hidden_size,
        num_hidden_layers=row.num_hidden_layers,
        n_routed_experts=row.n_routed_experts,
        vocab_size=row.vocab_size,
    )


def require_base_model(s: Session, name: str) -> BaseModelRow:
    row = repo.get_base_model(s, name)
    if row is None:
        known = [m.name for m in repo.list_base_models(s)]
        raise APIError(
            404,
            "unknown_base_model",
            f"base model {name!r} is not registered; known: {', '.join(known) or 'none'} (see GET /v1/models)",
            known=known,
        )
    return row


@router.get("", response_model=ModelList)
def list_models(_: Principal = Depends(current_principal), s: Session = Depends(get_session)) -> ModelList:
    return ModelList(data=[model_info(r) for r in repo.list_base_models(s)])


@router.get("/{name}", response_model=BaseModelInfo)
def get_model(name: str, _: Principal = Depends(current_principal), s: Session = Depends(get_session)) -> BaseModelInfo:
    return model_info(require_base_model(s, name))
