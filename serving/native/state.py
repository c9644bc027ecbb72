"""Per-sequence decoding state in preallocated pools, indexed by a sequence slot.

Full-attention layers keep every key/value up to `max_context`. Sliding layers keep a ring of the
last `sliding_window_size` keys/values (position p lives at p % window), which is all a query can
see there. Each ShortConv site keeps its last kernel-1 inputs: per layer k and v together (their channels
back to back, as the engine runs them), attention's output, the MLP's output.
Pools are allocated once, so admitting or finishing a request never allocates device memory.
"""

import torch
from transformers import InklingTextConfig

# The ShortConv sites of a layer, the order of `StatePool.conv[layer]`: k and v as one site (the engine runs them
# as one depthwise conv over their channels back to back), then attention's output, then the MLP's output.
KV_SITE, ATTN_SITE, MLP_SITE = 0, 1, 2


class StatePool:
    """KV caches, sliding rings and conv states for up to `max_seqs` sequences."""

    def __init__(
        self,
        config: InklingTextConfig,
        max_seqs: int,
        max_context: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.max_seqs = max_seqs
        self.max_context = max_context
        self.window = config.sliding_window_size
        self.sliding = [t == "hybrid_sliding" for t in config.layer_types]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.conv: list[list[torch.Tensor]] = []
        kernel = config.conv_kernel_size
        conv_widths = []
        for sliding in self.sliding:
            kv_heads = config.swa_num_key_value_heads if sliding else config.num_key_value_heads
            head_dim = config.swa_head_dim if sliding else config.head_dim
            length = self.window if sliding else max_context
            shape = (max_seqs, length, kv_heads, head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))
            kv_width = kv_heads * head_dim
            conv_widths.append((2 * kv_width, config.hidden_size, config.hidden_size))  # KV, ATTN, MLP sites
        # ShortConv runs in fp32 in the reference, and so does its state. Every site's state is a view of one
        # buffer, so admitting a sequence clears all of its conv state in one op, not one per layer and site.
        total = sum(sum(widths) for widths in conv_widths)
        self._conv_state = torch.zeros(max_seqs, total, kernel - 1, dtype=torch.float32, device=device)
        offset = 0
        for widths in conv_widths:
            sites = []
            for width in widths:
                sites.append(self._conv_state[:, offset : offset + width])
                offset += width
            self.conv.append(sites)
        self._free = list(range(max_seqs - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A cleared sequence slot; the caller checks `free_slots` first."""
        slot = self._free.pop()
        self._conv_state[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def store(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Record keys/values [n, kv_heads, head_dim] of sequence `slots` [n] at `positions` [n]; on a sliding
        layer the positions' ring places must be distinct (at most a window of each sequence's tokens)."""
        places = positions % self.window if self.sliding[layer] else positions
        self.keys[layer][slots, places] = keys
        self.values[layer][slots, places] = values
