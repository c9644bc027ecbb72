"""What a dataset upload records about its JSONL file, checked with the trainer's own parser
(`inkwell.trainer.records`), so a job never starts on a file the trainer would reject.
"""

from dataclasses import dataclass

from inkwell.trainer.records import DatasetFormat, parse_jsonl


@dataclass(frozen=True)
class DatasetSummary:
    format: DatasetFormat
    num_examples: int


def validate_jsonl(data: bytes) -> DatasetSummary:
    """The file's format and example count, or `JsonlError` for the first bad line."""
    lines = parse_jsonl(data)
    return DatasetSummary(format=lines[0].record.format, num_examples=len(lines))
