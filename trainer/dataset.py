"""SFT data: tokenize the JSONL examples (parsed by `inkwell.trainer.records`), split off an eval set, pack into
fixed-length rows.

Tokenization goes through inkwell.models (`encode_chat` / `encode_prompt_completion`), the
same code the serving engine uses, so the adapter sees identical token layouts. A packed row
holds whole samples back to back; `segments` numbers them so the model resets ShortConv state
and blocks attention at each boundary. Row order is a pure function of (seed, epoch), so a
resumed run reads exactly the rows the uninterrupted run would have read.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from inkwell.models import encode_chat, encode_prompt_completion
from inkwell.trainer.config import TrainConfigError
from inkwell.trainer.records import SFT_FORMATS, Chat, JsonlError, Record, parse_jsonl

BUNDLED = Path(__file__).parent / "data"


def bundled_dataset(name: str) -> Path:
    """A small SFT set shipped with the trainer (`uppercase`, `reverse`) for tests and demos."""
    path = BUNDLED / f"{name}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in BUNDLED.glob("*.jsonl"))
        raise FileNotFoundError(f"no bundled dataset {name!r}; bundled: {', '.join(known)}")
    return path


@dataclass(frozen=True)
class Example:
    ids: list[int]
    mask: list[int]
    line: int


def _encode(tokenizer: PreTrainedTokenizerFast, record: Record) -> tuple[list[int], list[int]]:
    if isinstance(record, Chat):
        return encode_chat(tokenizer, list(record.messages))
    return encode_prompt_completion(tokenizer, record.prompt, record.completion)


def load_examples(
    path: Path, tokenizer: PreTrainedTokenizerFast, seq_len: int, max_positions: int, field: str
) -> list[Example]:
    """Every example of `path`, parsed by the upload's rules and tokenized; the first bad line raises
    TrainConfigError."""
    if not path.is_file():
        raise TrainConfigError(f"{field}: {path} does not exist", field=field)
    try:
        lines = parse_jsonl(path.read_bytes())
    except JsonlError as exc:
        raise TrainConfigError(f"{path.name} {exc}", field=field, line=exc.line) from exc
    if lines[0].record.format not in SFT_FORMATS:
        raise TrainConfigError(
            f"{path.name} holds prompts and answers, the problems of an RL job (method 'grpo'); SFT learns from "
            "completions: give chat or prompt/completion lines",
            field=field,
            line=lines[0].number,
        )
    examples = []
    for n, record in lines:
        ids, mask = _encode(tokenizer, record)
        where = f"{path.name} line {n}"
        if len(ids) > max_positions:
            raise TrainConfigError(
                f"{where}: {len(ids)} tokens, longer than the model's max_position_embeddings ({max_positions}); "
                "shorten or drop the sample",
                field=field,
                line=n,
            )
        if len(ids) > seq_len:
            raise TrainConfigError(
                f"{where}: {len(ids)} tokens, longer than seq_len ({seq_len}); raise seq_len "
                f"(up to {max_positions}) or shorten the sample",
                field=field,
                line=n,
            )
        examples.append(Example(ids, mask, n))
    return examples


def split_eval(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Hold out round(fraction * n) samples (at least one when fraction > 0), chosen by seed."""
    if fraction <= 0:
        return examples, []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    held = max(1, round(fraction * len(examples)))
    if held >= len(examples):
        raise TrainConfigError(
            f"eval_fraction {fraction} of {len(examples)} samples leaves nothing to train on; "
            "add samples, lower eval_fraction or pass eval_dataset_path",
            field="eval_fraction",
        )
    keep = sorted(order[held:])
    return [examples[i] for i in keep], [examples[i] for i in sorted(order[:held])]


@dataclass
class Rows:
    """A batch of packed rows: inputs, segment ids, next-token targets and the loss mask."""

    input_ids: torch.Tensor  # [b, s] long
    segments: torch.Tensor  # [b, s] long
    targets: torch.Tensor  # [b, s] long
    loss_mask: torch.Tensor  # [b, s] float

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.segments, self.targets, self.loss_mask

    def to(self, device) -> "Rows":
        return Rows(*(t.to(device) for t in self.fields()))

    def slice(self, start: int, stop: int) -> "Rows":
        return Rows(*(t[start:stop] for t in self.fields()))

    @classmethod
    def cat(cls, parts: list["Rows"]) -> "Rows":
        return cls(*(torch.cat(group) for group in zip(*(p.fields() for p in parts), strict=True)))

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def pack(examples: list[Example], seq_len: int, pad_id: int) -> Rows:
    """Greedy in-order packing; the tail of each row is a padding segment that carries no loss."""
    rows: list[list[Example]] = [[]]
    used = 0
    for ex in examples:
        if used + len(ex.ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(ex)
        used += len(ex.ids)
    n = len(rows)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    segments = torch.zeros((n, seq_len), dtype=torch.long)
    targets = torch.zeros((n, seq_len), dtype=torch.long)
    loss_mask = torch.zeros((n, seq_len), dtype=torch.float32)
    for r, row in enumerate(rows):
        pos = 0
        for seg, ex in enumerate(row):
            k = len(ex.ids)
            ids[r, pos : pos + k] = torch.tensor(ex.ids)
            segments[r, pos : pos + k] = seg
            targets[r, pos : pos + k - 1] = torch.tensor(ex.ids[1:])
            loss_mask[r, pos : pos + k - 1] = torch.tensor(ex.mask[1:], dtype=torch.float32)
            pos += k
        segments[r, pos:] = len(row)
    return Rows(ids, segments, targets, loss_mask)


class RowStream:
    """Packed training rows epoch after epoch; epoch e's sample order is a permutation seeded by seed + e."""

    def __init__(self, examples: list[Example], seq_len: int, pad_id: int, seed: int):
        self.examples, self.seq_len, self.pad_id, self.seed = examples, seq_len, pad_id, seed
        self._sizes: list[int] = []
        self._cache: dict[int, Rows] = {}

    def _epoch(self, e: int) -> Rows:
        if e not in self._cache:
            order = torch.randperm(len(self.examples), generator=torch.Generator().manual_seed(self.seed + e))
            self._cache[e] = pack([self.examples[i] for i in order.tolist()], self.seq_len, self.pad_id)
            for old in [k for k in self._cache if k < e - 1]:
                del self._cache[old]
        return self._cache[e]

    def _size(self, e: int) -> int:
        while len(self._sizes) <= e:
            self._sizes.append(self._epoch(len(self._sizes)).input_ids.shape[0])
        return self._sizes[e]

    def rows(self, start: int, count: int) -> Rows:
        """Rows [start, start + count) of the endless stream."""
        e, offset = 0, start
        while offset >= self._size(e):
            offset -= self._size(e)
            e += 1
        parts = []
        while count > 0:
            take = min(count, self._size(e) - offset)
            parts.append(self._epoch(e).slice(offset, offset + take))
            count, offset, e = count - take, 0, e + 1
        return Rows.cat(parts)
