"""`client.models`, `.datasets`, `.jobs`, `.adapters`: one class each, shared by both clients.

Every method builds a `Call` or an `Op` and hands it to the client's transport, so on a `Client`
it returns the value and on an `AsyncClient` it returns an awaitable of the same value (the
`iter*` and `events` methods return an iterator or an async iterator respectively).
"""

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pydantic

from inkwell.adapters.layouts import LAYOUTS
from inkwell.adapters.spec import LoraSpec
from inkwell.sdk.calls import Call, FileSink, Op, Upload, parse_model, segment, single
from inkwell.sdk.errors import ValidationError
from inkwell.sdk.events import EventFollower, Page
from inkwell.service.schemas import (
    HYPERPARAMETERS,
    Adapter,
    AdapterFile,
    AdapterVersion,
    Alias,
    BaseModelInfo,
    Dataset,
    Download,
    JobEvent,
    ModelList,
)
from inkwell.service.schemas import Job as JobInfo
from inkwell.trainer.config import name_problem
from inkwell.validation import first_error, reason

if TYPE_CHECKING:
    from inkwell.sdk.client import Client
    from inkwell.sdk.jobs import Job

DATASET_ID = re.compile(r"^ds_[0-9a-f]{24}$")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
OPTIONAL_ADAPTER_FILES = ("manifest.json",)

type DatasetSource = str | Path | Iterable[Mapping[str, Any]]
type VersionRef = int | str


def _page[T](item: type[T], wrap=None):
    """Parse `{"data": [...], "next_cursor": ...}` into a `Page`, optionally wrapping each item."""

    def parse(response: httpx.Response) -> Page:
        body = response.json()
        items = [item.model_validate(x) for x in body["data"]]  # type: ignore[attr-defined]
        return Page([wrap(x) for x in items] if wrap else items, body.get("next_cursor"))

    return parse


def _next_cursor(call: Call):
    def next_call(page: Page) -> Call | None:
        if not page.next_cursor:
            return None
        return Call(
            call.method, call.path, params={**(call.params or {}), "cursor": page.next_cursor}, parse=call.parse
        )

    return next_call


def _check_name(kind: str, name: str) -> None:
    problem = name_problem(name) if isinstance(name, str) else "it is not a string"
    if problem:
        raise ValidationError(f"{kind} {name!r} is not allowed: {problem}", code="invalid_name", details={"name": name})


def pydantic_error(what: str, exc: pydantic.ValidationError, known: Iterable[str]) -> ValidationError:
    """A client-side ValidationError naming the bad field and, for unknown ones, the allowed names."""
    errors = exc.errors(include_url=False)
    where, why = first_error(exc)
    if errors[0]["type"] == "extra_forbidden":
        message = f"unknown {what} {where!r}; known: {', '.join(known)}"
    else:
        message = f"{what} {where}: {why}"
    details = {"errors": [{"loc": list(e["loc"]), "msg": reason(e)} for e in errors]}
    return ValidationError(message, code="validation_error", details=details)


def lora_spec(lora: LoraSpec | Mapping[str, Any] | None) -> LoraSpec:
    if lora is None or isinstance(lora, LoraSpec):
        return lora or LoraSpec()
    try:
        return LoraSpec.model_validate(dict(lora))
    except pydantic.ValidationError as exc:
        raise pydantic_error("lora field", exc, LoraSpec.model_fields) from exc


def hyperparameters(values: Mapping[str, Any], method: str = "sft") -> dict[str, Any]:
    """Validate the user's hyperparameters for `method` locally; only the ones given are sent (server defaults
    rule)."""
    model = HYPERPARAMETERS.get(method)
    if model is None:
        known = ", ".join(HYPERPARAMETERS)
        raise ValidationError(f"unknown method {method!r}; known: {known}", code="validation_error")
    try:
        return model.model_validate(dict(values)).model_dump(mode="json", exclude_unset=True)
    except pydantic.ValidationError as exc:
        raise pydantic_error("hyperparameter", exc, model.model_fields) from exc


class _Resource:
    def __init__(self, client: "Client") -> None:
        self._client = client
        self._t = client._transport


class Models(_Resource):
    def list(self) -> list[BaseModelInfo]:
        return self._t.run(Call("GET", "/v1/models", parse=lambda r: ModelList.model_validate_json(r.content).data))

    def get(self, name: str) -> BaseModelInfo:
        return self._t.run(self.get_call(name))

    def get_call(self, name: str) -> Call:
        return Call("GET", f"/v1/models/{segment(name)}", parse=parse_model(BaseModelInfo))


class Datasets(_Resource):
    def upload(self, source: DatasetSource, name: str | None = None) -> Dataset:
        """Upload a JSONL file (path) or a list of example dicts (serialized to JSONL)."""
        return self._t.run(self.upload_op(source, name))

    def upload_op(self, source: DatasetSource, name: str | None = None) -> Op[Dataset]:
        """The upload's Op; the source is read and checked here, before the Op sends anything."""
        if isinstance(source, str | Path):
            path = Path(source)
            if not path.is_file():
                what = "is a directory" if path.is_dir() else "does not exist"
                raise FileNotFoundError(
                    f"dataset file {str(path)!r} {what} (give a JSONL path, a list of dicts or a 'ds_...' id)"
                )
            upload = Upload("file", name or path.name, path, "application/jsonl")
        elif isinstance(source, Iterable) and not isinstance(source, bytes | Mapping):
            upload = Upload("file", name or "dataset.jsonl", _jsonl(source), "application/jsonl")
        else:
            raise TypeError(f"dataset must be a path, a list of dicts or a 'ds_...' id, not {type(source).__name__}")
        form = {"name": name} if name else None
        return single(Call("POST", "/v1/datasets", data=form, uploads=[upload], parse=parse_model(Dataset)))

    def list(self, limit: int | None = None, cursor: str | None = None) -> Page[Dataset]:
        return self._t.run(self._list_call(limit, cursor))

    def iter(self, page_size: int = 100) -> Iterator[Dataset]:
        """Every dataset, newest first, fetching pages as needed."""
        call = self._list_call(page_size, None)
        return self._t.paginate(call, _next_cursor(call))

    def get(self, dataset_id: str) -> Dataset:
        return self._t.run(Call("GET", f"/v1/datasets/{segment(dataset_id)}", parse=parse_model(Dataset)))

    def delete(self, dataset_id: str) -> None:
        """Delete a dataset's data (jobs that trained on it keep its id); ConflictError while a queued or running
        job uses it."""
        return self._t.run(Call("DELETE", f"/v1/datasets/{segment(dataset_id)}"))

    def _list_call(self, limit: int | None, cursor: str | None) -> Call:
        return Call("GET", "/v1/datasets", params={"limit": limit, "cursor": cursor}, parse=_page(Dataset))


def _jsonl(records: Iterable[Mapping[str, Any]]) -> bytes:
    lines = []
    for i, record in enumerate(records, 1):
        if not isinstance(record, Mapping):
            raise TypeError(f"dataset example {i} is a {type(record).__name__}, expected a dict")
        lines.append(json.dumps(record, ensure_ascii=False))
    if not lines:
        raise ValidationError("the dataset is empty: give at least one example", code="invalid_dataset")
    return ("\n".join(lines) + "\n").encode()


def job_body(
    base_model: str,
    adapter_name: str,
    lora: LoraSpec | Mapping[str, Any] | None,
    method: str,
    hparams: Mapping[str, Any],
) -> dict[str, Any]:
    """A job's fields but its datasets, checked here: `train()` checks them before it uploads a dataset, so a job
    refused for a misspelt hyperparameter leaves no upload behind."""
    _check_name("adapter name", adapter_name)
    return {
        "base_model": base_model,
        "adapter_name": adapter_name,
        "method": method,
        "lora": lora_spec(lora).model_dump(mode="json"),
        "hyperparameters": hyperparameters(hparams, method),
    }


class Jobs(_Resource):
    def create(
        self,
        base_model: str,
        dataset_id: str,
        adapter_name: str,
        *,
        lora: LoraSpec | Mapping[str, Any] | None = None,
        method: str = "sft",
        eval_dataset_id: str | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
    ) -> "Job":
        body = job_body(base_model, adapter_name, lora, method, hyperparameters or {})
        return self._t.run(self.create_op(body, dataset_id, eval_dataset_id))

    def create_op(self, body: dict[str, Any], dataset_id: str, eval_dataset_id: str | None) -> Op["Job"]:
        """Create the job `body` (from `job_body`) on the given datasets."""
        body = {**body, "dataset_id": dataset_id, "eval_dataset_id": eval_dataset_id}
        return (yield Call("POST", "/v1/jobs", json=body, parse=self._parse_job))

    def list(
        self,
        *,
        state: str | None = None,
        adapter_name: str | None = None,
        base_model: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page["Job"]:
        return self._t.run(self._list_call(state, adapter_name, base_model, limit, cursor))

    def iter(
        self,
        *,
        state: str | None = None,
        adapter_name: str | None = None,
        base_model: str | None = None,
        page_size: int = 100,
    ) -> Iterator["Job"]:
        """Every matching job, newest first, fetching pages as needed."""
        call = self._list_call(state, adapter_name, base_model, page_size, None)
        return self._t.paginate(call, _next_cursor(call))

    def get(self, job_id: str) -> "Job":
        return self._t.run(self.get_call(job_id))

    def cancel(self, job_id: str) -> "Job":
        return self._t.run(Call("POST", f"/v1/jobs/{segment(job_id)}/cancel", parse=self._parse_job))

    def events(self, job_id: str, *, after: int | None = None, timeout: float | None = None) -> Iterator[JobEvent]:
        """Follow the job's server-sent events (resuming across drops) until its terminal state event."""
        return self._t.follow(EventFollower(job_id, after, timeout))

    def history(self, job_id: str, *, after: int | None = None, page_size: int = 200) -> Iterator[JobEvent]:
        """The events recorded so far, oldest first, without waiting for new ones."""

        def call(after_id: int | None) -> Call:
            params = {"after": after_id, "limit": page_size}
            return Call("GET", f"/v1/jobs/{segment(job_id)}/events", params=params, parse=_page(JobEvent))

        def next_call(page: Page[JobEvent]) -> Call | None:
            return call(page.data[-1].id) if len(page.data) == page_size else None

        return self._t.paginate(call(after), next_call)

    def logs(self, job_id: str) -> str:
        return self._t.run(Call("GET", f"/v1/jobs/{segment(job_id)}/logs", parse=lambda r: r.text))

    def get_call(self, job_id: str, parse=None) -> Call:
        return Call("GET", f"/v1/jobs/{segment(job_id)}", parse=parse or self._parse_job)

    def _parse_job(self, response: httpx.Response) -> "Job":
        return self._client._job(JobInfo.model_validate_json(response.content))

    def _list_call(self, state, adapter_name, base_model, limit, cursor) -> Call:
        params = {"state": state, "adapter_name": adapter_name, "base_model": base_model, "limit": limit}
        return Call("GET", "/v1/jobs", params={**params, "cursor": cursor}, parse=_page(JobInfo, self._client._job))


@dataclass(frozen=True)
class DownloadedAdapter:
    """An adapter version written to `path`, every file's sha256 verified."""

    name: str
    version: int
    layout: str
    path: Path
    files: list[AdapterFile]


class Adapters(_Resource):
    def list(
        self, *, base_model: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> Page[Adapter]:
        return self._t.run(self._list_call(base_model, limit, cursor))

    def iter(self, *, base_model: str | None = None, page_size: int = 100) -> Iterator[Adapter]:
        call = self._list_call(base_model, page_size, None)
        return self._t.paginate(call, _next_cursor(call))

    def get(self, name: str) -> Adapter:
        return self._t.run(Call("GET", f"/v1/adapters/{segment(name)}", parse=parse_model(Adapter)))

    def versions(
        self, name: str, *, include_deleted: bool = False, limit: int | None = None, cursor: str | None = None
    ) -> Page[AdapterVersion]:
        params = {"include_deleted": str(include_deleted).lower(), "limit": limit, "cursor": cursor}
        path = f"/v1/adapters/{segment(name)}/versions"
        return self._t.run(Call("GET", path, params=params, parse=_page(AdapterVersion)))

    def version(self, name: str, ref: VersionRef) -> AdapterVersion:
        """One version by number (`3`) or alias (`"prod"`), deleted ones included."""
        return self._t.run(self.version_call(name, ref))

    def version_call(self, name: str, ref: VersionRef) -> Call:
        path = f"/v1/adapters/{segment(name)}/versions/{segment(ref)}"
        return Call("GET", path, parse=parse_model(AdapterVersion))

    def download(
        self,
        name: str,
        ref: VersionRef = "latest",
        *,
        layout: str = "sglang",
        dest: str | Path,
        presigned: bool = False,
    ) -> DownloadedAdapter:
        """Write one layout of a version (number, alias or "latest") into `dest`, verifying each file's
        sha256; files appear only once all of them verified. `presigned` fetches straight from S3."""
        return self._t.run(self._download_op(name, ref, layout, Path(dest), presigned))

    def _download_op(self, name, ref, layout, dest: Path, presigned: bool) -> Op[DownloadedAdapter]:
        _check_layout(layout)
        if dest.exists() and not dest.is_dir():
            raise ValidationError(f"dest {str(dest)!r} is a file: give a directory for its files", code="bad_dest")
        path = f"/v1/adapters/{segment(name)}/versions/{segment(ref)}/download"
        info = yield Call("GET", path, params={"layout": layout}, parse=parse_model(Download))
        try:
            dest.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file on its path, no permission
            raise ValidationError(f"cannot make the directory {str(dest)!r}: {exc.strerror}", code="bad_dest") from exc
        sinks = []
        try:
            for f in info.files:
                if Path(f.path).name != f.path or f.path in ("", ".", ".."):
                    raise ValidationError(f"the registry sent an unsafe file name {f.path!r}", code="unsafe_path")
                sink = FileSink(dest / f.path, f.sha256, f.size)
                sinks.append(sink)
                target = f.url if presigned else f.download_path
                yield Call("GET", target, sink=sink, auth=not presigned)
            for sink in sinks:
                sink.commit()
        finally:
            for sink in sinks:
                sink.discard()
        files = [AdapterFile.model_validate(f.model_dump()) for f in info.files]
        return DownloadedAdapter(info.name, info.version, info.layout, dest, files)

    def import_(
        self, path: str | Path, *, name: str, base_model: str, layout: str, version: int | None = None
    ) -> AdapterVersion:
        """Publish an adapter directory (`adapter_config.json`, `adapter_model.safetensors`, optional
        `manifest.json`) of either layout as a new version."""
        return self._t.run(self._import_op(Path(path), name, base_model, layout, version))

    def _import_op(self, path: Path, name, base_model, layout, version) -> Op[AdapterVersion]:
        _check_name("adapter name", name)
        _check_layout(layout)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} {'is a file' if path.exists() else 'does not exist'}: give the adapter's directory"
            )
        missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{path} is not an adapter directory: missing {', '.join(missing)}")
        names = ADAPTER_FILES + tuple(f for f in OPTIONAL_ADAPTER_FILES if (path / f).is_file())
        uploads = [Upload("files", f, path / f) for f in names]
        form = {"name": name, "base_model": base_model, "layout": layout}
        if version is not None:
            form["version"] = str(version)
        call = Call("POST", "/v1/adapters/import", data=form, uploads=uploads, parse=parse_model(AdapterVersion))
        return (yield call)

    def delete_version(self, name: str, version: int) -> AdapterVersion:
        """Soft-delete a version (audited); refused with ConflictError while an alias points at it."""
        path = f"/v1/adapters/{segment(name)}/versions/{segment(version)}"
        return self._t.run(Call("DELETE", path, parse=parse_model(AdapterVersion)))

    def set_alias(self, name: str, alias: str, version: int) -> Alias:
        """Create or move `alias` (e.g. "prod") to `version`."""
        return self._t.run(self._set_alias_op(name, alias, version))

    def _set_alias_op(self, name: str, alias: str, version: int) -> Op[Alias]:
        _check_name("alias", alias)
        path = f"/v1/adapters/{segment(name)}/aliases/{segment(alias)}"
        return (yield Call("PUT", path, json={"version": version}, parse=parse_model(Alias)))

    def delete_alias(self, name: str, alias: str) -> None:
        return self._t.run(Call("DELETE", f"/v1/adapters/{segment(name)}/aliases/{segment(alias)}"))

    def _list_call(self, base_model, limit, cursor) -> Call:
        params = {"base_model": base_model, "limit": limit, "cursor": cursor}
        return Call("GET", "/v1/adapters", params=params, parse=_page(Adapter))


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValidationError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}", code="validation_error")
