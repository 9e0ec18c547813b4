"""Shared fixtures: a real nats-server per test, settings, a bus, a served gateway.

Each test gets its own JetStream server (and so its own streams and buckets), as in
nats.py's own test suites: ``nats_server -> nats_url -> settings -> bus``. The server
runs with the configuration ``aikg up`` uses (services/common/nats_auth.py): no
anonymous client, one user per service with only its own subjects (a user per worker
id of :data:`TEST_WORKER_IDS`). ``settings`` names each service's credentials
(``nats_<role>_user`` / ``nats_<role>_password``, ``worker_id`` the first worker's),
so the gateway, generator and worker a test starts each connect as themselves; the
plain ``nats_user`` / ``nats_password`` are the admin's, used by the ``bus`` fixture
(a test's hands on the bus: fake heartbeats, garbage records, stream reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from schemas import WorkerInfo, encode
from services.common.bus import Bus, connect_bus
from services.common.embedded import EmbeddedNatsServer
from services.common.nats_auth import BusCredentials
from services.common.runtime import cancel_and_wait, free_port
from services.common.settings import Settings, load_settings
from tests.helpers import RELU_TASK, TIME_SCALE, scaled  # noqa: F401 - RELU_TASK re-exported


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of the ``tests/e2e/`` layer ``slow`` (several services end to end:
    ``make test-fast`` leaves them out), and scale every test's pytest-timeout limit (its
    ``timeout`` mark, else ``--timeout`` or the ini's) by ``AIKG_TEST_TIME_SCALE``
    (tests/helpers.py), like the deadlines the tests wait under. Runs before pytest's
    own ``-m`` selection."""
    default = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    for item in items:
        if item.path.parent.name == "e2e":
            item.add_marker(pytest.mark.slow)
        mark = item.get_closest_marker("timeout")
        limit = float(mark.args[0] if mark.args else mark.kwargs.get("timeout", default)) \
            if mark else default
        if limit > 0:
            item.add_marker(pytest.mark.timeout(scaled(limit)), append=False)


@pytest.fixture(scope="session", autouse=True)
def lowered_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point :data:`tests.lowering_cache.ROOT` at a directory every xdist worker of this
    run shares (the parent of the workers' own base temp dirs), so that a task is
    lowered once per session (:func:`tests.lowering_cache.lowered`)."""
    from tests import lowering_cache

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "lowered"
    root.mkdir(exist_ok=True)
    lowering_cache.ROOT = root
    yield root
    lowering_cache.ROOT = None


@pytest.fixture(scope="session")
def shared_verifier(tmp_path_factory):
    """One started cpu :class:`~services.worker.verifier.Verifier` for the whole session.

    Its fork server (torch and triton imported, the sandbox probed) takes seconds to
    start; modules that only need a started cpu verifier share this one. It is built
    and started with :data:`tests.helpers.SECRET_ENV` in the environment (its sandbox
    takes the environment when built; the variables go again after), so that the
    hostile tests can look for those secrets from its children.
    Tests of the sandbox's own start, or that need other settings (another memory
    limit or timeout, a scratch root of their own), build their own. Inputs above
    64 MiB fail at stage ``task``. Lend it to a worker with :func:`lend_verifier`.
    """
    from services.worker.verifier import Verifier
    from tests.helpers import SECRET_ENV

    with pytest.MonkeyPatch.context() as mp:
        for name, value in SECRET_ENV.items():
            mp.setenv(name, value)
        verifier = Verifier("cpu", worker_id="test-shared",
                            scratch_root=tmp_path_factory.mktemp("shared-verifier"),
                            memory_limit_bytes=64 << 20)
        verifier.start()
    yield verifier
    verifier.close()


class LentVerifier:
    """The session's verifier lent to one :class:`~services.worker.service.Worker`.

    While lent, the verifier reports the borrower's ``worker_id`` in its results (as a
    verifier of that worker would); :meth:`close` ends the loan instead of stopping the
    fork server, which the next borrower reuses. One loan at a time.
    """

    def __init__(self, verifier: Any, worker_id: str) -> None:
        self.verifier = verifier
        self.worker_id = worker_id
        self._owner = verifier.worker_id
        verifier.worker_id = worker_id

    def start(self) -> None:
        self.verifier.start()

    @property
    def shared_cache(self) -> Any:
        return self.verifier.shared_cache

    @shared_cache.setter
    def shared_cache(self, cache: Any) -> None:
        self.verifier.shared_cache = cache

    @property
    def sandbox(self) -> Any:
        return self.verifier.sandbox

    @property
    def sandbox_notes(self) -> list[str]:
        return self.verifier.sandbox_notes

    async def verify(self, request: Any, *, device: str, on_phase: Any = None) -> Any:
        return await self.verifier.verify(request, device=device, on_phase=on_phase)

    def close(self) -> None:
        self.verifier.worker_id = self._owner
        # The cache belongs to the borrower's bus, which closes with it.
        self.verifier.shared_cache = None


def lend_verifier(verifier: Any, worker_id: str) -> LentVerifier:
    """Lend the session's verifier to a worker with id ``worker_id`` (see :class:`LentVerifier`)."""
    return LentVerifier(verifier, worker_id)


@pytest.fixture(scope="session")
def lowering_sandbox():
    """One started built-in coder sandbox for the whole session (a fork server)."""
    from services.generator.coders.base import lowering_sandbox as make

    sandbox = make("test-lowering")
    sandbox.start()
    yield sandbox
    sandbox.close()


# What a worker's verifier or a generator's sandbox is built from (Worker, Generator):
# a test that changes one of them cannot borrow the session's.
_SANDBOX_SETTINGS = ("worker_backend", "memory_limit_bytes", "sandbox_require", "sandbox_env_allow",
                     "worker_aot_target", "worker_compile_extra_targets",
                     "worker_compile_extra_required", "sandbox_scratch_bytes", "task_timeout_s",
                     *(f"sandbox_{role}_{limit}" for role in ("lower", "reference", "candidate",
                                                              "compile")
                       for limit in ("address_space_bytes", "cpu_s")))


class LentSandbox:
    """The session's lowering sandbox lent to one generator: everything but
    :meth:`close` goes to the sandbox, which the next borrower reuses."""

    def __init__(self, sandbox: Any) -> None:
        self._sandbox = sandbox

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sandbox, name)

    def close(self) -> None:
        """End the loan; the session closes the sandbox."""


@pytest.fixture
def shared_services(shared_verifier, lowering_sandbox) -> Callable[..., Any]:
    """:func:`tests.helpers.services_running` with the session's started sandboxes lent
    to its worker and generator (their fork servers take seconds of CPU to start).
    Tests whose worker or generator needs sandbox settings of its own (memory, env,
    required mechanisms) or that kill a sandbox use ``services_running`` itself."""
    from services.worker.service import default_worker_id
    from tests.helpers import services_running

    defaults = load_settings(env={})

    def running(settings: Settings, bus: Bus, **kwargs: Any) -> Any:
        own = [name for name in _SANDBOX_SETTINGS
               if getattr(settings, name) != getattr(defaults, name)]
        assert not own, f"settings {own} need the worker's own sandbox: use services_running"
        worker_id = settings.worker_id or default_worker_id()
        return services_running(
            settings, bus, verifier=lend_verifier(shared_verifier, worker_id),
            lowering=LentSandbox(lowering_sandbox), **kwargs)

    return running


async def fake_worker_heartbeat(
    bus: Bus, backend: str = "cpu", arch: str = "x86_64", **fields: Any
) -> WorkerInfo:
    """Put a worker's heartbeat into the ``workers`` bucket, as a live worker would.

    Lets gateway-only tests pass the live-worker check without a real worker. The key
    expires after the bucket TTL (three ``worker_heartbeat_s``), like a dead worker's.

    Args:
        bus: the test's bus.
        backend / arch: what the fake worker offers.
        fields: further :class:`WorkerInfo` fields (``worker_id``, ``devices``, ``capacity`` ...).
    """
    info = WorkerInfo(
        worker_id=fields.pop("worker_id", f"fake-{backend}-{arch}"),
        backend=backend,
        arch=arch,
        devices=fields.pop("devices", ["0"]),
        capacity=fields.pop("capacity", 1),
        host=fields.pop("host", "test"),
        version=fields.pop("version", "test"),
        **fields,
    )
    await bus.workers.put(info.worker_id, encode(info))
    return info


@pytest.fixture
def dynamic_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the verifier's static check off: what follows must be caught by the dynamic
    checks alone (hostile-candidate tests)."""
    from services.worker import verifier as verifier_module

    monkeypatch.setattr(verifier_module, "check_candidate", lambda code, dsl="triton": [])


@pytest.fixture
def relu_task() -> str:
    """A small KernelBench-format task (torch.relu on a 16 x 1024 float32 tensor)."""
    return RELU_TASK


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """:func:`free_port`, for tests that do not import from conftest."""
    return free_port


@pytest.fixture(name="fake_worker_heartbeat")
async def fake_worker_heartbeat_fixture() -> AsyncIterator[Callable[..., Awaitable[WorkerInfo]]]:
    """:func:`fake_worker_heartbeat` that keeps beating until the test ends.

    ``await fake_worker_heartbeat(bus, "cpu", "x86_64")`` puts the heartbeat and
    re-puts it every half heartbeat period, so a slow test (or a loaded machine) does
    not see the fake worker expire.
    """
    tasks: list[asyncio.Task[None]] = []

    async def beat(bus: Bus, backend: str = "cpu", arch: str = "x86_64",
                   **fields: Any) -> WorkerInfo:
        info = await fake_worker_heartbeat(bus, backend, arch, **fields)

        async def refresh() -> None:
            while True:
                await asyncio.sleep(bus.settings.worker_heartbeat_s / 2)
                with contextlib.suppress(Exception):
                    await bus.workers.put(info.worker_id, encode(info))

        tasks.append(asyncio.create_task(refresh(), name=f"heartbeat-{info.worker_id}"))
        return info

    yield beat
    # Not one cancel(): a bucket put awaits through asyncio.wait_for, which on Python
    # 3.11 can drop a cancel (see cancel_and_wait); the loop would then beat forever
    # and this teardown would wait for it until the test timed out.
    await cancel_and_wait(*tasks)


def as_role(settings: Settings, role: str) -> Settings:
    """``settings`` whose plain ``nats_user`` / ``nats_password`` are ``role``'s
    (``gateway``, ``generator``, ``worker``): a client acting as that service."""
    return msgspec.structs.replace(settings, nats_user=getattr(settings, f"nats_{role}_user"),
                                   nats_password=getattr(settings, f"nats_{role}_password"))


def role_env(settings: Settings, role: str) -> dict[str, str]:
    """``AIKG_NATS_URL`` and ``role``'s ``AIKG_NATS_USER`` / ``AIKG_NATS_PASSWORD``, for a
    service run as a child process."""
    return {"AIKG_NATS_URL": settings.nats_url,
            "AIKG_NATS_USER": getattr(settings, f"nats_{role}_user"),
            "AIKG_NATS_PASSWORD": getattr(settings, f"nats_{role}_password")}


# Workers with a NATS user on the test servers: ``settings`` is the first one's; a test
# running more workers takes the others (``bus_credentials.worker_settings(id)``), or
# overrides ``bus_credentials`` with ids of its own.
TEST_WORKER_IDS = ("test-worker", "test-worker-2")


@pytest.fixture
def bus_credentials() -> BusCredentials:
    """Random passwords of this test's NATS users (admin, gateway, generator and one
    user per worker of :data:`TEST_WORKER_IDS`)."""
    return BusCredentials(worker_ids=TEST_WORKER_IDS)


@pytest.fixture
def nats_server(tmp_path, bus_credentials: BusCredentials) -> Iterator[EmbeddedNatsServer]:
    """A fresh nats-server with JetStream (store in the test's tmp dir) and the
    permissioned users of ``aikg up``, stopped after.

    Started with ``die_with_parent``: when the test process dies without running this
    fixture's teardown (SIGKILL, a hard timeout), Linux sends the server SIGTERM, so an
    interrupted run leaves no server behind. Start and restart it from the main thread
    (the death signal follows the thread that started it)."""
    conf = bus_credentials.write_server_config(tmp_path / "nats-auth.conf")
    server = EmbeddedNatsServer(tmp_path / "nats", config_file=conf, die_with_parent=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: EmbeddedNatsServer) -> str:
    return nats_server.url


@pytest.fixture
def settings(nats_url: str, bus_credentials: BusCredentials) -> Settings:
    """Settings for this test's server, ignoring any ``AIKG_*`` of the environment.

    Heartbeats every second (so the ``workers`` TTL is 3 s) and a free gateway port;
    each service's NATS credentials, and the admin's as the plain ones.
    """
    port = free_port()
    return load_settings(
        env={},
        nats_url=nats_url,
        **bus_credentials.role_settings(),
        worker_heartbeat_s=1.0,
        gateway_port=port,
        gateway_url=f"http://127.0.0.1:{port}",
        metrics_port=-1,
        log_format="console",
    )


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    """A connected admin bus (streams and buckets created), closed after the test.

    It also serves the consumer provisioner of ``aikg nats-setup --serve``
    (services/common/provision.py), which makes the JOBS/VERIFY consumers the
    generators and workers may only bind."""
    from services.common.provision import Provisioner

    b = await connect_bus(settings, "test")
    provisioner = Provisioner(b.nc, b.js, settings)
    await provisioner.start()
    try:
        yield b
    finally:
        await provisioner.stop()
        await b.close()


@contextlib.asynccontextmanager
async def running_gateway(settings: Settings, timeout_s: float = 15.0) -> AsyncIterator[str]:
    """Serve the gateway in this event loop until the block ends; yields its base URL
    (it must answer ``/healthz`` within ``scaled(timeout_s)``)."""
    from services.gateway.app import serve_gateway

    stop = asyncio.Event()
    task = asyncio.create_task(serve_gateway(settings, stop), name="test-gateway")
    base = f"http://{settings.gateway_host}:{settings.gateway_port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=scaled(2.0)) as client:
            timeout_s = scaled(timeout_s)
            deadline = asyncio.get_running_loop().time() + timeout_s
            while True:
                if task.done():
                    task.result()  # raises the gateway's startup error
                    raise RuntimeError("gateway stopped before answering /healthz")
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/healthz")).status_code == 200:
                        break
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"gateway did not answer {base}/healthz in {timeout_s}s")
                await asyncio.sleep(0.05)
        yield base
    finally:
        stop.set()
        await asyncio.wait_for(task, scaled(15.0))


@pytest.fixture
async def start_gateway() -> AsyncIterator[Callable[[Settings], Awaitable[str]]]:
    """Start gateways with custom settings: ``url = await start_gateway(settings)``.

    Each is stopped when the test ends.
    """
    async with contextlib.AsyncExitStack() as stack:

        async def start(settings: Settings) -> str:
            return await stack.enter_async_context(running_gateway(settings))

        yield start


@contextlib.asynccontextmanager
async def gateway_app_client(settings: Settings, **client_args: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway's app in this process over ASGI (Litestar's ``AsyncTestClient``, an
    ``httpx.AsyncClient``); yields the client.

    No port, no uvicorn: for route tests. The test client runs the app (its lifespan,
    which connects the gateway's own bus as the ``gateway`` user, and each request) on
    an event loop of its own in a thread, and the test's loop waits while a request
    runs. What needs a real HTTP server (event streams, shutdown with a stream open,
    the gateway's background tasks) uses :func:`running_gateway`."""
    from litestar.testing import AsyncTestClient

    from services.gateway.app import create_app

    async with AsyncTestClient(create_app(settings), timeout=client_args.pop("timeout", 10.0),
                               **client_args) as client:
        yield client


@pytest.fixture
async def app_client(settings: Settings, bus: Bus) -> AsyncIterator[httpx.AsyncClient]:
    """:func:`gateway_app_client` for ``settings`` (after ``bus`` made the streams and
    buckets and serves the consumer provisioner)."""
    async with gateway_app_client(settings) as client:
        yield client


@pytest.fixture
async def gateway(settings: Settings) -> AsyncIterator[str]:
    """The gateway for ``settings``, served in the test's loop; yields its base URL."""
    async with running_gateway(settings) as url:
        yield url
