"""The adapter loader: a process beside each worker that fetches, verifies and stages adapters.

Fetching and parsing (S3 downloads, safetensors, layout conversion, manifest checks) happen here,
off the worker's decode loop; the worker only receives a packed buffer through
torch.multiprocessing and copies it into a slot between steps. A staged buffer stays referenced
until the worker says it is done with it ("release"), which is what CUDA IPC requires.
"""

import multiprocessing
import queue
import shutil
import tempfile
from pathlib import Path

import torch

from inkwell.adapters.io import load_adapter
from inkwell.models import base_model_identity, load_base_config
from inkwell.service.serving.transfer import PackedAdapter, pack


def loader_main(model_dir: str, dtype: str, device: str, inbox, worker_inbox) -> None:
    """Serve ("load", key, source, pinned), ("release", key) and ("stop",) messages until stopped.

    It also stops when its worker is gone: a worker killed with SIGKILL never sends "stop", and an
    orphaned loader would otherwise wait on its queue forever.
    """
    torch.set_num_threads(1)
    worker = multiprocessing.parent_process()
    config = load_base_config(model_dir)
    identity = base_model_identity(model_dir)
    staged: dict[str, PackedAdapter] = {}
    scratch = Path(tempfile.mkdtemp(prefix="inkwell-loader-"))
    try:
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if worker is not None and not worker.is_alive():
                    return
                continue
            if msg[0] == "stop":
                return
            if msg[0] == "release":
                staged.pop(msg[1], None)
                continue
            _, key, source, pinned = msg
            try:
                adapter = load_adapter(source.fetch(scratch), config)
            except Exception as exc:  # every failure goes back to the request that asked for the load
                worker_inbox.put(("adapter_failed", key, "adapter_load_failed", f"{type(exc).__name__}: {exc}"))
                continue
            if adapter.base.config_sha256 != identity.config_sha256:
                why = f"adapter {key!r} was trained on {adapter.base.name!r}, whose config is not {identity.name!r}'s"
                worker_inbox.put(("adapter_failed", key, "adapter_incompatible", why))
                continue
            staged[key] = pack(adapter, getattr(torch, dtype), device)
            worker_inbox.put(("adapter", key, staged[key], pinned))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
