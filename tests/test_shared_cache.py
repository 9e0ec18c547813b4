"""Reference outputs and baselines shared by workers, over a real nats-server.

The cache's own calls run as the ``worker`` NATS user (the only one allowed to touch
the ``references`` object store and ``baselines`` bucket); the acceptance test runs
two real workers, one after the other, with the session's verifier lent to each and
its in-process cache cleared in between (what a fresh worker process starts with),
and reads the results off ``results.<job_id>``.
"""

from __future__ import annotations

import datetime as dt
import uuid

import msgspec
import nats.errors
import pytest
from prometheus_client import REGISTRY

from schemas import subjects, utcnow
from services.common.bus import Bus, connect_bus
from services.common.settings import Settings
from services.worker.cache import (
    CACHE_FORMAT,
    Baseline,
    ReferenceHeader,
    SharedCache,
    TensorEntry,
    Versions,
    baseline_key,
    reference_key,
)
from services.worker.verifier import Verifier
from tests.conftest import as_role
from tests.helpers import BUNDLED_RELU_TASK, RELU_KERNEL
from tests.test_worker_service import Results, publish_request, request_body, running_worker

SHAPES = {"batch_size": 16, "dim": 1024}
VERSIONS = Versions(torch="2.13.0", cuda="12.8", driver="570.1", default_dtype="float32")


def lookups(kind: str, result: str, arch: str) -> float:
    """``aikg_worker_cache_lookups_total`` for one kind and result on cpu/``arch``."""
    return REGISTRY.get_sample_value("aikg_worker_cache_lookups_total", {
        "backend": "cpu", "arch": arch, "kind": kind, "result": result}) or 0.0


def errors(kind: str, op: str) -> float:
    return REGISTRY.get_sample_value("aikg_worker_cache_errors_total",
                                     {"kind": kind, "op": op}) or 0.0


@pytest.fixture
async def worker_bus(settings: Settings):
    bus = await connect_bus(settings, "test-worker", role="worker")
    try:
        yield bus
    finally:
        await bus.close()


@pytest.fixture
async def cache(worker_bus: Bus, settings: Settings) -> SharedCache:
    opened = await SharedCache.open(worker_bus.js, settings, worker_id="w-test")
    assert opened is not None
    return opened


def test_keys_change_with_every_part_they_name() -> None:
    base = dict(task_sha256="a" * 64, shapes='{"dim": 1024}', backend="cuda", arch="h200",
                versions=VERSIONS)
    ref = reference_key(seed=1000, **base)
    assert len(ref) == 64 and ref == reference_key(seed=1000, **base)
    assert ref != reference_key(seed=1001, **base)
    assert ref != reference_key(seed=1000, **{**base, "shapes": '{"dim": 512}'})
    assert ref != reference_key(seed=1000, **{
        **base, "versions": Versions("2.13.0", "12.8", "570.1", "float16")})
    assert ref != reference_key(seed=1000, **{
        **base, "versions": Versions("2.14.0", "12.8", "570.1", "float32")})
    eager = baseline_key(**base)
    assert eager != baseline_key(**{**base, "arch": "a100"})
    assert eager != baseline_key(**{**base, "versions": Versions("2.13.0", "12.8", "575.2",
                                                                   "float32")})
    # The driver times the baseline, but does not change the reference's numbers.
    assert ref == reference_key(seed=1000, **{**base, "versions": Versions(
        "2.13.0", "12.8", "575.2", "float32")})


async def test_entries_round_trip_and_bad_entries_are_misses(
        cache: SharedCache, bus: Bus) -> None:
    key = reference_key(task_sha256="b" * 64, shapes="{}", seed=1000, backend="cpu",
                        arch="x86_64", versions=VERSIONS)
    assert await cache.get_reference(key) is None
    data = bytes(range(256)) * 4
    header = ReferenceHeader(format=CACHE_FORMAT, key=key, seed=1000,
                             outputs=[TensorEntry("float32", [16, 16], 1024)],
                             inputs_before=["d0"], inputs_after=["d0"], aliasing=[],
                             input_bytes=1024, size_names={"dim": 16})
    assert await cache.put_reference(header, [data])
    got, parts = await cache.get_reference(key)
    assert got.seed == 1000 and got.worker_id == "w-test" and got.size_names == {"dim": 16}
    assert [bytes(p) for p in parts] == [data]

    # Entries that do not decode, or sit under another key, are counted misses.
    before = errors("reference", "decode")
    store = await bus.js.object_store(subjects.OBJECT_STORE_REFERENCES)
    await store.put("garbage", b"\x00\x00\x00\x00\x00\x00\x00\x05{bad}")
    assert await cache.get_reference("garbage") is None
    await store.put("moved", (await store.get(key)).data)
    assert await cache.get_reference("moved") is None
    assert errors("reference", "decode") == before + 2
    # Larger than the entry bound: not stored.
    small = SharedCache(cache.references, cache.baselines, worker_id="w", entry_bytes=512)
    assert not await small.put_reference(header, [data])

    bkey = baseline_key(task_sha256="b" * 64, shapes="{}", backend="cuda", arch="h200",
                        versions=VERSIONS)
    measured = utcnow() - dt.timedelta(seconds=90)
    assert await cache.put_baseline(Baseline(
        format=CACHE_FORMAT, key=bkey, median_us=12.5, measured_at=measured,
        task_sha256="b" * 64, shapes="{}", backend="cuda", arch="h200",
        versions={"torch": "2.13.0"}))
    baseline = await cache.get_baseline(bkey)
    assert baseline.median_us == 12.5 and 89 < baseline.age_s() < 120
    before = errors("baseline", "decode")
    baselines = await bus.js.key_value(subjects.BUCKET_BASELINES)
    await baselines.put("f" * 64, b'{"median_us": -1}')
    assert await cache.get_baseline("f" * 64) is None
    assert errors("baseline", "decode") == before + 1


async def test_only_workers_may_touch_the_shared_cache(
        cache: SharedCache, settings: Settings) -> None:
    for role in ("gateway", "generator"):
        other = await connect_bus(as_role(settings, role), f"test-{role}")
        try:
            js = other.nc.jetstream(timeout=1.0)
            with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
                kv = await js.key_value(subjects.BUCKET_BASELINES)
                await kv.put("forged", b"{}")
            with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
                store = await js.object_store(subjects.OBJECT_STORE_REFERENCES)
                await store.put("forged", b"forged")
        finally:
            await other.close()
    assert await cache.get_baseline("forged") is None
    assert await cache.get_reference("forged") is None


async def test_a_shared_baseline_is_used_and_its_age_reported(
        shared_verifier: Verifier, cache: SharedCache) -> None:
    """The profile path's lookup, on cpu: the references are in the verifier's own
    cache and the baseline in the shared bucket, so nothing runs (cpu cannot time)."""
    from services.worker.verifier import SEED_BASE, _BaseTime
    from tests.test_verifier import request

    task = BUNDLED_RELU_TASK + f"# baseline {uuid.uuid4().hex}\n"
    req = msgspec.structs.replace(request(task=task), trials=1, arch="x86_64")
    task_sha, overrides = _task_key(task, req.shape_overrides)
    shared_verifier.shared_cache = cache
    try:
        refs = await shared_verifier._references_for(req, "0", [SEED_BASE], task_sha,
                                                     overrides, False)
        measured = utcnow() - dt.timedelta(minutes=5)
        assert await cache.put_baseline(Baseline(
            format=CACHE_FORMAT, key=shared_verifier._baseline_key(req, task_sha, overrides),
            median_us=42.0, measured_at=measured, task_sha256=task_sha, shapes=overrides,
            backend="cpu", arch="x86_64", versions={}))
        runs = shared_verifier.reference_runs
        hits = lookups("baseline", "shared", "x86_64")
        provenance: dict = {}
        again = await shared_verifier._references_for(req, "0", [SEED_BASE], task_sha,
                                                      overrides, True, provenance=provenance)
        assert [r.outputs[0].equal(a.outputs[0]) for r, a in zip(refs, again, strict=True)] == [True]
        assert shared_verifier.reference_runs == runs
        assert provenance["reference_source"] == "worker_cache"
        assert provenance["baseline_source"] == "shared_cache"
        assert 299 < provenance["baseline_age_s"] < 400
        assert lookups("baseline", "shared", "x86_64") == hits + 1
        base = shared_verifier._base_times[(task_sha, "x86_64", overrides)]
        assert isinstance(base, _BaseTime) and base.median_us == 42.0
        # Now this process holds it.
        provenance = {}
        await shared_verifier._references_for(req, "0", [SEED_BASE], task_sha, overrides,
                                              True, provenance=provenance)
        assert provenance["baseline_source"] == "worker_cache"
    finally:
        shared_verifier.shared_cache = None


def _task_key(task: str, overrides: dict) -> tuple[str, str]:
    import hashlib
    import json

    return hashlib.sha256(task.encode()).hexdigest(), json.dumps(overrides, sort_keys=True)


async def test_a_second_job_reuses_the_reference_and_a_changed_shape_does_not(
        settings: Settings, bus: Bus, shared_verifier: Verifier) -> None:
    collector = Results()
    await collector.start(bus)
    # A task no other test sends, so neither tier has it yet.
    task = BUNDLED_RELU_TASK + f"# shared cache {uuid.uuid4().hex}\n"
    arch = settings.arch

    async def verify(job_id: str, shapes: dict) -> object:
        body = request_body(settings, job_id, code=RELU_KERNEL, task_desc=task,
                            shape_overrides=shapes, trials=2)
        await publish_request(bus, settings, body)
        (result,) = await collector.wait(job_id)
        assert result.passed, (result.stage, result.error, result.log)
        return result

    runs = shared_verifier.reference_runs
    async with running_worker(settings, bus, verifier=shared_verifier):
        first = await verify("job-first", SHAPES)
    assert first.reference_source == "run" and first.baseline_source is None
    # Requested shapes and the task's own (the second size): two reference children.
    assert shared_verifier.reference_runs == runs + 2
    store = await bus.js.object_store(subjects.OBJECT_STORE_REFERENCES)
    assert len(await store.list()) == 3  # two seeds as asked, one at the second size

    # Another worker process: nothing in its own cache, the shared tier has it all.
    shared_verifier.clear_caches()
    shared_hits = lookups("reference", "shared", arch)
    misses = lookups("reference", "miss", arch)
    async with running_worker(settings, bus, verifier=shared_verifier) as (ws, _):
        second = await verify("job-second", SHAPES)
        assert second.worker_id == ws.worker_id != first.worker_id
        assert second.reference_source == "shared_cache"
        assert shared_verifier.reference_runs == runs + 2
        assert lookups("reference", "shared", arch) == shared_hits + 2
        assert lookups("reference", "miss", arch) == misses

        # Other shapes: a new reference run for them (the task's own sizes are cached).
        third = await verify("job-third", {"batch_size": 16, "dim": 512})
        assert third.reference_source == "run"
        assert shared_verifier.reference_runs == runs + 3
        assert lookups("reference", "miss", arch) == misses + 1
