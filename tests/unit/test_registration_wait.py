"""How a starting agent waits for a name another lease holds (Registration.start).
The service's answers are scripted as functions of a fake clock, which the
agent's pauses advance: no test sleeps."""

from __future__ import annotations

import logging
import math
import types

import pytest

from kvx.errors import ConnectError, MetadataError
from kvx.metadata import client as client_module
from kvx.metadata.client import MetadataClient, NameHeldError, Registration
from kvx.v1 import metadata_pb2


class Clock:
    """time.monotonic for the client module, and its Registration's stop event."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []
        self.stopped = False

    def monotonic(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        assert seconds > 0, "a pause of nothing: the wait would spin"
        self.pauses.append(seconds)
        self.now += seconds
        return self.stopped


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(client_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


@pytest.fixture
def registration(clock):
    # Never reaches a service: every registration is scripted by the test.
    client = MetadataClient("127.0.0.1:9")
    reg = Registration(client, lambda: metadata_pb2.AgentRecord(name="a", epoch=1))
    reg._stop = clock  # type: ignore[assignment]
    yield reg
    client.close()


TERM = 5  # the etcd raft term of an answer about a lease the service does not renew


def held(remaining_s: float, etcd_term: int) -> NameHeldError:
    """The service's refusal, its time in whole seconds (``etcd_term`` 0 for a lease the
    service renews itself), as the client makes it of the answer: the time bounded."""
    said_s = float(max(1, math.ceil(remaining_s)))
    bounded_s = min(said_s, client_module._HELD_RETRY_MAX_S)
    return NameHeldError("name 'a' is held", None, bounded_s, etcd_term, said_s)


def script(reg: Registration, clock: Clock, answer) -> list[float]:
    """Makes ``reg._register`` call ``answer(t)`` (t: seconds since the script began) for
    an exception to raise, or None to register; returns the times it was called."""
    began = clock.now
    calls: list[float] = []

    def register() -> None:
        t = clock.now - began
        calls.append(t)
        error = answer(t)
        if error is not None:
            raise error

    reg._register = register  # type: ignore[method-assign]
    return calls


def dead_lease(ttl_s: float, resets: tuple[float, ...] = (), untracked: bool = True):
    """A lease nobody renews, held ``ttl_s`` from t=0; each reset (a new etcd leader,
    a new term) sets its time back to ``ttl_s``."""

    def answer(t: float):
        past = [r for r in resets if r <= t]
        left = ttl_s - (t - max([0.0, *past]))
        return held(left, TERM + len(past) if untracked else 0) if left > 0 else None

    return answer


def live_lease(ttl_s: float, every_s: float, untracked: bool = True):
    """A lease renewed every ``every_s`` (at another replica when ``untracked``)."""
    return lambda t: held(ttl_s - (t % every_s), TERM if untracked else 0)


def test_a_dead_lease_runs_out_in_one_wait(registration, clock, caplog):
    calls = script(registration, clock, dead_lease(8))
    with caplog.at_level(logging.WARNING):
        registration._wait_for_name(held(8, TERM))
    assert 8 <= calls[-1] <= 8 + 1  # asked again right after it ran out
    assert "still held past its time" not in caplog.text


def test_a_lease_renewed_at_this_service_is_waited_for_once(registration, clock, caplog):
    script(registration, clock, live_lease(8, 2, untracked=False))
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(MetadataError, match="another live agent uses this name \\("),
    ):
        registration._wait_for_name(held(8, 0))
    assert "still held past its time" not in caplog.text
    assert 8 <= sum(clock.pauses) <= 8 + 1 + 0.01  # its time, and the slack


@pytest.mark.parametrize("reset_at", [1.5, 3.0, 7.5])
def test_a_dead_lease_reset_by_an_etcd_restart_is_waited_for_again(registration, clock, caplog, reset_at):
    calls = script(registration, clock, dead_lease(8, resets=(reset_at,)))
    with caplog.at_level(logging.WARNING):
        registration._wait_for_name(held(8, TERM))
    assert caplog.text.count("still held past its time") == 1
    assert reset_at + 8 <= calls[-1] <= reset_at + 8 + 2.5  # asked soon after it ran out


def test_rises_across_etcd_terms_are_not_taken_for_renewals(registration, clock, caplog):
    # Two new etcd leaders within one wait: two rises, neither a renewal.
    calls = script(registration, clock, dead_lease(8, resets=(3.0, 6.0)))
    with caplog.at_level(logging.WARNING):
        registration._wait_for_name(held(8, TERM))
    assert caplog.text.count("still held past its time") == 1
    assert 6 + 8 <= calls[-1] <= 6 + 8 + 2.5


def test_a_dead_lease_reset_in_every_wait_is_waited_for_up_to_the_bound(registration, clock, caplog):
    # etcd changing leader every 7 s: the lease never runs out, and the waits are bounded.
    resets = tuple(7.0 * i for i in range(1, 40))
    script(registration, clock, dead_lease(8, resets=resets))
    with caplog.at_level(logging.WARNING), pytest.raises(MetadataError, match="its holder may be dead"):
        registration._wait_for_name(held(8, TERM))
    assert caplog.text.count("still held past its time") == client_module._UNTRACKED_WAITS - 1


@pytest.mark.parametrize(("ttl_s", "every_s"), [(8, 8 / 3), (60, 20), (60, 23.4), (20, 20 / 3)])
def test_a_lease_renewed_at_another_replica_is_a_live_duplicate(registration, clock, caplog, ttl_s, every_s):
    # An etcd lease renewed elsewhere rises every third of its etcd ttl (23.4 s: a forward
    # that waited for the agent's next renewal at ttl 10).
    script(registration, clock, live_lease(ttl_s, every_s))
    with caplog.at_level(logging.WARNING), pytest.raises(MetadataError, match="renewing at another replica"):
        registration._wait_for_name(held(ttl_s, TERM))
    assert "still held past its time" not in caplog.text  # told within the first wait
    assert sum(clock.pauses) <= ttl_s + 1 + 0.01


def test_a_dead_lease_longer_than_the_clients_bound_on_a_wait_shows_no_rise(registration, clock, caplog):
    # A backstop longer than the client's bound on one wait (each wait is the bound).
    calls = script(registration, clock, dead_lease(1000))
    with caplog.at_level(logging.WARNING):
        registration._wait_for_name(held(1000, TERM))
    assert caplog.text.count("still held past its time") == 3
    assert 1000 <= calls[-1] <= 1000 + 2.5
    assert max(clock.pauses) == client_module._HELD_RETRY_MAX_S / 4  # asked every quarter of it


def test_replies_late_by_seconds_show_no_rise(registration, clock):
    # A loaded service answers each question 0.2-3 s after it read the time: a dead
    # lease's time, measured from an answer to the next question, never seems to rise
    # (from answer to answer it would, every other time). Its etcd time is longer than
    # the client's bound on a wait: several waits in one term.
    lease = dead_lease(1000)
    delays = iter([0.2, 3.0] * 1000)

    def slow(t: float):
        answer = lease(t)
        clock.now += next(delays)  # the time was read before the reply came
        return answer

    calls = script(registration, clock, slow)
    registration._wait_for_name(held(1000, TERM))  # no "renewed while we waited"
    assert calls[-1] >= 1000  # waited it out, and got the name


def test_renewals_seen_across_waits_name_a_live_duplicate(registration, clock, caplog):
    # etcd's ttl is the agent's (60 s, over a shorter backstop): a forward may come only
    # every two thirds of it, one in a wait at most; two within one term are enough.
    script(registration, clock, live_lease(60, 40))
    with caplog.at_level(logging.WARNING), pytest.raises(MetadataError, match="renewing at another replica"):
        registration._wait_for_name(held(60, TERM))
    assert caplog.text.count("still held past its time") <= 2


def test_an_outage_during_the_wait_is_asked_through(registration, clock):
    down = ConnectError("metadata service unavailable")
    lease = dead_lease(8, untracked=False)
    calls = script(registration, clock, lambda t: down if 7 < t < 20 else lease(t))
    registration._wait_for_name(held(8, 0))
    assert 20 <= calls[-1] <= 21  # asked once a second through the outage, then registered
    assert all(pause == 1.0 for pause in clock.pauses[-10:])


def test_a_live_duplicate_is_named_as_soon_as_it_shows(registration, clock, caplog):
    # Two renewals seen, then a new etcd leader: the proof stands, the agent does not
    # wait on (and lose count) until the end of its wait.
    live = live_lease(60, 10)
    calls = script(registration, clock, lambda t: live(t) if t < 40 else held(60 - (t - 40), TERM + 1))
    with caplog.at_level(logging.WARNING), pytest.raises(MetadataError, match="renewing at another replica"):
        registration._wait_for_name(held(60, TERM))
    assert calls[-1] < 40


def test_bad_times_and_terms_from_the_service_are_not_trusted():
    code = client_module.grpc.StatusCode.FAILED_PRECONDITION
    for millis in ("9" * 400, "x", "-5"):
        error = client_module._status_error("svc", code, "held", millis, "7")
        if isinstance(error, NameHeldError):
            assert client_module._HELD_RETRY_MIN_S <= error.retry_after_s <= client_module._HELD_RETRY_MAX_S
        else:
            assert type(error) is MetadataError
    for term in ("-1", "0", str(1 << 64), "9" * 5000, "seven", None):
        assert client_module._term(term) == 0
    assert client_module._term(str((1 << 64) - 1)) == (1 << 64) - 1


def test_an_outage_that_outlasts_the_grace_is_raised(registration, clock):
    calls = script(registration, clock, lambda t: ConnectError("metadata service unavailable"))
    with pytest.raises(ConnectError):
        registration._wait_for_name(held(8, 0))
    assert (
        8 + 1 + client_module._HELD_OUTAGE_GRACE_S
        <= calls[-1]
        <= 8 + 1 + client_module._HELD_OUTAGE_GRACE_S + 1
    )


def test_stop_ends_the_wait(registration, clock):
    calls = script(registration, clock, dead_lease(8))
    clock.stopped = True
    with pytest.raises(NameHeldError):
        registration._wait_for_name(held(8, TERM))
    assert calls == []


def test_a_registration_refused_for_minutes_logs_a_line_a_minute_not_each_retry(registration, clock, caplog):
    """The service refuses the registration (a wrong token, say) for 200 s, then another
    way for 100 s: the agent tries again every 2 s at most, and says so at the start of
    each refusal, then once a minute."""
    denied = MetadataError("metadata service refused: PERMISSION_DENIED: wrong token")
    full = MetadataError("metadata service refused: RESOURCE_EXHAUSTED: the registry is full")
    calls = script(registration, clock, lambda t: denied if t < 200 else full if t < 300 else None)
    registered: list[float] = []

    def keep_alive() -> None:  # registered at last: the loop ends
        registered.append(clock.now)
        clock.stopped = True

    registration._keep_alive = keep_alive  # type: ignore[method-assign]
    clock.is_set = lambda: clock.stopped  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="kvx.metadata.client"):
        registration._run()
    lines = [r.getMessage() for r in caplog.records if "registration" in r.getMessage()]
    assert len(calls) > 140 and registered, (len(calls), registered)
    # At 0, about 60, 120 and 180 s; at 200 s the new refusal at once, then about 260 s.
    assert [("still" in line, "PERMISSION" in line) for line in lines] == [
        (False, True),
        (True, True),
        (True, True),
        (True, True),
        (False, False),
        (True, False),
    ], lines
    assert lines[0] == f"metadata registration failed: {denied}; trying again"
