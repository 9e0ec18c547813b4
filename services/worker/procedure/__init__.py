"""One verification, from the children it starts to the outcome of its verdict.

:class:`Procedure` is what :meth:`services.worker.verifier.Verifier.verify` runs after
the static check. The facts the verdict rests on never pass through the candidate's
process:

1. The **reference** child (the task's code only) makes every input from seeds drawn
   from the OS's cryptographic source, each trial from a distribution of
   :mod:`services.worker.inputs`, and the outputs to match; and decoys (inputs at other
   secret seeds) for the candidate.
2. The **planner** child imports the candidate, builds ``ModelNew`` at every size
   checked (before it holds any input), dry-runs ``forward`` on meta tensors at the
   task's own sizes, then runs ``forward`` on the decoys with every launch a no-op,
   recording the plan (:mod:`services.worker.trace`).
3. The **replayer** child runs each plan on the real inputs with the candidate's
   kernels and nothing else of its code (:mod:`services.worker.replay`); this process
   compares its outputs with the reference's (:mod:`services.worker.correctness`).
4. Beside them: the same plan without launches (rule D003), every autotune config,
   the sizes congruent with the task's own (:mod:`services.worker.sizes`), the
   declared shapes of ``get_inputs_dyn_list()``, an awkward size for
   ``shape_generic``, and every kernel compiled for a GPU target
   (:mod:`services.worker.aot`).
5. ``mode="profile"`` on a GPU backend: the candidate, the eager and ``torch.compile``
   baselines and the launch floor timed on the leased device.

When a replayed output mismatches while the planner's own (ghost) outputs match the
reference at the decoys, the candidate's process computed them outside its kernels:
stage ``audit``, not ``mismatch``.

The package's parts: :mod:`~services.worker.procedure.core` (the :class:`Procedure`:
its steps, the run, timeouts and the passed outcome),
:mod:`~services.worker.procedure.state` (:class:`~services.worker.procedure.state.RunState`,
what the steps share: sizes, calls, children, notes),
:mod:`~services.worker.procedure.host` (what the procedure needs of its verifier, as
typed protocols), and the steps: :mod:`~services.worker.procedure.size_choice` (which
sizes are checked; their rules are :mod:`services.worker.sizes`),
:mod:`~services.worker.procedure.trials` (planning and judging the calls),
:mod:`~services.worker.procedure.replays` (posting the plans, taking the replays back,
the float64 recheck), :mod:`~services.worker.procedure.variants` (the first call's
variants), :mod:`~services.worker.procedure.compile_check` (every kernel compiled for
a GPU, the compiler's facts), :mod:`~services.worker.procedure.audit` (the candidate's
process), :mod:`~services.worker.procedure.profile` (timings and baselines on a GPU);
and :mod:`~services.worker.procedure.outcome` (:class:`Outcome`, the fields a
verification decides, and :class:`Verdict`, the exception carrying a failed one).
"""

from services.worker.procedure.core import Procedure
from services.worker.procedure.host import Host
from services.worker.procedure.outcome import Outcome, Timings, Verdict
from services.worker.procedure.state import PhaseClock

__all__ = ["Host", "Outcome", "PhaseClock", "Procedure", "Timings", "Verdict"]
