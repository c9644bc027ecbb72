"""The loader's staging ring and the worker's receiver, on CPU shared memory (the same code as CUDA IPC):
a row is reused only after its release, and an adapter the worker keeps survives the row's reuse."""

import queue

import pytest
import torch
import torch.multiprocessing as mp

from inkwell.adapters.io import load_adapter, save_adapter
from inkwell.models import base_model_identity, load_base_config
from inkwell.serving.contract import EngineConfig
from inkwell.serving.loader import loader_main, stop_loader
from inkwell.serving.messages import Load, Staged, StageFailed
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.slot_copy import slot_layout
from inkwell.serving.sources import DirectorySource
from inkwell.serving.transfer import ImageReceiver, StagingRing

ENGINE = EngineConfig(max_loras_per_batch=2, max_lora_rank=16)


def test_ring_rows_are_reused_only_after_release(tiny_model_dir, tiny_adapters):
    config = load_base_config(tiny_model_dir)
    layout = slot_layout(config, 16, ENGINE.lora_groups, torch.float32)
    ring, receiver = StagingRing(layout, "cpu", size=2), ImageReceiver(layout)
    first = ring.stage(tiny_adapters[0])
    second = ring.stage(tiny_adapters[1])
    assert first.ring is ring.ring and second.ring is None  # the ring crosses once
    assert (first.index, second.index) == (0, 1) and not ring.free
    kept = receiver.adapter(first)
    dropped = receiver.adapter(second)
    want = [layout.image(a) for a in tiny_adapters[:3]]
    assert torch.equal(kept.flat, want[0])
    assert kept.flat.data_ptr() == ring.ring.flat[0].data_ptr()  # no copy until the worker keeps it
    released = receiver.release(first, kept)
    ring.release(released.row, released.copied)
    released = receiver.release(second, None)
    ring.release(released.row, released.copied)
    third = ring.stage(tiny_adapters[2])
    assert third.index == 0  # the first released row, now overwritten
    assert torch.equal(receiver.adapter(third).flat, want[2])
    assert torch.equal(kept.flat, want[0])  # kept its own copy
    assert all(torch.equal(kept.tensors[n], t) for n, t in tiny_adapters[0].tensors.items())
    assert dropped.spec == tiny_adapters[1].spec


def test_receiver_refuses_a_ring_of_another_layout(tiny_model_dir, tiny_adapters):
    config = load_base_config(tiny_model_dir)
    ring = StagingRing(slot_layout(config, 8, ENGINE.lora_groups, torch.float32), "cpu")
    receiver = ImageReceiver(slot_layout(config, 16, ENGINE.lora_groups, torch.float32))
    with pytest.raises(RuntimeError, match="slot layout"):
        receiver.adapter(ring.stage(tiny_adapters[0]))


def test_loader_process_stages_through_a_one_row_ring(tiny_model_dir, tiny_adapters, tmp_path):
    """A real loader process: loads queue behind the one row, each arrives after the previous release,
    and slots written from the shared row hold exactly the adapter read from disk."""
    config = load_base_config(tiny_model_dir)
    dirs = [save_adapter(a, tmp_path / f"a{i}", "sglang", config) for i, a in enumerate(tiny_adapters[:3])]
    from_disk = [load_adapter(d, config) for d in dirs]
    ctx = mp.get_context("spawn")
    inbox, arrived = ctx.Queue(), ctx.Queue()
    engine = EngineConfig(max_loras_per_batch=2, max_lora_rank=8)  # adapter 2 (rank 16) is refused
    loader = ctx.Process(target=loader_main, args=(str(tiny_model_dir), engine, inbox, arrived, 1))
    loader.start()
    slots = LoraSlots(config, base_model_identity(tiny_model_dir), max_loras=2, max_rank=8)
    receiver = ImageReceiver(slots.layout)
    try:
        for i in (0, 1):
            inbox.put(Load(f"a{i}", DirectorySource(str(dirs[i])), i == 0))
        inbox.put(Load("a2", DirectorySource(str(dirs[2]))))
        inbox.put(Load("gone", DirectorySource(str(tmp_path / "missing"))))
        kept = []
        for i in (0, 1):
            msg = arrived.get(timeout=120)
            assert isinstance(msg, Staged)
            key, staged = msg.key, msg.staged
            assert (key, msg.pinned, staged.index) == (f"a{i}", i == 0, 0)
            assert (staged.ring is not None) == (i == 0)
            if i == 0:
                with pytest.raises(queue.Empty):  # the only row is taken: nothing else is staged meanwhile
                    arrived.get(timeout=2.0)
            adapter = receiver.adapter(staged)
            slot = slots.place(key, adapter)
            want = slots.slot_image(from_disk[i])
            assert torch.equal(slots.memory[slot], want) and slots.scalings[slot].any()
            inbox.put(receiver.release(staged, adapter))
            kept.append((adapter, want))
        failed = [arrived.get(timeout=120) for _ in range(2)]
        assert [type(f) for f in failed] == [StageFailed, StageFailed]
        assert (failed[0].key, failed[0].failure.code) == ("a2", "adapter_incompatible")
        assert "max_lora_rank" in failed[0].failure.message
        assert (failed[1].key, failed[1].failure.code) == ("gone", "adapter_load_failed")
        for adapter, flat in kept:  # the row was rewritten after each; the kept images were not
            assert torch.equal(adapter.flat, flat)
    finally:
        stop_loader(loader, inbox, receiver)
    assert loader.exitcode == 0
