"""Eager baselines shared by workers, over a real nats-server.

The cache's own calls run as the ``worker`` NATS user (the only one allowed to touch
the ``baselines`` bucket).
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
from services.worker.cache import CACHE_FORMAT, Baseline, SharedCache, Versions, baseline_key
from services.worker.verifier import Verifier
from tests.conftest import as_role
from tests.helpers import BUNDLED_RELU_TASK, scaled

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
    eager = baseline_key(**base)
    assert len(eager) == 64 and eager == baseline_key(**base)
    assert eager != baseline_key(**{**base, "shapes": '{"dim": 512}'})
    assert eager != baseline_key(**{**base, "arch": "a100"})
    assert eager != baseline_key(**{**base, "versions": Versions("2.13.0", "12.8", "575.2",
                                                                   "float32")})
    assert eager != baseline_key(**{**base, "versions": Versions("2.14.0", "12.8", "570.1",
                                                                   "float32")})


async def test_entries_round_trip_and_bad_entries_are_misses(
        cache: SharedCache, bus: Bus) -> None:
    bkey = baseline_key(task_sha256="b" * 64, shapes="{}", backend="cuda", arch="h200",
                        versions=VERSIONS)
    assert await cache.get_baseline(bkey) is None
    measured = utcnow() - dt.timedelta(seconds=90)
    assert await cache.put_baseline(Baseline(
        format=CACHE_FORMAT, key=bkey, median_us=12.5, measured_at=measured,
        task_sha256="b" * 64, shapes="{}", backend="cuda", arch="h200",
        versions={"torch": "2.13.0"}))
    baseline = await cache.get_baseline(bkey)
    assert baseline.median_us == 12.5 and 89 < baseline.age_s() < 120
    assert baseline.worker_id == "w-test"
    # Entries that do not decode, or sit under another key, are counted misses.
    before = errors("baseline", "decode")
    baselines = await bus.js.key_value(subjects.BUCKET_BASELINES)
    await baselines.put("f" * 64, b'{"median_us": -1}')
    assert await cache.get_baseline("f" * 64) is None
    await baselines.put("e" * 64, (await baselines.get(bkey)).value)
    assert await cache.get_baseline("e" * 64) is None
    assert errors("baseline", "decode") == before + 2


async def test_only_workers_may_touch_the_shared_cache(
        cache: SharedCache, settings: Settings) -> None:
    for role in ("gateway", "generator"):
        other = await connect_bus(as_role(settings, role), f"test-{role}")
        try:
            js = other.nc.jetstream(timeout=scaled(1.0))
            with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
                kv = await js.key_value(subjects.BUCKET_BASELINES)
                await kv.put("forged", b"{}")
        finally:
            await other.close()
    assert await cache.get_baseline("forged") is None


async def test_a_shared_baseline_is_used_and_its_age_reported(
        shared_verifier: Verifier, cache: SharedCache) -> None:
    """The profile path's lookup (cpu cannot time, so the lookup alone): a baseline in
    the shared bucket is used and then held by this process."""
    from services.worker.cache import BaseTime
    from tests.sandbox.test_verifier import request

    task = BUNDLED_RELU_TASK + f"# baseline {uuid.uuid4().hex}\n"
    req = msgspec.structs.replace(request(task=task), trials=1, arch="x86_64")
    task_sha, overrides = _task_key(task, req.shape_overrides)
    shared_verifier.shared_cache = cache
    try:
        assert await shared_verifier.cached_baseline(req) == (None, "measured")
        measured = utcnow() - dt.timedelta(minutes=5)
        assert await cache.put_baseline(Baseline(
            format=CACHE_FORMAT, key=shared_verifier.baselines.key(req, task_sha, overrides),
            median_us=42.0, measured_at=measured, task_sha256=task_sha, shapes=overrides,
            backend="cpu", arch="x86_64", versions={}))
        base, origin = await shared_verifier.cached_baseline(req)
        assert origin == "shared_cache" and isinstance(base, BaseTime)
        assert base.median_us == 42.0 and 299 < (utcnow() - base.measured_at).total_seconds() < 400
        base, origin = await shared_verifier.cached_baseline(req)
        assert origin == "worker_cache" and base.median_us == 42.0
    finally:
        shared_verifier.shared_cache = None
        shared_verifier.clear_caches()


def _task_key(task: str, overrides: dict) -> tuple[str, str]:
    import hashlib
    import json

    return hashlib.sha256(task.encode()).hexdigest(), json.dumps(overrides, sort_keys=True)


def test_compile_baselines_have_keys_of_their_own() -> None:
    base = dict(task_sha256="a" * 64, shapes="{}", backend="cuda", arch="h200",
                versions=VERSIONS)
    eager = baseline_key(**base)
    # The eager key is the one entries had before compiled baselines existed.
    assert eager == baseline_key(**base, kind="eager")
    compiled = baseline_key(**base, kind="compile")
    assert len(compiled) == 64 and compiled != eager
    with pytest.raises(ValueError, match="baseline kind must be one of eager, compile"):
        baseline_key(**base, kind="max-autotune")


async def test_an_entry_written_before_compiled_baselines_still_reads(
        cache: SharedCache, bus: Bus) -> None:
    bkey = baseline_key(task_sha256="c" * 64, shapes="{}", backend="cuda", arch="h200",
                        versions=VERSIONS)
    old = {"format": CACHE_FORMAT, "key": bkey, "median_us": 7.5,
           "measured_at": utcnow().isoformat(), "task_sha256": "c" * 64, "shapes": "{}",
           "backend": "cuda", "arch": "h200", "versions": {}, "worker_id": "w-old"}
    baselines = await bus.js.key_value(subjects.BUCKET_BASELINES)
    await baselines.put(bkey, msgspec.json.encode(old))
    baseline = await cache.get_baseline(bkey)
    assert baseline is not None and baseline.kind == "eager" and baseline.median_us == 7.5


async def test_compiled_baselines_are_shared_and_compile_failures_are_not(
        shared_verifier: Verifier, cache: SharedCache) -> None:
    from tests.sandbox.test_verifier import request

    req = msgspec.structs.replace(request(task=BUNDLED_RELU_TASK + f"# {uuid.uuid4().hex}\n"),
                                  trials=1, arch="x86_64")
    shared_verifier.shared_cache = cache
    try:
        assert await shared_verifier.cached_baseline(req, kind="compile") == (None, "measured")
        await shared_verifier.keep_baseline(req, "compile", 31.0)
        await shared_verifier.keep_baseline(req, "eager", 62.0)
        shared_verifier.clear_caches()
        compiled, origin = await shared_verifier.cached_baseline(req, kind="compile")
        assert origin == "shared_cache" and compiled.median_us == 31.0
        eager, origin = await shared_verifier.cached_baseline(req)
        assert origin == "shared_cache" and eager.median_us == 62.0
        # A failed torch.compile stays in the process that saw it.
        other = msgspec.structs.replace(req, task_desc=req.task_desc + "# failing\n")
        await shared_verifier.keep_baseline(other, "compile", 0.0, error="TypeError: x")
        failed, origin = await shared_verifier.cached_baseline(other, kind="compile")
        assert origin == "worker_cache" and failed.error == "TypeError: x"
        shared_verifier.clear_caches()
        assert await shared_verifier.cached_baseline(other, kind="compile") == (None,
                                                                               "measured")
    finally:
        shared_verifier.shared_cache = None
        shared_verifier.clear_caches()
