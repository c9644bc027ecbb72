"""`Job` / `AsyncJob`: a handle on a training job that can refresh, follow, wait for and cancel it.

The two differ only in how they iterate the event stream; refresh/cancel/outcome are shared ops.
"""

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from inkwell.sdk.calls import Call, Op, parse_model, segment
from inkwell.sdk.errors import JobCancelledError, JobFailedError
from inkwell.sdk.plots import write_plots
from inkwell.service.schemas import TERMINAL_STATES, AdapterVersion, JobErrorInfo, JobEvent, JobProgress
from inkwell.service.schemas import Job as JobInfo

if TYPE_CHECKING:
    from inkwell.sdk.client import AsyncClient, Client


class _JobBase:
    def __init__(self, client: "Client | AsyncClient", info: JobInfo) -> None:
        self._client = client
        self.info = info
        self.adapter: AdapterVersion | None = None
        """The published adapter version, filled in by `refresh()`/`wait()` once the job succeeded."""

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def state(self) -> str:
        return self.info.state

    @property
    def error(self) -> JobErrorInfo | None:
        return self.info.error

    @property
    def progress(self) -> JobProgress:
        return self.info.progress

    @property
    def adapter_name(self) -> str:
        return self.info.adapter_name

    @property
    def done(self) -> bool:
        return self.info.state in TERMINAL_STATES

    def refresh(self) -> Self:
        """Fetch the job's current state (and its adapter version once it succeeded)."""
        return self._client._transport.run(self._refresh_op())

    def cancel(self) -> Self:
        """Cancel: a queued job at once, a running one within a worker heartbeat."""
        call = Call("POST", f"/v1/jobs/{segment(self.id)}/cancel", parse=parse_model(JobInfo))
        return self._client._transport.run(self._update_op(call))

    def logs(self) -> str:
        return self._client.jobs.logs(self.id)

    def _refresh_op(self) -> Op[Self]:
        return (yield from self._update_op(self._client.jobs.get_call(self.id, parse=parse_model(JobInfo))))

    def _update_op(self, call: Call) -> Op[Self]:
        self.info = yield call
        version = self.info.adapter_version
        if self.info.state == "succeeded" and version is not None and getattr(self.adapter, "version", None) != version:
            self.adapter = yield self._client.adapters.version_call(self.info.adapter_name, version)
        return self

    def _outcome(self) -> Self:
        if self.info.state == "failed":
            error = self.info.error or JobErrorInfo(code="job_failed", message="the job failed without an error record")
            raise JobFailedError(self.id, error.code, error.message)
        if self.info.state == "cancelled":
            raise JobCancelledError(self.id)
        return self

    def __repr__(self) -> str:
        p = self.info.progress
        return f"<{type(self).__name__} {self.id} {self.state} step {p.step}/{p.max_steps} adapter={self.adapter_name}>"


class _ProgressBar:
    """A tqdm bar (step / total steps, loss, tokens/s; an RL job's reward and KL) fed with the job's events; no-op
    when disabled."""

    def __init__(self, job: _JobBase, enabled: bool) -> None:
        self._bar: Any = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        total = job.progress.max_steps or job.info.hyperparameters.get("max_steps")
        self._bar = tqdm(total=total, initial=job.progress.step, unit="step", file=sys.stderr, dynamic_ncols=True)
        self._name = job.adapter_name
        self._bar.set_description_str(f"{self._name} [{job.state}]")

    def update(self, event: JobEvent) -> None:
        if self._bar is None:
            return
        if event.type == "state" and event.state:
            if event.state == "running":
                self._bar.reset(total=self._bar.total)  # time/step rates count from the claim, not the queue
            self._bar.set_description_str(f"{self._name} [{event.state}]")
        elif event.type == "progress" and isinstance(event.data.get("step"), int):
            total = event.data.get("total_steps") or event.data.get("max_steps")
            if isinstance(total, int) and total > 0:
                self._bar.total = total
            self._bar.n = event.data["step"]
            postfix = {}
            if event.data.get("loss") is not None:
                postfix["loss"] = f"{event.data['loss']:.4f}"
            if event.data.get("tokens_per_s") is not None:
                postfix["tok/s"] = f"{event.data['tokens_per_s']:.0f}"
            if event.data.get("reward") is not None:
                postfix["reward"] = f"{event.data['reward']:.3f}"
            if event.data.get("kl_k3") is not None:
                postfix["kl"] = f"{event.data['kl_k3']:.1e}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Job(_JobBase):
    def events(self, *, after: int | None = None, timeout: float | None = None) -> Iterator[JobEvent]:
        """Follow the job's events live (from the start, or after event id `after`) until it ends."""
        return self._client.jobs.events(self.id, after=after, timeout=timeout)

    def plot(self, directory: str | Path = ".") -> dict[str, Path]:
        """Write the job's curves from its events so far into `directory`: `<adapter>-loss.png`, and for an RL job
        `<adapter>-reward.png`; returns the paths by curve ('loss', 'reward')."""
        events = self._client.jobs.history(self.id)
        return write_plots(events, Path(directory), self.adapter_name, f"{self.adapter_name} ({self.id})")

    def wait(self, timeout: float | None = None, progress: bool = True) -> Self:
        """Block until the job ends; returns it when it succeeded (with `.adapter` set), raises
        JobFailedError / JobCancelledError otherwise and JobTimeoutError after `timeout` seconds."""
        self.refresh()
        if not self.done:
            bar = _ProgressBar(self, progress)
            try:
                for event in self.events(timeout=timeout):
                    bar.update(event)
            finally:
                bar.close()
            self.refresh()
        return self._outcome()


class AsyncJob(_JobBase):
    def events(self, *, after: int | None = None, timeout: float | None = None) -> AsyncIterator[JobEvent]:
        return self._client.jobs.events(self.id, after=after, timeout=timeout)

    async def wait(self, timeout: float | None = None, progress: bool = True) -> Self:
        await self.refresh()
        if not self.done:
            bar = _ProgressBar(self, progress)
            try:
                async for event in self.events(timeout=timeout):
                    bar.update(event)
            finally:
                bar.close()
            await self.refresh()
        return self._outcome()
