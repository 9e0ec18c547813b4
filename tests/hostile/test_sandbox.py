"""Untrusted code stays in the sandbox: a task's own module code and a candidate, tried as
an attacker would, in every place they run (the generator's built-in coder, the
worker's reference and candidate children, ``aikg run`` and ``LocalWorker``).

The hostile task records what it can see (its uid, capability sets, the environment,
a connection to the NATS port) and raises it as its error, so the verdict carries the
record. The hostile candidate reads a root-only file, a NATS store, another job's
scratch directory and the worker's own files through several file APIs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from schemas import VerifyRequest
from services.common.verify_client import build_request
from services.sandbox.pool import MECHANISMS
from tests.helpers import DB_URL, RELU_KERNEL, ROOT, SECRET, scaled, services_running, wait_terminal

FACTS_TASK = '''\
import json, os, socket
import torch
import torch.nn as nn

FACTS = {{"uid": os.getuid(), "euid": os.geteuid(),
          "visible": sorted(k for k in os.environ
                            if k.startswith(("AIKG_", "DATABASE", "NATS")) or "{secret}" in os.environ[k])}}
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    FACTS["nats"] = "connected"
except OSError as exc:
    FACTS["nats"] = type(exc).__name__
with open("/proc/self/status") as f:
    FACTS["caps"] = {{l.split(":")[0]: l.split()[1] for l in f if l.startswith("Cap")}}
# Ways back to privilege: a user namespace (capabilities inside it), ptrace, setuid.
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
FACTS["unshare_user"] = ctypes.get_errno() if libc.unshare(0x10000000) else "allowed"
FACTS["ptrace"] = ctypes.get_errno() if libc.ptrace(0, 0, 0, 0) else "allowed"
try:
    os.setuid(0)
    FACTS["setuid"] = "allowed"
except OSError as exc:
    FACTS["setuid"] = exc.errno
raise RuntimeError("SANDBOX-FACTS " + json.dumps(FACTS) + " END")


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return []
'''

# Module-level code of a candidate: runs at import, before the static check's forward
# rules apply, and reaches os/io/codecs through torch's own module attributes.
READS_CANDIDATE = RELU_KERNEL.replace("class ModelNew(nn.Module):", '''\
_os = torch.serialization.os
_io = torch.serialization.io
FACTS = {{}}
for _name, _read in (
        ("os.open", lambda p: _os.read(_os.open(p, _os.O_RDONLY), 64)),
        ("io.FileIO", lambda p: _io.FileIO(p).read()),
        ("io.open", lambda p: _io.open(p, "rb").read()),
        ("codecs.open", lambda p: _os.sys.modules["codecs"].open(p, "rb").read())):
    for _what, _path in (("secret", "{secret_file}"), ("worker_file", "{worker_file}")):
        try:
            _read(_path)
            FACTS[_name + " " + _what] = "read"
        except Exception as _exc:
            FACTS[_name + " " + _what] = type(_exc).__name__
for _what, _path in (("nats_store", "{store}"), ("other_runs", "{runs}"), ("root_home", "/root")):
    try:
        _os.listdir(_path)
        FACTS["listdir " + _what] = "listed"
    except Exception as _exc:
        FACTS["listdir " + _what] = type(_exc).__name__
FACTS["env"] = sorted(k for k in _os.environ if k in ("DATABASE_URL", "AIKG_LLM_API_KEY"))
FACTS["uid"] = _os.getuid()


class ModelNew(nn.Module):''').replace("        return out\n", '''\
        if FACTS:
            raise RuntimeError("SANDBOX-FACTS " + str(FACTS).replace("'", '"') + " END")
        return out
''')

# The same 4 x 8 relu task without the fact recording (imports only, then the model).
PLAIN_TASK = FACTS_TASK.split("FACTS =")[0] + FACTS_TASK.split("END\")\n", 1)[1]

# A task whose constructor never returns.
HANGING_TASK = PLAIN_TASK.replace("import json, os, socket\n", "import time\n").replace(
    "class Model(nn.Module):\n", "class Model(nn.Module):\n    def __init__(self):\n"
    "        super().__init__()\n        while True:\n            time.sleep(1)\n\n")


def facts_of(text: str) -> dict:
    """The JSON a hostile task or candidate raised (between SANDBOX-FACTS and END)."""
    # ``aikg run --json`` prints the error inside a JSON string: undo its escaping.
    text = text.replace('\\"', '"')
    match = re.search(r"SANDBOX-FACTS (\{.*?\}) END", text, re.S)
    assert match, f"no recorded facts in: {text[:2000]}"
    return json.loads(match.group(1))


def assert_confined(facts: dict) -> None:
    """What a task's code saw: no secret, no bus, and (as root here) no privilege."""
    assert facts["visible"] == [], facts
    assert facts["nats"] != "connected", facts
    if os.geteuid() == 0:
        assert facts["uid"] != 0 and facts["euid"] != 0, facts
        assert set(facts["caps"].values()) == {"0000000000000000"}, facts
        # EPERM from the seccomp filter (unshare, ptrace) and from the kernel (setuid).
        assert (facts["unshare_user"], facts["ptrace"], facts["setuid"]) == (1, 1, 1), facts


@pytest.fixture
def secret_env(monkeypatch) -> None:
    """Secrets in the services' own environment, as an operator's shell might have."""
    monkeypatch.setenv("AIKG_LLM_API_KEY", SECRET)
    monkeypatch.setenv("DATABASE_URL", DB_URL)


@pytest.fixture(scope="module")
def verifier(shared_verifier):
    """A worker's verifier started while the environment holds secrets (the session's:
    SECRET_ENV)."""
    return shared_verifier


def request(task: str, code: str) -> VerifyRequest:
    return build_request(request_id=f"req-{uuid.uuid4().hex[:8]}", job_id="job-sandbox",
                         candidate_id="cand", op_name="relu", task_desc=task, code=code,
                         backend="cpu", arch="x86_64", trials=1, timeout_s=60)


async def test_probe_reports_every_mechanism(verifier) -> None:
    iso = verifier.sandbox.isolation
    summary = iso.summary()
    assert len(summary) == len(MECHANISMS)
    if os.geteuid() == 0:
        # Root on a Linux >= 5.13 with Landlock and libseccomp: everything in force.
        assert iso.in_force() == {m: True for m in iso.in_force()}, iso.notes
        assert summary[1] == "no capabilities" and iso.capabilities == 0


async def test_task_code_in_the_worker_sees_no_secret_no_network_no_privilege(
        verifier, nats_server) -> None:
    task = FACTS_TASK.format(secret=SECRET, port=nats_server.port)
    result = await verifier.verify(request(task, RELU_KERNEL), device="0")
    assert result.stage == "infrastructure", result
    assert_confined(facts_of(result.error))


async def test_candidate_cannot_read_past_its_scratch_directory(verifier, nats_server) -> None:
    if verifier.run_as is None or not verifier.sandbox.isolation.landlock_abi:
        pytest.skip("this machine permits no user switch or no Landlock: "
                    + "; ".join(verifier.sandbox_notes))
    # A root-only file in a directory anyone may traverse: only permissions protect it.
    secret_dir = Path("/tmp") / f"aikg-test-secret-{uuid.uuid4().hex[:8]}"
    secret_dir.mkdir(mode=0o755)
    secret_file = secret_dir / "secret"
    secret_file.write_text("root only")
    secret_file.chmod(0o600)
    other_run = verifier.sandbox.scratch("other-job", "candidate")
    (other_run / "candidate.py").write_text("# another job's kernel")
    try:
        code = READS_CANDIDATE.format(secret_file=secret_file, worker_file=ROOT / "pyproject.toml",
                                      store=nats_server.store_dir, runs=other_run)
        result = await verifier.verify(request(PLAIN_TASK, code), device="0")
    finally:
        secret_file.unlink()
        secret_dir.rmdir()
    assert result.stage == "runtime", result
    facts = facts_of(result.error)
    reads = {k: v for k, v in facts.items() if k.split()[0] in (
        "os.open", "io.FileIO", "io.open", "codecs.open", "listdir")}
    assert len(reads) == 11, facts  # 4 APIs x 2 files + 3 directories
    # Denied (Landlock, permissions) or not even visible (the private mount namespace).
    assert set(reads.values()) <= {"PermissionError", "FileNotFoundError"}, facts
    assert facts["env"] == [] and facts["uid"] != 0, facts
    # ... and the verifier serves the next candidate normally.
    ok = await verifier.verify(request(PLAIN_TASK, RELU_KERNEL), device="0")
    assert ok.passed, ok


@pytest.mark.slow
async def test_task_code_in_the_generator_through_the_gateway(
        settings, bus, start_gateway, nats_server, secret_env) -> None:
    """Submitted over HTTP: the lowering runs the task's code in the sandbox only."""
    gateway = await start_gateway(settings)
    task = FACTS_TASK.format(secret=SECRET, port=nats_server.port)
    async with services_running(settings, bus), httpx.AsyncClient(base_url=gateway,
                                                                  timeout=scaled(10)) as client:
        resp = await client.post("/api/v1/jobs/submit", json={
            "op_name": "facts", "task_desc": task, "backend": "cpu", "arch": settings.arch})
        assert resp.status_code in (200, 201, 202), resp.text
        record = await wait_terminal(client, resp.json()["job_id"], timeout_s=120)
    assert record["status"] == "failed", record
    assert record["error"].startswith("task source raised RuntimeError"), record["error"]
    assert_confined(facts_of(record["error"]))


@pytest.mark.slow
async def test_hanging_tasks_do_not_hold_up_other_jobs(settings, bus, start_gateway,
                                                       relu_task) -> None:
    """Two tasks whose Model.__init__ never returns, then a relu: the relu job ends while
    both hanging jobs are still lowering, its latency near an idle run's (2x plus a
    second of slack: sub-second latencies on a shared machine vary that much between
    two idle runs); the hanging jobs fail once the lowering times out."""
    settings = type(settings)(**{**{f: getattr(settings, f) for f in settings.__struct_fields__},
                                 "lowering_timeout_s": 20.0})
    gateway = await start_gateway(settings)
    body = {"op_name": "relu", "task_desc": relu_task, "backend": "cpu", "arch": settings.arch}

    async def job(client: httpx.AsyncClient, **fields) -> str:
        resp = await client.post("/api/v1/jobs/submit", json={**body, **fields})
        assert resp.status_code in (200, 201, 202), resp.text
        return resp.json()["job_id"]

    async def timed(client: httpx.AsyncClient) -> float:
        started = time.monotonic()
        record = await wait_terminal(client, await job(client), timeout_s=120)
        assert record["status"] == "completed", record
        return time.monotonic() - started

    async with services_running(settings, bus), httpx.AsyncClient(base_url=gateway,
                                                                  timeout=scaled(10)) as client:
        await timed(client)  # warm: the first job pays for the worker's first reference
        idle = await timed(client)
        hung = [await job(client, op_name="hang", task_desc=HANGING_TASK) for _ in range(2)]
        await asyncio.sleep(1.0)  # both are lowering (and hanging) now
        busy = await timed(client)
        meanwhile = [(await client.get(f"/api/v1/jobs/{j}")).json()["status"] for j in hung]
        ends = [await wait_terminal(client, j, timeout_s=90) for j in hung]
    assert meanwhile == ["running", "running"], meanwhile
    assert busy <= 2 * idle + scaled(1.0), \
        f"relu took {busy:.2f} s beside two hanging tasks, {idle:.2f} s idle"
    for record in ends:
        assert record["status"] == "failed", record
        assert "did not finish in 20 s (setting AIKG_LOWERING_TIMEOUT_S)" in record["error"], \
            record["error"]


@pytest.mark.slow
def test_aikg_run_lowers_in_the_sandbox(tmp_path, secret_env, nats_server) -> None:
    task = tmp_path / "facts.py"
    task.write_text(FACTS_TASK.format(secret=SECRET, port=nats_server.port))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "run", str(task), "--json"],
                          capture_output=True, text=True, timeout=scaled(240), env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert_confined(facts_of(proc.stdout + proc.stderr))


@pytest.mark.slow
async def test_local_worker_runs_task_code_in_the_sandbox(secret_env, nats_server) -> None:
    from services.sdk import LocalWorker, Task, WorkerManager

    task = FACTS_TASK.format(secret=SECRET, port=nats_server.port)
    manager = WorkerManager()
    worker = LocalWorker([0], backend="cpu")
    manager.add(worker, "cpu", worker.arch, 1)
    try:
        # init_code first: the worker's reference child runs the task; then the
        # built-in coder's lowering runs it too.
        _, passed, info = await Task("facts", task, task_id="sandbox", backend="cpu",
                                     arch=worker.arch, init_code=RELU_KERNEL,
                                     worker_manager=manager).run()
    finally:
        await worker.close()
    assert not passed
    assert_confined(facts_of(info["error"]))


def test_required_mechanisms_and_how_workers_show_them() -> None:
    from services.cli.render import sandbox_cell
    from services.sandbox.pool import Isolation, Sandbox, SandboxRefused

    full = Isolation(run_as=(65534, 65534), network_isolated=True, landlock_abi=7, seccomp=True)
    full.check(("user", "capabilities", "network", "landlock", "seccomp"))
    assert sandbox_cell(full.summary()).plain == "full"
    bare = Isolation(run_as=None, network_isolated=True, capabilities=0x3, landlock_abi=0,
                     notes=["files not confined (Landlock): Landlock is not available"])
    bare.check(("network",))
    with pytest.raises(SandboxRefused, match="lacks landlock, which the setting "
                       "sandbox_require asks for: files not confined"):
        bare.check(("network", "landlock"))
    assert sandbox_cell(bare.summary()).plain == (
        "missing: user switch, capabilities, landlock, seccomp")
    assert sandbox_cell([]).plain == "?"
    with pytest.raises(ValueError, match="unknown sandbox mechanism"):
        Sandbox("cpu", name="x", require=("landlok",))


def test_fork_servers_pin_triton_fp_fusion_unless_the_user_set_it(monkeypatch) -> None:
    """Triton 3.9 fuses a * b + c into an FMA unless told otherwise, 3.10 will not, and
    3.9 warns in every process where it is unset: a sandbox pins today's default for its
    fork server and children, and keeps a value the user chose."""
    from services.sandbox.pool import Sandbox

    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    assert Sandbox("cpu", name="fusion-default").pool.env["TRITON_DEFAULT_FP_FUSION"] == "1"
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert Sandbox("cpu", name="fusion-user").pool.env["TRITON_DEFAULT_FP_FUSION"] == "0"


@pytest.mark.slow  # a worker with a sandbox of its own
async def test_worker_heartbeat_says_what_its_sandbox_has(settings, bus) -> None:
    from schemas import WorkerInfo, decode

    async with services_running(settings, bus, generator=False):
        for _ in range(100):
            infos = [decode((await bus.workers.get(k)).value, WorkerInfo)
                     for k in await bus.workers.keys()]
            if infos and infos[0].sandbox:
                break
            await asyncio.sleep(0.1)
    assert len(infos[0].sandbox) == len(MECHANISMS), infos
    if os.geteuid() == 0 and not infos[0].sandbox_notes:
        user, caps, network, landlock, seccomp, pid, scratch = infos[0].sandbox
        assert (user, caps, network, seccomp, pid) == (
            "user 65534", "no capabilities", "no network", "seccomp", "own pid namespace"), infos
        assert landlock.startswith("landlock v"), infos
        assert scratch.startswith("scratch tmpfs "), infos


def test_two_sandboxes_of_one_name_get_their_own_scratch_roots(tmp_path, monkeypatch):
    """Two `aikg run` (or test sessions) on one machine build sandboxes of the same name:
    neither may own, and on close remove, the other's run directories."""
    from services.sandbox.pool import Sandbox

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    first, second = Sandbox("cpu", name="aikg-run"), Sandbox("cpu", name="aikg-run")
    assert first.own_scratch and second.own_scratch
    assert first.scratch_root != second.scratch_root
    assert {first.scratch_root.parent, second.scratch_root.parent} == {tmp_path}
    assert str(os.getpid()) in first.scratch_root.name
    assert not first.scratch_root.exists(), "created at start, not at construction"
