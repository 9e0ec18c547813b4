"""Schedule ``recurrent``: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (``aten.lstm.input``,
``aten.gru.input``, ``aten.rnn_tanh.input``, ``aten.rnn_relu.input``, kept whole by the
export) as one GEMM and a loop of step kernels per layer and direction.

For each layer and direction, forward launches:

1. the input projection of every time step at once, ``pre = x @ W_ih^T + b_ih`` over
   the ``T * B`` rows of the layer's input (``tl.dot`` tiles, float32, the matmul
   schedule's product tile, :func:`.matmul.product_tile`);
2. then, in a Python ``for`` over the ``T`` steps (backwards for the reverse
   direction), one step kernel: ``pre[t] + h_{t-1} @ W_hh^T + b_hh`` on ``tl.dot``
   tiles of batch rows by hidden units, one accumulator per gate, then the gate
   nonlinearities and the state update in registers; ``h_t`` is stored into the
   layer's output sequence (its direction's half of the features), the cell state of
   an LSTM into ``c_n`` (each program reads and writes only its own tile of it), and
   the last step's ``h`` into ``h_n``. ``h_{t-1}`` is read back from the output
   sequence (``h0`` at the first step), so no program reads what another writes in
   the same launch.

Layers after the first read the previous layer's output (both directions side by
side). Every extent (T, B, the input and hidden sizes) is read from the tensors at run
time; only the number of layers and directions, which the parameter list fixes, is
written into the candidate. Numerics: float32 accumulation and gate arithmetic, the
gate order and formulas of ``torch.nn.LSTM`` / ``GRU`` / ``RNN``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.launch_configs import launch_options
from services.generator.lowering.emit import add_kernel, torch_dtype_name
from services.generator.lowering.errors import LoweringError
from services.generator.lowering.ir import PendingMatmul, Value, bind_args, meta_val
from services.generator.lowering.schedules import matmul

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer

# Cell (the operator's name) -> its gates, in the order of the weights' rows.
GATES = {"lstm": ("i", "f", "g", "o"), "gru": ("r", "z", "n"), "rnn_tanh": ("a",),
         "rnn_relu": ("a",)}
# The nonlinearity and the state update of each cell, on float32 tiles: ``x_<gate>``
# is the input projection (b_ih included), ``h_<gate>`` the recurrent one (b_hh
# included), ``h_prev`` / ``c_prev`` the previous state's tile; ``h`` (and ``c``) result.
_UPDATES = {
    "lstm": ["c_prev = tl.load(cp_ptr + rm[:, None] * scb + rn[None, :] * sch, mask=mask,",
             "                 other=0.0).to(tl.float32)",
             "c = tl.sigmoid(x_f + h_f) * c_prev + tl.sigmoid(x_i + h_i) * _tanh(x_g + h_g)",
             "h = tl.sigmoid(x_o + h_o) * _tanh(c)",
             "tl.store(c_ptr + rm[:, None] * sdb + rn[None, :] * sdh,",
             "         c.to(c_ptr.dtype.element_ty), mask=mask)"],
    "gru": ["h_prev = tl.load(hp_ptr + tp * sht + rm[:, None] * shb + rn[None, :] * shk,",
            "                 mask=mask, other=0.0).to(tl.float32)",
            "r = tl.sigmoid(x_r + h_r)",
            "z = tl.sigmoid(x_z + h_z)",
            "n = _tanh(x_n + r * h_n)",
            "h = (1.0 - z) * n + z * h_prev"],
    "rnn_tanh": ["h = _tanh(x_a + h_a)"],
    "rnn_relu": ["h = tl.where(x_a + h_a < 0.0, 0.0, x_a + h_a)"],  # NaN stays NaN
}


def lower(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``recurrent``: ``aten.lstm.input(input, [h0, c0], params, has_biases,
    num_layers, dropout, train, bidirectional, batch_first)`` and ``aten.gru.input`` /
    ``aten.rnn_tanh.input`` / ``aten.rnn_relu.input`` (``hx`` one tensor).

    ``input`` is ``(T, B, I)`` or, with ``batch_first``, ``(B, T, I)``; ``h0`` / ``c0``
    are ``(num_layers * D, B, H)`` (zeros when the Model passes none: the graph makes
    them); ``params`` holds ``W_ih (G*H, I)``, ``W_hh (G*H, H)`` and, with biases,
    ``b_ih``, ``b_hh (G*H,)`` per layer and direction (G gates: 4, 3 or 1). Results: the
    last layer's output ``(T, B, D*H)`` (``(B, T, D*H)`` with ``batch_first``) in the
    input's dtype, ``h_n`` and for an LSTM ``c_n``, ``(num_layers * D, B, H)``.
    Tensors may be float32, float16 or bfloat16; kernels compute in float32.

    Raises:
        LoweringError: (the operator) dropout between layers in training mode, LSTM
            projections (``proj_size``), an input that is not 3-D, or a parameter list
            that is not ``num_layers * D`` groups of 2 or 4 tensors.
    """
    raw = bind_args(node)
    cell = op.split(".")[1]
    gates = GATES[cell]
    layers, dirs = int(raw["num_layers"]), 2 if raw["bidirectional"] else 1
    has_bias, batch_first = bool(raw["has_biases"]), bool(raw["batch_first"])
    if float(raw["dropout"]) > 0 and raw["train"] and layers > 1:
        raise LoweringError(op, f"built-in coder cannot lower {op} with dropout="
                            f"{raw['dropout']} between layers in training mode (random "
                            "masks); use the LLM coder or put the Model in eval mode")
    params = list(raw["params"])
    per = 4 if has_bias else 2
    if len(params) != layers * dirs * per or any(
            len(meta_val(params[k + 1]).shape) != 2
            or meta_val(params[k + 1]).shape[0] != len(gates) * meta_val(params[k + 1]).shape[1]
            for k in range(0, len(params), per)):
        raise LoweringError(op, f"built-in coder cannot lower {op} with these parameters "
                            "(LSTM projections, proj_size, or an unexpected parameter list); "
                            "use the LLM coder")
    if len(meta_val(raw["input"]).shape) != 3:
        raise LoweringError(op, f"built-in coder cannot lower {op} on an input of rank "
                            f"{len(meta_val(raw['input']).shape)} (only 3-D); use the LLM coder")
    x = lw.materialize(raw["input"])
    hx = list(raw["hx"]) if cell == "lstm" else [raw["hx"]]
    states = [_state(lw, h) for h in hx]
    weights = [lw.materialize(p) for p in params]
    dtype = meta_val(node)[0].dtype

    gemm = _input_kernel(lw, op, has_bias)
    step = _step_kernel(lw, op, cell, has_bias)
    f = lw.fresh
    ws, xin, seq, steps, hidden = f("weights"), f("layer_in"), f("x_seq"), f("steps"), f("hidden")
    batch = f("batch")
    hn = f("h_n")
    cn = f("c_n") if cell == "lstm" else None
    dev = lw.device
    # Tiles: the launch parameters, or less where the extent they tile is smaller (a
    # batch of 10 rows, a hidden size of 16): tl.dot's 16 at least.
    tiles = [f(n) for n in ("block_m", "block_n", "block_k", "block_m", "block_n",
                            "block_k")]
    # GPU: num_warps/num_stages tuned (the reduction list), the tiles as fitted here
    gemm_opts = launch_options(lw, gemm[0], "reduction", ["M", "N", "K"]) + ")"
    step_opts = launch_options(lw, step, "reduction", ["B", "H"]) + ")"

    def tile(var: str, extent: str) -> str:
        return (f"{var} = max(16, min({lw.p[var.rstrip('0123456789')]}, "
                f"triton.next_power_of_2({extent})))")
    lines = [f"{ws} = [{', '.join(weights)}]  # {op}: W_ih, W_hh[, b_ih, b_hh] per layer "
             "and direction",
             f"{xin} = {x}",
             f"{seq} = {x}.transpose(0, 1)" if batch_first else f"{seq} = {x}",
             f"{steps}, {batch} = {seq}.shape[0], {seq}.shape[1]",
             f"{hidden} = {ws}[1].shape[1]"]
    shape = f"({layers * dirs}, {batch}, {hidden})"
    for k, state in enumerate(states):
        if isinstance(state, float):  # the Model passed no state: the graph's constant
            states[k] = f(f"state{k}_")
            lines.append(f"{states[k]} = torch.full({shape}, {state!r}, dtype="
                         f"{torch_dtype_name(meta_val(hx[k]).dtype)}, device={dev})")
    lines.append(f"{hn} = torch.empty({shape}, dtype={torch_dtype_name(dtype)}, device={dev})")
    lines += [tile(tiles[3], batch), tile(tiles[4], hidden), tile(tiles[5], hidden)]
    if cn is not None:
        lines.append(f"{cn} = torch.empty_like({hn})")
    layer, out, oseq, x2, d, k, w_ih, w_hh, pre, pre2, pseq, idx, outd, hnd, s, t, tp, hp, \
        t_prev = (f(n) for n in ("layer", "out", "out_seq", "rows", "direction", "at",
                                 "w_ih", "w_hh", "pre", "pre_rows", "pre_seq", "state",
                                 "out_dir", "h_n_dir", "step", "t", "t_in", "h_in", "t_prev"))
    b_ih, b_hh = (f("b_ih"), f("b_hh")) if has_bias else (None, None)
    cp, cnd = (f("c_in"), f("c_n_dir")) if cn is not None else (None, None)
    gemm_launch = gemm[1](pre2, x2, w_ih, b_ih)
    step_args = [pseq, t, f"*{pseq}.stride()", hp, tp, f"*{hp}.stride()", w_hh,
                 f"*{w_hh}.stride()"]
    if has_bias:
        step_args.append(b_hh)
    if cn is not None:
        step_args += [cp, f"*{cp}.stride()", cnd, f"*{cnd}.stride()"]
    step_args += [outd, f"*{outd}.stride()", hnd, f"*{hnd}.stride()",
                  f"int({s} == {steps} - 1)", batch, hidden]
    first = f"{states[0]}[{idx}].unsqueeze(0), 0" + (f", {states[1]}[{idx}]" if cn else "")
    later = f"{outd}, {t_prev}" + (f", {cnd}" if cn else "")
    lines += [
        f"for {layer} in range({layers}):",
        f"    {out} = torch.empty((*{xin}.shape[:2], {dirs} * {hidden}), "
        f"dtype={torch_dtype_name(dtype)}, device={dev})",
        f"    {oseq} = {out}.transpose(0, 1)" if batch_first else f"    {oseq} = {out}",
        f"    {x2} = {xin}.reshape(-1, {xin}.shape[2])",
        "    " + tile(tiles[0], f"{x2}.shape[0]"),
        "    " + tile(tiles[1], f"{len(gates)} * {hidden}"),
        "    " + tile(tiles[2], f"{x2}.shape[1]"),
        f"    for {d} in range({dirs}):",
        f"        {k} = ({layer} * {dirs} + {d}) * {per}",
        f"        {w_ih}, {w_hh} = {ws}[{k}], {ws}[{k} + 1]",
        *([f"        {b_ih}, {b_hh} = {ws}[{k} + 2], {ws}[{k} + 3]"] if has_bias else []),
        f"        {pre} = torch.empty((*{xin}.shape[:2], {w_ih}.shape[0]), "
        f"dtype=torch.float32, device={dev})",
        f"        {pre2} = {pre}.view(-1, {w_ih}.shape[0])",
        f"        if {pre2}.numel() > 0:",
        f"            {gemm[0]}[(triton.cdiv({pre2}.shape[0], {tiles[0]}), "
        f"triton.cdiv({pre2}.shape[1], {tiles[1]}), 1)](",
        f"                {', '.join(gemm_launch)},",
        f"                BLOCK_M={tiles[0]}, BLOCK_N={tiles[1]}, BLOCK_K={tiles[2]}, {gemm_opts}",
        f"        {pseq} = {pre}.transpose(0, 1)" if batch_first else f"        {pseq} = {pre}",
        f"        {idx} = {layer} * {dirs} + {d}",
        f"        {outd} = {oseq}.narrow(2, {d} * {hidden}, {hidden})",
        f"        {hnd} = {hn}[{idx}]",
        *([f"        {cnd} = {cn}[{idx}]"] if cn else []),
        f"        {t_prev} = 0",
        f"        for {s} in range({steps}):",
        f"            {t} = {steps} - 1 - {s} if {d} else {s}",
        f"            {hp}, {tp}{', ' + cp if cn else ''} = ({first}) if {s} == 0 else ({later})",
        f"            {step}[(triton.cdiv({batch}, {tiles[3]}), "
        f"triton.cdiv({hidden}, {tiles[4]}))](",
        f"                {', '.join(step_args)},",
        f"                BLOCK_M={tiles[3]}, BLOCK_N={tiles[4]}, BLOCK_K={tiles[5]}, {step_opts}",
        f"            {t_prev} = {t}",
        f"    {xin} = {out}",
    ]
    lw.forward += lines
    results = [Value("tensor", xin), Value("tensor", hn)]
    if cn is not None:
        results.append(Value("tensor", cn))
    lw.values[node] = Value("tuple", items=results)


def _state(lw: Lowerer, node: torch.fx.Node) -> str | float:
    """An initial state: its forward tensor, or its fill value when the graph makes it
    with ``aten.full`` (nn.LSTM's zeros when forward is given none), whose size the
    graph fixed at the hidden size it was traced with; the caller allocates it at the
    run-time sizes instead."""
    if (str(node.target) == "aten.full.default" and lw.values[node].kind == "pointwise"
            and isinstance(bind_args(node)["fill_value"], int | float)):
        return float(bind_args(node)["fill_value"])
    return lw.materialize(node)


def _input_kernel(lw: Lowerer, op: str, has_bias: bool):
    """Write the input projection's kernel: ``pre[m, n] = sum_k x[m, k] * W_ih[n, k]
    (+ b_ih[n])`` over the ``T * B`` rows ``m`` of a layer's input, float32 out.
    Returns its name and a function of the forward names (output, rows, W_ih, b_ih)
    giving its launch arguments."""
    def pending(out: str, rows: str, w_ih: str, b_ih: str | None) -> PendingMatmul:
        return PendingMatmul(op, rows, f"{w_ih}.t()", b_ih, f"{out}.shape", False, 1.0, 1.0,
                             bias_row=True)

    def tile(out: str, rows: str, w_ih: str, b_ih: str | None):
        return matmul.product_tile(lw, pending(out, rows, w_ih, b_ih), out,
                                   (f"{out}.shape[0]", f"{out}.shape[1]"),
                                   (["scb", "scm", "scn"], [f"*{out}.unsqueeze(0).stride()"]))

    lines, params, _ = tile("OUT", "ROWS", "W_IH", "B_IH" if has_bias else None)
    lines[:0] = ["pid_m = tl.program_id(0)", "pid_n = tl.program_id(1)",
                 "batch = tl.program_id(2).to(tl.int64)",
                 "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
                 "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)"]
    lines.append("tl.store(c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn, "
                 "acc.to(c_ptr.dtype.element_ty), mask=mask)")
    name = lw.fresh("rnn_input_kernel_")
    add_kernel(lw, name, [*params, "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                          "BLOCK_K: tl.constexpr"],
               f"Recurrent input projection: {op}: pre[m, n] = sum_k x[m, k] * W_ih[n, k]"
               + (" + b_ih[n]" if has_bias else "")
               + ",\nfor the T * B rows m of a layer's input at once (one launch per layer "
               "and direction).", lines, [op])
    return name, lambda out, rows, w_ih, b_ih: tile(out, rows, w_ih, b_ih)[2]


def _step_kernel(lw: Lowerer, op: str, cell: str, has_bias: bool) -> str:
    """Write the step kernel of ``cell``: one time step ``t`` of one layer and direction
    for a BLOCK_M x BLOCK_N tile of (batch rows, hidden units); returns its name."""
    gates = GATES[cell]
    lines = ["pid_m = tl.program_id(0)", "pid_n = tl.program_id(1)",
             "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
             "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
             *(f"h_{g} = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)" for g in gates),
             "for k0 in range(0, H, BLOCK_K):",
             "    rk = k0 + tl.arange(0, BLOCK_K)",
             "    hk = tl.load(hp_ptr + tp * sht + rm[:, None] * shb + rk[None, :] * shk,",
             "                 mask=(rm[:, None] < B) & (rk[None, :] < H), other=0.0)",
             "    wmask = (rk[:, None] < H) & (rn[None, :] < H)"]
    for j, g in enumerate(gates):
        lines += [f"    w = tl.load(w_ptr + ({j} * H + rn[None, :]) * swn + rk[:, None] * swk,",
                  "                mask=wmask, other=0.0)",
                  f"    h_{g} += tl.dot(hk.to(tl.float32), w.to(tl.float32), "
                  f"input_precision=\"{lw.p['precision']}\")"]
    lines += ["mask = (rm[:, None] < B) & (rn[None, :] < H)",
              "pre = pre_ptr + t * spt + rm[:, None] * spb"]
    for j, g in enumerate(gates):
        lines.append(f"x_{g} = tl.load(pre + ({j} * H + rn[None, :]) * spg, mask=mask, "
                     "other=0.0)")
        if has_bias:
            lines.append(f"h_{g} += tl.load(bias_ptr + {j} * H + rn, mask=rn < H, "
                         "other=0.0).to(tl.float32)[None, :]")
    lines += _UPDATES[cell]
    lines += ["tl.store(out_ptr + t * sot + rm[:, None] * sob + rn[None, :] * soh,",
              "         h.to(out_ptr.dtype.element_ty), mask=mask)",
              "tl.store(hn_ptr + rm[:, None] * snb + rn[None, :] * snh,",
              "         h.to(hn_ptr.dtype.element_ty),",
              "         mask=(rm[:, None] < B * last) & (rn[None, :] < H))  # last: 1 or 0"]
    params = ["pre_ptr", "t", "spt", "spb", "spg", "hp_ptr", "tp", "sht", "shb", "shk",
              "w_ptr", "swn", "swk"]
    if has_bias:
        params.append("bias_ptr")
    if cell == "lstm":
        params += ["cp_ptr", "scb", "sch", "c_ptr", "sdb", "sdh"]
    params += ["out_ptr", "sot", "sob", "soh", "hn_ptr", "snb", "snh", "last", "B", "H",
               "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr"]
    name = lw.fresh(f"{cell.split('_')[0]}_step_kernel_")
    update = {"lstm": "c = f * c_prev + i * g, h = o * tanh(c)",
              "gru": "h = (1 - z) * n + z * h_prev, n = tanh(x_n + r * h_n)",
              "rnn_tanh": "h = tanh(x + h_prev @ W_hh^T + b_hh)",
              "rnn_relu": "h = relu(x + h_prev @ W_hh^T + b_hh)"}[cell]
    add_kernel(lw, name, params,
               f"Recurrent step: {op}: gates ({', '.join(gates)}) = pre[t] + h_prev @ W_hh^T"
               + (" + b_hh" if has_bias else "") + f", then {update},\nfor a tile of batch "
               "rows by hidden units; h is stored into the output sequence at t (and h_n at "
               "the last step).", lines, [op])
    return name
