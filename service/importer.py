"""Import an adapter directory uploaded by a user: load it with inkwell.adapters (an inkwell
export with its manifest, or another tool's directory whose spec is inferred), validate it
against the base model, re-save it in both layouts and publish it as a new registry version.
"""

import tempfile
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from inkwell.adapters.errors import AdapterError
from inkwell.adapters.io import load_adapter, read_external_adapter, save_adapter
from inkwell.adapters.layouts import LAYOUTS
from inkwell.adapters.validate import validate
from inkwell.models.base import BaseModelIdentity, load_base_config
from inkwell.service.db.models import AdapterVersionRow, BaseModelRow
from inkwell.service.errors import APIError
from inkwell.service.registry import Publication, check_name, publish
from inkwell.service.storage import ObjectStore

ALLOWED_FILES = ("adapter_config.json", "adapter_model.safetensors", "manifest.json")


def _invalid(message: str, reason_code: str, **details) -> APIError:
    return APIError(422, "invalid_adapter", message, reason_code=reason_code, **details)


def import_adapter(
    sm: sessionmaker[Session],
    store: ObjectStore,
    scratch: Path,
    tenant_id: str,
    actor: str,
    name: str,
    base: BaseModelRow,
    layout: str,
    files: dict[str, bytes],
    version: int | None = None,
) -> AdapterVersionRow:
    check_name(name)
    if layout not in LAYOUTS:
        raise _invalid(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}", "bad_layout")
    unknown = sorted(set(files) - set(ALLOWED_FILES))
    if unknown:
        raise _invalid(
            f"unexpected files {unknown}; an adapter directory holds {', '.join(ALLOWED_FILES)}", "unexpected_file"
        )
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="import-") as tmp:
        src = Path(tmp) / "in"
        src.mkdir()
        for filename, data in files.items():
            (src / filename).write_bytes(data)
        config = load_base_config(base.path)
        identity = BaseModelIdentity(base.name, base.config_sha256)
        try:
            if "manifest.json" in files:
                adapter = load_adapter(src, config)
            else:
                adapter = read_external_adapter(src, layout, config, identity)
            validate(adapter, config, base=identity)
        except AdapterError as exc:
            raise _invalid(f"not a usable adapter for {base.name}: {exc}", exc.code, tensor=exc.tensor) from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise _invalid(
                f"not an Inkling LoRA adapter in the {layout} layout ({type(exc).__name__}: {exc})", "unreadable"
            ) from exc
        out = Path(tmp) / "out"
        dirs = {lay: save_adapter(adapter, out / lay, lay, config) for lay in LAYOUTS}
        pub = Publication(
            tenant_id=tenant_id,
            name=name,
            base_model=base.name,
            base_config_sha256=base.config_sha256,
            layout_dirs=dirs,
            lora=adapter.spec.model_dump(mode="json"),
            source="import",
            actor=actor,
            metrics={"num_parameters": adapter.num_parameters, "imported_layout": layout},
            version=version,
        )
        return publish(sm, store, pub)
