"""An authenticated bus: no anonymous client, each service only its own subjects.

The server is the ``nats_server`` fixture, started with the configuration ``aikg up``
writes (services/common/nats_auth.py). Each service's user is tried on what it must
not do; nats-server answers a denied publish with ``-ERR 'Permissions Violation for
Publish to ...'`` (delivered to the client's error callback) and drops the message, so
a JetStream request behind it gets no reply: each case asserts the violation and that
nothing changed. Token, NKEY and TLS connections run against servers configured for
them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import ConsumerConfig

from schemas import subjects
from services.common.bus import Bus, bucket_entries, connect_bus, nats_credentials
from services.common.consumer import durable_pull
from services.common.embedded import EmbeddedNatsServer
from services.common.nats_auth import (
    ROLES,
    BusCredentials,
    authorization_block,
    inbox_prefix,
    user_permissions,
    worker_user,
)
from services.common.provision import (
    ProvisionError,
    create_consumer,
    ensure_consumer,
    lane_config,
    run_nats_setup,
)
from services.common.settings import Settings, load_settings
from tests.conftest import as_role
from tests.helpers import scaled

# How long a denied JetStream request waits for the reply that never comes, seconds.
DENIED_TIMEOUT_S = 1.0


class Client:
    """A raw nats-py connection as one user, recording the server's -ERR messages."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Any = None

    async def connect(self, url: str, **credentials: Any) -> Client:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False,
                                     connect_timeout=3, **credentials)
        return self

    async def violation(self, subject: str, timeout_s: float = 5.0) -> str:
        """The permissions violation the server reported for a subject that starts with
        ``subject`` (nats-py reports it in lower case)."""
        deadline = asyncio.get_running_loop().time() + scaled(timeout_s)
        while asyncio.get_running_loop().time() < deadline:
            for error in self.errors:
                if "permissions violation" in error.lower() and f'"{subject.lower()}' in error.lower():
                    return error
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation for {subject!r}; errors: {self.errors}")

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.close()


async def as_user(settings: Settings, role: str) -> Client:
    """A raw client with ``role``'s credentials and inbox prefix (the only inbox its user
    may subscribe to)."""
    user = getattr(settings, f"nats_{role}_user")
    return await Client().connect(settings.nats_url, user=user,
                                  password=getattr(settings, f"nats_{role}_password"),
                                  inbox_prefix=inbox_prefix(user))


async def test_a_client_without_credentials_is_refused(settings: Settings) -> None:
    anonymous = msgspec.structs.replace(settings, nats_user="", nats_password="")
    started = asyncio.get_running_loop().time()
    with pytest.raises(ConnectionError, match="refused this client's credentials") as err:
        await connect_bus(anonymous, "anonymous")
    # Refused at once: retrying the same credentials cannot help.
    assert asyncio.get_running_loop().time() - started < 5
    assert settings.nats_url in str(err.value)
    wrong = msgspec.structs.replace(settings, nats_worker_password="not-the-password")
    with pytest.raises(ConnectionError, match="AIKG_NATS_WORKER_USER"):
        await connect_bus(wrong, "wrong", role="worker")
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await Client().connect(settings.nats_url)


async def test_a_worker_cannot_write_the_jobs_bucket(settings: Settings, bus: Bus) -> None:
    worker = await as_user(settings, "worker")
    try:
        js = worker.nc.jetstream(timeout=DENIED_TIMEOUT_S)
        jobs = await js.key_value(subjects.BUCKET_JOBS)
        with pytest.raises(nats.errors.TimeoutError):
            await jobs.put("forged", b'{"status": "completed"}')
        assert "forged" in await worker.violation(f"$KV.{subjects.BUCKET_JOBS}.")
        with pytest.raises(nats.errors.TimeoutError):
            await jobs.delete("forged")
        # It may still read records (a cancelled job stops its runs) and write its own
        # heartbeat.
        await bus.jobs.put("real", b"{}")
        assert (await jobs.get("real")).value == b"{}"
        await (await js.key_value(subjects.BUCKET_WORKERS)).put(settings.worker_id, b"{}")
    finally:
        await worker.close()
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await bus.jobs.get("forged")


async def test_a_generator_cannot_publish_a_verdict(settings: Settings, bus: Bus) -> None:
    generator = await as_user(settings, "generator")
    try:
        js = generator.nc.jetstream(timeout=DENIED_TIMEOUT_S)
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish("results.x", b'{"passed": true}')
        await generator.violation("results.x")
        await generator.nc.publish("results.x", b'{"passed": true}')
        await generator.nc.flush()
        # Nor write a worker's heartbeat or lease.
        with pytest.raises(nats.errors.TimeoutError):
            await (await js.key_value(subjects.BUCKET_LEASES)).put("w.0", b"{}")
        await generator.violation(f"$KV.{subjects.BUCKET_LEASES}.w.0")
        # What it needs works: a verify request.
        await js.publish(subjects.verify("cpu", "x86_64"), b"{}")
    finally:
        await generator.close()
    assert (await bus.js.stream_info(subjects.STREAM_RESULTS)).state.messages == 0
    assert (await bus.js.stream_info(subjects.STREAM_VERIFY)).state.messages == 1


async def test_the_gateway_cannot_consume_verify_requests(settings: Settings, bus: Bus) -> None:
    gateway = await as_user(settings, "gateway")
    try:
        js = gateway.nc.jetstream(timeout=DENIED_TIMEOUT_S)
        config = ConsumerConfig(durable_name="thief", filter_subject="verify.>")
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_consumer(subjects.STREAM_VERIFY, config)
        # nats-py creates a durable by $JS.API.CONSUMER.DURABLE.CREATE.VERIFY.thief.
        await gateway.violation(f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.STREAM_VERIFY}.thief")
        await gateway.nc.publish(
            f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_VERIFY}.thief.verify.cpu.x86_64", b"{}")
        await gateway.violation(f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_VERIFY}")
        # Nor pull from the workers' durable, nor listen to the subject itself.
        await gateway.nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM_VERIFY}.verify-cpu-x86_64", b"{}")
        await gateway.violation(f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM_VERIFY}")
        await gateway.nc.subscribe("verify.>")
        await gateway.violation("verify.>")
        # Queue metrics still read the consumer list (information, not consumption).
        assert await js.consumers_info(subjects.STREAM_VERIFY) == []
    finally:
        await gateway.close()
    assert [c.name for c in await bus.js.consumers_info(subjects.STREAM_VERIFY)] == []


async def test_no_service_may_change_a_stream(settings: Settings, bus: Bus) -> None:
    for role in ROLES:
        client = await as_user(settings, role)
        try:
            js = client.nc.jetstream(timeout=DENIED_TIMEOUT_S)
            with pytest.raises(nats.errors.TimeoutError):
                await js.delete_stream(f"KV_{subjects.BUCKET_JOBS}")
            await client.violation(f"$JS.API.STREAM.DELETE.KV_{subjects.BUCKET_JOBS}")
            with pytest.raises(nats.errors.TimeoutError):
                await js.purge_stream(subjects.STREAM_JOB_EVENTS)
            await client.violation(f"$JS.API.STREAM.PURGE.{subjects.STREAM_JOB_EVENTS}")
        finally:
            await client.close()
    assert await bus.js.stream_info(f"KV_{subjects.BUCKET_JOBS}")


def test_credential_settings_are_checked_and_masked(tmp_path: Path) -> None:
    env = {"AIKG_NATS_USER": "worker", "AIKG_NATS_PASSWORD": "pw-SECRET",
           "AIKG_NATS_GATEWAY_USER": "gateway", "AIKG_NATS_GATEWAY_PASSWORD": "gw-SECRET"}
    settings = load_settings(env=env)
    assert nats_credentials(settings) == {"user": "worker", "password": "pw-SECRET"}
    assert nats_credentials(settings, "gateway") == {"user": "gateway", "password": "gw-SECRET"}
    # A role without its own credentials falls back to the plain ones.
    assert nats_credentials(settings, "generator")["user"] == "worker"
    assert "SECRET" not in repr(settings)
    with pytest.raises(ValueError, match="AIKG_NATS_USER is not"):
        nats_credentials(load_settings(env={"AIKG_NATS_PASSWORD": "x"}))
    with pytest.raises(ValueError, match="AIKG_NATS_TOKEN and AIKG_NATS_USER"):
        nats_credentials(load_settings(env={"AIKG_NATS_TOKEN": "t", "AIKG_NATS_USER": "u"}))
    with pytest.raises(ValueError, match="AIKG_NATS_CREDS_FILE=.*not a readable file"):
        nats_credentials(load_settings(env={"AIKG_NATS_CREDS_FILE": str(tmp_path / "no")}))
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match="TLS_CERT_FILE and AIKG_NATS_TLS_KEY_FILE go together"):
        nats_credentials(load_settings(env={"AIKG_NATS_TLS_CERT_FILE": str(cert)}))
    with pytest.raises(ValueError, match="cannot load the NATS TLS files"):
        nats_credentials(load_settings(env={"AIKG_NATS_TLS_CA_FILE": str(cert)}))
    with pytest.raises(ValueError, match="unknown NATS role"):
        nats_credentials(settings, "admin")


def test_server_configuration_is_private_and_valid(tmp_path: Path) -> None:
    from services.common.embedded import nats_server_binary

    credentials = BusCredentials()
    conf = credentials.write_server_config(tmp_path / "auth.conf")
    assert conf.stat().st_mode & 0o777 == 0o600
    done = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr + done.stdout
    assert len(set(credentials.passwords.values())) == 4
    with pytest.raises(ValueError, match="quotes"):
        authorization_block({u: 'a"b' for u in ("admin", *user_permissions(["w"]))}, ["w"])


async def _serve(tmp_path: Path, conf_text: str) -> EmbeddedNatsServer:
    conf = tmp_path / "server.conf"
    conf.write_text(conf_text)
    server = EmbeddedNatsServer(tmp_path / "store", config_file=conf, die_with_parent=True)
    server.start()
    return server


async def test_token_authentication(tmp_path: Path) -> None:
    server = await _serve(tmp_path, 'authorization { token: "tok-123" }\n')
    try:
        settings = load_settings(env={}, nats_url=server.url, nats_token="tok-123")
        bus = await connect_bus(settings, "token", role="worker")
        await bus.close()
        with pytest.raises(ConnectionError, match="given: token"):
            await connect_bus(msgspec.structs.replace(settings, nats_token="nope"), "bad")
    finally:
        server.stop()


@pytest.mark.skipif(importlib.util.find_spec("nkeys") is None,
                    reason="nkeys not installed (pip install -e .[dev] or aikg[nkeys])")
async def test_nkey_seed_file_authentication(tmp_path: Path) -> None:
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "worker.nk"
    seed_file.write_bytes(seed)
    server = await _serve(tmp_path, f'authorization {{ users = [ {{nkey: "{public}"}} ] }}\n')
    try:
        settings = load_settings(env={}, nats_url=server.url,
                                 nats_nkey_seed_file=str(seed_file))
        bus = await connect_bus(settings, "nkey")
        await bus.close()
    finally:
        server.stop()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make certificates")
async def test_tls_with_a_client_certificate(tmp_path: Path) -> None:
    # A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it.
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=aikg-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=tmp_path)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=tmp_path)
        (tmp_path / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
                 "-out", f"{name}.pem", cwd=tmp_path)
    server = await _serve(tmp_path, (
        f'tls {{ cert_file: "{tmp_path}/server.pem", key_file: "{tmp_path}/server.key", '
        f'ca_file: "{tmp_path}/ca.pem", verify: true }}\n'))
    try:
        settings = load_settings(env={}, nats_url=server.url.replace("nats://", "tls://"),
                                 nats_tls_ca_file=str(tmp_path / "ca.pem"),
                                 nats_tls_cert_file=str(tmp_path / "client.pem"),
                                 nats_tls_key_file=str(tmp_path / "client.key"))
        bus = await connect_bus(settings, "tls")
        assert bus.nc.is_connected
        await bus.close()
        # Without the client certificate the server (verify: true) refuses the handshake.
        bare = msgspec.structs.replace(settings, nats_tls_cert_file="", nats_tls_key_file="")
        with pytest.raises(ConnectionError):
            await connect_bus(bare, "tls-no-cert")
    finally:
        server.stop()



async def test_a_service_starts_on_a_stream_it_may_not_update(settings: Settings,
                                                             bus: Bus) -> None:
    # The admin gave JOB_EVENTS another max age than the worker's settings ask for.
    config = (await bus.js.stream_info(subjects.STREAM_JOB_EVENTS)).config
    config.max_age = 3600.0
    await bus.js.update_stream(config)
    worker = await connect_bus(settings, "worker", role="worker")
    try:
        kept = await worker.js.stream_info(subjects.STREAM_JOB_EVENTS)
        assert kept.config.max_age == 3600.0
    finally:
        await worker.close()


# --- private replies, provisioned consumers, each worker's own keys ------------------


def _users(settings: Settings) -> dict[str, str]:
    return {role: getattr(settings, f"nats_{role}_user") for role in ROLES}


async def test_each_service_gets_replies_only_on_its_own_inbox(settings: Settings,
                                                              bus: Bus) -> None:
    users = _users(settings)
    assert users["worker"] == worker_user(settings.worker_id)
    await bus.jobs.put("job-1", b'{"task": "secret source"}')
    # Each service connects with its own prefix, and its JetStream replies (requests,
    # key reads, key listings) come through it.
    services = {role: await connect_bus(settings, role, role=role) for role in users}
    spies: list[Client] = []
    seen: list[str] = []

    async def spied(msg: Any) -> None:
        seen.append(msg.subject)

    try:
        for role, service in services.items():
            assert service.nc._inbox_prefix.decode() == inbox_prefix(users[role])
        # With each service's credentials, nobody else's replies can be subscribed to:
        # not the default _INBOX.>, not another service's prefix, not a wider wildcard.
        for role, user in users.items():
            spy = await as_user(settings, role)
            spies.append(spy)
            others = [inbox_prefix(u) for u in users.values() if u != user]
            for subject in ("_INBOX.>", *(f"{p}.>" for p in others), ">", "*.>"):
                await spy.nc.subscribe(subject, cb=spied)
                await spy.violation(subject)
        for role in ("gateway", "generator", "worker"):
            entry = await services[role].jobs.get("job-1")
            assert entry.value == b'{"task": "secret source"}'
        entries = await bucket_entries(services["gateway"].js, subjects.BUCKET_JOBS)
        assert entries["job-1"].value == b'{"task": "secret source"}'
        for spy in spies:
            await spy.nc.flush()
        assert seen == []
    finally:
        for spy in spies:
            await spy.close()
        for service in services.values():
            await service.close()


async def test_a_worker_binds_the_provisioned_consumer_but_cannot_change_it(
        settings: Settings, bus: Bus) -> None:
    subject = subjects.verify("cpu", settings.arch)
    durable = subjects.verify_consumer("cpu", settings.arch)
    worker = await connect_bus(settings, "worker", role="worker")
    try:
        # Missing: the worker asks the provisioner (the ``bus`` fixture serves it), which
        # makes it with the provisioner's configuration, not the one the worker brings.
        psub = await durable_pull(worker.js, stream=subjects.STREAM_VERIFY, subject=subject,
                                  durable=durable, ack_wait_s=1.0, max_deliver=1)
        made = (await bus.js.consumer_info(subjects.STREAM_VERIFY, durable)).config
        assert made.max_deliver == settings.verify_max_deliver + 1
        assert made.ack_wait == pytest.approx(settings.verify_ack_wait_s)
        await bus.js.publish(subject, b"{}", headers={"Nats-Msg-Id": "v-1"})
        (msg,) = await psub.fetch(1, timeout=scaled(10))
        await msg.ack()
        await psub.unsubscribe()
    finally:
        await worker.close()

    client = await as_user(settings, "worker")
    try:
        js = client.nc.jetstream(timeout=DENIED_TIMEOUT_S)
        forged = lane_config(subject, durable, ack_wait_s=1.0, max_deliver=1)
        # A create of an existing consumer is an update: refused in every subject form.
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_consumer(subjects.STREAM_VERIFY, forged)
        # (nats-py sends a config without a name to the legacy DURABLE.CREATE subject.)
        await client.violation(
            f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.STREAM_VERIFY}.{durable}")
        body = json.dumps({"stream_name": subjects.STREAM_VERIFY, "config": forged.as_dict(),
                           "action": "update"}).encode()
        for api in (f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.STREAM_VERIFY}.{durable}",
                    f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_VERIFY}.{durable}",
                    f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_VERIFY}",
                    f"$JS.API.CONSUMER.DELETE.{subjects.STREAM_VERIFY}.{durable}",
                    f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_JOBS}.generator.jobs.submit"):
            await client.nc.publish(api, body)
            await client.violation(api)
        # The provisioner takes no configuration from the asker and leaves an existing
        # consumer as it is; it makes no consumer for a lane without messages, nor for
        # anything that is no lane.
        ask = {"stream": subjects.STREAM_VERIFY, "subject": subject, "config": forged.as_dict()}
        reply = await client.nc.request(subjects.PROVISION_CONSUMER, json.dumps(ask).encode(),
                                        timeout=scaled(10))
        assert json.loads(reply.data) == {"consumer": durable}
        for stream, lane in ((subjects.STREAM_VERIFY, f"{subject}.acme.high"),
                             (subjects.STREAM_VERIFY, "verify.cpu"),
                             (f"KV_{subjects.BUCKET_JOBS}", "$KV.jobs.>")):
            reply = await client.nc.request(
                subjects.PROVISION_CONSUMER,
                json.dumps({"stream": stream, "subject": lane}).encode(), timeout=scaled(10))
            assert "error" in json.loads(reply.data), lane
    finally:
        await client.close()
    kept = (await bus.js.consumer_info(subjects.STREAM_VERIFY, durable)).config
    assert (kept.max_deliver, kept.ack_wait) == (made.max_deliver, made.ack_wait)
    assert [c.name for c in await bus.js.consumers_info(subjects.STREAM_VERIFY)] == [durable]


async def test_without_a_provisioner_a_service_may_not_make_its_consumer(
        settings: Settings, nats_url: str) -> None:
    admin = await connect_bus(settings, "admin")  # no provisioner on this bus
    worker = await connect_bus(settings, "worker", role="worker")
    try:
        subject = subjects.verify("cpu", settings.arch)
        config = lane_config(subject, subjects.verify_consumer("cpu", settings.arch),
                             ack_wait_s=1.0, max_deliver=1)
        with pytest.raises(ProvisionError, match="aikg nats-setup --serve"):
            await ensure_consumer(worker.js, worker.nc, subjects.STREAM_VERIFY, subject, config)
        assert await admin.js.consumers_info(subjects.STREAM_VERIFY) == []
    finally:
        await worker.close()
        await admin.close()


async def test_a_worker_writes_only_its_own_heartbeat_and_leases(settings: Settings,
                                                                bus: Bus) -> None:
    me, other = settings.worker_id, "test-worker-2"
    # Every write that reaches the buckets, as the server routes it (a denied publish is
    # dropped before it).
    landed: list[str] = []

    async def on_write(msg: Any) -> None:
        landed.append(msg.subject)

    tap = await bus.nc.subscribe(f"$KV.{subjects.BUCKET_WORKERS}.>", cb=on_write)
    tap_leases = await bus.nc.subscribe(f"$KV.{subjects.BUCKET_LEASES}.>", cb=on_write)
    await bus.nc.flush()
    client = await as_user(settings, "worker")
    try:
        js = client.nc.jetstream(timeout=DENIED_TIMEOUT_S)
        workers = await js.key_value(subjects.BUCKET_WORKERS)
        leases = await js.key_value(subjects.BUCKET_LEASES)
        for write in (lambda: workers.put(other, b'{"forged": true}'),
                      lambda: workers.delete(other),
                      lambda: leases.put(f"{other}.0", b'{"forged": true}'),
                      lambda: leases.delete(f"{other}.0"),
                      lambda: leases.put(f"{other}.1", b"{}")):
            with pytest.raises(nats.errors.TimeoutError):
                await write()
        await client.violation(f"$KV.{subjects.BUCKET_WORKERS}.{other}")
        await client.violation(f"$KV.{subjects.BUCKET_LEASES}.{other}.0")
        await client.violation(f"$KV.{subjects.BUCKET_LEASES}.{other}.1")
        # Nor listen on (and answer) another worker's control subjects.
        await client.nc.subscribe(f"{subjects.worker_service(other)}.>")
        await client.violation(f"{subjects.worker_service(other)}.>")
        # Its own keys it writes.
        await workers.put(me, b"{}")
        await leases.put(f"{me}.0", b"{}")
        await leases.delete(f"{me}.0")
        await client.nc.flush()
        await bus.nc.flush()
        for _ in range(200):  # the tap's callbacks run after the flush returns
            if len(landed) >= 3:
                break
            await asyncio.sleep(0.02)
    finally:
        await client.close()
        await tap.unsubscribe()
        await tap_leases.unsubscribe()
    assert landed == [f"$KV.{subjects.BUCKET_WORKERS}.{me}", f"$KV.{subjects.BUCKET_LEASES}.{me}.0",
                      f"$KV.{subjects.BUCKET_LEASES}.{me}.0"]


async def test_a_worker_id_its_user_may_not_write_is_refused(settings: Settings,
                                                             bus: Bus) -> None:
    from services.worker.service import Worker

    wrong = msgspec.structs.replace(settings, worker_id="test-worker-2")
    with pytest.raises(ValueError, match="does not match its NATS user 'worker-test-worker'.*"
                                         "AIKG_WORKER_ID=test-worker"):
        Worker(bus, wrong)


async def test_nats_setup_makes_and_updates_the_consumers(settings: Settings, bus: Bus) -> None:
    tuned = msgspec.structs.replace(settings, verify_ack_wait_s=7.0, verify_max_deliver=2)
    verify = subjects.verify_consumer("cpu", settings.arch)
    done = await run_nats_setup(tuned, [("cpu", settings.arch)], serve=False)
    assert done == [subjects.CONSUMER_GENERATOR, verify]
    config = (await bus.js.consumer_info(subjects.STREAM_VERIFY, verify)).config
    assert (config.ack_wait, config.max_deliver) == (pytest.approx(7.0), 3)
    # A lane consumer the provisioner made earlier is brought to the settings too.
    lane = subjects.verify_lane("cpu", settings.arch, "acme", "high")
    await bus.js.publish(lane, b"{}", headers={"Nats-Msg-Id": "lane-1"})
    await create_consumer(bus.js, subjects.STREAM_VERIFY, lane, settings)
    again = msgspec.structs.replace(tuned, verify_ack_wait_s=9.0)
    done = await run_nats_setup(again, [("cpu", settings.arch)], serve=False)
    lane_consumer = subjects.verify_lane_consumer("cpu", settings.arch, "acme", "high")
    assert lane_consumer in done
    for name in (verify, lane_consumer):
        config = (await bus.js.consumer_info(subjects.STREAM_VERIFY, name)).config
        assert config.ack_wait == pytest.approx(9.0), name


@pytest.mark.slow  # an `aikg nats-setup` process
async def test_nats_setup_as_a_service_user_says_to_run_it_as_the_admin(
        settings: Settings, bus: Bus) -> None:
    gateway = as_role(settings, "gateway")
    with pytest.raises(PermissionError, match="'gateway' could not set up.*as the admin user"):
        await run_nats_setup(gateway, [("cpu", settings.arch)], serve=False)


def test_nats_setup_help_says_what_it_is_for() -> None:
    from typer.testing import CliRunner

    from services.cli import app

    result = CliRunner().invoke(app, ["nats-setup", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for words in ("admin", "durable consumers", "--serve", "--verify", "aikg up"):
        assert words in result.output, words



# ---------------------------------------------------------------- delivery elsewhere
# nats-server does not check a push consumer's deliver subject against its creator's
# publish rights (https://github.com/nats-io/nats-server/issues/8274), nor the reply
# subject of a JetStream API request: every right that lets a user name where the server
# delivers is withheld (services/common/nats_auth.py, "Consumers").

OTHER_WORKER = "test-worker-2"


def _create_forms(stream: str, filter_subject: str) -> list[str]:
    """Every subject of nats-server's consumer create API for a consumer ``thief``."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.thief",
            f"$JS.API.CONSUMER.CREATE.{stream}.thief.{filter_subject}",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.thief"]


# Per service: a stream it reads (and its subjects), and one it does not read.
_READ_AND_NOT = {
    "generator": ((subjects.STREAM_RESULTS, "results.>"), (subjects.STREAM_DLQ, "dlq.>")),
    "gateway": ((subjects.STREAM_JOB_EVENTS, "jobs.events.>"), (subjects.STREAM_DLQ, "dlq.>")),
    "worker": ((f"KV_{subjects.BUCKET_JOBS}", "$KV.jobs.>"), (subjects.STREAM_DLQ, "dlq.>")),
}


async def _tap(bus: Bus, targets: list[str]) -> list[str]:
    """Subjects of every message the server routes to ``targets`` from now on."""
    landed: list[str] = []

    async def on_msg(msg: Any) -> None:
        landed.append(msg.subject)

    for target in targets:
        await bus.nc.subscribe(target, cb=on_msg)
    await bus.nc.flush()
    return landed


async def test_no_service_may_create_a_consumer_delivering_anywhere(settings: Settings,
                                                                    bus: Bus) -> None:
    """The generator, the gateway and a worker each try every create form of a push
    consumer (ephemeral and durable) whose deliver subject is another service's (a
    worker's drain endpoint, another worker's result subject, a job record's key), on a
    stream it reads and on one it does not: all refused, nothing delivered, no consumer
    made; nats-py's ordered consumer (the same create) fails too."""
    job = "job-target"
    targets = [f"{subjects.worker_service(OTHER_WORKER)}.drain",
               f"{subjects.RESULTS_PREFIX}.{job}.{OTHER_WORKER}", f"$KV.{subjects.BUCKET_JOBS}.{job}"]
    # Something to deliver at once on every stream tried.
    await bus.js.publish(f"{subjects.RESULTS_PREFIX}.old", b'{"passed": true}')
    await bus.js.publish(subjects.job_events("old"), b"{}")
    await bus.jobs.put("old", b"{}")
    await bus.js.publish(f"{subjects.DLQ_PREFIX}.old", b"{}")
    landed = await _tap(bus, targets)
    streams = {stream for pair in _READ_AND_NOT.values() for stream, _ in pair}
    for role, pairs in _READ_AND_NOT.items():
        client = await as_user(settings, role)
        try:
            for stream, filter_subject in pairs:
                for target in targets:
                    config = ConsumerConfig(deliver_subject=target, filter_subject=filter_subject,
                                            ack_policy="none")
                    for api in _create_forms(stream, filter_subject.replace(">", "x")):
                        named = {"name": "thief"} if api.count(".") > 4 else {}
                        durable = {"durable_name": "thief"} if ".DURABLE." in api else {}
                        body = {"stream_name": stream, "action": "create",
                                "config": {**config.as_dict(), **named, **durable}}
                        client.errors.clear()
                        await client.nc.publish(api, json.dumps(body).encode())
                        await client.violation(api)
            js = client.nc.jetstream(timeout=DENIED_TIMEOUT_S)
            read_stream, read_subjects = pairs[0]
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
                await js.subscribe(read_subjects, stream=read_stream, ordered_consumer=True)
        finally:
            await client.close()
    await bus.nc.flush()
    await asyncio.sleep(scaled(0.5))
    assert landed == []
    for stream in streams:
        assert await bus.js.consumers_info(stream) == [], stream


async def test_no_service_may_direct_get_to_an_injected_reply_subject(settings: Settings,
                                                                      bus: Bus) -> None:
    """A direct get answers raw bytes on whatever reply subject the asker names: a worker
    that asked for its own heartbeat with a job's key as the reply subject had the
    server store its bytes as that job's record. Refused for every service; a message
    get's reply, which the server still sends anywhere, is a JSON envelope that decodes
    as no record."""
    from schemas import JobRecord, decode

    job = "job-forged"
    await bus.workers.put(settings.worker_id, b'{"job_id": "job-forged", "status": "completed"}')
    landed = await _tap(bus, [f"$KV.{subjects.BUCKET_JOBS}.{job}"])
    own_key = f"$KV.{subjects.BUCKET_WORKERS}.{settings.worker_id}"
    for role in ROLES:
        client = await as_user(settings, role)
        try:
            for api in (f"$JS.API.DIRECT.GET.KV_{subjects.BUCKET_WORKERS}.{own_key}",
                        f"$JS.API.DIRECT.GET.KV_{subjects.BUCKET_WORKERS}"):
                client.errors.clear()
                await client.nc.publish(api, json.dumps({"last_by_subj": own_key}).encode(),
                                        reply=f"$KV.{subjects.BUCKET_JOBS}.{job}")
                await client.violation(api)
            # The residual: a JSON-wrapped message get lands there, and spoils the key.
            if role == "worker":
                await client.nc.publish(
                    f"$JS.API.STREAM.MSG.GET.KV_{subjects.BUCKET_WORKERS}",
                    json.dumps({"last_by_subj": own_key}).encode(),
                    reply=f"$KV.{subjects.BUCKET_JOBS}.{job}")
                await client.nc.flush()
        finally:
            await client.close()
    deadline = asyncio.get_running_loop().time() + scaled(5)
    while not landed and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert landed == [f"$KV.{subjects.BUCKET_JOBS}.{job}"]  # the message get's envelope only
    stored = (await bus.jobs.get(job)).value or b""
    assert json.loads(stored)["type"] == "io.nats.jetstream.api.v1.stream_msg_get_response"
    with pytest.raises(msgspec.ValidationError):
        decode(stored, JobRecord)


async def test_bucket_entries_skip_a_copy_the_server_relayed(settings: Settings,
                                                             bus: Bus) -> None:
    """A raw server reply stored on a key (its headers name the stream and subject it
    was read from) is not the key's writer's value: listings leave it out and count it.
    Planted as the admin, the one user who may still direct-get, from a bucket of its
    own that allows direct gets (the AIKG buckets do not)."""
    from nats.js.api import KeyValueConfig

    from services.common.bus import RELAYED_COPIES

    assert not (await bus.js.stream_info(f"KV_{subjects.BUCKET_WORKERS}")).config.allow_direct
    source = await bus.js.create_key_value(KeyValueConfig(bucket="source", direct=True))
    await source.put("w", b'{"forged": true}')
    await bus.jobs.put("honest", b'{"job_id": "honest"}')
    before = RELAYED_COPIES.labels(bucket=subjects.BUCKET_JOBS)._value.get()
    await bus.nc.publish("$JS.API.DIRECT.GET.KV_source.$KV.source.w", b"",
                         reply=f"$KV.{subjects.BUCKET_JOBS}.relayed")
    await bus.nc.flush()
    raw = await poll_stored(bus, f"KV_{subjects.BUCKET_JOBS}", f"$KV.{subjects.BUCKET_JOBS}.relayed")
    assert raw.data == b'{"forged": true}' and "Nats-Stream" in (raw.headers or {})
    worker = await connect_bus(settings, "worker", role="worker")
    try:
        entries = await bucket_entries(worker.js, subjects.BUCKET_JOBS)
    finally:
        await worker.close()
    assert set(entries) == {"honest"} and entries["honest"].value == b'{"job_id": "honest"}'
    assert RELAYED_COPIES.labels(bucket=subjects.BUCKET_JOBS)._value.get() == before + 1


async def poll_stored(bus: Bus, stream: str, subject: str) -> Any:
    """The last message stored on ``subject`` of ``stream``, waited for."""
    deadline = asyncio.get_running_loop().time() + scaled(5)
    while True:
        try:
            return await bus.js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.slow  # a worker verifies a relu after the attacks
async def test_a_pull_relayed_to_a_drain_endpoint_drains_nobody_and_the_fleet_serves(
        settings: Settings, bus: Bus, shared_verifier: Any) -> None:
    """A pull (``MSG.NEXT``) delivers the raw message to whatever reply subject the
    puller names, unchecked by the server: the generator's pull of a queued job with a
    worker's drain endpoint as its reply subject reaches that endpoint. The worker
    ignores a request that is a JetStream delivery (its reply subject an ack subject)
    rather than draining, and answering it, which would have acked the job away. After
    this and the refused creates above, the worker still answers status and verifies."""
    from tests.bus.test_worker_service import (
        Results,
        publish_request,
        request_body,
        running_worker,
        worker_status,
    )

    results = Results()
    await results.start(bus)
    async with running_worker(settings, bus, verifier=shared_verifier) as (ws, _):
        drain = f"{subjects.worker_service(ws.worker_id)}.drain"
        landed = await _tap(bus, [drain])
        await create_consumer(bus.js, subjects.STREAM_JOBS, subjects.JOBS_SUBMIT, settings)
        await bus.js.publish(subjects.JOBS_SUBMIT, b'{"job_id": "queued"}',
                             headers={"Nats-Msg-Id": "queued-1"})
        generator = await as_user(settings, "generator")
        try:
            await generator.nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM_JOBS}.{subjects.CONSUMER_GENERATOR}",
                json.dumps({"batch": 1}).encode(), reply=drain)
            await generator.nc.flush()
        finally:
            await generator.close()
        deadline = asyncio.get_running_loop().time() + scaled(5)
        while not landed and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        # The server did deliver it there (under the job's own subject).
        assert landed == [subjects.JOBS_SUBMIT]
        await asyncio.sleep(scaled(0.5))
        status = await worker_status(bus, ws.worker_id)
        assert status["status"] == "running", status
        # Not acked by the worker's answer: the job waits for its redelivery.
        info = await bus.js.consumer_info(subjects.STREAM_JOBS, subjects.CONSUMER_GENERATOR)
        assert info.num_ack_pending + info.num_pending == 1, info
        body = request_body(settings, "job-after-attacks")
        await publish_request(bus, settings, body)
        (result,) = await results.wait("job-after-attacks")
        assert result.passed is True, (result.stage, result.error)
        assert result.worker_id == ws.worker_id


async def test_the_generator_reads_an_object_without_a_consumer(settings: Settings,
                                                                bus: Bus) -> None:
    """An evolve checkpoint of several chunks comes back whole through message gets
    (nats-py's ObjectStore.get would create a consumer, which the generator may not);
    a missing object is ObjectNotFoundError."""
    from services.common.bus import object_bytes

    store = await bus.js.create_object_store(subjects.OBJECT_STORE_ARTIFACTS)
    data = os.urandom(300 * 1024)  # three 128 KiB chunks
    await store.put("evolve/job-1.json", data)
    generator = await connect_bus(settings, "generator", role="generator")
    try:
        got = await object_bytes(generator.js, subjects.OBJECT_STORE_ARTIFACTS,
                                 "evolve/job-1.json")
        assert got == data
        with pytest.raises(nats.js.errors.ObjectNotFoundError):
            await object_bytes(generator.js, subjects.OBJECT_STORE_ARTIFACTS, "evolve/none")
    finally:
        await generator.close()


async def test_a_request_relayed_onto_a_lease_key_counts_as_no_lease(settings: Settings,
                                                                    bus: Bus) -> None:
    """A pull still delivers where the puller says, so a worker can have a queued verify
    request (tenant, backend and arch in it) stored under another worker's lease or
    heartbeat key. The fleet's view counts only values that name the key's worker: the
    copy takes no device share from its tenant, a real lease does. (The bytes are put
    as the admin: the same stored value the relay leaves.)"""
    from services.worker.fleet import DeviceShares

    arch = settings.arch
    request = {"request_id": "r-1", "job_id": "j-1", "tenant": "acme", "backend": "cpu",
               "arch": arch, "code": "", "task_desc": ""}
    await bus.leases.put(f"{OTHER_WORKER}.0", json.dumps(request).encode())
    await bus.workers.put(OTHER_WORKER, json.dumps({**request, "capacity": 8}).encode())
    shares = DeviceShares(settings.worker_id, "cpu", arch, 1, period_s=0.2)
    await shares.start(bus)
    try:
        assert shares.held_elsewhere("acme") == 0 and shares.devices() == 1
        lease = {"worker_id": OTHER_WORKER, "device": "1", "tenant": "acme", "backend": "cpu",
                 "arch": arch}
        await bus.leases.put(f"{OTHER_WORKER}.1", json.dumps(lease).encode())
        deadline = asyncio.get_running_loop().time() + scaled(5)
        while shares.held_elsewhere("acme") != 1:
            assert asyncio.get_running_loop().time() < deadline, shares.leases
            await asyncio.sleep(0.05)
    finally:
        await shares.stop()
