"""A base model's weights on disk, checked when opened and read one tensor (or slice) at a time.

Two name formats (transformers' or the released one, `models/released.py`), two layouts (one `model.safetensors`
or shards with an index, `models/shards.py`), two configs (text or multimodal, `models/config.py`): a
`BaseCheckpoint` shows all of them as the same Mapping of canonical transformers names to tensors. Opening reads
config.json and the safetensors headers only, and refuses the directory with every problem named (the tensor and
its file). A read brings just the requested rows into new memory with pread(2), one file open at a time: a TP/EP
rank reads only its shard, and nothing is memory-mapped, so reading the whole model takes its size in host memory
and no more than one tensor besides (a mapped file's pages would stay resident while it is open). Not thread-safe.
"""

import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from inkwell.models.config import CONFIG_FILE, BaseModelError, is_multimodal, load_base_config, read_config_json
from inkwell.models.names import NESTED_PREFIX, canonical_name, expected_tensors, ignored_part, spellings
from inkwell.models.released import RELEASED_PREFIX, Placement, placement
from inkwell.models.shards import StoredTensor, WeightFiles, weight_files

log = logging.getLogger("inkwell.models")
MAX_LISTED = 12  # problems named in one error; the rest are counted

Index = tuple[slice, ...]
Cut = tuple[int, int, int]  # (dim, part, parts): keep part `part` of `parts` along `dim`, as torch.chunk cuts it
# The config's sizes that tensor parallelism splits between ranks (attention heads, MLP and expert widths), in the
# trainer and in the serving engine alike; the trainer also splits the vocabulary.
TP_SIZES = (
    "num_attention_heads",
    "num_key_value_heads",
    "swa_num_attention_heads",
    "swa_num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
)


def shard_index(shape: tuple[int, ...], cuts: list[Cut]) -> Index:
    """The slices of a tensor of `shape` that `cuts` keep, applied in order (a later cut of the same dim cuts the
    earlier one's part): how a TP/EP rank names its shard of a tensor, to `read` only that."""
    bounds = [(0, n) for n in shape]
    for dim, part, parts in cuts:
        start, stop = bounds[dim]
        size = -(-(stop - start) // parts)
        bounds[dim] = (min(start + part * size, stop), min(start + (part + 1) * size, stop))
    return tuple(slice(start, stop) for start, stop in bounds)


@dataclass(frozen=True)
class _Source:
    """Where a canonical tensor's values are: stored tensor `name`, all of it or (fused) the rows `placement` says."""

    name: str
    stored: StoredTensor
    placement: Placement | None


class BaseCheckpoint(Mapping[str, torch.Tensor]):
    """The tensors of a base-model directory by canonical transformers name, read from disk when asked for.

    Names come in file order (reading in that order opens each file once); `shape(name)` costs nothing;
    `read(name, index)` returns `tensor[index]` in new contiguous memory; `notes` say what was ignored.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.config = load_base_config(self.model_dir)
        self.notes: list[str] = []
        if is_multimodal(read_config_json(self.model_dir)):
            self.notes.append(
                f"{CONFIG_FILE} is a multimodal Inkling config: inkwell uses its text_config; "
                "the vision and audio towers are ignored"
            )
        files = weight_files(self.model_dir)
        expected = expected_tensors(self.config)
        problems = list(files.problems)
        released = any(name.startswith(RELEASED_PREFIX) for name in files.tensors)
        self._sources = (_released_sources if released else _transformers_sources)(files, expected, problems)
        held = {source.name for source in self._sources.values()}
        ignored: Counter[str] = Counter()
        for name, tensor in files.tensors.items():
            if name in held:
                continue
            if part := ignored_part(name):
                ignored[part] += 1
            else:
                problems.append(f"{tensor.file}: unexpected tensor {name} (not in the model config.json describes)")
        self.notes += [f"ignored {n} tensor{'s' * (n > 1)} of the {part}" for part, n in ignored.items()]
        if problems:
            more = [f"... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else []
            listed = "\n  ".join(problems[:MAX_LISTED] + more)
            raise BaseModelError(f"{self.model_dir}: not a usable Inkling base model:\n  {listed}")
        self._shapes = expected
        stored = {name: source.stored for name, source in self._sources.items()}
        self._order = sorted(expected, key=lambda n: (stored[n].file.name, stored[n].offset))
        self._open: tuple[Path, object] | None = None
        for note in self.notes:
            log.info("%s: %s", self.model_dir, note)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def shape(self, name: str) -> torch.Size:
        return self._shapes[name]

    @property
    def nbytes(self) -> int:
        """The stored bytes of the text model: what reading all of it brings into memory."""
        return sum({s.name: s.stored.nbytes for s in self._sources.values()}.values())

    def read(self, name: str, index: Index = ()) -> torch.Tensor:
        """`tensor[index]` (slices of step 1 over leading dims) as a new contiguous tensor: only those rows are read."""
        source, shape = self._sources[name], self._shapes[name]
        index = index + (slice(None),) * (len(shape) - len(index))
        full = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
        where = source.placement
        if where is None or not where.halves:
            return self._slice(source, full)
        d, rows = where.dim, full[where.dim]
        parts = [
            self._slice(source, full[:d] + (released,) + full[d + 1 :])
            for _, released in where.runs(rows.start, rows.stop, shape[d])
        ]
        if not parts:  # no rows asked for
            return self._slice(source, full[:d] + (slice(0, 0),) + full[d + 1 :])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)

    def _slice(self, source: _Source, index: Index) -> torch.Tensor:
        return self._file(source.stored.file).get_slice(source.name)[index].contiguous()

    def _file(self, path: Path):
        """The open file `path`; the one open before it is closed first."""
        if self._open is None or self._open[0] != path:
            self._open = None
            self._open = (path, safe_open(str(path), framework="pt", backend="pread"))
        return self._open[1]


def _transformers_sources(files: WeightFiles, expected: dict[str, torch.Size], problems: list[str]) -> dict:
    """Each expected tensor in a checkpoint under transformers' names (any spelling `canonical_name` knows)."""
    by_canonical = {canonical_name(name): name for name in files.tensors}
    nested = any(name.startswith(NESTED_PREFIX) for name in files.tensors)
    sources = {}
    for name, shape in expected.items():
        held = by_canonical.get(name)
        if held is None:  # named as the checkpoint would spell it
            problems.append(files.missing(sorted(spellings(name), key=lambda n: n.startswith(NESTED_PREFIX) != nested)))
            continue
        tensor = files.tensors[held]
        sources[name] = _Source(held, tensor, None)
        if tensor.shape != tuple(shape):
            problems.append(f"{tensor.file}: tensor {held} is {list(tensor.shape)}, config.json says {list(shape)}")
    return sources


def _released_sources(files: WeightFiles, expected: dict[str, torch.Size], problems: list[str]) -> dict:
    """Each expected tensor in a checkpoint under the released names: the tensor (or rows of the fused one) holding
    it. A fused tensor's problem is reported once, not once for each half."""
    sources = {}
    for name, shape in expected.items():
        try:
            where = placement(name)
        except KeyError as exc:
            problems.append(str(exc.args[0]))
            continue
        tensor = files.tensors.get(where.name)
        if tensor is None:
            problem = files.missing([where.name])
        else:
            sources[name] = _Source(where.name, tensor, where)
            want = list(shape)
            want[where.dim] = where.released_size(want[where.dim])
            if list(tensor.shape) == want:
                continue
            problem = f"{tensor.file}: tensor {where.name} is {list(tensor.shape)}, config.json says {want}"
        if problem not in problems:
            problems.append(problem)
    return sources
