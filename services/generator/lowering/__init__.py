"""The built-in coder's lowering: a task's core-ATen graph to Triton kernels, no LLM.

The pipeline, laid out as PyTorch Inductor's is (a table of lowerings per ATen
operator, the schedule that handles a node group, a Triton source emitter)::

    task source ─ task.load_task ──► model, example inputs      (runs the task's code)
                 task.export_program ──► core-ATen fx graph      (torch.export, decompositions;
                                                                  LSTM/GRU/RNN kept whole)
                 lowerer.Lowerer.run: each node, in order ──► registry.schedule_of(op)
                    element-wise (registry.RULES) ──► fused into the kernel that reads it
                    view / split / arange ──► a line of forward
                    schedules.{pointwise, reduction, matmul, scan, flip, pooling, conv,
                               concat, fused_rows, matmul_rows, recurrent}
                        ──► a @triton.jit kernel (emit.add_kernel) and its launch
                            (recurrent: a GEMM per layer and direction, then a step
                            kernel launched per time step from a loop in forward)
                 emit.render ──► the candidate: kernels + class ModelNew
                    (parameters.init_lines declares the Model's parameters again)

- :mod:`.task`: run the task (KernelBench format) and export it;
- :mod:`.registry`: the element-wise rule table and which operators each schedule
  lowers; refusals naming the operator's family;
- :mod:`.ir`: the per-node and per-kernel records (the graph is torch.fx's);
- :mod:`.lowerer`: the graph walk, shared state, size expressions, element-wise chains;
- :mod:`.schedules`: one module per schedule;
- :mod:`.emit`: Triton helpers, kernel text, launches, the candidate module;
- :mod:`.parameters`: ``ModelNew.__init__``;
- :mod:`.entry`: :func:`lower_task`, :func:`warm_up`.

Anything the schedules do not cover (adaptive pooling, indexing, sorting,
...) raises :class:`LoweringError` naming the operator and its family, so the caller
can hand the task to the LLM coder. The lowering runs the task's code in this process:
call it where that code is trusted, or from a subprocess (the sandbox role ``lower``,
:mod:`services.generator.coders.lowering_role`).
"""

from services.generator.coders.errors import LoweringError
from services.generator.lowering.entry import lower_task, warm_up

__all__ = ["LoweringError", "lower_task", "warm_up"]
