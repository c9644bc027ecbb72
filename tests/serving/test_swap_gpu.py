"""Hot-swap through CUDA IPC from a real loader process (run on the device machine: pytest -m gpu).

The loader stages slot images in its ring on the GPU; the worker side (here the test, with the same
`ImageReceiver` the worker uses) maps the ring once and writes slots from its rows. Slots written
that way equal slots written locally from the adapter read from disk, rows are reused only after
the worker's copy (a CUDA IPC event), and other adapters' requests decode unchanged meanwhile.
"""

import pytest
import torch
import torch.multiprocessing as mp

from inkwell.adapters.io import load_adapter, save_adapter
from inkwell.models import base_model_identity, load_base_config
from inkwell.serving.contract import EngineConfig, Request, SamplingParams
from inkwell.serving.loader import loader_main
from inkwell.serving.messages import Load, Staged, Stop
from inkwell.serving.native.engine import Engine
from inkwell.serving.native.lora import LoraSlots
from inkwell.serving.sources import DirectorySource
from inkwell.serving.transfer import ImageReceiver
from tests.serving.test_engine import PROMPT

pytestmark = pytest.mark.gpu


class Loader:
    """A real loader process on CUDA for `engine`'s slot layout, and the worker's end of its ring."""

    def __init__(self, model_dir, engine: EngineConfig, layout):
        ctx = mp.get_context("spawn")
        self.inbox, self.arrived = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=loader_main, args=(str(model_dir), engine, self.inbox, self.arrived))
        self.process.start()
        self.receiver = ImageReceiver(layout)

    def load(self, key: str, directory, pinned: bool = True) -> None:
        self.inbox.put(Load(key, DirectorySource(str(directory)), pinned))

    def receive(self, key: str, pinned: bool = True):
        msg = self.arrived.get(timeout=120)
        assert isinstance(msg, Staged) and (msg.key, msg.pinned) == (key, pinned), msg
        return msg.staged

    def close(self) -> None:
        self.receiver.close()
        self.inbox.put(Stop())
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def test_cuda_ipc_swap_equals_a_local_write(tiny_model_dir, tiny_adapters, tmp_path):
    config = load_base_config(tiny_model_dir)
    engine = EngineConfig(max_loras_per_batch=2, max_lora_rank=16, dtype="bfloat16", device="cuda")
    slots = LoraSlots(config, base_model_identity(tiny_model_dir), 2, 16, engine.lora_groups, torch.bfloat16, "cuda")
    dirs = [save_adapter(a, tmp_path / f"a{i}", "sglang", config) for i, a in enumerate(tiny_adapters)]
    wants = [slots.slot_image(load_adapter(d, config)) for d in dirs]  # padded on the host, as bf16
    loader = Loader(tiny_model_dir, engine, slots.layout)
    kept = {}
    try:
        for i, d in enumerate(dirs):  # five adapters through a ring of two rows: every row is reused
            loader.load(f"a{i}", d)
        for i in range(len(dirs)):
            staged = loader.receive(f"a{i}")
            if i == 0:
                assert staged.ring is not None and staged.ring.flat.is_cuda  # a CUDA IPC mapping, sent once
            adapter = loader.receiver.adapter(staged)
            slot = slots.place(f"a{i}", adapter)  # straight from the row; evicts the least recently used
            loader.inbox.put(loader.receiver.release(staged, adapter))
            kept[f"a{i}"] = adapter
            assert torch.equal(slots.memory[slot].cpu(), wants[i]) and slots.scalings[slot].any()
    finally:
        loader.close()
    for i in (0, 1):  # evicted long ago, their rows rewritten since: readmitted from the kept images
        slot = slots.place(f"a{i}", kept[f"a{i}"])
        assert torch.equal(slots.memory[slot].cpu(), wants[i])


def test_cuda_ipc_swap_while_other_adapters_decode(tiny_model_dir, tiny_adapters, tmp_path, exact_fp32):
    config = EngineConfig(max_loras_per_batch=6, max_lora_rank=16, device="cuda")
    engine = Engine(tiny_model_dir, config)
    for i in range(4):
        engine.load_adapter(f"a{i}", tiny_adapters[i])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    others = [Request(f"r{i}", PROMPT[: 20 + i], params, f"a{i}") for i in range(4)]
    for r in others:
        engine.add_request(r)
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)

    for _ in range(4):
        step()
    directory = save_adapter(tiny_adapters[4], tmp_path / "a4", "sglang", engine.model_config)
    loader = Loader(tiny_model_dir, config, engine.lora.layout)
    try:
        loader.load("a4", directory)
        steps_while_loading = 0
        while loader.arrived.empty():
            step()
            steps_while_loading += 1
        staged = loader.receive("a4")
        adapter = loader.receiver.adapter(staged)
        engine.load_adapter("a4", adapter, pinned=True)  # what the worker does between two steps
        loader.inbox.put(loader.receiver.release(staged, adapter))
        late = Request("late", PROMPT[:22], params, "a4")
        engine.add_request(late)
        while engine.has_work():
            step()
    finally:
        loader.close()
    assert steps_while_loading >= 1  # the others kept decoding while the loader read and staged a4
    fresh = Engine(tiny_model_dir, config)
    for i, adapter in enumerate(tiny_adapters):
        fresh.load_adapter(f"a{i}", adapter)
    for r in [*others, late]:
        alone = fresh.generate([r])[r.request_id][0].token_ids
        assert outputs[r.request_id] == alone, r.request_id
