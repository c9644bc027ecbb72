"""On-disk layouts of one adapter: the tensor names and shapes a consumer loads."""

from inkwell.adapters.layouts.sglang import SglangLayoutError, from_sglang, to_sglang

__all__ = ["SglangLayoutError", "from_sglang", "to_sglang"]
