"""`Job` / `AsyncJob`: a handle on a training job that can refresh, follow, wait for and cancel it.

The two differ only in how they iterate the event stream; refresh/cancel/outcome are shared ops.
"""

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
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


def _ended(events: list[JobEvent]) -> bool:
    """Whether the events hold the job's terminal state: it ended as the wait began, nothing is left to follow."""
    return any(event.type == "state" and event.state in TERMINAL_STATES for event in events)


def _goes_on(job_id: str) -> str:
    """The note on an interrupted wait: stopping the wait left the job running."""
    return f"job {job_id} goes on running on the service: job.cancel() or `inkwell jobs cancel {job_id}` stops it"


def _last_id(events: list[JobEvent]) -> int | None:
    return events[-1].id if events else None


# A progress event's figures shown beside the bar: (event key, label, format).
_POSTFIX = (
    ("loss", "loss", "{:.4f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("reward", "reward", "{:.3f}"),
    ("kl_k3", "kl", "{:.1e}"),
)


class _ProgressBar:
    """A tqdm bar (step / total steps, loss, tokens/s; an RL job's reward and KL) fed with the job's events; no-op
    when disabled.

    The events recorded before the wait began (`history`) only set where the bar starts: replayed on screen, a
    running job's bar went back to [queued] and step 0, and its rate counted the replay's steps as done at once."""

    def __init__(self, job: _JobBase, enabled: bool, history: list[JobEvent]) -> None:
        self._bar: Any = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        self._name = job.adapter_name
        self._state = job.state
        self._step = job.progress.step
        self._total = job.progress.max_steps or job.info.hyperparameters.get("max_steps")
        self._postfix: dict[str, str] = {}
        for event in history:
            self._apply(event)
        self._bar = tqdm(total=self._total, initial=self._step, unit="step", file=sys.stderr, dynamic_ncols=True)
        self._show()

    def update(self, event: JobEvent) -> None:
        if self._bar is None:
            return
        was = self._state
        self._apply(event)
        if self._state == "running" and was != "running":
            self._bar.reset(total=self._total)  # time/step rates count from the claim, not the queue
        self._show()

    def _apply(self, event: JobEvent) -> None:
        if event.type == "state" and event.state:
            self._state = event.state
        elif event.type == "progress" and isinstance(event.data.get("step"), int):
            total = event.data.get("total_steps") or event.data.get("max_steps")
            if isinstance(total, int) and total > 0:
                self._total = total
            self._step = event.data["step"]
            shown = [(label, form, event.data.get(key)) for key, label, form in _POSTFIX]
            self._postfix = {label: form.format(value) for label, form, value in shown if value is not None}

    def _show(self) -> None:
        self._bar.total = self._total
        self._bar.n = self._step
        self._bar.set_description_str(f"{self._name} [{self._state}]", refresh=False)
        self._bar.set_postfix(self._postfix, refresh=False)
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
        JobFailedError / JobCancelledError otherwise and JobTimeoutError after `timeout` seconds. Ctrl+C stops the
        wait, not the job (its KeyboardInterrupt says how to cancel it)."""
        self.refresh()
        if not self.done:
            try:  # from the first event read on: a Ctrl+C as the bar appears says what the wait left behind too
                history = list(self._client.jobs.history(self.id)) if progress else []
                with closing(_ProgressBar(self, progress, history)) as bar:
                    if not _ended(history):
                        for event in self.events(after=_last_id(history), timeout=timeout):
                            bar.update(event)
            except KeyboardInterrupt as exc:  # the wait stops here, the job does not
                exc.add_note(_goes_on(self.id))
                raise
            self.refresh()
        return self._outcome()


class AsyncJob(_JobBase):
    def events(self, *, after: int | None = None, timeout: float | None = None) -> AsyncIterator[JobEvent]:
        return self._client.jobs.events(self.id, after=after, timeout=timeout)

    async def wait(self, timeout: float | None = None, progress: bool = True) -> Self:
        """`Job.wait` awaited. Ctrl+C under `asyncio.run` (or cancelling the task) stops the wait, not the job: the
        CancelledError says how to cancel it, and asyncio.run's KeyboardInterrupt shows it as its context."""
        await self.refresh()
        if not self.done:
            try:
                history = [event async for event in self._client.jobs.history(self.id)] if progress else []
                with closing(_ProgressBar(self, progress, history)) as bar:
                    if not _ended(history):
                        async for event in self.events(after=_last_id(history), timeout=timeout):
                            bar.update(event)
            except asyncio.CancelledError as exc:
                exc.add_note(_goes_on(self.id))
                raise
            await self.refresh()
        return self._outcome()
