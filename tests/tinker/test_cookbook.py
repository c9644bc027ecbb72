"""tinker-cookbook 0.6.1's own training loops, unmodified, against inkwell on local data: its supervised
`train.main` on a JSONL conversation file (FromConversationFileBuilder), and its RL `train.main` on a small local
environment. The cookbook loads tokenizers by model name; `inkling-tiny`'s is registered (the cookbook's
`register_tokenizer`) to load from the base model's directory, as `TrainingClient.get_tokenizer` does."""

import asyncio
import json
import string
from functools import partial
from pathlib import Path

import pytest
from transformers import AutoTokenizer

pytest.importorskip("tinker_cookbook")

import chz  # noqa: E402
from tinker_cookbook import renderers  # noqa: E402
from tinker_cookbook.rl import train as rl_train  # noqa: E402
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder  # noqa: E402
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder  # noqa: E402
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer  # noqa: E402

RENDERER = "role_colon"  # plain "User: ... Assistant: ..." turns, for any tokenizer


@pytest.fixture(autouse=True)
def cookbook_env(service, tenant, base_dir, monkeypatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", tenant[1])
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    register_tokenizer("inkling-tiny", lambda: AutoTokenizer.from_pretrained(base_dir))


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_supervised_train_on_a_local_jsonl(service, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w} {w}"}]}
        for w in ("red", "blue", "green", "gold") * 2
    ]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer="inkling-tiny", renderer_name=RENDERER, max_length=128, batch_size=4
    )
    config = sl_train.Config(
        log_path=str(tmp_path / "sl"),
        model_name="inkling-tiny",
        recipe_name="inkwell_test_sl",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
        learning_rate=2e-2,
        lr_schedule="constant",
        num_epochs=4,
        lora_rank=4,
        base_url=service.url,
        save_every=4,
        eval_every=0,
        infrequent_eval_every=0,
    )
    asyncio.run(sl_train.main(config))
    metrics = _metrics(tmp_path / "sl")
    nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    assert len(nll) == 8 and nll[-1] < nll[0] * 0.8, nll
    saved = [json.loads(line) for line in (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["name"] == "final" and saved[-1]["state_path"].endswith("/weights/final")
    assert saved[-1]["sampler_path"].endswith("/sampler_weights/final")
    assert any(s["name"] == "000004" for s in saved)


class LetterEnv(ProblemEnv):
    """Answer with lowercase letters: the reward is their share of the response (dense, so a few steps move it)."""

    def get_question(self) -> str:
        return "write letters"

    def check_answer(self, sample_str: str) -> float:
        return sum(c in string.ascii_lowercase for c in sample_str) / max(len(sample_str), 1)

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "abc"


class LetterDataset(RLDataset):
    def __init__(self, renderer, batches: int, groups: int, group_size: int) -> None:
        self.renderer, self.batches, self.groups, self.group_size = renderer, batches, groups, group_size

    def get_batch(self, index: int) -> list[ProblemGroupBuilder]:
        make = partial(LetterEnv, self.renderer, format_coef=0.0)
        return [ProblemGroupBuilder(make, self.group_size, "letters") for _ in range(self.groups)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class LetterDatasetBuilder(RLDatasetBuilder):
    batches: int
    groups: int
    group_size: int

    async def __call__(self) -> tuple[LetterDataset, None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer("inkling-tiny"))
        return LetterDataset(renderer, self.batches, self.groups, self.group_size), None


def test_rl_train_on_a_local_environment(service, tmp_path):
    config = rl_train.Config(
        learning_rate=1e-2,  # LoRA scale alpha/rank = 8: larger rates swing the tiny model's rewards
        dataset_builder=LetterDatasetBuilder(batches=8, groups=4, group_size=16),
        model_name="inkling-tiny",
        recipe_name="inkwell_test_rl",
        max_tokens=6,
        log_path=str(tmp_path / "rl"),
        renderer_name=RENDERER,
        lora_rank=4,
        base_url=service.url,
        eval_every=0,
        save_every=0,
        rollout_json_export=False,
        num_groups_to_log=0,
    )
    asyncio.run(rl_train.main(config))
    rewards = [m["env/all/reward/total"] for m in _metrics(tmp_path / "rl") if "env/all/reward/total" in m]
    assert len(rewards) == 8 and sum(rewards[-2:]) > sum(rewards[:2]), rewards  # a random start: it climbs after ~4
