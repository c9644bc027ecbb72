"""A Tinker session whose client stops beating (a killed script) is finished: its training model closes and gives
its session slot back, rather than holding it for the sessions' ten-minute idle timeout while a new run waits on
429s. One that beats stays open. The client is played over raw HTTP, so that its heartbeats can stop."""

import time

import httpx
import pytest

from inkwell.service.tinker import door


def _open_model(url: str, headers: dict) -> str:
    """A Tinker session with one training model, once the model is up."""
    body = {"tags": [], "user_metadata": None, "sdk_version": "x"}
    session = httpx.post(f"{url}/create_session", json=body, headers=headers).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": "inkling-tiny", "lora_config": {"rank": 2}}
    created = httpx.post(f"{url}/create_model", json=create, headers=headers)
    assert created.status_code == 200, created.text
    request = {"request_id": created.json()["request_id"]}
    answer = httpx.post(f"{url}/retrieve_future", json=request, headers=headers, timeout=60).json()
    assert answer.get("model_id") == f"{session}:train:0", answer
    return session


def test_a_silent_client_is_finished_and_frees_its_slot_a_beating_one_is_not(service, tenant, monkeypatch):
    url, headers = f"{service.url}/api/v1", {"X-API-Key": tenant[1]}
    inkwell = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {tenant[1].removeprefix('tml-')}"})
    session = _open_model(url, headers)
    monkeypatch.setattr(door, "HEARTBEAT_LOST_SECONDS", 1.0)  # the client's 2 minutes, as 1 s
    tinker_door = service.app.state.tinker
    live_id = tinker_door.models[f"{session}:train:0"].live.id
    interval = service.app.state.sessions.settings.reap_interval

    beating_until = time.monotonic() + interval + 0.5  # a reaper pass falls while it beats
    while time.monotonic() < beating_until:
        beat = httpx.post(f"{url}/session_heartbeat", json={"session_id": session}, headers=headers)
        assert beat.status_code == 200, beat.text
        time.sleep(0.3)
    assert inkwell.get(f"/v1/sessions/{live_id}").json()["state"] != "closed"

    deadline = time.monotonic() + interval + 3  # silent now: finished at a pass after 1 s
    while (state := inkwell.get(f"/v1/sessions/{live_id}").json())["state"] != "closed":
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert state["closed_code"] == "session_heartbeat_lost" and "no heartbeat" in state["closed_reason"]
    gone = httpx.post(f"{url}/session_heartbeat", json={"session_id": session}, headers=headers)
    assert gone.status_code == 410 and gone.json()["code"] == "session_finished"
    with pytest.raises(KeyError):  # its model is forgotten with it
        tinker_door.models[f"{session}:train:0"]
