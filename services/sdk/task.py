"""``Task``: generate a kernel for one operator here and verify it on a registered worker.

The HTTP AIKG service's local and worker-only modes (docs/compatibility.md):
register a worker once (``await register_local_worker([0], backend=..., arch=...)`` or
``await register_remote_worker(backend=..., arch=...)``), then
``await Task(op_name=..., task_desc=..., task_id=..., dsl=..., backend=..., arch=...).run()``
returns ``(op_name, passed, info)``.

Candidates are, in order, ``init_code`` when given, then the built-in coder's kernel
(:func:`services.generator.lowering.lower_task`, which executes the task's code:
it runs in a sandboxed child process, never here). The first candidate that passes ends the
task; ``max_attempts`` bounds the verifications.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from schemas import subjects
from schemas.events import VerifyPhase
from services.common.settings import LOWERING_TIMEOUT_S
from services.common.task_source import TaskError, check_task
from services.generator.coders.screen import decline
from services.sdk.workers import (
    DevicePool,
    LocalWorker,
    WorkerManager,
    get_worker_manager,
)

# A lowering (torch.export of the task) takes ~1-2 s; a task whose code hangs is cut
# off after this many seconds (as the generator's built-in coder).
WORKFLOWS = ("coder_only_workflow", "default_workflow")

if TYPE_CHECKING:
    from services.sandbox.pool import Sandbox

_sandbox: Sandbox | None = None
_sandbox_lock = threading.Lock()


def _lowering_sandbox() -> Sandbox:
    """This process's built-in coder sandbox, started on first use, closed at exit."""
    # Imported here: the SDK's HTTP client must not pull in torch.
    from services.generator.coders.base import lowering_sandbox

    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            sandbox = lowering_sandbox(f"sdk-{os.getpid()}")
            sandbox.start()
            atexit.register(sandbox.close)
            _sandbox = sandbox
        return _sandbox


async def lower_in_child(task_desc: str, shape_overrides: Mapping[str, Any] | None = None,
                         timeout_s: float = LOWERING_TIMEOUT_S, *,
                         backend: str = "cpu") -> tuple[str | None, str | None]:
    """Run the built-in coder on ``task_desc`` in a sandboxed child (it executes the
    task's code: as an unprivileged user, without network, confined by Landlock and
    seccomp where the machine permits; see :class:`services.sandbox.pool.Sandbox`),
    with the launch parameters a service job on ``backend`` gets
    (:func:`services.generator.coders.base.launch_defaults`: on ``cpu``, the
    interpreter's larger blocks and tiles).

    Returns:
        ``(candidate source, None)``, or ``(None, reason)`` when the task cannot be
        lowered (the reason names the op), its code failed or killed the child, or it
        took longer than ``timeout_s`` seconds.
    """
    from services.generator.coders.base import launch_defaults
    from services.generator.coders.lowering_role import lower_in_sandbox
    from services.generator.lowering.errors import LoweringError
    from services.sandbox.pool import PoolBroken

    try:
        sandbox = await asyncio.to_thread(_lowering_sandbox)
        return await lower_in_sandbox(sandbox, task_desc, shape_overrides,
                                      launch_defaults(backend), timeout_s=timeout_s), None
    except LoweringError as exc:
        return None, str(exc)
    except PoolBroken as exc:
        return None, f"built-in coder's sandbox is broken: {exc}"


class Task:
    """One operator: write a kernel here, verify it on a worker from the manager.

    Args:
        op_name: operator name (``relu``).
        task_desc: KernelBench-format source (``class Model``, ``get_inputs()``,
            ``get_init_inputs()``).
        task_id: your id for this task; reported back in ``info``.
        dsl: ``triton`` (``triton_cuda`` / ``triton_ascend`` accepted).
        backend: ``cpu`` | ``cuda`` | ``ascend``.
        arch: e.g. ``a100``; None takes any registered worker of ``backend``.
        config: the reference's config mapping; its keys ``shape_overrides``,
            ``init_code``, ``max_attempts``, ``timeout_s`` and ``trials`` are read when
            the keyword arguments are not given. Other keys (LLM settings) are kept in
            :attr:`config` but unused: locally the built-in coder writes the kernel.
        framework: ``torch``.
        workflow: ``coder_only_workflow`` or ``default_workflow``; both run the
            built-in coder here.
        device_pool: deprecated (DeprecationWarning): registers a :class:`LocalWorker`
            on these devices with the manager; use ``register_local_worker``.
        shape_overrides: module-level names of the task to rebind, e.g. ``{"batch_size": 16}``.
        init_code: a candidate of your own, tried first.
        max_attempts: verifications at most (2 when init_code fails and the built-in
            coder's kernel follows).
        timeout_s: the worker's wall-clock limit per candidate, seconds.
        trials: correctness trials (seeds) per candidate.
        worker_manager: manager to take the worker from; default the process-wide one.
        on_phase: told the built-in coder's lowering as it starts and ends (a
            :class:`~schemas.events.VerifyPhase` named ``lowering``); a
            :class:`LocalWorker`'s own ``on_phase`` tells its verifications' phases.
    """

    def __init__(self, op_name: str, task_desc: str, task_id: str = "", dsl: str = "triton",
                 backend: str = "cpu", arch: str | None = None,
                 config: Mapping[str, Any] | None = None, framework: str = "torch",
                 workflow: str = "coder_only_workflow", device_pool: Any = None, *,
                 shape_overrides: Mapping[str, Any] | None = None, init_code: str | None = None,
                 max_attempts: int | None = None, timeout_s: float | None = None,
                 trials: int | None = None, worker_manager: WorkerManager | None = None,
                 on_phase: Callable[[VerifyPhase], None] | None = None) -> None:
        if workflow not in WORKFLOWS:
            raise ValueError(f"workflow must be one of {', '.join(WORKFLOWS)}, not {workflow!r}")
        config = dict(config or {}) if isinstance(config, Mapping) else {}
        self.op_name = op_name
        self.task_desc = task_desc
        self.task_id = task_id or op_name
        self.dsl = dsl
        self.backend = backend
        self.arch = arch
        self.config = config
        self.framework = framework
        self.workflow = workflow
        self.shape_overrides = dict(shape_overrides if shape_overrides is not None
                                    else config.get("shape_overrides") or {})
        self.init_code = init_code if init_code is not None else config.get("init_code")
        self.max_attempts = int(max_attempts or config.get("max_attempts") or 3)
        self.timeout_s = float(timeout_s or config.get("timeout_s") or 300.0)
        self.trials = int(trials or config.get("trials") or 3)
        self.manager = worker_manager or get_worker_manager()
        self.on_phase = on_phase
        if device_pool is not None:
            warnings.warn(
                "Task(device_pool=...) is deprecated and will be removed: call "
                f"`await register_local_worker({_devices_of(device_pool)!r}, backend="
                f"{backend!r}, arch={arch!r})` once and create Tasks without device_pool",
                DeprecationWarning, stacklevel=2)
            self._register_device_pool(device_pool)

    def _register_device_pool(self, device_pool: Any) -> None:
        devices = _devices_of(device_pool)
        for r in self.manager.registrations:
            w = r.worker
            if (isinstance(w, LocalWorker) and w.devices == devices and r.backend == self.backend
                    and (self.arch is None or r.arch in (self.arch, None))):
                return  # one sandbox per device pool, however many tasks use it
        worker = LocalWorker(devices, backend=self.backend, arch=self.arch)
        self.manager.add(worker, self.backend, worker.arch, len(devices))

    async def run(self) -> tuple[str, bool, dict[str, Any]]:
        """Generate candidates and verify them until one passes.

        Returns:
            ``(op_name, passed, info)``; ``info`` has ``task_id``, ``op_name``,
            ``backend``, ``arch``, ``passed``, ``code`` (the kernel: the passing one, or
            the last tried), ``verdict`` (the worker's VerifyResult as a dict),
            ``error`` (why it did not pass), ``attempts``, ``coder``, ``speedup``.

        Raises:
            services.sdk.workers.NoWorkerError: no worker registered for backend/arch.
        """
        info: dict[str, Any] = {
            "task_id": self.task_id, "op_name": self.op_name, "backend": self.backend,
            "arch": self.arch, "passed": False, "code": None, "verdict": None, "error": None,
            "attempts": 0, "coder": None, "speedup": None,
        }
        worker = self.manager.select(self.backend, self.arch)
        info["arch"] = self.arch or getattr(worker, "arch", None)
        try:
            check_task(self.task_desc, self.shape_overrides)
        except TaskError as exc:
            info["error"] = str(exc)
            return self.op_name, False, info

        if not self.init_code:
            declined = decline(self.task_desc)
            if declined is not None:  # seen in the source: no sandbox starts at all
                info["error"] = _llm_hint(declined)
                return self.op_name, False, info
        # A LocalWorker's sandbox takes seconds to start: overlap that with the lowering.
        warm = asyncio.ensure_future(worker.start()) if hasattr(worker, "start") else None
        try:
            await self._attempts(worker, info, warm)
        finally:
            if warm is not None and not warm.done():
                if info["attempts"] == 0 and hasattr(worker, "abort_start"):
                    # Nothing to verify (the coder declined): stop a start still under
                    # way rather than wait seconds for a sandbox no candidate will use.
                    worker.abort_start()
                await asyncio.gather(warm, return_exceptions=True)
        return self.op_name, bool(info["passed"]), info

    async def _attempts(self, worker: Any, info: dict[str, Any], warm: Any) -> None:
        candidates: list[tuple[str, str]] = []
        if self.init_code:
            candidates.append((self.init_code, "init_code"))
        coder_pending = True
        while info["attempts"] < self.max_attempts:
            if not candidates and coder_pending:
                coder_pending = False  # deterministic: one kernel per task
                code, error = await self._lower()
                if code is None:
                    info["error"] = _llm_hint(error or "")
                    return
                candidates.append((code, "builtin"))
            if not candidates:
                return
            code, coder = candidates.pop(0)
            info["attempts"] += 1
            if warm is not None:
                await warm  # a sandbox that cannot start raises here, once
                warm = None
            result = await worker.verify(
                self.task_desc, code, self.op_name, dsl=self.dsl, framework=self.framework,
                shape_overrides=self.shape_overrides, timeout_s=self.timeout_s,
                trials=self.trials, candidate_id=_candidate_id(self.task_id, info["attempts"]),
                mode="verify" if self.backend == "cpu" else "profile")
            info.update(code=code, coder=coder, verdict=msgspec.to_builtins(result),
                        passed=result.passed, speedup=result.speedup,
                        error=None if result.passed else
                        f"candidate failed verification at stage '{result.stage}': "
                        f"{result.error or 'no detail'}")
            if result.passed:
                return


    async def _lower(self) -> tuple[str | None, str | None]:
        """:func:`lower_in_child` of this task, told to ``on_phase``."""
        if self.on_phase is None:
            return await lower_in_child(self.task_desc, self.shape_overrides,
                                        backend=self.backend)
        from services.worker.progress import phase

        self.on_phase(phase("lowering"))
        started = time.monotonic()
        try:
            return await lower_in_child(self.task_desc, self.shape_overrides,
                                        backend=self.backend)
        finally:
            self.on_phase(phase("lowering", "ended", time.monotonic() - started))


def _llm_hint(error: str) -> str:
    """A refusal, with where the LLM coder runs: the generator service, not here."""
    if error.endswith("use the LLM coder"):
        error += (" (it runs in the generator service: `aikg submit --coder llm` to a "
                  "gateway whose generator has AIKG_LLM_BASE_URL and AIKG_LLM_MODEL set; "
                  "README: Using an LLM)")
    return error


def _devices_of(device_pool: Any) -> list[str]:
    if isinstance(device_pool, DevicePool):
        return list(device_pool.devices)
    devices = getattr(device_pool, "devices", device_pool)
    if isinstance(devices, int | str):
        devices = [devices]
    return [str(d) for d in devices]


def _candidate_id(task_id: str, attempt: int) -> str | None:
    return f"{task_id}-{attempt}" if subjects.is_token(task_id, 48) else None
