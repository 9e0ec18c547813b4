"""bench/fleet.py: its options, the curve at its smallest size, and its simulated device,
which no normal verify request can reach."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench import fleet
from schemas import VerifyRequest, encode, subjects
from services.common.bus import Bus
from services.common.settings import Settings
from services.common.verify_client import build_request
from services.worker.service import Worker
from tests.bus.test_worker_service import Results, running_worker
from tests.helpers import RELU_KERNEL, RELU_TASK

ROOT = Path(__file__).resolve().parents[2]


def test_bad_options_are_refused() -> None:
    for argv in (["--workers", "0"], ["--seconds", "0"], ["--device-ms", "-1"],
                 ["--depth", "0"], ["--procs", "0"], ["--tenants", "-1"]):
        with pytest.raises(SystemExit) as exc:
            fleet.main(argv)
        assert exc.value.code == 2, argv


def test_a_simulated_device_needs_the_runs_token() -> None:
    with pytest.raises(ValueError, match="token"):
        fleet.SimulatedDevice("w", 0.01, "")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_bench_prints_the_curve_at_its_smallest_size(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet.main(["--workers", "1", "4", "--seconds", "2", "--warmup", "0.5",
                       "--device-ms", "20"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("curve this")]
    assert [row[2] for row in rows] == ["1", "4"], out
    for row in rows:
        workers, rate, ideal = int(row[2]), float(row[3]), float(row[4])
        assert ideal == workers / 0.02, out
        # Something was dispatched, and no faster than the devices allow.
        assert 0 < rate <= ideal * 1.05, out
    assert "refused by the simulated device" not in out, out


def test_no_service_module_imports_the_bench() -> None:
    """The simulated device lives in bench/fleet.py; no module of the services (whose
    commands start workers) imports the bench, so none can build it."""
    importers = []
    for path in sorted((ROOT / "services").rglob("*.py")) + sorted(
            (ROOT / "schemas").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name == "bench" or name.startswith("bench.") for name in names):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == []


async def test_a_worker_without_a_verifier_runs_the_real_one(settings: Settings,
                                                             bus: Bus) -> None:
    from services.worker.verifier import Verifier

    assert type(Worker(bus, settings).verifier) is Verifier


async def test_a_normal_verify_request_never_reaches_the_simulated_device(
        settings: Settings, bus: Bus, bus_credentials) -> None:
    """A worker lent the simulated device, on the bench's arch: a normal relu request,
    and a bench-shaped one with another run's token, are answered with failed
    ``infrastructure`` results that name the refusal, without the device running; the
    run's own request gets the simulated verdict, which says it is simulated."""
    device = fleet.SimulatedDevice(bus_credentials.worker_ids[0], 0.01, "run-token")
    collector = Results()
    await collector.start(bus)
    async with running_worker(settings, bus, verifier=device, worker_arch=fleet.SIM_ARCH,
                              **bus_credentials.worker_settings()):
        def request(rid: str, code: str, task: str = RELU_TASK) -> VerifyRequest:
            return build_request(request_id=rid, job_id="job-sim", candidate_id=rid,
                                 op_name="relu", task_desc=task, code=code, backend="cpu",
                                 arch=fleet.SIM_ARCH, trials=1)

        for req in (request("normal", RELU_KERNEL),
                    request("other-run", fleet.MARKER + "another-token"),
                    request("bench", fleet.MARKER + "run-token", "# simulated\n")):
            await bus.js.publish(subjects.verify("cpu", fleet.SIM_ARCH), encode(req),
                                 headers={"Nats-Msg-Id": req.request_id})
        results = {r.request_id: r for r in await collector.wait("job-sim", 3)}
    for rid in ("normal", "other-run"):
        refused = results[rid]
        assert not refused.passed and refused.stage == "infrastructure", refused
        assert refused.error.startswith("refused by the simulated device"), refused
    simulated = results["bench"]
    assert not simulated.passed and simulated.stage == "infrastructure", simulated
    assert simulated.error.startswith("simulated device: slept"), simulated
    assert "simulated_dispatch" in simulated.phases, simulated
    assert (device.runs, device.refused) == (1, 2)
