"""Per-sequence decoding state in preallocated pools, indexed by a sequence slot.

Full-attention layers keep every key/value up to `max_context`. Sliding layers keep a ring of the
last `sliding_window_size` keys/values (position p lives at p % window), which is all a query can
see there. Each ShortConv site keeps its last kernel-1 inputs: per layer k and v together (their channels
back to back, as the engine runs them), attention's output, the MLP's output.
Pools are allocated once, so admitting or finishing a request never allocates device memory.

The full layers' keys and values live in one buffer [2, full layers, slots, max_context, kv heads, head dim], the
sliding layers' rings in another, and every conv state in a third; `keys[layer]` / `values[layer]` are views. So
one sequence's prefix (every full layer's keys and values over a range of positions), its rings and its conv
states are each one strided slice, and the prefix cache reads or restores each in one copy
(`read_prefix` / `write_prefix`, `read_boundary` / `write_boundary`).
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
        n_sliding = sum(self.sliding)
        full_shape = (max_seqs, max_context, config.num_key_value_heads, config.head_dim)
        ring_shape = (max_seqs, self.window, config.swa_num_key_value_heads, config.swa_head_dim)
        self.full_kv = torch.zeros(2, len(self.sliding) - n_sliding, *full_shape, dtype=dtype, device=device)
        self.ring_kv = torch.zeros(2, n_sliding, *ring_shape, dtype=dtype, device=device)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.conv: list[list[torch.Tensor]] = []
        kernel = config.conv_kernel_size
        conv_widths = []
        counts = {True: 0, False: 0}
        for sliding in self.sliding:
            buffer = self.ring_kv if sliding else self.full_kv
            self.keys.append(buffer[0, counts[sliding]])
            self.values.append(buffer[1, counts[sliding]])
            counts[sliding] += 1
            kv_width = buffer.shape[-2] * buffer.shape[-1]
            conv_widths.append((2 * kv_width, config.hidden_size, config.hidden_size))  # KV, ATTN, MLP sites
        # ShortConv runs in fp32 in the reference, and so does its state. Every site's state is a view of one
        # buffer, so admitting a sequence clears all of its conv state in one op, not one per layer and site.
        total = sum(sum(widths) for widths in conv_widths)
        self.conv_state = torch.zeros(max_seqs, total, kernel - 1, dtype=torch.float32, device=device)
        offset = 0
        for widths in conv_widths:
            sites = []
            for width in widths:
                sites.append(self.conv_state[:, offset : offset + width])
                offset += width
            self.conv.append(sites)
        self._free = list(range(max_seqs - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A cleared sequence slot; the caller checks `free_slots` first."""
        slot = self._free.pop()
        self.clear(slot)
        return slot

    def clear(self, slot: int) -> None:
        """Zero `slot`'s ShortConv states, where a new sequence starts (its caches are written before they are read)."""
        self.conv_state[slot].zero_()

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

    def read_prefix(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of every full layer's keys and values at positions start..end-1 of `slot`:
        [2, full layers, end - start, kv heads, head dim]."""
        return self.full_kv[:, :, slot, start:end].clone()

    def write_prefix(self, slot: int, start: int, kv: torch.Tensor) -> None:
        """Put `read_prefix`'s keys and values back at positions start.. of `slot`."""
        self.full_kv[:, :, slot, start : start + kv.shape[2]].copy_(kv, non_blocking=True)

    def read_boundary(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of what `slot` carries past its last computed position besides the full layers' keys: the sliding
        rings (the last window of keys and values, in ring order) and every ShortConv state."""
        return self.ring_kv[:, :, slot].clone(), self.conv_state[slot].clone()

    def write_boundary(self, slot: int, rings: torch.Tensor, conv: torch.Tensor) -> None:
        """Restore `read_boundary`'s rings and conv states into `slot` (ring places depend only on positions, so a
        ring read at position p is valid for any sequence at p with the same past)."""
        self.ring_kv[:, :, slot].copy_(rings, non_blocking=True)
        self.conv_state[slot].copy_(conv, non_blocking=True)
