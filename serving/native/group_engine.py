"""The native engine over a group of processes, one per device: tensor- and expert-parallel serving.

`GroupEngine` is the `Engine` (same scheduling, batching, sampling and adapter table) whose process is rank 0 of
`EngineConfig.ranks`: it starts the other ranks as child processes, each loads its own slices of the base model from
the same checkpoint directory (`shards`; no rank reads the whole model), and they follow rank 0's step plan (`plan`)
over private backends (`group`). Adapters are handed to rank 0 whole; every rank keeps its slices of them.

The prefix cache's tree lives on rank 0; each rank keeps its slice of the cached copies, which rank 0's plan saves,
restores and forgets on every rank. Refused across processes: CUDA graphs (a captured decode step would have to
capture the collectives too).
"""

import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inkwell.adapters.adapter import Adapter
from inkwell.models import base_model_identity, load_base_config, load_base_weights
from inkwell.serving.contract import EngineConfig, EngineError, ServingEngine
from inkwell.serving.native.engine import Engine
from inkwell.serving.native.group import RankGroup
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.native.plan import (
    AddAdapter,
    DropAdapter,
    LeadingModel,
    Plan,
    RecordingLoraSlots,
    RecordingPrefixStore,
    RecordingStatePool,
    follow,
    host_copy,
)
from inkwell.serving.native.sharded_model import ShardedInklingModel
from inkwell.serving.native.shards import Shard
from inkwell.serving.native.state import StatePool
from inkwell.serving.rules import context_limit

STOP_SECONDS = 30.0  # how long rank 0 waits for the others to return after the group's Stop
POLL_SECONDS = 0.05


def native_engine(model_dir: str | Path, config: EngineConfig | None = None) -> ServingEngine:
    """The native engine `config` asks for: one process, or a group of `config.ranks`."""
    config = config or EngineConfig()
    return Engine(model_dir, config) if config.ranks == 1 else GroupEngine(model_dir, config)


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device: `rank` places after rank 0's `device` on CUDA ("cuda:2" -> rank 1 on cuda:3); the CPU
    for every rank on the CPU."""
    first = torch.device(device)
    if first.type == "cpu":
        return first
    return torch.device(first.type, (first.index or 0) + rank)


def rank_parts(
    model_dir: str | Path, config: EngineConfig, shard: Shard, plan: Plan | None = None
) -> tuple[ShardedInklingModel, StatePool, LoraSlots]:
    """One rank's model over its slices of the checkpoint, its state and its adapter slots; rank 0's (with `plan`)
    record what they do for the others."""
    base = load_base_config(model_dir)
    shard.check(base)
    local = shard.local_config(base)
    dtype, device = getattr(torch, config.dtype), rank_device(config.device, shard.rank)
    weights = shard.weights(load_base_weights(model_dir))
    state = (local, config.max_seqs, context_limit(base, config.max_context), dtype, device)
    lora = (
        local,
        base_model_identity(model_dir),
        config.max_loras_per_batch,
        config.max_lora_rank,
        config.lora_groups,
        dtype,
        device,
    )
    if plan is None:
        return ShardedInklingModel(base, weights, shard, dtype, device), StatePool(*state), LoraSlots(*lora)
    model = LeadingModel(plan, base, weights, shard, dtype, device)
    return model, RecordingStatePool(plan, *state), RecordingLoraSlots(plan, *lora)


def follower_main(rank: int, store_path: str, model_dir: str, config: EngineConfig, threads: int) -> None:
    """A rank other than 0: load its shard, say so in the store (or why not), join the group and follow it."""
    torch.set_num_threads(threads)
    shard = Shard.of(rank, config.tensor_parallel, config.expert_parallel)
    device = rank_device(config.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, shard.world)
    try:
        model, state, lora = rank_parts(model_dir, config, shard)
    except Exception as exc:  # rank 0 reports it
        store.set(f"failed/{rank}", f"{type(exc).__name__}: {exc}")
        return
    store.set(f"ready/{rank}", "")
    model.group = RankGroup.connect(store, shard, device)
    follow(model.group, model, state, lora, shard)


def check_group_config(config: EngineConfig) -> None:
    """ValueError for what an engine across processes does not do."""
    if config.tensor_parallel < 1 or config.expert_parallel < 1:
        raise ValueError("tensor_parallel and expert_parallel must be at least 1")
    if config.cuda_graphs and torch.device(config.device).type == "cuda":
        raise ValueError(
            f"cuda_graphs cannot run on an engine spanning {config.ranks} processes "
            f"(tensor_parallel={config.tensor_parallel}, expert_parallel={config.expert_parallel}): set it to False"
        )


class GroupEngine(Engine):
    """The native engine as rank 0 of a group of `config.ranks` processes (see the module's doc)."""

    def __init__(self, model_dir: str | Path, config: EngineConfig):
        check_group_config(config)
        self.shard = Shard.of(0, config.tensor_parallel, config.expert_parallel)
        self.plan = Plan()
        self._dir = Path(tempfile.mkdtemp(prefix="inkwell-group-"))
        store_path = str(self._dir / "store")
        ctx = mp.get_context("spawn")
        self._followers = [
            ctx.Process(
                target=follower_main,
                args=(rank, store_path, str(model_dir), config, torch.get_num_threads()),
                name=f"inkwell-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, config.ranks)
        ]
        for process in self._followers:
            process.start()
        self._store = dist.FileStore(store_path, config.ranks)
        self._stopped = False
        try:
            super().__init__(model_dir, config)
            self._await_followers()
            self.plan.group = self.model.group = RankGroup.connect(self._store, self.shard, self.device)
        except BaseException:
            self._end_followers(grace=0.0)
            raise

    def _parts(self, dtype: torch.dtype, device: torch.device, seq_slots: int):
        """Rank 0's shard (its dtype, device and slots follow from the config, as every rank's do)."""
        return rank_parts(self.model_dir, self.config, self.shard, self.plan)

    def _prefix_store(self) -> RecordingPrefixStore:
        """Rank 0's copies of the cached prefixes, each change of them repeated on every rank."""
        return RecordingPrefixStore(self.plan, self.state)

    def _await_followers(self) -> None:
        """Wait until every other rank has loaded its shard; raise saying which one could not and why."""
        for rank, process in enumerate(self._followers, start=1):
            while not self._store.check([f"ready/{rank}"]):
                if self._store.check([f"failed/{rank}"]):
                    reason = self._store.get(f"failed/{rank}").decode()
                    raise EngineError("rank_failed", f"rank {rank} could not load its shard: {reason}")
                if not process.is_alive():
                    raise EngineError("rank_failed", f"rank {rank} exited with code {process.exitcode} while loading")
                time.sleep(POLL_SECONDS)

    # ---- adapters: whole here, each rank keeps its slices ----------------------------------------

    def load_adapter(self, key: str, adapter: Adapter, pinned: bool = False) -> None:
        self.lora.check(adapter)
        self._table.check_new(key)
        self.plan.record(AddAdapter(key, host_copy(adapter)))
        try:
            super().load_adapter(key, self.shard.adapter(adapter), pinned)
        except EngineError:
            self.plan.record(DropAdapter(key))
            raise

    def unload_adapter(self, key: str) -> None:
        super().unload_adapter(key)
        self.plan.record(DropAdapter(key))

    # ---- the group's end ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the other ranks (they return after the steps sent before) and remove the group's files."""
        if self._stopped:
            return
        self._stopped = True
        self.plan.send_stop()
        self._end_followers(STOP_SECONDS)

    def _end_followers(self, grace: float) -> None:
        """Wait up to `grace` seconds for the other ranks to return, then end those that have not."""
        deadline = time.monotonic() + grace
        for process in self._followers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join()
        shutil.rmtree(self._dir, ignore_errors=True)
