"""The schedules: one module per family of operators that the built-in coder writes
kernels for. Each exposes ``lower(lw, node, op)``, called by the lowerer for a node of
its family (:data:`services.generator.lowering.registry.SCHEDULE_OPS`); it reads and
extends the lowerer's state (values, forward lines, kernels).

- :mod:`.pointwise`: element-wise chains with broadcasting (``lower(lw, node)``: written
  when a tensor must exist, not where the node stands);
- :mod:`.reduction`: row reductions over ``(outer, R, inner)``;
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
