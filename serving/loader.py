"""The adapter loader: a process beside each worker that fetches, verifies and stages adapters.

Fetching and parsing (S3 downloads, safetensors, layout conversion, manifest checks) happen here,
off the worker's decode loop. The loader also pads each adapter into the engine's slot image (the
same `slot_layout` the engine's `LoraSlots` use) in a staging ring on the engine's device, so the
worker's part of a swap is one copy into a slot between two steps (see `transfer`). Loads wait for
a free ring row; the worker frees one with `Release` once it has copied the image out.
"""

import multiprocessing
import queue
import shutil
import tempfile
from collections import deque
from pathlib import Path

import torch

from inkwell.models import base_model_identity, load_base_config
from inkwell.serving import messages
from inkwell.serving.contract import AdapterIncompatibleError, EngineConfig
from inkwell.serving.slot_copy import check_adapter, slot_layout
from inkwell.serving.transfer import RING_SIZE, ImageReceiver, StagingRing


def stop_loader(process, inbox, receiver: ImageReceiver, timeout: float = 30.0) -> None:
    """Stop a loader process: unmap its staging ring first (the ring is the loader's memory), then ask it
    to stop and wait; one that does not stop in `timeout` seconds is killed."""
    receiver.close()
    inbox.put(messages.Stop())
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()


def loader_main(model_dir: str, engine: EngineConfig, inbox, worker_inbox, ring_size: int = RING_SIZE) -> None:
    """Serve `Load`, `Release` and `Stop` messages (`messages.ToLoader`) until stopped.

    A load answers `Staged` or `StageFailed` on `worker_inbox`. The loader also stops when its worker is
    gone: a worker killed with SIGKILL never sends `Stop`, and an orphaned loader would otherwise wait on
    its queue forever.
    """
    torch.set_num_threads(1)
    worker = multiprocessing.parent_process()
    config = load_base_config(model_dir)
    identity = base_model_identity(model_dir)
    layout = slot_layout(config, engine.max_lora_rank, engine.lora_groups, getattr(torch, engine.dtype))
    ring = StagingRing(layout, engine.device, ring_size)
    waiting: deque[messages.Load] = deque()
    scratch = Path(tempfile.mkdtemp(prefix="inkwell-loader-"))
    try:
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if worker is not None and not worker.is_alive():
                    return
                continue
            match msg:
                case messages.Stop():
                    return
                case messages.Release(row=row, copied=copied):
                    ring.release(row, copied)
                case messages.Load():
                    waiting.append(msg)
            while waiting and ring.free:
                load = waiting.popleft()
                try:
                    adapter = load.source.load(scratch, config)
                    check_adapter(adapter, identity, layout)
                    staged = ring.stage(adapter)
                except AdapterIncompatibleError as exc:
                    worker_inbox.put(messages.StageFailed(load.key, messages.Failure("adapter_incompatible", str(exc))))
                except Exception as exc:  # every failure goes back to the request that asked for the load
                    failure = messages.Failure("adapter_load_failed", f"{type(exc).__name__}: {exc}")
                    worker_inbox.put(messages.StageFailed(load.key, failure))
                else:
                    worker_inbox.put(messages.Staged(load.key, staged, load.pinned))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
