"""How ``aikg run`` / ``verify`` / ``submit --wait`` show a verification's phases
(services/cli/phases.py): a status line on a terminal, plain lines otherwise, nothing
with --json."""

from __future__ import annotations

import io

from rich.console import Console

from schemas.events import VerifyPhase
from services.cli.phases import JobPhases, LocalPhases
from services.worker.progress import label, phase


def reports() -> list[VerifyPhase]:
    trial = [VerifyPhase(name="trials", label=label("trials", "trial", i, 3), step="trial",
                         trial=i, trials=3) for i in (1, 2, 3)]
    return [phase("lowering"), phase("sandbox_start"), phase("lowering", "ended", 1.0),
            phase("sandbox_start", "ended", 2.0), phase("static"),
            phase("static", "ended", 0.1), phase("reference_start"), *trial,
            VerifyPhase(name="checks", label="compile check", step="compile check"),
            phase("verdict"), phase("verdict", "ended", 0.2)]


def console(terminal: bool) -> tuple[Console, io.StringIO]:
    text = io.StringIO()
    return Console(file=text, force_terminal=terminal, width=120), text


def test_not_a_terminal_prints_a_plain_line_per_phase_started() -> None:
    err, text = console(False)
    with LocalPhases("verifying k.py against t.py on cpu ...", False, err) as view:
        for report in reports():
            view(report)
    lines = text.getvalue().splitlines()
    assert lines[0] == "verifying k.py against t.py on cpu ..."
    assert [line.split("] ", 1)[1] for line in lines[1:]] == [
        "lowering", "sandbox start", "static checks", "reference", "trial 1 of 3",
        "trial 2 of 3", "trial 3 of 3", "compile check", "verdict"]
    assert all(line.startswith("[") and " s] " in line for line in lines[1:])


def test_a_terminal_gets_one_status_line_and_json_nothing() -> None:
    err, text = console(True)
    with LocalPhases("verifying k.py ...", False, err) as view:
        view(phase("lowering"))
        view(phase("sandbox_start"))
        assert view._bar is not None
        shown = view._bar.tasks[0].description
        assert shown == "verifying k.py: lowering + sandbox start", shown
        view(phase("lowering", "ended", 1.0))
        assert view._bar.tasks[0].description == "verifying k.py: sandbox start"
        view(VerifyPhase(name="trials", label="trial 2 of 3", trial=2, trials=3))
        assert view._bar.tasks[0].description == "verifying k.py: trial 2 of 3"
    assert "trial 2 of 3\n" not in text.getvalue()  # no line per phase: one transient line

    quiet, text = console(True)
    with LocalPhases("verifying k.py ...", True, quiet) as view:
        for report in reports():
            view(report)
    assert text.getvalue() == "" and view.shown == []


def test_submit_wait_shows_the_phase_under_the_progress_line_until_the_verdict() -> None:
    shown: list = []
    view = JobPhases(shown.append)
    view.event({"event": "verify_phase", "candidate_id": "j-c1", "message": "trial 2 of 3"})
    assert shown == []  # nothing before the first status
    view.status("j running")
    out, _ = console(False)
    with out.capture() as captured:
        out.print(shown[-1])
    view.event({"event": "verify_phase", "candidate_id": "j-c1", "message": "compile check"})
    with out.capture() as later:
        out.print(shown[-1])
    assert "verifying j-c1: trial 2 of 3" in captured.get()
    assert "verifying j-c1: compile check" in later.get()
    view.event({"event": "verify_result", "candidate_id": "j-c1"})
    assert shown[-1] == "j running"
