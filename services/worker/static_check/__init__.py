"""AST checks of a candidate's source, run before anything is spawned.

A candidate must define ``class ModelNew`` whose ``forward`` launches a Triton
kernel (``kernel[grid](...)``) defined in the same module with ``@triton.jit``
(optionally under ``@triton.autotune`` / ``@triton.heuristics``), directly or
through helper functions and methods it calls. In ``forward`` and those helpers it
must not compute with PyTorch (``torch.<op>(...)``, ``F.<op>(...)``, tensor compute
methods such as ``x.sum()``, the ``@`` operator, calling ``torch.nn`` submodules);
allocation and layout helpers (``torch.empty_like``, ``x.contiguous()``,
``x.view(...)`` ...) are fine. Anywhere in the module it must not create streams,
start threads or processes, load native code, handle signals, open sockets or
files, read the environment, run dynamic code (``eval``/``exec``/``__import__``/
``importlib``/``compile``) or patch library attributes (``time.perf_counter = ...``,
``setattr(torch, ...)``). Indirection is seen through: a computed attribute name
(``getattr(torch, "r" + "elu")``), a torch function stored, passed or aliased
(``ops = {"r": torch.relu}``, ``f = torch.relu``, ``self.act = F.relu``), an alias of
``eval``/``exec``/``getattr``, importing the task's module (``aikg_task``) or the
harness's, and walking frames or the garbage collector's object graph.

Every rule has an id (``S001`` ...), listed with what it catches, the public report it
comes from and the test that covers it in :data:`RULES`; a :class:`Finding` carries it
as ``rule_id``.

The checks are a first filter for LLM-written code, not a security boundary: the
sandbox (:mod:`services.sandbox.pool`) is. They are written so that honest
kernels pass and the common reward hacks fail with a message a coder can act on.

Layout: one table (:mod:`.table`, from which the rules table of docs/verification.md is generated),
one AST walk (:mod:`.checker`, over the helpers of :mod:`.syntax`), and one module per
family of rules:

- :mod:`.model`: ``ModelNew``, ``forward`` and the Triton kernels it launches (S003-S006);
- :mod:`.torch_ops`: PyTorch compute in ``forward`` and its helpers (S007, S018);
- :mod:`.imports`: forbidden, task and harness modules (S009, S020);
- :mod:`.system`: processes, the environment, files and streams (S008, S010, S011, S014);
- :mod:`.dynamic`: dynamic code, computed names, references, introspection (S012,
  S013, S016, S017, S019, S021);
- :mod:`.patching`: patched library attributes (S015);
- :mod:`.tensor_internals`: host reads, type walks and torch's dispatch machinery
  (S022, S023).
"""

from services.worker.static_check.checker import check_candidate
from services.worker.static_check.imports import FORBIDDEN_MODULES, TASK_MODULE
from services.worker.static_check.table import RULES, RULES_BY_ID, Finding, StaticRule
from services.worker.static_check.torch_ops import ALLOWED_TORCH_CALLS, COMPUTE_METHODS

__all__ = ["ALLOWED_TORCH_CALLS", "COMPUTE_METHODS", "FORBIDDEN_MODULES", "RULES",
           "RULES_BY_ID", "TASK_MODULE", "Finding", "StaticRule", "check_candidate"]
