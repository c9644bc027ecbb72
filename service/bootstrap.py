"""First-start setup shared by the app and the CLI: migrate the database, register base models,
and make sure a tenant with a key exists for the embedded single-user default."""

import logging
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from inkwell.models import PRESETS, BaseCheckpoint, base_model_identity, check_base_model, init_base_model
from inkwell.service.db import repo

log = logging.getLogger("inkwell.service")
LOCAL_TENANT = "local"


def register_base_model(s: Session, name: str, model_dir: Path) -> BaseCheckpoint:
    """Record a base-model directory once it is checked (a BaseModelError names every tensor and file that is
    wrong); the checked checkpoint's notes say what it ignored (a multimodal model's towers)."""
    checkpoint = check_base_model(model_dir)
    identity = base_model_identity(model_dir)
    repo.upsert_base_model(s, name, str(Path(model_dir).resolve()), identity.config_sha256, checkpoint.config)
    return checkpoint


def ensure_preset_models(sm: sessionmaker[Session], presets: list[str], models_dir: Path) -> None:
    """Create (once) and register each preset under `models_dir/<preset>`."""
    for preset in presets:
        if preset not in PRESETS:
            raise ValueError(f"INKWELL_BASE_MODELS names unknown preset {preset!r}; known: {', '.join(PRESETS)}")
        with sm() as s:
            if repo.get_base_model(s, preset) is not None:
                continue
        model_dir = models_dir / preset
        if not (model_dir / "config.json").exists():
            log.info("creating base model %s in %s", preset, model_dir)
            init_base_model(preset, model_dir, seed=0, name=preset)
        with sm() as s:
            register_base_model(s, preset, model_dir)
            try:
                s.commit()
            except IntegrityError:  # another API process registered it first
                s.rollback()


def ensure_local_key(sm: sessionmaker[Session]) -> str | None:
    """The plaintext of a new key for the `local` tenant if it has none yet; None otherwise."""
    with sm() as s:
        tenant = repo.tenant_by_name(s, LOCAL_TENANT)
        if tenant is not None:
            return None
        tenant = repo.create_tenant(s, LOCAL_TENANT)
        _, plaintext = repo.create_api_key(s, tenant.id, "local")
        s.commit()
        return plaintext
