"""The generator's side of an evolve job: verify requests, checkpoints, progress.

:class:`services.generator.evolve.EvolveSearch` does the search; this module gives
it what touches NATS: each candidate's verify request (deterministic ids, so a
resumed job's republished requests are dropped by the stream's dedupe window and
their verdicts are read back from RESULTS), a checkpoint in the ``artifacts`` Object
Store after each verified candidate, and the job record's evolve summary.
"""

from __future__ import annotations

import contextlib

import msgspec
import nats.js.errors
import structlog

from schemas import (
    TERMINAL_STATUSES,
    JobEvent,
    JobRecord,
    JobResult,
    VerifyResult,
    subjects,
)
from services.common.bus import object_bytes
from services.common.jobs import live_workers, publish_event
from services.common.records import request_id_of
from services.generator.coders.base import Candidate
from services.generator.evolve import EvolveSearch, EvolveState
from services.generator.mutators import BuiltinMutator, LLMMutator
from services.generator.workflows import WorkflowError

log = structlog.get_logger("aikg.evolve")


def checkpoint_name(job_id: str) -> str:
    return f"evolve/{job_id}.json"


async def artifacts(js):
    """The ``artifacts`` Object Store bucket (created when missing)."""
    try:
        return await js.object_store(subjects.OBJECT_STORE_ARTIFACTS)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_object_store(subjects.OBJECT_STORE_ARTIFACTS)


class EvolveJob:
    """Runs one evolve job for a :class:`services.generator.job_run.JobRun`.

    Args:
        run: the job's run (bus, store, record, verdict waiter, report, chat).
        use_llm: mutate with the LLM coder (else the built-in launch-parameter search).
    """

    def __init__(self, run, *, use_llm: bool, ids) -> None:
        self.run = run
        self.bus = run.bus
        self.job_id = run.job_id
        self.submit = run.submit
        self.record: JobRecord = run.record
        self.use_llm = use_llm
        self.ids = ids
        self.last_round = -1

    async def concurrency(self) -> int:
        """Devices of the job's backend/arch among live workers (at least 1)."""
        workers = await live_workers(self.bus)
        devices = sum(w.capacity for w in workers
                      if w.backend == self.submit.backend and w.arch == self.record.arch)
        return max(1, min(devices, self.submit.max_rounds * self.submit.parallel_num))

    async def load(self) -> EvolveState | None:
        await artifacts(self.bus.js)
        try:
            # Message gets, not ObjectStore.get (a consumer, which the generator may
            # not create: services/common/nats_auth.py).
            found = await object_bytes(self.bus.js, subjects.OBJECT_STORE_ARTIFACTS,
                                       checkpoint_name(self.job_id))
        except nats.js.errors.ObjectNotFoundError:
            return None
        try:
            return msgspec.json.decode(found, type=EvolveState)
        except msgspec.ValidationError as exc:
            log.warning("evolve_checkpoint_unreadable", error=str(exc))
            return None

    async def checkpoint(self, state: EvolveState) -> None:
        """Object Store checkpoint (with code), then the record's summary (without)."""
        store = await artifacts(self.bus.js)
        await store.put(checkpoint_name(self.job_id), msgspec.json.encode(state))
        summary = state.summary
        done = [c for c in summary.candidates if c.passed is not None]

        def change(r: JobRecord) -> JobRecord | None:
            if r.status in TERMINAL_STATUSES:
                return None
            r.evolve = summary
            r.progress.round = summary.round + 1
            r.progress.max_rounds = summary.rounds
            r.progress.candidates_generated = len(summary.candidates)
            r.progress.candidates_verified = len(done)
            r.progress.candidates_passed = sum(bool(c.passed) for c in done)
            return r

        await self.run.jobs.update(self.job_id, change)
        if summary.round > self.last_round:
            self.last_round = summary.round
            best = max((c.speedup or 0.0 for c in done if c.passed), default=0.0)
            await publish_event(self.bus, JobEvent(
                job_id=self.job_id, event="progress", status="running",
                message=f"round {summary.round + 1}/{summary.rounds}",
                data={"round": summary.round + 1, "rounds": summary.rounds,
                      "passed": sum(bool(c.passed) for c in done), "verified": len(done),
                      "best_speedup": best or None,
                      "islands": [len(i) for i in summary.islands]}))

    async def verify(self, candidate: Candidate, candidate_id: str) -> VerifyResult:
        """Send ``candidate``'s verify request and return its verdict (see
        :meth:`JobRun.send_request`); its request id is the one
        :func:`services.common.records.attempt_ids` pairs with ``candidate_id``.

        Raises:
            WorkflowError: no verdict within ``verify_result_timeout_s``.
        """
        request_id = request_id_of(candidate_id)
        await self.run.send_request(candidate_id, request_id, candidate.code)
        result = await self.run.await_verdict(candidate_id, request_id)
        await publish_event(self.bus, JobEvent(
            job_id=self.job_id, event="verify_result", status="running",
            candidate_id=candidate_id, request_id=request_id, verdict=result))
        return result

    async def run_search(self, builtin, chat) -> JobResult:
        """Resume from the checkpoint when there is one, search, return the result.

        Raises:
            WorkflowError: no candidate passed (the result lists what was tried).
        """
        state = await self.load()
        if state is not None:
            log.info("evolve_resumed", candidates=len(state.summary.candidates))
        mutator = LLMMutator(chat, builtin) if self.use_llm else BuiltinMutator(builtin)
        fitness = "modeled_time" if self.submit.backend == "cpu" else "speedup"
        concurrency = await self.concurrency()
        await self.run.report(
            "progress", phase="evolving", max_rounds=self.submit.max_rounds,
            message=f"evolving: {self.submit.max_rounds} rounds x {self.submit.parallel_num} "
            f"candidates on {self.submit.num_islands} island(s), {concurrency} at once"
            + ("; cpu backend: ranked by correctness, then the modeled time of the "
               "counted traffic on the target GPU (interpreter timings are not meaningful)"
               if fitness == "modeled_time" else ""))
        search = EvolveSearch(self.submit, mutator, self.verify, self.run.report, self.checkpoint,
                              concurrency=concurrency, fitness=fitness, state=state, ids=self.ids)
        result = await search.run()
        with contextlib.suppress(Exception):
            await self.checkpoint(search.state)
        if not result.passed:
            raise WorkflowError(
                f"no candidate passed verification in {len(search.summary.candidates)} tried "
                f"({self.submit.max_rounds} rounds)", result=result)
        return result
