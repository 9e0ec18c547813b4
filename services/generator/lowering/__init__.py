"""The built-in coder's lowering: a task's core-ATen graph to Triton kernels, no LLM.

The pipeline, laid out as PyTorch Inductor's is (a table of lowerings per ATen
operator, the schedule that handles a node group, a Triton source emitter)::

    task source ─ task.load_task ──► model, example inputs      (runs the task's code)
                 task.export_program ──► core-ATen fx graph      (torch.export, decompositions;
                                                                  LSTM/GRU/RNN kept whole)
                 lowerer.Lowerer.run: each node, in order ──► registry.schedule_of(op).lower
                    element-wise (ops.RULES) ──► fused into the kernel that reads it
                    view / split / arange / copy ──► a line of forward
                    schedules.{pointwise, reduction, matmul, scan, flip, pooling, conv,
                               concat, fused_rows, matmul_rows, recurrent}
                        ──► a @triton.jit kernel (emit.add_kernel) and its launch
                            (recurrent: a GEMM per layer and direction, then a step
                            kernel launched per time step from a loop in forward)
                 emit.render ──► the candidate: kernels + class ModelNew
                    (parameters.init_lines declares the Model's parameters again)

- :mod:`.task`: run the task (KernelBench format) and export it;
- :mod:`.ops`: the element-wise rule table, the operator set of each schedule, the
  dtypes a kernel loads; refusals naming the operator's family;
- :mod:`.registry`: the one table from operator to schedule to lowering function;
- :mod:`.ir`: the per-node and per-kernel records (the graph is torch.fx's);
- :mod:`.lowerer`: the graph walk, shared state, size expressions, element-wise chains;
- :mod:`.schedules`: one module per schedule;
- :mod:`.emit`: Triton helpers, kernel text, launches, the candidate module;
- :mod:`.parameters`: ``ModelNew.__init__``;
- :mod:`.entry`: :func:`lower_task`, :func:`warm_up`;
- :mod:`.errors`: :class:`LoweringError`;
- :mod:`.launch_facts`: the GPU compiler's facts of the launch-configuration table
  (a tool run by hand, ``python -m services.generator.lowering.launch_facts``).

Anything the schedules do not cover (adaptive pooling, indexing, sorting,
...) raises :class:`LoweringError` naming the operator and its family, so the caller
can hand the task to the LLM coder. The lowering runs the task's code in this process:
call it where that code is trusted, or from a subprocess (the sandbox role ``lower``,
:mod:`services.generator.coders.lowering_role`). :mod:`.errors` holds
:class:`LoweringError` and imports nothing, so catching it does not load torch.
"""

from typing import TYPE_CHECKING, Any

from services.generator.lowering.errors import LoweringError

if TYPE_CHECKING:
    from services.generator.lowering.entry import lower_task, warm_up

__all__ = ["LoweringError", "lower_task", "warm_up"]


def __getattr__(name: str) -> Any:
    """:func:`lower_task` and :func:`warm_up` on first use: they load torch, which the
    generator and the SDK (importing :class:`LoweringError` from here) never need."""
    if name in ("lower_task", "warm_up"):
        from services.generator.lowering import entry

        return getattr(entry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
