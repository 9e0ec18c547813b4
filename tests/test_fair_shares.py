"""Fair shares between tenants, tenant timeout caps, task-code hangs named after the
task, and the resource limits of every sandboxed child.

Real parts: a nats-server per test, the gateway over HTTP, generators and workers in
this event loop, sandboxed children forked from real fork servers. Hangs use
``time.sleep`` (no CPU burnt on a shared CI machine) and short hang limits set
through the settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from schemas import VerifyRequest, encode, subjects
from services.common.bus import Bus
from services.common.lanes import LanePull, lane_config
from services.common.settings import Settings
from services.common.shares import TenantSlots, share_slots
from services.common.tenants import hash_token, load_tenants
from services.common.verdicts import VerdictWaiter
from services.generator.coders.base import lowering_sandbox as make_lowering_sandbox
from services.worker.child_limits import ChildLimits, child_limits_from
from services.worker.sandbox import LoweringFailed
from services.worker.service import run_worker
from services.worker.verifier import Verifier
from tests.helpers import RELU_KERNEL, RELU_TASK, services_running, wait_terminal

TOKENS = {"team_a": "tok-a", "team_b": "tok-b"}


def tenants_toml(tmp_path: Path, **entries: dict) -> str:
    lines = []
    for name in TOKENS:
        lines.append(f"[tenants.{name}]")
        lines.append(f'token_sha256 = "{hash_token(TOKENS[name])}"')
        lines += [f"{k} = {json.dumps(v)}" for k, v in entries.get(name, {}).items()]
    path = tmp_path / "tenants.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


# A task whose own code hangs: Model construction sleeps (no CPU used).
HANG_IN_MODEL = RELU_TASK.replace("super().__init__()", "super().__init__()\n"
                                  "        import time\n        time.sleep(600)")
# A task whose get_inputs allocates 10 GB outside torch (fake tensors cannot see it).
ALLOC_10GB = RELU_TASK.replace("def get_inputs():", "def get_inputs():\n"
                               "    _blob = bytearray(10 * 10**9)")
assert HANG_IN_MODEL != RELU_TASK and ALLOC_10GB != RELU_TASK


def request(task: str, request_id: str, *, tenant: str = "default", job_id: str = "fair",
            timeout_s: float = 120.0) -> VerifyRequest:
    return VerifyRequest(request_id=request_id, job_id=job_id, candidate_id=request_id,
                         op_name="relu", task_desc=task, code=RELU_KERNEL, backend="cpu",
                         arch="x86_64", trials=1, timeout_s=timeout_s, tenant=tenant)


# ------------------------------------------------------------------ shares and settings


def test_share_slots_rounds_down_but_never_to_zero() -> None:
    assert [share_slots(0.5, n) for n in (0, 1, 2, 3, 4, 8)] == [1, 1, 1, 1, 2, 4]
    assert share_slots(1.0, 4) == 4 and share_slots(0.01, 100) == 1


async def test_tenant_slots_hold_a_tenant_at_its_share_while_others_get_in() -> None:
    slots = TenantSlots(4, lambda tenant: 0.5, "lowering")
    entered: list[str] = []
    release = asyncio.Event()

    async def use(tenant: str) -> None:
        async with slots.hold(tenant):
            entered.append(tenant)
            await release.wait()

    tasks = [asyncio.create_task(use("a")) for _ in range(4)]
    await asyncio.sleep(0.05)
    tasks.append(asyncio.create_task(use("b")))
    await asyncio.sleep(0.05)
    assert entered == ["a", "a", "b"]  # a holds its two slots; b got in at once
    assert slots.at_share("a") and not slots.at_share("b")
    release.set()
    await asyncio.gather(*tasks)
    assert entered.count("a") == 4 and slots.in_use() == 0


def test_tenant_share_and_timeout_keys_are_checked(tmp_path: Path, settings: Settings) -> None:
    path = tenants_toml(tmp_path, team_a={"max_generator_share": 0.25, "max_timeout_s": 30})
    table = load_tenants(msgspec.structs.replace(settings, tenants_file=path))
    assert table.get("team_a").max_generator_share == 0.25
    assert table.get("team_a").max_timeout_s == 30
    # Unlisted keys take the AIKG_TENANT_* defaults.
    assert table.get("team_b").max_device_share == settings.tenant_max_device_share == 0.5
    assert table.get("team_b").max_timeout_s == 600
    for bad, words in (({"max_device_share": 0}, "max_device_share = 0 must be a fraction"),
                       ({"max_generator_share": 1.5}, "max_generator_share = 1.5"),
                       ({"max_timeout_s": -1}, "max_timeout_s = -1 must be a number")):
        path = tenants_toml(tmp_path, team_a=bad)
        with pytest.raises(ValueError, match=words):
            load_tenants(msgspec.structs.replace(settings, tenants_file=path))


def test_child_limits_table_names_each_setting(settings: Settings) -> None:
    limits = child_limits_from(msgspec.structs.replace(
        settings, sandbox_reference_address_space_bytes=1 << 30, sandbox_candidate_cpu_s=7))
    space = limits.address_space("reference", "cpu")
    assert space.value == 1 << 30
    assert space.note == "AIKG_SANDBOX_REFERENCE_ADDRESS_SPACE_BYTES=1073741824 (1.0 GiB)"
    assert limits.address_space("reference", "cuda").value is None  # cpu only
    assert limits.cpu_seconds("replay", 100).value == 7  # the replayer has the candidate's row
    assert limits.cpu_seconds("lower", 100, cores=1).value == 110  # derived: wall + 10 s
    derived = limits.address_space("candidate", "cpu", derived=3 << 30)
    assert derived.value == 3 << 30 and "AIKG_SANDBOX_CANDIDATE_ADDRESS_SPACE_BYTES is 0" in \
        derived.note
    with pytest.raises(ValueError, match="AIKG_SANDBOX_LOWER_CPU_S=-1"):
        child_limits_from(msgspec.structs.replace(settings, sandbox_lower_cpu_s=-1))


# ------------------------------------------------------------------ reference child


@pytest.fixture(scope="module")
def short_verifier(tmp_path_factory):
    """A verifier whose calls into the task's code may last 3 s each."""
    v = Verifier("cpu", worker_id="fair-test", memory_limit_bytes=64 << 20,
                 scratch_root=tmp_path_factory.mktemp("fair-verifier"), task_timeout_s=3.0,
                 child_limits=ChildLimits(reference_address_space_bytes=2 << 30))
    v.start()
    yield v
    v.close()


async def test_a_hang_in_the_tasks_model_is_named_after_the_task(short_verifier) -> None:
    started = time.monotonic()
    result = await short_verifier.verify(request(HANG_IN_MODEL, "hang-ref"), device="0")
    elapsed = time.monotonic() - started
    assert result.stage == "task", result
    assert result.error.startswith("the task's Model(*get_init_inputs()) did not finish in "
                                   "3 s (setting AIKG_TASK_TIMEOUT_S)"), result.error
    assert "shape_overrides" not in result.error and "infrastructure" not in result.error
    assert elapsed < 60, elapsed  # the 3 s limit, not the request's 120 s


async def test_a_10gb_allocation_in_get_inputs_fails_in_seconds_naming_the_limit(
        short_verifier) -> None:
    started = time.monotonic()
    result = await short_verifier.verify(request(ALLOC_10GB, "alloc-ref"), device="0")
    assert result.stage == "task", result
    assert "MemoryError" in result.error and "get_inputs()" in result.error, result.error
    assert "AIKG_SANDBOX_REFERENCE_ADDRESS_SPACE_BYTES=2147483648 (2.0 GiB)" in result.error
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------ lowering child


@pytest.fixture(scope="module")
def lowering():
    sandbox = make_lowering_sandbox("fair-lowering")
    sandbox.start()
    yield sandbox
    sandbox.close()


async def test_a_10gb_allocation_while_lowering_fails_in_seconds_naming_the_limit(
        lowering) -> None:
    started = time.monotonic()
    with pytest.raises(LoweringFailed) as failed:
        await lowering.lower(ALLOC_10GB, timeout_s=60,
                             limits=ChildLimits(lower_address_space_bytes=2 << 30))
    assert "MemoryError" in str(failed.value)
    assert "AIKG_SANDBOX_LOWER_ADDRESS_SPACE_BYTES=2147483648 (2.0 GiB)" in str(failed.value)
    assert time.monotonic() - started < 30


async def test_a_hang_while_lowering_is_named_after_the_task(lowering) -> None:
    with pytest.raises(LoweringFailed) as failed:
        await lowering.lower(HANG_IN_MODEL, timeout_s=3)
    assert str(failed.value).startswith(
        "the task's Model(*get_init_inputs()) did not finish in 3 s (setting "
        "AIKG_LOWERING_TIMEOUT_S)"), failed.value
    assert "shape_overrides" not in str(failed.value)
