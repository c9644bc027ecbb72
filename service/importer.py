"""Import an adapter directory uploaded by a user: load it with inkwell.adapters (an inkwell
export with its manifest, or another tool's directory whose spec is inferred), validate it
against the base model, re-save it in both layouts and publish it as a new registry version.

Every check of the upload runs before the first object is written, and a refusal names files as
they were uploaded: the scratch directory they are read from is the server's business.
"""

import json
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from inkwell.adapters.errors import AdapterError
from inkwell.adapters.io import load_adapter, read_external_adapter, save_adapter
from inkwell.adapters.layouts import LAYOUTS
from inkwell.adapters.validate import validate
from inkwell.models import BaseModelIdentity, load_base_config
from inkwell.service.db.models import AdapterVersionRow, BaseModelRow
from inkwell.service.errors import APIError
from inkwell.service.registry import Publication, check_name, publish
from inkwell.service.storage import ObjectStore

ALLOWED_FILES = ("adapter_config.json", "adapter_model.safetensors", "manifest.json")
JSON_FILES = {"adapter_config.json": "bad_layout", "manifest.json": "bad_manifest"}
# What reading a malformed upload raises besides AdapterError: bad input, never a server fault.
UNREADABLE = (ValueError, LookupError, TypeError, AttributeError)


def _invalid(message: str, reason_code: str, **details) -> APIError:
    return APIError(422, "invalid_adapter", message, reason_code=reason_code, **details)


def _uploaded(files: Mapping[str, bytes] | Iterable[tuple[str, bytes]]) -> dict[str, bytes]:
    """The upload by file name; a name given twice is refused (which of the two is meant is a guess)."""
    out: dict[str, bytes] = {}
    for filename, data in files.items() if isinstance(files, Mapping) else files:
        if filename in out:
            raise _invalid(
                f"{filename} is uploaded more than once; send each file of the adapter directory once", "duplicate_file"
            )
        out[filename] = data
    return out


def _check_json_objects(files: dict[str, bytes]) -> None:
    """A JSON file that parses to something else than an object is refused by name (the readers would crash)."""
    for filename, reason_code in JSON_FILES.items():
        if filename not in files:
            continue
        try:
            value = json.loads(files[filename])
        except ValueError:
            continue  # the readers say where it is not JSON
        if not isinstance(value, dict):
            raise _invalid(f"{filename}: must be a JSON object, not {type(value).__name__}", reason_code)


def _manifest_layout(files: dict[str, bytes]) -> str | None:
    try:
        layout = json.loads(files["manifest.json"]).get("layout")
    except (KeyError, ValueError):
        return None
    return layout if layout in LAYOUTS else None


def _mismatch(declared: str, actual: str) -> APIError:
    return _invalid(
        f"the files are an adapter in the {actual} layout, not the declared {declared}; send layout={actual}",
        "layout_mismatch",
        declared=declared,
        actual=actual,
    )


def import_adapter(
    sm: sessionmaker[Session],
    store: ObjectStore,
    scratch: Path,
    tenant_id: str,
    actor: str,
    name: str,
    base: BaseModelRow,
    layout: str,
    files: Mapping[str, bytes] | Iterable[tuple[str, bytes]],
    version: int | None = None,
) -> AdapterVersionRow:
    check_name(name)
    if layout not in LAYOUTS:
        raise _invalid(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}", "bad_layout")
    files = _uploaded(files)
    unknown = sorted(set(files) - set(ALLOWED_FILES))
    if unknown:
        raise _invalid(
            f"unexpected files {unknown}; an adapter directory holds {', '.join(ALLOWED_FILES)}", "unexpected_file"
        )
    _check_json_objects(files)
    if (actual := _manifest_layout(files)) not in (None, layout):
        raise _mismatch(layout, actual)
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="import-") as tmp:
        src = Path(tmp) / "in"
        src.mkdir()
        for filename, data in files.items():
            (src / filename).write_bytes(data)

        def scrub(message: str) -> str:
            """The message with the scratch paths cut: `<tmp>/in/adapter_config.json` reads `adapter_config.json`."""
            return message.replace(f"{src}/", "").replace(str(src), "the upload").replace(str(scratch), "the server")

        config = load_base_config(base.path)
        identity = BaseModelIdentity(base.name, base.config_sha256)
        try:
            if "manifest.json" in files:
                adapter = load_adapter(src, config)
            else:
                adapter = _read_external(src, layout, config, identity)
            validate(adapter, config, base=identity)
        except AdapterError as exc:
            raise _invalid(
                f"not a usable adapter for {base.name}: {scrub(str(exc))}", exc.code, tensor=exc.tensor
            ) from exc
        except UNREADABLE as exc:
            raise _invalid(
                f"not an Inkling LoRA adapter in the {layout} layout ({type(exc).__name__}: {scrub(str(exc))})",
                "unreadable",
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


def _read_external(src: Path, layout: str, config, identity: BaseModelIdentity):
    """Another tool's directory in `layout`; when it does not read as that layout but does as another, the
    refusal says so (the reader's own error names a tensor, not the wrong layout)."""
    try:
        return read_external_adapter(src, layout, config, identity)
    except AdapterError as exc:
        for other in LAYOUTS:
            if other == layout:
                continue
            try:
                read_external_adapter(src, other, config, identity)
            except (AdapterError, *UNREADABLE):
                continue
            raise _mismatch(layout, other) from exc
        raise
