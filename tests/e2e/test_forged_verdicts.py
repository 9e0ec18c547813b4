"""A compromised worker cannot decide another worker's requests (issue: verdicts only
from the worker that holds the request).

A real gateway, generator and cpu worker (``test-worker``) run; a second worker's
credentials (``test-worker-2``) drive a forger that does what a sandbox escape on
another worker host could: it watches the ``leases`` bucket (every worker may read it)
to learn which job and request another worker is verifying, and publishes a passing
verdict with speedup 999 for each at once, with a claim, on its own subject and on the
other worker's. Whatever it sends, the job, the batch entry and ``RemoteWorker.verify``
end with the real worker's verdict, and the forgeries are counted.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats
import pytest

from schemas import VerifyClaim, VerifyResult, encode, subjects
from services.common.bus import Bus
from services.common.settings import Settings
from services.common.verdicts import VERDICTS_REJECTED
from services.sdk import AsyncAIKGClient, RemoteWorker
from tests.conftest import TEST_WORKER_IDS, as_role
from tests.helpers import BUNDLED_RELU_TASK, WRONG_RELU_KERNEL, scaled

REAL, FORGER = TEST_WORKER_IDS
LEASES = f"KV_{subjects.BUCKET_LEASES}"

pytestmark = pytest.mark.slow


class Forger:
    """Publishes a forged claim and passing verdict for every lease another worker
    holds, as soon as it sees it (polling every 50 ms)."""

    def __init__(self, nc) -> None:
        self.nc, self.js = nc, nc.jetstream(timeout=5)
        self.forged: set[str] = set()
        self.refused = 0

    async def _leases(self) -> list[dict]:
        info = await self.js.stream_info(LEASES, subjects_filter=f"$KV.{subjects.BUCKET_LEASES}.>")
        out = []
        for subject in info.state.subjects or {}:
            with contextlib.suppress(Exception):
                raw = await self.js.get_msg(LEASES, subject=subject)
                if raw.data:
                    out.append(msgspec.json.decode(raw.data))
        return out

    async def _forge(self, job_id: str, request_id: str) -> None:
        claim = VerifyClaim(request_id=request_id, job_id=job_id, worker_id=FORGER,
                            proof="0" * 32)
        await self.js.publish(subjects.claims(job_id, FORGER), encode(claim))
        result = VerifyResult(request_id=request_id, job_id=job_id, candidate_id="forged",
                              worker_id=FORGER, device="0", passed=True, speedup=999.0,
                              base_time_us=999.0, gen_time_us=1.0, proof="0" * 32)
        await self.js.publish(subjects.results(job_id, FORGER), encode(result))
        # The real worker's subject: the server refuses a worker publishing there.
        result.worker_id = REAL
        try:
            await self.js.publish(subjects.results(job_id, REAL), encode(result), timeout=1)
        except Exception:  # noqa: BLE001 - a permissions violation: no PubAck comes
            self.refused += 1

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                for lease in await self._leases():
                    if lease.get("worker_id") == REAL and lease["request_id"] not in self.forged:
                        self.forged.add(lease["request_id"])
                        await self._forge(lease["job_id"], lease["request_id"])
            await asyncio.sleep(0.05)


@pytest.fixture
async def forger(settings: Settings, bus_credentials):
    own = bus_credentials.worker_settings(FORGER)
    nc = await nats.connect(settings.nats_url, user=own["nats_worker_user"],
                            password=own["nats_worker_password"],
                            inbox_prefix=f"_INBOX_{own['nats_worker_user']}")
    forger = Forger(nc)
    task = asyncio.create_task(forger.run())
    try:
        yield forger
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await nc.close()


def rejected() -> float:
    return sum(VERDICTS_REJECTED.labels(reason=r)._value.get()
               for r in ("bad_proof", "unclaimed", "not_holder"))


async def test_forged_verdicts_change_no_job_batch_or_remote_verdict(
        shared_services, settings: Settings, bus: Bus, gateway: str, forger: Forger) -> None:
    async with shared_services(settings, bus):
        # RemoteWorker.verify: a wrong kernel stays failed (the forger said passed).
        before = rejected()
        worker = RemoteWorker(settings.nats_url, backend="cpu", arch=settings.arch,
                              settings=as_role(settings, "generator"))
        try:
            verdict = await worker.verify(BUNDLED_RELU_TASK, WRONG_RELU_KERNEL, "relu", trials=1)
        finally:
            await worker.close()
        assert (verdict.passed, verdict.stage, verdict.worker_id) == (False, "mismatch", REAL)
        assert verdict.request_id in forger.forged, "the forger saw the request"
        assert rejected() >= before + 1

        async with AsyncAIKGClient(gateway) as client:
            # A batch entry: the wrong kernel's verdict is the real one.
            verdicts = await client.verify_batch("relu", BUNDLED_RELU_TASK, [WRONG_RELU_KERNEL],
                                                 backend="cpu", arch=settings.arch, trials=1,
                                                 timeout=scaled(240))
            (entry,) = verdicts
            assert (entry["passed"], entry["stage"], entry["worker_id"]) == \
                (False, "mismatch", REAL)

            # A job: its verdict is the worker's (cpu: no speedup), never the 999.
            job_id = await client.submit_job(op_name="relu", task_desc=BUNDLED_RELU_TASK,
                                             backend="cpu", arch=settings.arch)
            status = await client.wait_for_completion(job_id, timeout=scaled(240),
                                                      poll_interval=0.2, progress=False,
                                                      cancel_on_interrupt=False)
        assert status["status"] == "completed", status
        result = status.get("result") or {}
        assert (result.get("verdict") or {}).get("worker_id") == REAL, result
        assert (result.get("verdict") or {}).get("speedup") != 999.0
        assert len(forger.forged) >= 3, "it forged for the remote, batch and job requests"
        for _ in range(40):  # the last refusal is a PubAck that never comes (1 s)
            if forger.refused == len(forger.forged):
                break
            await asyncio.sleep(0.1)
        assert forger.refused == len(forger.forged), "each try on the real worker's subject"
