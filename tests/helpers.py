"""Task constants and helpers shared by the tests: the relu task and hand-written
candidates for it, running the worker and generator in the test's loop, and reading a
stream's history. Define a task or a helper here once rather than in each test file.

Every deadline a test waits under that depends on the machine's speed goes through
:func:`scaled`: ``AIKG_TEST_TIME_SCALE`` (default 1, read once here) multiplies them
all, pytest-timeout's per-test limits included (tests/conftest.py), so a loaded CI
machine is given more time in one place. Bounds that are the acceptance itself (a
redelivery within 15 s of a kill) are not scaled."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from schemas import JobEvent, decode, subjects
from services.common.bus import Bus
from services.common.jobs import live_workers
from services.common.settings import Settings
from services.sdk.client import AsyncAIKGClient
from tests.support_candidates import TRITON_IMPORTS, relu_jit, relu_model


def _time_scale(raw: str | None) -> float:
    """``AIKG_TEST_TIME_SCALE`` as a positive factor (unset or empty: 1)."""
    if raw is None or not raw.strip():
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"AIKG_TEST_TIME_SCALE={raw!r}: expected a number such as 2 "
                         "(every test deadline times that)") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"AIKG_TEST_TIME_SCALE={raw!r}: expected a finite number > 0")
    return value


TIME_SCALE = _time_scale(os.environ.get("AIKG_TEST_TIME_SCALE"))


def scaled(seconds: float) -> float:
    """``seconds`` times ``AIKG_TEST_TIME_SCALE``: a deadline that a slower machine needs
    more of (a start, a result, a process exit)."""
    return seconds * TIME_SCALE


def representatives(names: Iterable[str], fast: Iterable[str],
                    lane: Iterable[str] | None = None) -> list[Any]:
    """Parameters of a family of like tests for ``pytest.mark.parametrize``: the names
    in ``fast`` (the family's representatives, which :func:`checked_sizes` verifies at
    every size) run in every lane; the others are marked ``slow``, so ``make test``
    runs the whole family and ``make test-fast`` its representatives. ``lane``, a part
    of ``fast``, narrows what runs in the fast lane where a representative costs many
    CPU-seconds (the others of ``fast`` still check every size in ``make test``).

    Raises:
        ValueError: a name in ``fast`` is not one of ``names``, or one in ``lane`` not
            in ``fast``.
    """
    names, fast = list(names), set(fast)
    lane = fast if lane is None else set(lane)
    if not fast <= set(names):
        raise ValueError(f"representatives {sorted(fast - set(names))} are not in the family")
    if not lane <= fast:
        raise ValueError(f"fast-lane names {sorted(lane - fast)} are not representatives")
    return [name if name in lane else pytest.param(name, marks=pytest.mark.slow)
            for name in names]


def checked_sizes(name: str, fast: Iterable[str],
                  overrides: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sizes a member of a family of like tests (:func:`representatives`) verifies
    its one candidate at, for :func:`verify_at_sizes`: the task's own (``{}``, where the
    verifier adds an awkward size of odd extents) and every one of ``overrides`` for a
    representative (a name in ``fast``); the task's own and the first override for the
    others, whose kernels the representatives already run at the rest."""
    overrides = list(overrides)
    return [{}, *(overrides if name in set(fast) else overrides[:1])]


ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tasks"
DATA = Path(__file__).resolve().parent / "data"
CORPUS_TASKS = Path(__file__).resolve().parent / "corpus" / "tasks"

# A small KernelBench-format task: torch.relu on a 16 x 1024 float32 tensor.
RELU_TASK = (CORPUS_TASKS / "relu.py").read_text()


def cpu_request(code: str, task: str, *, trials: int = 2, job_id: str = "job-test",
                **fields: Any) -> Any:
    """A cpu-backend :class:`~schemas.events.VerifyRequest` of ``code`` against ``task``
    (a fresh request id; ``fields`` override the rest, ``timeout_s`` 120 s unless told)."""
    import time

    from services.common.verify_client import build_request

    body = {"request_id": f"req-{time.monotonic_ns()}", "job_id": job_id,
            "candidate_id": "cand-test", "op_name": "op", "task_desc": task, "code": code,
            "backend": "cpu", "arch": "x86_64", "timeout_s": 120.0, "trials": trials}
    body.update(fields)
    return build_request(**body)
# The bundled tasks/relu.py (16 x 4096), as `aikg run` and the README use it.
BUNDLED_RELU_TASK = (TASKS / "relu.py").read_text()

# A correct hand-written candidate for tasks/relu.py (any shape: it runs flattened).
RELU_KERNEL = TRITON_IMPORTS + "\n\n" + relu_jit(pid=False) + "\n\n" + relu_model()
# Runs, but clamps at 0.5 instead of 0: a mismatch on every value in (0, 0.5).
WRONG_RELU_KERNEL = RELU_KERNEL.replace("tl.maximum(x, 0.0)", "tl.maximum(x, 0.5)")

# Secrets an operator's shell might hold, in the environment when the session's
# verifier (tests/conftest.py, ``shared_verifier``) starts its sandbox: the hostile
# tests look for them wherever a candidate or a task could reach.
SECRET = "sk-sandbox-test-secret"
DB_URL = "postgres://aikg:hunter2@db.internal/aikg"
SECRET_ENV = {"AIKG_LLM_API_KEY": SECRET, "NATS_TOKEN": SECRET, "DB_PASSWORD": SECRET,
              "DATABASE_URL": DB_URL}


@contextlib.asynccontextmanager
async def services_running(settings: Settings, bus: Bus, *, generator: bool = True,
                           verifier: Any = None, lowering: Any = None) -> AsyncIterator[None]:
    """A cpu worker (and a generator) as tasks of this loop until the block ends;
    waits for the worker's first heartbeat. ``verifier`` and ``lowering``: the
    worker's verifier and the generator's sandbox (default: their own, started here);
    the ``shared_services`` fixture lends the session's."""
    from services.generator.service import run_generator
    from services.worker.service import run_worker

    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_worker(settings, stop, verifier=verifier), name="worker")]
    if generator:
        tasks.append(asyncio.create_task(run_generator(settings, stop, sandbox=lowering),
                                         name="generator"))
    try:
        await wait_for_heartbeat(bus, tasks)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), scaled(60))


async def wait_terminal(client: httpx.AsyncClient, job_id: str, timeout_s: float = 180) -> dict:
    """The job's record as JSON once it has ended (within ``scaled(timeout_s)``): the SDK's wait
    (:meth:`AsyncAIKGClient.wait_for_completion`) against ``client``'s gateway, with its
    token. The job is left alone if the test stops waiting."""
    token = client.headers.get("authorization", "").removeprefix("Bearer ")
    async with AsyncAIKGClient(str(client.base_url), token=token) as sdk:
        return await sdk.wait_for_completion(job_id, timeout=scaled(timeout_s), poll_interval=0.2,
                                             progress=False, cancel_on_interrupt=False)


async def stream_messages(bus: Bus, subject: str) -> list[bytes]:
    """Every message on ``subject`` still in its stream (an ordered consumer from the start)."""
    sub = await bus.js.subscribe(subject, ordered_consumer=True)
    out = []
    try:
        while True:
            out.append((await sub.next_msg(timeout=0.5)).data)
    except Exception:  # noqa: BLE001 - timeout: no more history
        pass
    finally:
        await sub.unsubscribe()
    return out


async def job_events(bus: Bus, job_id: str) -> list[JobEvent]:
    """Every event of the job so far, from the JOB_EVENTS stream."""
    return [decode(m, JobEvent) for m in await stream_messages(bus, subjects.job_events(job_id))]

# Tasks the built-in coder declines, so a job of them needs the LLM coder (or fails).
# An embedding lookup: the built-in coder has no indexing schedule (aten.embedding).
DECLINED_TASK = (CORPUS_TASKS / "embedding.py").read_text()
# A softmax over rows whose forward branches on a tensor's value: torch.export cannot
# trace it, so the built-in coder declines it, while an LLM-written row softmax
# (tests/fake_llm.py) passes.
LLM_ONLY_SOFTMAX_TASK = (CORPUS_TASKS / "softmax_data_dependent.py").read_text()


async def wait_for_heartbeat(bus: Bus, tasks: Sequence[asyncio.Task] = ()) -> None:
    """Until a worker's heartbeat is in the ``workers`` bucket (the gateway's own check:
    a worker it would route a submission to), for ``scaled(60)`` s, then TimeoutError.
    Raises the error of any of ``tasks`` (services run in the test's loop) that ends
    first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(60)
    while True:
        for t in tasks:
            if t.done():
                t.result()
        with contextlib.suppress(Exception):
            if await live_workers(bus):
                return
        if loop.time() > deadline:
            raise TimeoutError(f"worker sent no heartbeat within {scaled(60):g} s")
        await asyncio.sleep(0.05)


async def started_generator_pull(bus: Bus):
    """A started :class:`~services.common.lanes.LanePull` of the generator's lanes of
    JOBS_SUBMIT (30 s ack wait, 3 deliveries), its base consumer made first."""
    from services.common.lanes import LanePull
    from services.common.provision import lane_config

    await bus.js.add_consumer(subjects.STREAM_JOBS, lane_config(
        subjects.JOBS_SUBMIT, subjects.CONSUMER_GENERATOR, ack_wait_s=30, max_deliver=3))
    pull = LanePull(bus.js, bus.nc, stream=subjects.STREAM_JOBS, base=subjects.JOBS_SUBMIT,
                    consumer_of=subjects.generator_consumer,
                    config_of=lambda s, d: lane_config(s, d, ack_wait_s=30, max_deliver=3))
    await pull.start()
    return pull


async def poll_until(check, timeout_s: float, what: str, every_s: float = 0.1):
    """Await ``check()`` every ``every_s`` seconds until it returns something truthy, and
    return that; TimeoutError naming ``what`` after ``scaled(timeout_s)`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout_s)
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise TimeoutError(f"{what}: not within {scaled(timeout_s):g} s")
        await asyncio.sleep(every_s)


def verify_at_sizes(verifier: Any, name: str, task_src: str, candidate: str,
                    overrides: Iterable[dict[str, Any]]) -> Any:
    """Verify one ``candidate`` of ``task_src`` on the cpu ``verifier`` (one trial, 120 s)
    at each of ``overrides`` (``{}``: the task's own sizes) and assert it passes;
    returns the result at the task's own sizes (None if ``{}`` is not among them)."""
    from services.common.verify_client import build_request

    own = None
    for k, sizes in enumerate(overrides):
        request = build_request(request_id=f"{name}-{k}", job_id="sizes-test",
                                candidate_id="c0", op_name=name, task_desc=task_src,
                                code=candidate, backend="cpu", arch="x86_64", trials=1,
                                timeout_s=120, shape_overrides=sizes)
        result = asyncio.run(verifier.verify(request, device="0"))
        assert result.passed, (sizes, result.stage, result.error, result.log[-2000:])
        if not sizes:
            own = result
    return own
