"""A verification's phases as they happen: the clock's reports and their rate-limited
job events (services/worker/progress.py, PhaseClock in services/worker/procedure/state.py)."""

from __future__ import annotations

import asyncio

from schemas import JobEvent, decode, encode
from schemas.events import VerifyPhase
from services.worker.procedure.state import PhaseClock
from services.worker.progress import PhaseEvents, label


def started(n: int) -> VerifyPhase:
    return VerifyPhase(name="trials", label=label("trials", "trial", n, 50), step="trial",
                       trial=n, trials=50)


async def test_phase_events_are_rate_limited_coalesced_and_end_with_the_last() -> None:
    interval = 0.1
    sent: list[tuple[float, VerifyPhase]] = []
    loop = asyncio.get_running_loop()

    async def send(phase: VerifyPhase) -> None:
        sent.append((loop.time(), phase))

    async with PhaseEvents(send, min_interval_s=interval) as events:
        for n in range(1, 51):  # 50 phases in about 0.5 s
            events.report(started(n))
            events.report(VerifyPhase(name="trials", label="trials", state="ended"))
            await asyncio.sleep(0.01)
        events.report(VerifyPhase(name="verdict", label="verdict", state="ended",
                                  seconds=0.2))
        closing = loop.time()
    times = [t for t, _ in sent if t < closing]
    phases = [p for _, p in sent]
    assert phases[0].trial == 1  # the first goes at once
    assert 3 <= len(sent) <= 0.5 / interval + 3, [p.label for p in phases]
    # At most one per interval, but for what waits at the end: sent at once on close.
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps and all(g >= interval * 0.9 for g in gaps), gaps
    trials = [p.trial for p in phases if p.trial is not None]
    assert trials == sorted(trials) and trials[-1] == 50  # in order; the newest wins
    # Ended reports are left out, but for the very last one, always sent.
    assert [p.state for p in phases].count("ended") == 1
    assert phases[-1].name == "verdict" and phases[-1].state == "ended"
    assert events.sent == phases


async def test_phase_events_send_a_waiting_phase_at_once_on_close() -> None:
    sent: list[VerifyPhase] = []

    async def send(phase: VerifyPhase) -> None:
        sent.append(phase)

    events = PhaseEvents(send, min_interval_s=30.0)
    async with events:
        events.report(started(1))
        await asyncio.sleep(0.01)
        events.report(started(2))  # waits for its slot 30 s later ...
        closing = asyncio.get_running_loop().time()
    assert asyncio.get_running_loop().time() - closing < 1.0  # ... cut short by close
    assert [p.trial for p in sent] == [1, 2]


async def test_a_failing_or_hanging_send_fails_nothing() -> None:
    async def broken(phase: VerifyPhase) -> None:
        raise ConnectionError("no JOB_EVENTS leader")

    async with PhaseEvents(broken) as events:
        events.report(started(1))
    assert events.sent == []

    async def hangs(phase: VerifyPhase) -> None:
        await asyncio.Event().wait()

    async with PhaseEvents(hangs, close_wait_s=0.1) as events:
        events.report(started(1))
    assert events.sent == []


def test_clock_reports_each_phase_as_it_starts_and_ends() -> None:
    seen: list[VerifyPhase] = []
    clock = PhaseClock(seen.append)
    clock.begin("static")
    clock.lap("static")
    clock.begin("trials", step="trial", trial=2, trials=3)
    clock.begin("checks", step="compile check")
    clock.lap("checks")
    assert [(p.name, p.state, p.label) for p in seen] == [
        ("static", "started", "static checks"), ("static", "ended", "static checks"),
        ("trials", "started", "trial 2 of 3"), ("checks", "started", "compile check"),
        ("checks", "ended", "checks")]
    assert seen[1].seconds == round(clock.spans["static"], 3)
    assert all(a.elapsed_s <= b.elapsed_s for a, b in zip(seen, seen[1:], strict=False))


def test_an_observer_that_raises_is_dropped_not_the_verification() -> None:
    calls = []

    def broken(phase: VerifyPhase) -> None:
        calls.append(phase)
        raise RuntimeError("display gone")

    clock = PhaseClock(broken)
    clock.begin("static")
    clock.lap("static")
    assert len(calls) == 1 and "static" in clock.spans


def test_a_phase_event_round_trips_on_the_wire() -> None:
    event = JobEvent(job_id="j1", event="verify_phase", message="trial 1 of 3",
                     request_id="j1-a1", phase=started(1))
    again = decode(encode(event), JobEvent)
    assert again.phase == event.phase and again.event == "verify_phase"
