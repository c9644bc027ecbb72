"""An adapter as one flat buffer plus an index, the form it crosses process boundaries in.

torch.multiprocessing sends a tensor as a handle to its storage: a shared-memory file descriptor
on CPU, a CUDA IPC handle on GPU. One storage per adapter means one handle however many tensors
it has (a file descriptor per tensor would exhaust the process limit), and the receiver's
tensors are views into the sender's memory until it copies them into its own slots.
"""

from dataclasses import dataclass

import torch

from inkwell.adapters.adapter import Adapter
from inkwell.adapters.spec import LoraSpec
from inkwell.models.base import BaseModelIdentity


@dataclass
class PackedAdapter:
    flat: torch.Tensor  # 1-D, every tensor back to back
    index: list[tuple[str, tuple[int, ...], int]]  # (canonical name, shape, offset into flat)
    spec: dict
    base: dict
    metadata: dict

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def pack(adapter: Adapter, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> PackedAdapter:
    """Copy `adapter`'s tensors into one buffer (shared memory on CPU so a queue sends just a handle)."""
    total = sum(t.numel() for t in adapter.tensors.values())
    flat = torch.empty(total, dtype=dtype, device=device)
    if flat.device.type == "cpu":
        flat.share_memory_()
    index, offset = [], 0
    for name, tensor in adapter.tensors.items():
        flat[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
        index.append((name, tuple(tensor.shape), offset))
        offset += tensor.numel()
    return PackedAdapter(
        flat=flat,
        index=index,
        spec=adapter.spec.model_dump(mode="json"),
        base=adapter.base.to_dict(),
        metadata=dict(adapter.metadata),
    )


def unpack(packed: PackedAdapter) -> Adapter:
    """An Adapter whose tensors are views into `packed.flat` (no copy)."""
    tensors = {}
    for name, shape, offset in packed.index:
        numel = 1
        for dim in shape:
            numel *= dim
        tensors[name] = packed.flat[offset : offset + numel].view(shape)
    return Adapter(
        spec=LoraSpec.model_validate(packed.spec),
        tensors=tensors,
        base=BaseModelIdentity.from_dict(packed.base),
        metadata=packed.metadata,
    )
