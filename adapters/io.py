"""Save and load adapter directories in the `sglang` or `peft` layout, with a verified manifest.

A directory holds `adapter_config.json`, `adapter_model.safetensors` and `manifest.json`. Files
are written into a temporary sibling directory and renamed into place, so a crash never leaves a
half-written adapter under the final name.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import InklingTextConfig

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.errors import LayoutError, ManifestError
from inkwell.adapters.layouts import LAYOUTS
from inkwell.adapters.layouts import peft as peft_layout
from inkwell.adapters.layouts import sglang as sglang_layout
from inkwell.adapters.layouts.lora_config import plain_lora_problem
from inkwell.adapters.manifest import MANIFEST, read_manifest, write_manifest
from inkwell.adapters.spec import LoraSpec
from inkwell.models.base import BaseModelIdentity

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown adapter layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def save_adapter_layouts(adapter: Adapter, root: Path, config: InklingTextConfig) -> dict[str, Path]:
    """Write `adapter` in every layout, each in `root / <layout>`: what a job or session exports."""
    return {layout: save_adapter(adapter, root / layout, layout, config) for layout in LAYOUTS}


def save_adapter(adapter: Adapter, out_dir: str | Path, layout: str, config: InklingTextConfig) -> Path:
    """Write `adapter` to `out_dir` (which must not exist yet) in `layout`."""
    _check_layout(layout)
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists; adapter directories are never overwritten")
    convert = sglang_layout.to_sglang if layout == "sglang" else peft_layout.to_peft
    tensors, adapter_config = convert(adapter, config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # cloned: loaded factors may share storage (sglang keeps one A for w1/w3), which safetensors refuses
        save_file({k: v.detach().cpu().clone() for k, v in tensors.items()}, tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        write_manifest(
            tmp,
            [CONFIG_FILE, WEIGHTS_FILE],
            {
                "layout": layout,
                "spec": adapter.spec.model_dump(mode="json"),
                "base_model": adapter.base.to_dict(),
                "metadata": adapter.metadata,
            },
        )
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(directory / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise LayoutError(f"{directory / WEIGHTS_FILE}: unreadable safetensors file ({exc})", WEIGHTS_FILE) from exc


def load_adapter(directory: str | Path, config: InklingTextConfig) -> Adapter:
    """Load an adapter directory written by `save_adapter`, after verifying its manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    layout = manifest.get("layout")
    _check_layout(layout)
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if required not in manifest["files"]:
            raise ManifestError(f"{directory / MANIFEST}: does not list {required}", required)
    adapter_config = json.loads((directory / CONFIG_FILE).read_text())
    tensors = _read_tensors(directory)
    spec = LoraSpec.model_validate(manifest["spec"])
    if layout == "sglang":
        _, canonical = sglang_layout.from_sglang(tensors, adapter_config, config)
    else:
        canonical = peft_layout.from_peft(tensors, adapter_config, config, spec)
    return Adapter(
        spec=spec,
        tensors=canonical,
        base=BaseModelIdentity.from_dict(manifest["base_model"]),
        metadata=manifest.get("metadata", {}),
    )


def read_external_adapter(
    directory: str | Path, layout: str, config: InklingTextConfig, base: BaseModelIdentity
) -> Adapter:
    """An adapter directory written by another tool (no manifest); its spec is inferred from its files."""
    _check_layout(layout)
    directory = Path(directory)
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / required).is_file():
            raise LayoutError(
                f"{directory / required}: missing; a {layout} adapter needs {CONFIG_FILE} and {WEIGHTS_FILE}"
            )
    try:
        adapter_config = json.loads((directory / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise LayoutError(f"{directory / CONFIG_FILE}: not valid JSON ({exc})", CONFIG_FILE) from exc
    if problem := plain_lora_problem(adapter_config):
        raise LayoutError(f"{directory / CONFIG_FILE}: {problem}", CONFIG_FILE)
    if layout == "sglang":
        spec, canonical = sglang_layout.from_sglang(_read_tensors(directory), adapter_config, config)
    else:
        spec = peft_layout.infer_spec(adapter_config)
        canonical = peft_layout.from_peft(_read_tensors(directory), adapter_config, config, spec)
    return Adapter(spec=spec, tensors=canonical, base=base, metadata={"imported_from": layout})
