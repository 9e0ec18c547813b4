"""What the built-in coder declines fails fast and says why: the operator, its family,
and where the LLM coder is; no sandbox starts for a refusal the task's source shows, and
a verification sandbox still starting is not waited for; the too-large-inputs hint
names the command in use."""

from __future__ import annotations

import threading
import time

import pytest

from schemas import JobSubmit
from services.common.verify_client import build_request
from services.generator.coders.base import BuiltinCoder, CoderError, lowering_sandbox
from services.generator.coders.screen import decline
from services.sdk import LocalWorker, Task, WorkerManager
from tests.e2e.test_cli_more import aikg
from tests.helpers import RELU_KERNEL, RELU_TASK

DECLINED_TASK = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        {init}

    def forward(self, x):
        return {body}


def get_inputs():
    return [torch.randn(2, 4, 16)]


def get_init_inputs():
    return []
"""


def declined_task(init: str = "self.emb = nn.Embedding(10, 4)",
                  body: str = "self.emb(x.long().clamp(0, 9))") -> str:
    return DECLINED_TASK.format(init=init, body=body)


@pytest.mark.parametrize(("init", "body", "op", "spelled"), [
    ("self.emb = nn.Embedding(10, 4)", "self.emb(x.long())", "aten.embedding.default",
     "nn.Embedding"),
    ("self.conv = torch.nn.LazyConv1d(4, 3)", "self.conv(x)", "aten.convolution.default",
     "nn.LazyConv1d"),
    ("pass", "F.unfold(x.unsqueeze(0), 3)", "aten.im2col.default", "F.unfold"),
    ("self.attn = nn.MultiheadAttention(16, 2)", "self.attn(x, x, x)[0]",
     "aten._native_multi_head_attention.default", "nn.MultiheadAttention"),
])
def test_source_shows_what_is_declined(init, body, op, spelled):
    reason = decline(declined_task(init, body))
    assert reason is not None
    assert f"cannot lower {op}" in reason and spelled in reason
    assert reason.endswith("use the LLM coder")


@pytest.mark.parametrize("source", [
    RELU_TASK, "class Model(:\n", "x = 1\n", declined_task("pass", "torch.relu(x)"),
    # convolutions have a schedule (schedules/conv.py)
    declined_task("self.conv = nn.Conv1d(4, 4, 3)", "self.conv(x)"),
    declined_task("self.up = torch.nn.ConvTranspose1d(4, 2, 3)", "self.up(x)"),
    declined_task("pass", "F.conv1d(x, torch.ones(4, 4, 3))"),
    # recurrent layers too (schedules/recurrent.py)
    declined_task("self.rnn = nn.LSTM(16, 8)", "self.rnn(x)[0]"),
    declined_task("self.rnn = torch.nn.GRU(16, 8, 2)", "self.rnn(x)[0]")])
def test_source_screen_leaves_the_rest_to_the_lowering(source):
    assert decline(source) is None


def test_a_constant_tensor_other_than_a_number_is_refused_by_name():
    from services.generator.lowering import lower_task
    from services.generator.lowering.errors import LoweringError

    with pytest.raises(LoweringError, match=r"constant tensor \(lifted_tensor_0\)"):
        lower_task(declined_task("pass", "x + torch.tensor([1.0, 2.0]).sum()"))


async def test_generator_coder_declines_without_a_sandboxed_child():
    # Never started: a lowering would fail with "not started", not with the refusal.
    coder = BuiltinCoder(lowering_sandbox("refusal-test"))
    submit = JobSubmit(op_name="embedding", task_desc=declined_task(), job_id="refusal-1")
    with pytest.raises(CoderError) as info:
        await coder.generate(submit)
    message = str(info.value)
    assert "aten.embedding.default" in message and "indexing" in message
    assert "coder 'llm'" in message and "AIKG_LLM_BASE_URL" in message
    assert coder.lowerings == 0


async def test_sdk_task_declines_and_starts_no_sandbox():
    manager = WorkerManager()
    worker = LocalWorker([0], backend="cpu")
    manager.add(worker, "cpu", worker.arch, 1)
    _, passed, info = await Task("embedding", declined_task(), worker_manager=manager).run()
    assert not passed and info["attempts"] == 0
    assert "aten.embedding.default" in info["error"] and "`aikg submit --coder llm`" in info["error"]
    assert worker._verifier is None  # no verification sandbox was started for nothing


def test_abort_start_cuts_a_starting_sandbox_short(tmp_path):
    """The verification sandbox that `aikg run` starts beside the lowering is not waited
    for once the coder declines: abort_start kills its server before it is ready."""
    from services.sandbox.pool import PoolBroken, Sandbox

    sandbox = Sandbox("cpu", name="abort-test", scratch_root=tmp_path / "sandbox")
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            sandbox.start()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            outcome.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    time.sleep(0.2)  # the server is importing torch (seconds)
    aborted = time.monotonic()
    sandbox.abort_start()
    thread.join(timeout=30)
    try:
        assert time.monotonic() - aborted < 2.0
        assert isinstance(outcome[0], PoolBroken) and "aborted" in str(outcome[0])
        assert not sandbox.started
    finally:
        sandbox.close()


@pytest.mark.slow
async def test_aikg_run_declines_an_embedding_without_importing_torch(tmp_path):
    """The refusal comes from the task's source alone: with a ``torch`` on the path
    whose import fails, ``aikg run`` still declines the embedding (and says why), so
    the answer takes Python's start and the CLI's imports, not torch's seconds."""
    task = tmp_path / "embedding.py"
    task.write_text(declined_task())
    poisoned = tmp_path / "poison"
    (poisoned / "torch").mkdir(parents=True)
    (poisoned / "torch" / "__init__.py").write_text(
        "raise ImportError('torch imported by a refusal that needs only the source')\n")
    code, out, err = await aikg("run", str(task), "--json", env={"PYTHONPATH": str(poisoned)})
    assert code == 1, err
    assert "aten.embedding.default" in out and "indexing operators" in out, out + err
    assert "aikg submit --coder llm" in out
    assert "torch imported" not in out + err


BIG_TASK = RELU_TASK.replace("batch_size = 16", "batch_size = 4096").replace(
    "dim = 1024", "dim = 65536")


@pytest.mark.parametrize("command", ["aikg submit", "aikg run"])
async def test_memory_hint_names_the_command_in_use(shared_verifier, command):
    before = shared_verifier.client_command
    shared_verifier.client_command = command  # as LocalWorker(client_command=...) sets it
    try:
        result = await shared_verifier.verify(build_request(
            request_id=f"big-{command.split()[1]}", job_id="hint", candidate_id="c0",
            op_name="relu", task_desc=BIG_TASK, code=RELU_KERNEL, backend="cpu", arch="x86_64"),
            device="0")
    finally:
        shared_verifier.client_command = before
    assert result.stage == "task"
    assert f"({command}: --shape batch_size=" in result.error


@pytest.mark.slow
async def test_aikg_run_hint_names_aikg_run(tmp_path):
    """`aikg run` on inputs over its 4 GiB cpu limit: the hint gives `aikg run`'s flag."""
    task = tmp_path / "big.py"
    task.write_text(RELU_TASK.replace("batch_size = 16", "batch_size = 65536").replace(
        "dim = 1024", "dim = 65536"))
    code, out, err = await aikg("run", str(task), "--json", "--trials", "1", timeout=180)
    assert code == 1, err
    assert "(aikg run: --shape batch_size=" in out, out[-2000:]


BROKEN_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x @ x  # (3, 4) @ (3, 4): the task itself is wrong


def get_inputs():
    return [torch.randn(3, 4)]


def get_init_inputs():
    return []
"""


def test_a_task_whose_own_model_fails_is_blamed_not_the_coder():
    from services.generator.lowering import LoweringError, lower_task

    with pytest.raises(LoweringError) as caught:
        lower_task(BROKEN_TASK)
    assert caught.value.op == "task"
    message = str(caught.value)
    assert "the task's own Model fails on its get_inputs()" in message
    assert "same reduction dim" in message and "LLM coder" not in message
