"""`sdk.train()` end to end: the real service, a real worker process and the real trainer on
inkling-tiny; wait() with its progress bar, the published adapter, a verified download that
loads as an adapter, and a job the trainer rejects surfacing as JobFailedError."""

import asyncio

import pytest

from inkwell import sdk

EXAMPLES = [
    {"messages": [{"role": "user", "content": f"what is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}"}]}
    for i in range(16)
]
TINY_RUN = {"batch_size": 2, "seq_len": 64, "learning_rate": 5e-3, "checkpoint_every": 2}


def test_train_wait_adapter_download(training_service, tmp_path, capsys):
    from inkwell.adapters.io import load_adapter
    from inkwell.models import load_base_config

    _, key = training_service.new_tenant("train")
    client = sdk.Client(training_service.url, key)
    lora = sdk.LoraSpec(rank=2, alpha=4, targets=("attn", "mlp", "experts"))

    rejected = client.train("inkling-tiny", EXAMPLES, adapter_name="too-long", wait=False, max_steps=2, seq_len=8)
    job = sdk.train(
        base_model="inkling-tiny",
        dataset=EXAMPLES,
        lora=lora,
        adapter_name="sdk-e2e",
        client=client,
        timeout=600,
        max_steps=3,
        **TINY_RUN,
    )
    assert job.state == "succeeded" and job.error is None
    bar = capsys.readouterr().err
    assert "sdk-e2e" in bar and "3/3" in bar and "loss=" in bar

    assert job.adapter is not None and job.adapter.version == job.info.adapter_version == 1
    assert job.adapter.lineage.job_id == job.id and job.adapter.lineage.source == "job"
    assert job.adapter.lora["rank"] == 2
    events = list(job.events())
    assert [e.state for e in events if e.type == "state"] == ["queued", "running", "succeeded"]
    assert [e.data["step"] for e in events if e.type == "progress"] == [1, 2, 3]
    assert [e.data["version"] for e in events if e.type == "published"] == [1]

    async def refreshed_async() -> sdk.AsyncJob:
        async with sdk.AsyncClient(training_service.url, key) as aclient:
            return await (await aclient.jobs.get(job.id)).wait(progress=False)

    ajob = asyncio.run(refreshed_async())
    assert ajob.state == "succeeded" and ajob.adapter == job.adapter

    got = client.adapters.download("sdk-e2e", layout="sglang", dest=tmp_path / "dl")
    assert got.version == 1
    base = load_base_config(training_service.settings.data_dir / "models" / "inkling-tiny")
    loaded = load_adapter(got.path, base)  # checks the manifest's sha256s and the shapes
    assert loaded.spec.rank == 2 and loaded.num_parameters > 0

    with pytest.raises(sdk.JobFailedError) as err:
        rejected.wait(timeout=300, progress=False)
    assert err.value.code == "invalid_job" and "seq_len" in err.value.message
    assert rejected.state == "failed" and rejected.adapter is None
    client.close()
