"""How a starting agent waits for a name another lease holds (Registration.start):
the answers of the service are scripted, the waits shortened."""

from __future__ import annotations

import logging
import time

import pytest

from kvx.errors import ConnectError, MetadataError
from kvx.metadata import client as client_module
from kvx.metadata.client import MetadataClient, NameHeldError, Registration
from kvx.v1 import metadata_pb2

RETRY_S = 0.1
SLACK_S = 0.3  # past the time the service said, as _HELD_SLACK_S (shortened)


def _held(untracked: bool = False) -> NameHeldError:
    return NameHeldError("name 'a' is held", None, RETRY_S, untracked)


@pytest.fixture
def registration(monkeypatch):
    monkeypatch.setattr(client_module, "_HELD_SLACK_S", SLACK_S)
    # Never reaches a service: every registration is scripted by the test.
    client = MetadataClient("127.0.0.1:9")
    reg = Registration(client, lambda: metadata_pb2.AgentRecord(name="a", epoch=1))
    yield reg
    client.close()


def _script(reg: Registration, answers: list) -> list:
    """Makes ``reg._register`` answer with ``answers`` in turn (an exception is
    raised, None registers; a callable is called for the answer), then with the
    last one forever; returns the calls."""
    calls: list[int] = []

    def register() -> None:
        answer = answers[min(len(calls), len(answers) - 1)]
        calls.append(1)
        if callable(answer) and not isinstance(answer, BaseException):
            answer = answer()
        if answer is not None:
            raise answer

    reg._register = register  # type: ignore[method-assign]
    return calls


def _held_until(seconds: float, untracked: bool):
    """An answer: the name is held for ``seconds`` from now (past the first wait, whose
    end is RETRY_S + SLACK_S away), then free."""
    free_at = time.monotonic() + seconds
    return lambda: _held(untracked) if time.monotonic() < free_at else None


def test_a_lease_renewed_at_this_service_is_waited_for_once(registration, caplog):
    calls = _script(registration, [_held_until(RETRY_S + SLACK_S + 0.3, untracked=False)])
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(MetadataError, match="another live agent uses this name \\("),
    ):
        registration._wait_for_name(_held())
    assert "still held past its time" not in caplog.text
    assert len(calls) >= 2  # asked every RETRY_S until its end, then given up


def test_an_untracked_lease_that_runs_out_in_the_second_wait_frees_the_name(registration, caplog):
    # Held past the first wait (an etcd restart set the dead lease's time back), free in the second.
    calls = _script(registration, [_held_until(RETRY_S + SLACK_S + 0.3, untracked=True)])
    with caplog.at_level(logging.WARNING):
        registration._wait_for_name(_held(untracked=True))
    assert caplog.text.count("still held past its time") == 1
    assert len(calls) >= 3


def test_an_untracked_lease_held_through_both_waits_is_refused(registration, caplog):
    calls = _script(registration, [_held(untracked=True)])
    with caplog.at_level(logging.WARNING), pytest.raises(MetadataError, match="renewing at another replica"):
        registration._wait_for_name(_held(untracked=True))
    assert caplog.text.count("still held past its time") == 1  # one more wait, not more
    assert len(calls) >= 4


def test_an_outage_during_the_wait_is_asked_through(registration):
    down = ConnectError("metadata service unavailable")
    calls = _script(registration, [_held(), down, down, None])
    registration._wait_for_name(_held())
    assert len(calls) == 4


def test_an_outage_that_outlasts_the_grace_is_raised(registration, monkeypatch):
    monkeypatch.setattr(client_module, "_HELD_OUTAGE_GRACE_S", 0.5)
    calls = _script(registration, [ConnectError("metadata service unavailable")])
    with pytest.raises(ConnectError):
        registration._wait_for_name(_held())
    assert 1 <= len(calls) <= 3  # a retry a second, for RETRY_S + SLACK_S + the grace


def test_stop_ends_the_wait(registration):
    _script(registration, [_held()])
    registration._stop.set()
    with pytest.raises(NameHeldError):
        registration._wait_for_name(_held())
