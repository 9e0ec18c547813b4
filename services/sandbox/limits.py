"""Resource limits of every sandboxed child, from one table of settings.

One row per role that runs code we did not write; each row is two settings
(services/common/settings.py), applied by :func:`services.sandbox.hardening.enter_sandbox`:

- ``lower``, the built-in coder's lowering of a task (generator, ``aikg run``):
  ``sandbox_lower_address_space_bytes`` (4 GiB), ``sandbox_lower_cpu_s``;
- ``reference``, the task's code in a worker (inputs, reference outputs):
  ``sandbox_reference_address_space_bytes`` (8 GiB), ``sandbox_reference_cpu_s``;
- ``candidate``, the candidate's planner and its kernels' replayers:
  ``sandbox_candidate_address_space_bytes`` (0: 16x the task's input bytes plus
  2 GiB), ``sandbox_candidate_cpu_s``;
- ``compile``, the GPU compile check (the candidate's kernel module and Triton's
  compiler, :mod:`services.worker.aot`): ``sandbox_compile_address_space_bytes``
  (4 GiB; a compile here grew the address space by about 30 MiB, and LLVM's thread
  pool may add a stack and a malloc arena, 72 MiB, per core), ``sandbox_compile_cpu_s``
  (600 s).

Address space is bytes beyond the forked child's own (the fork server's torch and
triton are mapped already) and applies on ``cpu`` only, but for the compile child on
every backend: CUDA and CANN map the device's memory into the address space, so a
bound there refuses the driver, not the task; the compile child uses no device. CPU time is seconds; 0 derives it from the run's wall-clock limit
(``lowering_timeout_s``, or the request's ``timeout_s`` times the machine's cores,
plus 10 s). A child over its address space gets ``MemoryError`` (or torch's
"can't allocate memory"), and its failure names the setting and its value; one over
its CPU time is killed by SIGXCPU, named the same way.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from services.common.settings import Settings

ROLES = ("lower", "reference", "candidate", "compile")
# The child roles that take a row of another (the replayer runs the candidate's kernels).
ROW_OF = {"lower": "lower", "reference": "reference", "candidate": "candidate",
          "replay": "candidate", "compile": "compile"}
# Seconds of CPU time beyond the wall-clock limit (interpreter start, teardown).
CPU_SLACK_S = 10
# The settings' defaults: those of the table's rows too.
_DEFAULTS = Settings()


def _gib(value: int) -> str:
    return f"{value / (1 << 30):.1f} GiB"


@dataclass(frozen=True)
class Limit:
    """One resolved limit: its value (None: none) and the words that name it."""

    value: int | None
    note: str


@dataclass(frozen=True)
class ChildLimits:
    """The table: per role, address space (bytes; 0 derived) and CPU time (seconds; 0
    derived). Defaults are the settings' defaults (:class:`Settings`)."""

    lower_address_space_bytes: int = _DEFAULTS.sandbox_lower_address_space_bytes
    lower_cpu_s: int = _DEFAULTS.sandbox_lower_cpu_s
    reference_address_space_bytes: int = _DEFAULTS.sandbox_reference_address_space_bytes
    reference_cpu_s: int = _DEFAULTS.sandbox_reference_cpu_s
    candidate_address_space_bytes: int = _DEFAULTS.sandbox_candidate_address_space_bytes
    candidate_cpu_s: int = _DEFAULTS.sandbox_candidate_cpu_s
    compile_address_space_bytes: int = _DEFAULTS.sandbox_compile_address_space_bytes
    compile_cpu_s: int = _DEFAULTS.sandbox_compile_cpu_s

    def address_space(self, role: str, backend: str, derived: int | None = None) -> Limit:
        """RLIMIT_AS headroom of a ``role`` child on ``backend``, bytes (None off cpu,
        but for the compile child).

        ``derived``: the value when the role's setting is 0 (None: no limit).

        Raises:
            KeyError: ``role`` has no row.
        """
        row = ROW_OF[role]
        name = f"sandbox_{row}_address_space_bytes"
        setting = getattr(self, f"{row}_address_space_bytes")
        if backend != "cpu" and row != "compile":
            return Limit(None, "")
        value = setting or derived
        if value is None:
            return Limit(None, "")
        if setting:
            note = f"AIKG_{name.upper()}={setting} ({_gib(setting)})"
        else:
            note = (f"{_gib(value)}, derived from the task's sizes since "
                    f"AIKG_{name.upper()} is 0")
        return Limit(value, note)

    def cpu_seconds(self, role: str, wall_s: float, cores: int | None = None) -> Limit:
        """RLIMIT_CPU of a ``role`` child whose run may last ``wall_s`` seconds.

        Derived (setting 0): ``ceil(wall_s)`` times ``cores`` (default: this machine's,
        for the worker's children; the lowering child runs on one) plus
        :data:`CPU_SLACK_S`.
        """
        row = ROW_OF[role]
        name = f"sandbox_{row}_cpu_s"
        setting = getattr(self, f"{row}_cpu_s")
        if setting:
            return Limit(setting, f"AIKG_{name.upper()}={setting} s")
        cores = cores if cores is not None else max(1, os.cpu_count() or 1)
        value = math.ceil(wall_s) * cores + CPU_SLACK_S
        return Limit(value, f"{value} s of CPU time, derived from the run's time limit "
                     f"since AIKG_{name.upper()} is 0")

    def notes(self, role: str, backend: str, wall_s: float, *, derived_as: int | None = None,
              cores: int | None = None) -> tuple[int | None, int, dict[str, str]]:
        """(address space, CPU seconds, notes for the child spec) of one child."""
        space = self.address_space(role, backend, derived_as)
        cpu = self.cpu_seconds(role, wall_s, cores)
        notes = {"cpu": cpu.note}
        if space.value is not None:
            notes["address_space"] = space.note
        return space.value, int(cpu.value or 0), notes


def child_limits_from(settings: Settings) -> ChildLimits:
    """The table from :class:`services.common.settings.Settings`.

    Raises:
        ValueError: a value is negative (the message names the variable).
    """
    values = {}
    for role in ROLES:
        for kind in ("address_space_bytes", "cpu_s"):
            value = getattr(settings, f"sandbox_{role}_{kind}")
            if value < 0:
                raise ValueError(f"AIKG_SANDBOX_{role.upper()}_{kind.upper()}={value} must "
                                 "be >= 0 (0: derived)")
            values[f"{role}_{kind}"] = value
    return ChildLimits(**values)
