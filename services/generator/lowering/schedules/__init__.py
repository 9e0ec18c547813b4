"""The schedules: one module per family of operators that the built-in coder writes
kernels for. Each exposes ``lower(lw, node, op)``, called by the lowerer for a node of
its family (the row of :data:`services.generator.lowering.registry.SCHEDULES` that
pairs the function with its operators); it reads and extends the lowerer's state
(values, forward lines, kernels). A schedule imports no other module of the lowering
than those below it (:mod:`..ops`, :mod:`..emit`, :mod:`..ir`, another schedule); the
lowerer reaches them through the registry.

- :mod:`.pointwise`: element-wise chains with broadcasting (``defer`` where the node
  stands; ``lower(lw, node)`` writes the kernel when a tensor must exist);
- :mod:`.views`: views, ``torch.arange`` and copies: a line of forward, no kernel;
- :mod:`.reduction`: row reductions over ``(outer, R, inner)`` (the row view and its
  tiles in :mod:`.rows`, shared with the scan and the fused schedules);
- :mod:`.fused_rows`: row reductions with the reductions and element-wise nodes on the
  same rows, one kernel (softmax, norms); entered from :mod:`.reduction`; its kernel
  bodies in :mod:`.fused_bodies`, its row layouts in :mod:`.row_layout`;
- :mod:`.matmul`: ``tl.dot`` tiles with bias and element-wise epilogues;
- :mod:`.scan`: cumsum, cumprod;
- :mod:`.flip`: a copy reading reversed indices;
- :mod:`.pooling`: max/avg pooling, 1-D to 3-D;
- :mod:`.conv`: convolutions, 1-D to 3-D, grouped and transposed, as an implicit GEMM
  with bias and element-wise epilogues;
- :mod:`.concat`: ``torch.cat`` as a strided copy per input into its slice
  (``lower_cat``), and split / chunk / unbind as views (``lower_split``);
- :mod:`.recurrent`: LSTM, GRU and RNN layers: an input-projection GEMM per layer and
  direction, then a fused step kernel per time step, launched from a loop in forward.
"""
