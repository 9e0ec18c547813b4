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
from services.common.bus import Bus, connect_bus, nats_credentials
from services.common.embedded import EmbeddedNatsServer
from services.common.nats_auth import PERMISSIONS, BusCredentials, authorization_block
from services.common.settings import Settings, load_settings

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
        deadline = asyncio.get_running_loop().time() + timeout_s
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
    return await Client().connect(settings.nats_url, user=getattr(settings, f"nats_{role}_user"),
                                  password=getattr(settings, f"nats_{role}_password"))


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
        # buckets.
        await bus.jobs.put("real", b"{}")
        assert (await jobs.get("real")).value == b"{}"
        await (await js.key_value(subjects.BUCKET_WORKERS)).put("w1", b"{}")
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
    for role in PERMISSIONS:
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
        authorization_block({u: 'a"b' for u in ("admin", *PERMISSIONS)})


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
