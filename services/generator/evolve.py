"""Evolve jobs: an island-model evolutionary search over kernel candidates.

The search follows the island model used by AlphaEvolve/OpenEvolve-style kernel
searches: each island keeps its own population; every ``migration_interval`` rounds
the best candidates of each island are copied to the next island (a ring), where
they can be chosen as parents; an elite archive spans the islands. Candidates are
verified as soon as they are generated (no barrier between rounds), up to
``concurrency`` at once — the number of devices of the job's backend/arch.

Like every workflow this module knows nothing of NATS: the service passes a
``mutator`` (writes candidates), ``verify`` (returns a verdict), ``report`` (progress)
and ``checkpoint`` (persists :class:`EvolveState` after each verified candidate, so a
restarted generator resumes with every verified candidate kept).

Fitness: correctness first, then speedup. On the ``cpu`` backend timings are not
meaningful (Triton's interpreter), so candidates rank by correctness, then by the
modeled time of their counted traffic (``modeled_time``: the verdict's
``traffic.tile_time_us``, the tile model of the request's GPU, which tells a 32x32x32
tile from a 128x128x64 one by L2 reuse, occupancy and spills; the roofline's
``traffic.modeled_time_us`` where a verdict has no tile time; lower is better; see
docs/verification.md, "Counted traffic"); among equally fit parents the least-used one is bred
first, then a migrant, which spreads the search over islands and lineages instead of
always re-breeding the oldest candidate.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from schemas import (
    EvolveCandidate,
    EvolveSummary,
    JobResult,
    JobSubmit,
    Migration,
    ParentChoice,
    VerifyResult,
)
from schemas.events import Traffic
from services.common.records import normalised_hash
from services.generator.coders.base import Candidate
from services.generator.mutators import BuiltinMutator, CoderError

# How many candidates the final result lists.
BEST_N = 5

VerifyWithIdFn = Callable[[Candidate, str], Awaitable[VerifyResult]]
ReportFn = Callable[..., Awaitable[None]]


class EvolveState(msgspec.Struct, kw_only=True):
    """Everything needed to resume an evolve job: the summary plus candidate code.

    Stored as a checkpoint after each verified candidate; the job record holds the
    summary without code.
    """

    summary: EvolveSummary
    codes: dict[str, str] = msgspec.field(default_factory=dict)
    # Children bred per ``"<island>:<candidate_id>"``.
    children: dict[str, int] = msgspec.field(default_factory=dict)


class Mutator(Protocol):
    """Writes evolve candidates: seeds for round 0, children of a parent after."""

    name: str

    async def seed(self, submit: JobSubmit, index: int, rng: random.Random) -> Candidate: ...

    async def mutate(self, submit: JobSubmit, parent: EvolveCandidate, parent_code: str,
                     inspirations: list[tuple[EvolveCandidate, str]],
                     rng: random.Random) -> Candidate: ...


def fitness_key(c: EvolveCandidate, mode: str) -> tuple:
    """Sort key, larger is better: passed, then speedup (``speedup`` mode) or the
    negated modeled time (``modeled_time`` mode: a candidate without one ranks below
    every candidate with one; at equal times the lower ``traffic_ratio``);
    ``correctness`` mode ranks by passing alone."""
    if mode == "speedup":
        return (bool(c.passed), c.speedup or 0.0)
    if mode == "modeled_time":
        modeled = c.modeled_time_us
        # Equal modeled times (launch-bound kernels, a re-read the tile model serves
        # from L2): fewer bytes moved wins.
        ratio = c.traffic_ratio if c.traffic_ratio is not None else float("inf")
        return (bool(c.passed), modeled is not None, -(modeled or 0.0), -ratio)
    return (bool(c.passed), 0.0)


def modeled_fitness(t: Traffic) -> tuple[float | None, float | None]:
    """A verdict's modeled time (microseconds) and speedup over eager for ranking: the
    tile model's (``tile_time_us``, ``tile_speedup``) where it ran, else the
    roofline's (``modeled_time_us``, ``modeled_speedup``): the tile model is the one
    that ranks launch configurations as a GPU does (services/worker/traffic.py)."""
    if t.tile_time_us is not None:
        return t.tile_time_us, t.tile_speedup
    return t.modeled_time_us, t.modeled_speedup


class EvolveSearch:
    """The island-model search of one evolve job.

    Args:
        submit: the job (max_rounds, parallel_num, num_islands, migration_interval,
            elite_size, parent_selection_prob are honoured).
        mutator: writes candidates.
        verify: sends a candidate (with its id) to a worker, returns the verdict.
        report: progress callback (``await report(event, **fields)``).
        checkpoint: persists the state after each verified candidate.
        concurrency: candidates in flight at once (devices of the backend/arch).
        fitness: ``speedup`` or ``correctness`` (the cpu backend).
        state: a checkpoint to resume from.
    """

    def __init__(self, submit: JobSubmit, mutator: Mutator, verify: VerifyWithIdFn,
                 report: ReportFn, checkpoint: Callable[[EvolveState], Awaitable[None]], *,
                 concurrency: int, fitness: str, state: EvolveState | None = None,
                 seed: int | None = None, ids: Callable[[int], str] | None = None) -> None:
        self.submit = submit
        self.mutator = mutator
        self.verify = verify
        self.report = report
        self.checkpoint = checkpoint
        self.concurrency = max(1, concurrency)
        self.job_id = submit.job_id or "job"
        self.ids = ids or (lambda index: f"{self.job_id}-c{index}")
        self.seed = seed if seed is not None else int(hashlib.sha256(self.job_id.encode()).hexdigest()[:8], 16)
        self.state = state or EvolveState(summary=EvolveSummary(
            rounds=submit.max_rounds, fitness=fitness,  # type: ignore[arg-type]
            islands=[[] for _ in range(submit.num_islands)]))
        self.by_id = {c.candidate_id: c for c in self.state.summary.candidates}
        self.by_hash: dict[str, str] = {}
        for c in self.state.summary.candidates:
            if c.passed is not None and c.duplicate_of is None:
                self.by_hash.setdefault(c.code_hash, c.candidate_id)
            if isinstance(self.mutator, BuiltinMutator):
                self.mutator.remember(c.params)
        self.changed = asyncio.Condition()
        self.lock = asyncio.Lock()
        # A verdict at stage ``task`` (the task cannot be verified on this worker, e.g.
        # too big for it): no later candidate starts.
        self.task_failed = False

    # --- bookkeeping ------------------------------------------------------------------

    @property
    def summary(self) -> EvolveSummary:
        return self.state.summary

    @property
    def total(self) -> int:
        return self.submit.max_rounds * self.submit.parallel_num

    def candidate_id(self, index: int) -> str:
        """Deterministic id of the index-th candidate, so a resumed job's verify
        requests are deduplicated by the stream (Nats-Msg-Id)."""
        return self.ids(index)

    def place(self, index: int) -> tuple[int, int]:
        """(round, island) of the index-th candidate: rounds of ``parallel_num``,
        islands in turn."""
        return index // self.submit.parallel_num, index % self.submit.num_islands

    def rng(self, index: int, purpose: str) -> random.Random:
        return random.Random(f"{self.seed}-{index}-{purpose}")

    def verified(self, ids: list[str]) -> list[EvolveCandidate]:
        return [self.by_id[i] for i in ids if i in self.by_id and self.by_id[i].passed is not None]

    def ranked(self, cands: list[EvolveCandidate]) -> list[EvolveCandidate]:
        mode = self.summary.fitness
        order = {c.candidate_id: n for n, c in enumerate(self.summary.candidates)}
        return sorted(cands, key=lambda c: (fitness_key(c, mode), -order[c.candidate_id]),
                      reverse=True)

    def update_elites(self) -> None:
        unique = [c for c in self.summary.candidates if c.passed and c.duplicate_of is None]
        self.summary.elites = [c.candidate_id for c in self.ranked(unique)][: max(1, self.submit.elite_size)]

    # --- choices ----------------------------------------------------------------------

    def choose_parent(self, island: int, index: int) -> EvolveCandidate | None:
        """A parent for a child on ``island``: with probability ``parent_selection_prob``
        the fittest of the island's population (own candidates and migrants), else a
        random member; ties go to the member this island has bred from least, then to
        a migrant (another island's lineage). Falls back to all verified candidates while the
        island has none yet."""
        pool = self.verified(self.summary.islands[island])
        passed = [c for c in pool if c.passed]
        if not passed:
            everywhere = [c for c in self.summary.candidates if c.passed]
            pool = passed or everywhere or pool or self.verified(
                [c.candidate_id for c in self.summary.candidates])
        else:
            pool = passed
        if not pool:
            return None
        rng = self.rng(index, "parent")
        mode = self.summary.fitness
        if rng.random() < self.submit.parent_selection_prob:
            best = max(fitness_key(c, mode) for c in pool)
            tied = [c for c in pool if fitness_key(c, mode) == best]
        else:
            tied = pool
        used = {c.candidate_id: self.state.children.get(self.child_key(island, c), 0) for c in tied}
        fewest = min(used.values())
        tied = [c for c in tied if used[c.candidate_id] == fewest]
        # Still tied: prefer a migrant, whose lineage this island has not bred yet.
        migrants = [c for c in tied if c.island != island]
        tied = migrants or tied
        return tied[rng.randrange(len(tied))]

    @staticmethod
    def child_key(island: int, parent: EvolveCandidate) -> str:
        """Children are counted per island: a migrant arrives with none bred here."""
        return f"{island}:{parent.candidate_id}"

    def inspirations(self, parent: EvolveCandidate, index: int) -> list[tuple[EvolveCandidate, str]]:
        """One good, one medium and one poor passed candidate (not the parent), with code."""
        ranked = [c for c in self.ranked([c for c in self.summary.candidates if c.passed])
                  if c.candidate_id != parent.candidate_id and c.candidate_id in self.state.codes]
        if not ranked:
            return []
        n = len(ranked)
        tiers = [ranked[: max(1, n // 3)], ranked[n // 3: max(n // 3 + 1, 2 * n // 3)],
                 ranked[2 * n // 3:]]
        rng = self.rng(index, "inspiration")
        picked: list[tuple[EvolveCandidate, str]] = []
        for tier in tiers:
            tier = [c for c in tier if all(c.candidate_id != p.candidate_id for p, _ in picked)]
            if tier:
                c = tier[rng.randrange(len(tier))]
                picked.append((c, self.state.codes[c.candidate_id]))
        return picked

    def maybe_migrate(self) -> None:
        """After each fully verified round r with (r + 1) % migration_interval == 0,
        copy each island's best passed candidates to the next island (ring)."""
        s = self.summary
        islands = self.submit.num_islands
        if islands < 2:
            return
        done_rounds = {m.round for m in s.migrations}
        per_round = self.submit.parallel_num
        for r in range(self.submit.max_rounds - 1):
            if r in done_rounds or (r + 1) % self.submit.migration_interval:
                continue
            members = [c for c in s.candidates if c.round == r]
            if len(members) < per_round or any(c.passed is None for c in members):
                continue
            count = max(1, self.submit.elite_size // islands)
            moves = []
            for src in range(islands):
                dst = (src + 1) % islands
                own = [c for c in self.verified(s.islands[src]) if c.passed and c.island == src]
                best = [c.candidate_id for c in self.ranked(own)[:count]
                        if c.candidate_id not in s.islands[dst]]
                if best:
                    moves.append((src, dst, best))
            for src, dst, best in moves:
                s.islands[dst].extend(best)
                s.migrations.append(Migration(round=r, source_island=src, target_island=dst,
                                              candidate_ids=best))

    # --- the loop ---------------------------------------------------------------------

    async def run_one(self, index: int) -> None:
        rnd, island = self.place(index)
        cid = self.candidate_id(index)
        existing = self.by_id.get(cid)
        if existing is not None and existing.passed is not None:
            return  # verified before a restart: kept as is
        if existing is not None and cid in self.state.codes:
            candidate = Candidate(code=self.state.codes[cid], coder=existing.coder,
                                  meta=dict(existing.params))
            parent_id = existing.parent_id
            entry = existing
        else:
            parent = None
            if rnd > 0:
                async with self.changed:
                    while (parent := self.choose_parent(island, index)) is None:
                        await self.changed.wait()
            try:
                if parent is None:
                    candidate = await self.mutator.seed(self.submit, index, self.rng(index, "seed"))
                else:
                    key = self.child_key(island, parent)
                    self.state.children[key] = self.state.children.get(key, 0) + 1
                    candidate = await self.mutator.mutate(
                        self.submit, parent, self.state.codes.get(parent.candidate_id, ""),
                        self.inspirations(parent, index), self.rng(index, "mutate"))
            except CoderError as exc:
                entry = EvolveCandidate(candidate_id=cid, island=island, round=rnd,
                                        coder=self.mutator.name, code_hash="",
                                        parent_id=parent.candidate_id if parent else None,
                                        passed=False, stage="static", error=f"coder: {exc}")
                await self._record(entry, None)
                return
            parent_id = parent.candidate_id if parent else None
            entry = EvolveCandidate(
                candidate_id=cid, island=island, round=rnd, coder=candidate.coder,
                code_hash=normalised_hash(candidate.code), parent_id=parent_id,
                params={k: int(v) for k, v in candidate.meta.items() if isinstance(v, int)})
            async with self.lock:
                self.summary.candidates.append(entry)
                self.by_id[cid] = entry
                self.summary.islands[island].append(cid)
                self.state.codes[cid] = candidate.code
                if parent is not None:
                    self.summary.parent_choices.append(ParentChoice(
                        child_id=cid, island=island, round=rnd, parent_id=parent.candidate_id,
                        migrant=parent.island != island,
                        elite=parent.candidate_id in self.summary.elites))
        await self.report("candidate_generated", phase="evolving", round=rnd + 1,
                          message=f"round {rnd + 1}/{self.submit.max_rounds}: island {island} "
                          f"candidate {cid}" + (f" from parent {parent_id}" if parent_id else ""))
        duplicate = self.by_hash.get(entry.code_hash)
        if duplicate and duplicate != cid and self.by_id[duplicate].passed is not None:
            src = self.by_id[duplicate]
            entry.duplicate_of = duplicate
            for f in ("passed", "stage", "error", "speedup", "gen_time_us", "base_time_us",
                      "modeled_time_us", "modeled_speedup", "traffic_ratio"):
                setattr(entry, f, getattr(src, f))
            await self._record(entry, None)
            return
        result = await self.verify(candidate, cid)
        self.task_failed = self.task_failed or result.stage == "task"
        entry.passed = result.passed
        entry.stage = result.stage
        entry.error = (result.error or "")[:500] or None
        entry.speedup = result.speedup
        entry.gen_time_us = result.gen_time_us
        entry.base_time_us = result.base_time_us
        if result.traffic is not None:
            entry.modeled_time_us, entry.modeled_speedup = modeled_fitness(result.traffic)
            entry.traffic_ratio = result.traffic.traffic_ratio
        self.by_hash.setdefault(entry.code_hash, cid)
        await self._record(entry, result)

    async def _record(self, entry: EvolveCandidate, result: VerifyResult | None) -> None:
        async with self.lock:
            if entry.candidate_id not in self.by_id:
                self.summary.candidates.append(entry)
                self.by_id[entry.candidate_id] = entry
                self.summary.islands[entry.island].append(entry.candidate_id)
            self.update_elites()
            self.maybe_migrate()
            self.summary.round = max(self.summary.round, entry.round)
            await self.checkpoint(self.state)
        async with self.changed:
            self.changed.notify_all()

    async def run(self) -> JobResult:
        """Run (or resume) the search to its budget of ``max_rounds x parallel_num``
        candidates and return the job result with the best candidates."""
        gate = asyncio.Semaphore(self.concurrency)

        async def slot(index: int) -> None:
            async with gate:
                if self.task_failed:
                    return  # the task cannot be verified here: no candidate helps
                await self.run_one(index)

        # Candidates start in index order; each waits for a device slot, so round r+1
        # starts as soon as round r frees a device (no round barrier).
        await asyncio.gather(*(slot(i) for i in range(self.total)))
        return self.result()

    def result(self) -> JobResult:
        s = self.summary
        ranked = self.ranked([c for c in s.candidates if c.passed and c.duplicate_of is None])
        best = [msgspec.structs.replace(c, code=self.state.codes.get(c.candidate_id))
                for c in ranked[:BEST_N]]
        top = best[0] if best else None
        return JobResult(
            passed=top is not None,
            code=top.code if top else None,
            candidate_id=top.candidate_id if top else None,
            coder=top.coder if top else self.mutator.name,
            attempts=len(s.candidates),
            speedup=top.speedup if top else None,
            best=best,
        )
