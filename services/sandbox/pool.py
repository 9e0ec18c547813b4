"""The sandbox as its users see it: :class:`Sandbox`, a warm fork server, the probe of
what confinement this machine permits, scratch directories and child specs.

The parts: :mod:`~services.sandbox.server` (the fork server, from its parent's side),
:mod:`~services.sandbox.channel` (one child: its frames, its exit, its cleanup),
:mod:`~services.sandbox.errors`. A user spawns children with :meth:`Sandbox.spawn` on
specs from :meth:`Sandbox.spec` and reads them through the
:class:`~services.sandbox.channel.ChildRun` it gets.
"""

from __future__ import annotations

import asyncio
import functools
import os
import pwd
import re
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from services.common.runtime import claim_owner, remove_stale_dirs
from services.sandbox import wire
from services.sandbox.channel import (
    EXIT_WAIT_S,
    ChildRun,
    abandon,
    abandon_when_forked,
    background,
    describe_exit,
    keep,
)
from services.sandbox.errors import PoolBroken, SandboxRefused
from services.sandbox.roles import runner_of
from services.sandbox.server import SandboxPool
from services.sandbox.wire import ChildSpec

log = structlog.get_logger("aikg.sandbox")

# Isolation mechanisms a Sandbox can be told to require (setting ``sandbox_require``).
MECHANISMS = ("user", "capabilities", "network", "landlock", "seccomp", "pid", "scratch")
_PROBE_TIMEOUT_S = 120.0


def safe_name(text: str) -> str:
    """``text`` reduced to a short file-name-safe token."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64] or "x"


# A default scratch root's name: aikg-<name>-<pid of its owner>-<8 hex digits>.
_SCRATCH_ROOT_NAME = re.compile(r"aikg-.+-(\d+)-[0-9a-f]{8}")


def remove_stale_scratch_roots(base: Path) -> list[Path]:
    """Remove the default scratch roots under ``base`` (``aikg-<name>-<pid>-<hex>``, with
    an owner file) whose process is gone. A process killed with its fork server (SIGKILL
    of a whole ``aikg up``, an OOM kill of the process group) leaves its root behind:
    run directories, a Triton cache. Each start of a default root removes those (see
    :func:`services.common.runtime.remove_stale_dirs`).

    Returns:
        The directories removed.
    """
    def pid_of(name: str) -> int | None:
        match = _SCRATCH_ROOT_NAME.fullmatch(name)
        return int(match.group(1)) if match else None

    return remove_stale_dirs(base, "aikg-*-*-*", pid_of, need_owner=True)


@dataclass
class Isolation:
    """What the sandbox probe found: the confinement every child of a :class:`Sandbox` gets.

    ``run_as``: (uid, gid) children switch to, or None when they keep this process's
    user; ``capabilities``: capability bits a child still holds (0: none);
    ``landlock_abi``: 0 when files are not confined; ``notes``: each step the machine
    did not permit, in words.
    """

    run_as: tuple[int, int] | None = None
    network_isolated: bool = False
    capabilities: int = 0
    landlock_abi: int = 0
    seccomp: bool = False
    pid_namespace: bool = False
    scratch_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def in_force(self) -> dict[str, bool]:
        """Each of :data:`MECHANISMS` -> whether children have it."""
        return {"user": self.run_as is not None and self.run_as[0] != 0,
                "capabilities": self.capabilities == 0,
                "network": self.network_isolated,
                "landlock": self.landlock_abi > 0,
                "seccomp": self.seccomp,
                "pid": self.pid_namespace,
                "scratch": self.scratch_bytes is not None}

    def check(self, require: tuple[str, ...] | list[str]) -> None:
        """Raise when a mechanism in ``require`` is not in force.

        Raises:
            SandboxRefused: naming the missing mechanisms and the probe's notes.
        """
        missing = [m for m, on in self.in_force().items() if m in require and not on]
        if missing:
            raise SandboxRefused(
                f"the sandbox lacks {', '.join(missing)}, which the setting sandbox_require "
                f"asks for: {'; '.join(self.notes) or 'the probe gave no reason'}")

    def summary(self) -> list[str]:
        """One short phrase per mechanism, e.g. ``user 65534``, ``no landlock``."""
        on = self.in_force()
        words = {"user": f"user {self.run_as[0]}" if on["user"] else "no user switch",
                 "capabilities": "no capabilities" if on["capabilities"]
                 else f"capabilities {self.capabilities:#x}",
                 "network": "no network" if on["network"] else "network reachable",
                 "landlock": f"landlock v{self.landlock_abi}" if on["landlock"] else "no landlock",
                 "seccomp": "seccomp" if on["seccomp"] else "no seccomp",
                 "pid": "own pid namespace" if on["pid"] else "no pid namespace",
                 "scratch": f"scratch tmpfs {(self.scratch_bytes or 0) >> 20} MiB"
                 if on["scratch"] else "scratch unbounded"}
        return [words[m] for m in MECHANISMS]


class Sandbox:
    """The one way this service runs untrusted code: a warm fork server, the probe of
    what confinement this machine permits, scratch directories and child specs.

    Its users run children of the roles they registered in it
    (:mod:`services.sandbox.roles`): the worker's verifier, and the generator's and the
    SDK's built-in coder. Every child is a fresh process (no state carried from one job
    to the next) confined as :func:`services.sandbox.hardening.enter_sandbox` says.

    Args:
        backend: ``cpu`` (Triton interpreter), ``cuda`` or ``ascend``: the device the
            children use (the probe launches a Triton kernel on it).
        name: names the default scratch root, ``<tmp>/aikg-<name>-<pid>-<random>`` (created at start).
        scratch_root: where run directories and per-device Triton caches live; a
            default one is removed on :meth:`close` (and by the fork server when this
            process dies; by the next start of a default root under the same directory
            when the fork server died too, :func:`remove_stale_scratch_roots`).
        require: mechanisms (:data:`MECHANISMS`) without which :meth:`start` refuses.
        env_allow: more environment variable names (or ``PREFIX*``) children keep.
        preload: more modules the fork server imports once.

    Raises:
        ValueError: ``backend`` or a name in ``require`` is unknown.
    """

    def __init__(self, backend: str, *, name: str, scratch_root: str | Path | None = None,
                 require: tuple[str, ...] | list[str] = (), env_allow: tuple[str, ...] = (),
                 preload: tuple[str, ...] = (),
                 scratch_bytes: int | None = 256 << 20) -> None:
        if backend not in ("cpu", "cuda", "ascend"):
            raise ValueError(f"backend must be cpu, cuda or ascend, not {backend!r}")
        unknown = sorted(set(require) - set(MECHANISMS))
        if unknown:
            raise ValueError(f"unknown sandbox mechanism(s) {', '.join(unknown)}; "
                             f"choose from {', '.join(MECHANISMS)}")
        self.backend = backend
        self.require = tuple(require)
        self.env_allow = tuple(env_allow)
        self.scratch_bytes = scratch_bytes
        self.own_scratch = scratch_root is None
        # The default root is this process's own (a fresh directory): two sandboxes of
        # the same name on one machine (two ``aikg run``, two test sessions) must not
        # remove each other's run directories when one of them closes.
        self.scratch_root = Path(scratch_root) if scratch_root is not None else (
            Path(os.environ.get("TMPDIR", "/tmp"))
            / f"aikg-{safe_name(name)}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.isolation = Isolation()
        # Triton decides at import time whether its standard library (tl.sigmoid,
        # tl.softmax ...) is interpreted, so the fork server must import it with
        # TRITON_INTERPRET already set on the cpu backend; a child's later switch only
        # covers kernels the candidate defines itself (a compile child switches back,
        # services.worker.aot.compile_mode).
        server_env = dict(os.environ)
        # Triton 3.9's default (FP fusion on: a * b + c may become one FMA), set
        # explicitly: Triton 3.10 turns it off, which would change results under the
        # same verdict, and 3.9 warns once in every process where it is unset. A value
        # the user set stands.
        server_env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        if backend == "cpu":
            server_env["TRITON_INTERPRET"] = "1"
        else:
            server_env.pop("TRITON_INTERPRET", None)
        if backend == "cpu":
            # A child runs on one core's worth (threads are refused once it holds
            # inputs); BLAS pools sized for the machine would try to start threads.
            # One thread whatever the environment says: the interpreter's tl.dot calls
            # BLAS (services.sandbox.interpreter).
            for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
                server_env[name] = "1"
        self.pool = SandboxPool(
            env=server_env, env_allow=self.env_allow, preload=list(preload),
            # A SIGKILLed owner cannot remove its own scratch root; its fork server does.
            orphan_cleanup=self.scratch_root if self.own_scratch else None,
            visible=[self.scratch_root])
        self.started = False
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the fork server and probe the sandbox (blocks for seconds). Idempotent.

        Raises:
            PoolBroken: the server did not start, or no sandboxed child could run.
            SandboxRefused: a required mechanism is not available.
        """
        with self._start_lock:
            if self.started:
                return
            self.scratch_root.mkdir(parents=True, exist_ok=True)
            os.chmod(self.scratch_root, 0o711)
            if self.own_scratch:
                claim_owner(self.scratch_root)
                removed = remove_stale_scratch_roots(self.scratch_root.parent)
                if removed:
                    log.info("sandbox.stale_scratch_removed", count=len(removed),
                             paths=[str(p) for p in removed])
            for sub in ("runs", "triton-cache"):
                (self.scratch_root / sub).mkdir(exist_ok=True)
                os.chmod(self.scratch_root / sub, 0o711)
            self.pool.start()
            try:
                self.isolation = self._probe()
                self.isolation.check(self.require)
            except BaseException:
                self.pool.close()
                raise
            self.started = True

    def abort_start(self) -> None:
        """Make a :meth:`start` under way in another thread fail fast (PoolBroken) if its
        fork server is not ready yet (:meth:`SandboxPool.abort_start`)."""
        if not self.started:
            self.pool.abort_start()

    def close(self) -> None:
        """Stop the fork server (it kills every child's process group); remove a default
        scratch root."""
        with self._start_lock:
            self.pool.close()
            self.started = False
            if self.own_scratch:
                shutil.rmtree(self.scratch_root, ignore_errors=True)

    def _probe(self) -> Isolation:
        """Run probe children: as user ``nobody`` first (when root), else as this user."""
        notes: list[str] = []
        choices: list[tuple[int, int] | None] = [None]
        if os.geteuid() == 0:
            try:
                nobody = pwd.getpwnam("nobody")
                choices.insert(0, (nobody.pw_uid, nobody.pw_gid))
            except KeyError:
                notes.append("children run as root: no user 'nobody'")
        failure = ""
        for run_as in choices:
            hello, failure = _in_thread(self._probe_once(run_as))
            if hello is not None:
                return Isolation(run_as=run_as, network_isolated=hello.network_isolated,
                                 capabilities=hello.capabilities,
                                 landlock_abi=hello.landlock_abi, seccomp=hello.seccomp,
                                 pid_namespace=hello.pid_namespace,
                                 scratch_bytes=hello.scratch_bytes,
                                 notes=notes + hello.notes)
            notes.append(f"children keep this process's user: switching to uid {run_as[0]} "
                         f"failed: {failure}" if run_as else failure)
        raise PoolBroken(f"no sandboxed child could run: {failure}")

    async def _probe_once(self, run_as: tuple[int, int] | None) -> tuple[wire.Hello | None, str]:
        scratch = self.scratch("probe", "probe", run_as)
        # No device restriction: the probe checks that some device is usable at all.
        env = {k: v for k, v in self.child_env("probe", run_as).items()
               if k not in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")}
        spec = ChildSpec(role="probe", scratch_dir=str(scratch), backend=self.backend,
                         env=env, run_as=run_as, env_allow=list(self.env_allow),
                         scratch_bytes=self.scratch_bytes)
        run = await self.spawn(spec, 1 << 20)
        hello = None
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_S):
                while True:
                    frame = await run.frame()
                    if isinstance(frame, wire.Hello):
                        hello = frame
                    elif isinstance(frame, wire.Failure):
                        return None, frame.message
                    elif isinstance(frame, wire.Done):
                        return hello, ""
                    elif frame is None:
                        status = await run.wait(EXIT_WAIT_S)
                        return None, f"the probe child {describe_exit(status)}: " + \
                            run.output(4096)
        finally:
            await run.close()

    # ------------------------------------------------------------ children

    def scratch(self, label: str, role: str, run_as: tuple[int, int] | None = None) -> Path:
        """A fresh scratch directory (mode 0700, owned by the sandbox user) for one child."""
        path = self.scratch_root / "runs" / f"{safe_name(label)}-{role}-{uuid.uuid4().hex[:8]}"
        path.mkdir(mode=0o700)
        run_as = run_as if run_as is not None else self.isolation.run_as
        if run_as is not None:
            os.chown(path, *run_as)
        return path

    def child_env(self, device: str, run_as: tuple[int, int] | None = None) -> dict[str, str]:
        """Variables set in a child for ``device``: its Triton cache, its one visible device."""
        run_as = run_as if run_as is not None else self.isolation.run_as
        cache = self.scratch_root / "triton-cache" / safe_name(device)
        if not cache.exists():
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            if run_as is not None:
                os.chown(cache, *run_as)
        env = {"TRITON_CACHE_DIR": str(cache)}
        if self.backend == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = device
        elif self.backend == "ascend":
            env["ASCEND_RT_VISIBLE_DEVICES"] = device
        else:
            env["TRITON_INTERPRET"] = "1"
        return env

    def spec(self, role: str, scratch: Path, device: str, **fields: Any) -> ChildSpec:
        """A ChildSpec for ``role`` with this sandbox's user, environment and isolation,
        and the role's registered runner (:func:`services.sandbox.roles.runner_of`).

        Raises:
            KeyError: nobody registered ``role``.
        """
        fields.setdefault("scratch_bytes", self.scratch_bytes)
        fields.setdefault("runner", runner_of(role))
        return ChildSpec(role=role, scratch_dir=str(scratch), backend=self.backend,
                         env=self.child_env(device), run_as=self.isolation.run_as,
                         isolate_network=True, env_allow=list(self.env_allow), **fields)

    async def spawn(self, spec: ChildSpec, max_frame_bytes: int) -> ChildRun:
        """Fork a child for ``spec`` and wait for its pid.

        A caller cancelled meanwhile (a job cancelled, a worker stopping) leaves nothing
        behind: the child forked for it is killed and its scratch directory removed.

        Raises:
            PoolBroken: the fork server is gone and could not be restarted (the
                scratch directory is removed).
        """
        forking = asyncio.ensure_future(asyncio.to_thread(self.pool.spawn, spec, max_frame_bytes))
        try:
            run = await asyncio.shield(forking)
        except asyncio.CancelledError:
            # The fork goes on in its thread: reap what it starts.
            forking.add_done_callback(functools.partial(abandon_when_forked, spec.scratch_dir))
            keep(forking)
            raise
        except BaseException:
            shutil.rmtree(spec.scratch_dir, ignore_errors=True)
            raise
        starting = asyncio.ensure_future(run.start())
        try:
            await asyncio.shield(starting)
        except PoolBroken:
            await run.close()
            raise
        except asyncio.CancelledError:
            # The start goes on: the cleanup waits for it (a second reader of the
            # status socket would leave this one pending when the socket closes).
            background(abandon(run, starting))
            raise
        return run


def _in_thread(coro: Any) -> Any:
    """Run ``coro`` on a fresh event loop in its own thread (callable from sync code
    that may itself be running inside an event loop); its exception becomes
    ``(None, "Type: message")``."""
    box: dict[str, Any] = {}

    def runner() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            box["value"] = (None, f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=runner, name="aikg-sandbox-probe")
    thread.start()
    thread.join()
    return box["value"]
