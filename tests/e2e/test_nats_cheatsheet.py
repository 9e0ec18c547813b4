"""The `nats` CLI cheat sheet (docs/nats.md), line by line, against a real generator and worker.

There is no ``nats`` binary here; each line is replayed with nats-py doing what the
CLI does on the wire (``nats pub`` sends the given bytes and headers, ``nats kv get``
reads the bucket's last value, ``nats stream view`` reads the stream's messages by
sequence, ``nats micro ls`` is a ``$SRV.PING`` request gathering every reply). The
lines are parsed out of docs/nats.md, so the document cannot drift from the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
from pathlib import Path

import nats
import pytest

from schemas import JobRecord, VerifyRequest, decode, subjects
from services.common.bus import Bus
from services.common.nats_auth import BusCredentials
from services.common.settings import Settings
from tests.helpers import scaled

pytestmark = pytest.mark.slow

CHEAT_SHEET = Path(__file__).resolve().parents[2] / "docs" / "nats.md"


def cheat_sheet() -> dict[str, list[list[str]]]:
    """The cheat sheet's ``nats`` lines as argv, grouped by verb (``pub``, ``kv get`` ...)."""
    text = CHEAT_SHEET.read_text()
    section = text[text.index("## The `nats` CLI cheat sheet"):]
    block = re.search(r"```console\n(.*?)```", section, re.S).group(1)
    commands: dict[str, list[list[str]]] = {}
    for line in block.splitlines():
        if not line.startswith("nats "):
            continue
        argv = shlex.split(line, comments=True)
        verb = " ".join(argv[1:3]) if argv[1] in ("kv", "stream", "micro") else argv[1]
        commands.setdefault(verb, []).append(argv)
    return commands


async def gather_replies(nc, subject: str, payload: bytes = b"", wait_s: float = 1.0) -> list:
    """What ``nats micro ls`` does: one request, every responder's reply within ``wait_s``."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, payload, reply=inbox)
    replies = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    with contextlib.suppress(Exception):
        while loop.time() < deadline:
            replies.append(json.loads((await sub.next_msg(timeout=deadline - loop.time())).data))
    await sub.unsubscribe()
    return replies


async def admin_connection(argv: list[str], admin_env: Path):
    """``nats context save ... --server "$NATS_URL" --user "$NATS_USER" --password
    "$NATS_PASSWORD"`` after sourcing the admin file ``aikg up`` writes: a connection."""
    env = dict(line.split("=", 1) for line in admin_env.read_text().splitlines() if line)
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    values = {k: re.sub(r"\$(\w+)", lambda m: env[m.group(1)], v) for k, v in flags.items()}
    return await nats.connect(values["--server"], user=values["--user"],
                              password=values["--password"])


async def test_every_cheat_sheet_line_works(settings: Settings, bus: Bus, tmp_path: Path,
                                            bus_credentials: BusCredentials,
                                            fake_worker_heartbeat) -> None:
    from services.generator.service import run_generator
    from services.worker.service import run_worker

    sheet = cheat_sheet()
    cmds = {verb: lines[0] for verb, lines in sheet.items()}
    assert {"context", "pub", "sub", "kv get", "stream view", "kv ls", "micro ls",
            "micro info", "req"} <= set(cmds), sorted(cmds)
    assert len(sheet["kv get"]) == 2  # a job record, a worker's heartbeat
    # The server refuses anonymous clients: every line runs as the admin, connected the
    # way the sheet's first line says, with the file `aikg up` writes.
    admin_env = bus_credentials.write_admin_env(tmp_path / "nats-admin.env", settings.nats_url)
    assert admin_env.stat().st_mode & 0o777 == 0o600
    nc = await admin_connection(cmds["context"], admin_env)

    # `nats sub 'jobs.events.>'`, started before anything happens.
    sub_argv = cmds["sub"]
    assert sub_argv[2] == "jobs.events.>"
    events = await nc.subscribe(sub_argv[2])

    # A worker's heartbeat (so the job is accepted) but no worker pulling yet, so the
    # verify request waits in VERIFY for `nats stream view` to show it.
    await fake_worker_heartbeat(bus, "cpu", settings.arch, worker_id="not-pulling")
    stop = asyncio.Event()
    services = [asyncio.create_task(run_generator(settings, stop), name="generator")]
    try:
        # `nats pub jobs.submit -H Nats-Msg-Id:relu-1 '{...}'`
        pub = cmds["pub"]
        subject, header, body = pub[2], pub[4], pub[5]
        assert (subject, pub[3]) == ("jobs.submit", "-H")
        name, _, value = header.partition(":")
        await nc.publish(subject, body.encode(), headers={name: value})
        job_id = json.loads(body)["job_id"]

        # `nats stream view VERIFY`
        stream = cmds["stream view"][3]
        assert stream == subjects.STREAM_VERIFY
        for _ in range(600):
            if (await bus.js.stream_info(stream)).state.messages:
                break
            await asyncio.sleep(0.1)
        # VERIFY is a work queue, which takes no unacknowledged (ordered) consumer: read
        # it by sequence, message by message, as a pager over it does.
        state = (await bus.js.stream_info(stream)).state
        raw = await bus.js.get_msg(stream, state.first_seq)
        request = decode(raw.data, VerifyRequest)
        assert (request.job_id, request.op_name, request.backend) == (job_id, "relu", "cpu")

        # Now a real worker takes it.
        services.append(asyncio.create_task(run_worker(settings, stop), name="worker"))

        # `nats kv get jobs relu-1`: the raw bytes of the record.
        kv_get = cmds["kv get"]
        assert kv_get[3:5] == ["jobs", job_id]
        kv = await bus.js.key_value(kv_get[3])
        record = {}
        for _ in range(900):
            with contextlib.suppress(Exception):
                record = json.loads((await kv.get(kv_get[4])).value)
                if record["status"] in ("completed", "failed"):
                    break
            for t in services:
                if t.done():
                    t.result()
            await asyncio.sleep(0.1)
        assert record.get("status") == "completed", record.get("error")
        assert record["result"]["verdict"]["passed"] is True
        decode(json.dumps(record).encode(), JobRecord)

        seen = []
        with contextlib.suppress(Exception):
            while True:
                msg = await events.next_msg(timeout=scaled(1.0))
                seen.append((msg.subject, json.loads(msg.data)["event"]))
        assert seen[0] == (f"jobs.events.{job_id}", "submitted")
        assert ("jobs.events." + job_id, "completed") in seen
        assert {"started", "verify_started", "verify_result"} <= {e for _, e in seen}

        # `nats kv ls workers`, `nats kv get workers WORKER_ID`
        workers_kv = await bus.js.key_value(cmds["kv ls"][3])
        live = await workers_kv.keys()
        real = next(k for k in live if k != "not-pulling")

        # `nats micro ls` / `nats micro info aikg-worker` / `nats req aikg.worker.ID.status ''`
        assert cmds["micro ls"] == ["nats", "micro", "ls"]
        pings = await gather_replies(nc, "$SRV.PING")
        mine = [p for p in pings if p["name"] == cmds["micro info"][3]]
        assert [p["metadata"]["worker_id"] for p in mine] == [real]
        (info,) = await gather_replies(nc, f"$SRV.INFO.{cmds['micro info'][3]}")
        req = cmds["req"]
        status_subject = req[2].replace("WORKER_ID", real)
        assert status_subject in [e["subject"] for e in info["endpoints"]]
        reply = await nc.request(status_subject, req[3].encode(), timeout=scaled(5))
        status = json.loads(reply.data)
        assert status["worker_id"] == real and status["leases"] == []
        kv_worker = sheet["kv get"][1]
        assert kv_worker[3:5] == ["workers", "WORKER_ID"]
        worker_info = json.loads((await workers_kv.get(kv_worker[4].replace("WORKER_ID",
                                                                           real))).value)
        assert worker_info["backend"] == "cpu" and worker_info["capacity"] >= 1
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*services, return_exceptions=True), 60)
        await events.unsubscribe()
        await nc.close()
