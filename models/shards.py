"""A checkpoint's safetensors files: one `model.safetensors`, or shards listed by `model.safetensors.index.json`.

Reading here means headers only (names, dtypes, shapes, sizes), so a checkpoint is checked before any tensor is
read; writing goes one shard at a time, reading each tensor from a lazy Mapping only when its shard is written.
"""

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from inkwell.models.config import BaseModelError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # where its bytes start in the file: reading in this order reads each file front to back


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, or a BaseModelError for a damaged or truncated file."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > path.stat().st_size:
                raise ValueError(f"header length {length} is past the end of the file")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        tensors = {
            name: StoredTensor(path, info["dtype"], tuple(info["shape"]), end - start, start)
            for name, info in header.items()
            for start, end in [info["data_offsets"]]
        }
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise BaseModelError(f"{path}: corrupt safetensors file ({exc}); re-download or re-create it") from exc
    end = 8 + length + max((t.offset + t.nbytes for t in tensors.values()), default=0)
    if path.stat().st_size < end:
        raise BaseModelError(
            f"{path}: corrupt safetensors file (truncated: {path.stat().st_size} bytes of {end}); "
            "re-download or re-create it"
        )
    return tensors


@dataclass(frozen=True)
class WeightFiles:
    """A checkpoint's weight files: every tensor they hold by stored name, the index's placement of each (None
    for one file), and what is wrong with them (a listed file missing, a shard's tensor the index does not list)."""

    files: list[Path]
    tensors: dict[str, StoredTensor]
    index: dict[str, Path] | None
    problems: list[str]

    def missing(self, spellings: list[str]) -> str:
        """The problem of a stored tensor being absent, named as the index lists it (or as `spellings[0]`), with
        the file it should be in."""
        name = next((n for n in spellings if self.index and n in self.index), spellings[0])
        if self.index is None:
            return f"{self.files[0]}: tensor {name} is missing"
        if name in self.index:
            return f"{self.index[name]}: tensor {name} is missing ({INDEX_FILE} puts it in this file)"
        return f"{self.files[0].parent / INDEX_FILE}: tensor {name} is in none of its {len(self.files)} files"


def weight_files(model_dir: Path) -> WeightFiles:
    """The weight files of a base-model directory, their headers read (BaseModelError if there are none)."""
    single, index_path = model_dir / WEIGHTS_FILE, model_dir / INDEX_FILE
    if single.is_file():
        return WeightFiles([single], read_header(single), None, [])
    if not index_path.is_file():
        raise BaseModelError(
            f"{model_dir}: no weights; a base model needs {WEIGHTS_FILE}, or {INDEX_FILE} and the shards it lists"
        )
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        index = {name: model_dir / file for name, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BaseModelError(f"{index_path}: not a safetensors index ({exc}); re-download it") from exc
    files = list(dict.fromkeys(index.values()))
    tensors: dict[str, StoredTensor] = {}
    problems = []
    for file in files:
        if not file.is_file():
            problems.append(f"{file}: missing ({INDEX_FILE} lists it)")
            continue
        for name, tensor in read_header(file).items():
            if index.get(name) == file:
                tensors[name] = tensor
            elif name not in index:
                problems.append(f"{file}: tensor {name} is not in {INDEX_FILE}")
    return WeightFiles(files, tensors, index, problems)


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shards(tensors: Mapping[str, torch.Tensor], out_dir: Path, shards: int = 1) -> list[Path]:
    """Write `tensors` in their order as one `model.safetensors` or `shards` files and their index; the tensors
    of one shard are read (from a lazy Mapping) only while that shard is written."""
    names = list(tensors)
    shards = max(1, min(shards, len(names)))
    per = math.ceil(len(names) / shards)
    groups = [names[i : i + per] for i in range(0, len(names), per)]
    files = [out_dir / (WEIGHTS_FILE if len(groups) == 1 else shard_name(i, len(groups))) for i in range(len(groups))]
    weight_map, total = {}, 0
    for group, file in zip(groups, files, strict=True):
        shard = {name: tensors[name].contiguous() for name in group}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, str(file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, file.name)
        del shard  # before the next one is read
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files
