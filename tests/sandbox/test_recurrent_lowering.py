"""Built-in coder, schedule ``recurrent``: nn.LSTM, nn.GRU and nn.RNN as an input
projection GEMM and a step kernel launched once per time step.

Each task below is lowered once, at its own sizes, and verified end to end by the
worker's Verifier on cpu (op audit, ghost replay, a second and an awkward size) at its
own sizes and at shape_overrides of odd extents, a batch of one and a hidden size
over one tile (the representatives also at powers of two,
:func:`tests.helpers.checked_sizes`), so the one candidate must follow sizes, the
sequence length included, read at run time. Kernels
run in Triton's interpreter (TRITON_INTERPRET=1).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU

import asyncio  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402

from services.generator.lowering import LoweringError  # noqa: E402
from tests.helpers import checked_sizes, representatives, verify_at_sizes  # noqa: E402
from tests.lowering_cache import lowered  # noqa: E402
from tests.sandbox.test_builtin_coder import (  # noqa: E402
    _assert_forward_only_launches,
    _assert_matches,
    _launches,
)

RNN_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.rnn = nn.{module}(input_size, hidden_size, {options})

    def forward(self, x{args}):
        return {body}


batch = 2
seq = 5
input_size = 6
hidden_size = 8


def get_inputs():
    return [torch.randn({x_shape}){states}]


def get_init_inputs():
    return [input_size, hidden_size]
"""

# name -> (module, its options, states given to forward)
RNNS = {
    "lstm": ("LSTM", "num_layers=1", True),
    "lstm_two_layers_batch_first_no_state": ("LSTM", "num_layers=2, batch_first=True", False),
    "lstm_bidirectional_batch_first": (
        "LSTM", "num_layers=2, batch_first=True, bidirectional=True", True),
    "lstm_bidirectional_no_bias_no_state": (
        "LSTM", "num_layers=1, bias=False, bidirectional=True", False),
    "gru": ("GRU", "num_layers=2", True),
    "gru_bidirectional_batch_first_no_state": (
        "GRU", "num_layers=2, batch_first=True, bidirectional=True", False),
    "gru_bidirectional_no_bias": ("GRU", "num_layers=1, bias=False, bidirectional=True", True),
    "rnn_tanh": ("RNN", "num_layers=2", True),
    "rnn_relu_bidirectional_no_state": (
        "RNN", "num_layers=1, nonlinearity='relu', bidirectional=True, batch_first=True",
        False),
}
# Two size sets beside the task's own: odd extents, a batch of one and a hidden size
# over one 32-wide tile (two K slices, a ragged second tile); then powers of two.
OVERRIDES = ({"batch": 1, "seq": 3, "input_size": 5, "hidden_size": 37},
             {"batch": 4, "seq": 4, "input_size": 16, "hidden_size": 16})


def rnn_task(name: str, options: str | None = None) -> str:
    """The task of ``RNNS[name]``, every result returned (output, h_n[, c_n]);
    ``options`` replaces the module's options."""
    module, own, given = RNNS[name]
    options = own if options is None else options
    layers = int(re.search(r"num_layers=(\d+)", options).group(1))
    states = layers * (2 if "bidirectional=True" in options else 1)
    x_shape = "batch, seq, input_size" if "batch_first=True" in options else \
        "seq, batch, input_size"
    state = f"torch.randn({states}, batch, hidden_size)"
    if module == "LSTM":
        args, call, inputs = ", h0, c0", "x, (h0, c0)", f", {state}, {state}"
        body = f"(lambda out, hc: (out, *hc))(*self.rnn({call if given else 'x'}))"
    else:
        args, inputs = ", h0", f", {state}"
        body = f"self.rnn({'x, h0' if given else 'x'})"
    return RNN_TASK.format(module=module, options=options, args=args if given else "",
                           body=body, x_shape=x_shape, states=inputs if given else "")


# Representatives, checked at every size: one LSTM and one GRU; the LSTM alone runs in
# the fast lane (the GRU's sizes cost ~10 CPU-s more).
FAST = ("lstm", "gru")


@pytest.mark.parametrize("name", representatives(RNNS, FAST,
                                                    lane=("lstm",)))
def test_recurrent_network_passes_the_worker(name, shared_verifier):

    task_src = rnn_task(name)
    candidate = lowered(task_src)
    _assert_forward_only_launches(candidate, kernels=len(_launches(candidate)))
    cell = RNNS[name][0].lower()
    assert [k.split("_kernel_")[0] for k in _launches(candidate)] == ["rnn_input", f"{cell}_step"]
    own = verify_at_sizes(shared_verifier, f"rnn-{name}", task_src, candidate,
                          checked_sizes(name, FAST, OVERRIDES))
    assert own.shape_generic is not False, own.notes


@pytest.mark.slow  # the representatives above verify sizes in the fast lane
def test_the_time_loop_is_in_forward_and_no_extent_is_written():
    """The steps are a Python loop over the input's length, not an unrolled graph: the
    candidate is the same whatever the sequence length, and no extent of the task
    (seq 5, batch 2, input 6, hidden 8) is a literal in its kernels or forward."""
    task_src = rnn_task("lstm_bidirectional_batch_first")
    candidate = lowered(task_src)
    longer = lowered(task_src, {"seq": 9})
    assert re.sub(r"# Lowered at .*", "", candidate) == re.sub(r"# Lowered at .*", "", longer)
    forward = candidate[candidate.index("    def forward"):]
    assert re.search(r"for step\d+ in range\(steps\d+\):", forward), forward
    kernels = candidate[candidate.index("@triton.jit\ndef rnn_input"):
                        candidate.index("class ModelNew")]
    for text in (forward, re.sub(r'""".*?"""', "", kernels, flags=re.DOTALL)):
        assert not re.search(r"\b(5|6|8)\b", text), text
    # two layers, two directions: the layer and direction loops, not four copies
    assert "for layer" in forward and "range(2)" in forward
    _assert_matches(task_src, candidate, {"seq": 9, "hidden_size": 40}, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # the representatives above verify sizes in the fast lane
def test_one_candidate_follows_other_sizes():
    """Lowered once: right for other batches, lengths and widths, GRU and RNN cells."""
    for name in ("gru_bidirectional_batch_first_no_state", "rnn_relu_bidirectional_no_state"):
        task_src = rnn_task(name)
        candidate = lowered(task_src)
        for sizes in OVERRIDES:
            _assert_matches(task_src, candidate, sizes, rtol=1e-4, atol=1e-4)


def test_dropout_between_layers_in_training_is_refused():
    task_src = rnn_task("lstm", "num_layers=2, dropout=0.5")
    with pytest.raises(LoweringError) as info:
        lowered(task_src)
    assert info.value.op == "aten.lstm.input"
    assert "dropout=0.5 between layers in training mode" in str(info.value)


def test_lstm_projections_are_refused():
    task_src = rnn_task("lstm", "num_layers=1, proj_size=3").replace(
        "torch.randn(1, batch, hidden_size), torch.randn(1, batch, hidden_size)",
        "torch.randn(1, batch, 3), torch.randn(1, batch, hidden_size)")
    with pytest.raises(LoweringError) as info:
        lowered(task_src)
    assert info.value.op == "aten.lstm.input"
    assert "proj_size" in str(info.value)


VANILLA_RNN_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        # plain tensor attributes, drawn before the layers' weights: one overwritten by
        # forward's input (copy_), one read as it is
        self.hidden = torch.randn((batch, hidden_size))
        self.scale = torch.randn(hidden_size)
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.h2o = nn.Linear(hidden_size, 3)

    def forward(self, x, initial_hidden):
        self.hidden.copy_(initial_hidden)
        self.hidden = self.hidden.to(x.device)
        self.hidden = torch.tanh(self.i2h(torch.cat((x, self.hidden), dim=1))) * self.scale
        return self.h2o(self.hidden)


batch = 4
input_size = 6
hidden_size = 8


def get_inputs():
    return [torch.randn(batch, input_size), torch.randn(batch, hidden_size)]


def get_init_inputs():
    return [input_size, hidden_size]
"""


@pytest.mark.slow  # the representatives above verify the recurrent schedule in the fast lane
def test_tensor_attributes_are_drawn_again_and_an_overwritten_one_is_its_input(
        shared_verifier):
    """A Model's plain tensor attributes (KernelBench's vanilla RNN keeps its state in
    one and overwrites it with forward's input) are non-persistent buffers of ModelNew,
    drawn with torch.randn in the Model's order, so the layers created after them get
    the same weights; the overwritten one is read as the input itself (no kernel)."""
    from services.common.verify_client import build_request

    candidate = lowered(VANILLA_RNN_TASK)
    init = candidate[candidate.index("def __init__"):candidate.index("def forward")]
    assert init.index("self.register_buffer('hidden', torch.randn((4, args[1], ))") < \
        init.index("self.register_buffer('scale', torch.randn((args[1], ))") < \
        init.index("self.i2h = nn.Linear")
    assert "persistent=False" in init
    _assert_matches(VANILLA_RNN_TASK, candidate, rtol=1e-4, atol=1e-4)
    request = build_request(request_id="vanilla-rnn", job_id="rnn-test", candidate_id="c0",
                            op_name="vanilla_rnn", task_desc=VANILLA_RNN_TASK, code=candidate,
                            backend="cpu", arch="x86_64", trials=1, timeout_s=120)
    result = asyncio.run(shared_verifier.verify(request, device="0"))
    assert result.passed, (result.stage, result.error, result.log[-2000:])
