"""The session worker: one process holding one training session's model, adapter and optimizer resident on its
device, running the session's requests strictly in the order they arrive.

It is the trainer's `TrainingCore` (the same core the SFT jobs run on) behind a queue: `handle.SessionHandle` is
the service's end. Saved states go to and come from the object store here, so a save followed by a load of the
same name is ordered like every other request.
"""

import multiprocessing
import queue
import shutil
import tempfile
import traceback
from pathlib import Path

import torch

from inkwell.adapters.io import save_adapter_layouts
from inkwell.models import load_base_config
from inkwell.service.sessions import messages
from inkwell.service.storage import ObjectStore
from inkwell.trainer.config import one_process_compile_mode
from inkwell.trainer.core import TrainingCore
from inkwell.trainer.datums import DatumError
from inkwell.trainer.parallel import model_parallel


def _store(config: messages.StoreConfig) -> ObjectStore:
    return ObjectStore(config.endpoint, config.bucket, config.region, config.access_key, config.secret_key)


class SessionWorker:
    def __init__(self, config: messages.SessionConfig, core: TrainingCore, outbox) -> None:
        self.config, self.core, self.outbox = config, core, outbox
        self.store = _store(config.store)
        self.scratch = Path(config.scratch_dir)

    def run(self, inbox) -> None:
        parent = multiprocessing.parent_process()
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return  # the service was killed without stopping us: free the device
                continue
            if isinstance(msg, messages.Stop):
                self.outbox.put(messages.Stopped())
                return
            try:
                self.outbox.put(messages.Done(msg.future_id, self.execute(msg)))
            except DatumError as exc:
                details = {"field": exc.field, "index": exc.index}
                self.outbox.put(messages.Failed(msg.future_id, "invalid_datum", str(exc), details))
            except Exception as exc:  # noqa: BLE001 - the session keeps serving; the request says why it failed
                traceback.print_exc()
                self.outbox.put(messages.Failed(msg.future_id, "session_error", f"{type(exc).__name__}: {exc}"))

    def execute(self, msg: messages.Operation) -> dict:
        core = self.core
        match msg:
            case messages.ForwardBackward(datums=datums, loss_fn=loss_fn, loss_fn_config=config, backward=backward):
                run = core.forward_backward if backward else core.forward
                out = run(datums, loss_fn, config)
                return {"logprobs": out.logprobs, "metrics": out.metrics}
            case messages.OptimStep(adam=adam):
                return {"metrics": core.optim_step(adam), "step": core.step}
            case messages.SaveState(prefix=prefix):
                with tempfile.TemporaryDirectory(dir=self.scratch) as tmp:
                    self.store.put_tree(prefix, core.save_state(Path(tmp) / "state"))
                return {"step": core.step}
            case messages.LoadState(prefix=prefix, with_optimizer=with_optimizer):
                self.load(prefix, with_optimizer)
                return {"step": core.step}
            case messages.ExportAdapter(dest=dest):
                adapter = core.adapter()
                root = Path(dest)
                shutil.rmtree(root, ignore_errors=True)
                saved = save_adapter_layouts(adapter, root, core.hf_config)
                dirs = {layout: str(path) for layout, path in saved.items()}
                # the tensors themselves too: they reach the serving workers in shared memory, not through the files
                return {"dirs": dirs, "step": core.step, "adapter": adapter}

    def load(self, prefix: str, with_optimizer: bool) -> None:
        with tempfile.TemporaryDirectory(dir=self.scratch) as tmp:
            self.store.download_tree(prefix, Path(tmp) / "state")
            self.core.load_state(Path(tmp) / "state", with_optimizer=with_optimizer)


def session_main(config: messages.SessionConfig, inbox, outbox) -> None:
    """The worker process's entry point: build the core, report Ready (or why not), serve until Stop."""
    torch.set_num_threads(config.threads)
    Path(config.scratch_dir).mkdir(parents=True, exist_ok=True)
    try:
        with model_parallel(1, 1, config.device, config.seed):
            try:
                core = TrainingCore.create(
                    base_model_dir=Path(config.base_model_dir),
                    lora=config.lora,
                    seed=config.seed,
                    device=config.device,
                    dtype=config.dtype,
                    compile_mode=one_process_compile_mode(config.device, config.dtype),
                )
                worker = SessionWorker(config, core, outbox)
                if config.initial_state is not None:
                    worker.load(config.initial_state, config.with_optimizer)
            except Exception as exc:  # noqa: BLE001 - a bad base model or state: say so instead of dying silently
                traceback.print_exc()
                outbox.put(messages.StartFailed("session_start_failed", f"{type(exc).__name__}: {exc}"))
                return
            hf = load_base_config(config.base_model_dir)
            outbox.put(messages.Ready(messages.SessionInfo(hf.vocab_size, hf.max_position_embeddings, core.step)))
            worker.run(inbox)
    finally:
        shutil.rmtree(config.scratch_dir, ignore_errors=True)
