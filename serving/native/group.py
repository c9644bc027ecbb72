"""The process group of one parallel engine: rendezvous, the collectives its forward needs, and the step messages.

Each engine builds private backends over its own FileStore instead of torch.distributed's default group, so an
engine group never touches process-wide state: a trainer (megatron's groups) or a second engine can live in the same
process. Control messages (the step plan, pickled) go over gloo from rank 0; tensors go over the device's backend
(NCCL on CUDA, the same gloo group on the CPU). The TP group is the ranks of one EP rank; the experts' sums run over
every rank.
"""

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from inkwell.serving.native.shards import Shard

# An idle worker sends nothing for as long as no request comes; the ranks following it wait that long.
IDLE_TIMEOUT = timedelta(days=3650)


def _backend(store: dist.Store, prefix: str, rank: int, size: int, device: torch.device) -> dist.Backend:
    store = dist.PrefixStore(prefix, store)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, IDLE_TIMEOUT)


@dataclass
class RankGroup:
    """This rank's view of the group: its shard, the control backend and the device backends (world and TP)."""

    shard: Shard
    control: dist.Backend
    world: dist.Backend
    tp: dist.Backend | None  # None: the TP group is the whole world (ep == 1), or a group of one

    @classmethod
    def connect(cls, store: dist.Store, shard: Shard, device: torch.device) -> "RankGroup":
        """Join the group's backends (blocks until every rank has joined them)."""
        rank, world = shard.rank, shard.world
        control = _backend(store, "control", rank, world, torch.device("cpu"))
        world_backend = control if device.type == "cpu" else _backend(store, "world", rank, world, device)
        tp = None
        if 1 < shard.tp < world:
            tp = _backend(store, f"tp{shard.ep_rank}", shard.tp_rank, shard.tp, device)
        return cls(shard, control, world_backend, tp)

    def sum_over_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the TP ranks (attention's and the dense MLP's row-parallel outputs)."""
        if self.shard.tp == 1:
            return tensor
        self._all_reduce(self.tp or self.world, tensor)
        return tensor

    def sum_over_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over every rank (each holds some experts, and a slice of each)."""
        self._all_reduce(self.world, tensor)
        return tensor

    @staticmethod
    def _all_reduce(backend: dist.Backend, tensor: torch.Tensor) -> None:
        backend.allreduce([tensor]).wait()

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place (the same shape and dtype everywhere)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.world.broadcast([tensor], options).wait()
        return tensor

    def send(self, message: object) -> None:
        """Rank 0: send `message` to every other rank (pickled, over the control backend)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self._control_broadcast(torch.tensor([payload.numel()], dtype=torch.long))
        self._control_broadcast(payload)

    def receive(self) -> object:
        """Every other rank: the next message rank 0 sends."""
        size = self._control_broadcast(torch.zeros(1, dtype=torch.long))
        payload = self._control_broadcast(torch.empty(int(size), dtype=torch.uint8))
        return pickle.loads(payload.numpy().tobytes())

    def _control_broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.control.broadcast([tensor], options).wait()
        return tensor
