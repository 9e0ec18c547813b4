"""LLM agents and workflows without NATS: code extraction from model replies, the
coder's prompts and its retries on unusable replies (through the real openai client
against the scripted server), and the attempt loop of both workflows with a verify
function standing in for the workers."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import JobSubmit, VerifyResult
from services.common.settings import load_settings
from services.generator.agents import (
    Conductor,
    Designer,
    LLMCoder,
    UnusableReply,
    check_module,
    extract_code,
)
from services.generator.coders.base import Attempt, Candidate, CoderError
from services.generator.llm import LLMClient
from services.generator.workflows import (
    WorkflowContext,
    WorkflowError,
    coder_only_workflow,
    default_workflow,
)
from tests import fake_llm
from tests.fake_llm import SOFTMAX_BROKEN, SOFTMAX_FIXED, FakeLLM, Reply, fenced

SOFTMAX_TASK = (Path(__file__).resolve().parents[2] / "tasks" / "softmax.py").read_text()
MISMATCH = ("output 0: 16384 of 16384 elements differ beyond atol=1e-4 rtol=1e-4; max abs error "
            "0.991316 at [3, 141] (expected 0.00868396, got 1) in trial 0 (seed 1000)")


def softmax_job(**extra) -> JobSubmit:
    return JobSubmit(op_name="softmax", task_desc=SOFTMAX_TASK, backend="cpu", arch="x86_64",
                     job_id="job-agents", **extra)


def verdict(attempt: Attempt) -> VerifyResult:
    """What a worker would say: the fixed softmax passes, anything else mismatches."""
    passed = attempt.candidate.code == SOFTMAX_FIXED
    return VerifyResult(request_id=f"r{attempt.number}", job_id="job-agents",
                        candidate_id=f"c{attempt.number}", worker_id="w", device="0",
                        passed=passed, stage=None if passed else "mismatch",
                        error=None if passed else MISMATCH,
                        log="" if passed else "Traceback? no: values differ\n" + MISMATCH)


# --- extraction ----------------------------------------------------------------------


def test_fenced_block_with_prose_around_it() -> None:
    assert extract_code(fenced(SOFTMAX_FIXED)) == SOFTMAX_FIXED


def test_picks_the_block_that_defines_modelnew() -> None:
    reply = ("First, the reference for comparison:\n```python\nimport torch\nprint(1)\n```\n"
             f"Now the kernel:\n```py\n{SOFTMAX_FIXED}```\nDone. Usage:\n```bash\npython x.py\n```")
    assert extract_code(reply) == SOFTMAX_FIXED


def test_kernel_and_module_split_over_two_blocks_are_joined() -> None:
    kernel, module = SOFTMAX_FIXED.split("class ModelNew")
    reply = f"Kernel:\n```python\n{kernel}```\nModule:\n```python\nclass ModelNew{module}```"
    code = extract_code(reply)
    assert check_module(code) is None and "softmax_kernel" in code and "class ModelNew" in code


def test_json_with_a_code_field() -> None:
    assert extract_code(json.dumps({"code": SOFTMAX_FIXED, "notes": "one row per program"})) \
        == SOFTMAX_FIXED
    wrapped = "```json\n" + json.dumps({"code": SOFTMAX_FIXED}) + "\n```"
    assert extract_code(wrapped) == SOFTMAX_FIXED


def test_bare_module_and_thinking_are_handled() -> None:
    assert check_module(extract_code(SOFTMAX_FIXED)) is None
    reply = ("<think>maybe ```python\nclass ModelNew: pass\n``` no...</think>\n"
             + fenced(SOFTMAX_FIXED))
    assert extract_code(reply) == SOFTMAX_FIXED
    prose_then_code = "Sure! This should work.\n\n" + SOFTMAX_FIXED
    assert check_module(extract_code(prose_then_code)) is None


@pytest.mark.parametrize(("reply", "reason"), [
    ("", "empty"),
    ("I cannot help with that.", "no module defining class ModelNew"),
    (fenced(SOFTMAX_FIXED.replace("def forward(self, x", "def forwrd(self, x")), "no forward"),
    (fenced(SOFTMAX_FIXED.replace("@triton.jit\n", "")), "no @triton.jit kernel"),
    (fenced(SOFTMAX_FIXED.replace("n_rows, n_cols = x.shape", "n_rows, n_cols = = x.shape")),
     "does not parse"),
    (fenced(SOFTMAX_FIXED.replace("class ModelNew", "class ModelOld")), "no module defining"),
    ("Here:\n```python\n" + SOFTMAX_FIXED[:300], "cut off"),
])
def test_unusable_replies_say_why(reply: str, reason: str) -> None:
    with pytest.raises(UnusableReply, match=reason):
        extract_code(reply, "length" if reply.endswith(SOFTMAX_FIXED[:300]) else "stop")


# --- agents over HTTP ----------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeLLM]:
    with FakeLLM([Reply(content=fenced(SOFTMAX_FIXED))]) as server:
        yield server


@contextlib.asynccontextmanager
async def chat_with(fake: FakeLLM, **overrides):
    """The agents' chat function on an LLM client of ``fake``, closed when the block ends."""
    client = LLMClient(load_settings(env={}, llm_base_url=fake.url, llm_model="fake-coder",
                                     llm_timeout_s=5.0, **overrides))

    async def chat(agent, messages):
        return await client.chat(agent, messages)

    try:
        yield chat
    finally:
        await client.aclose()


async def test_coder_prompt_has_task_guide_hardware_and_the_failure(fake: FakeLLM) -> None:
    failed = Attempt(1, Candidate(code=SOFTMAX_BROKEN, coder="llm"))
    failed.verdict = verdict(failed)
    async with chat_with(fake) as chat:
        candidate = await LLMCoder(chat).write(softmax_job(), [failed], plan="one row per program",
                                               instruction="divide by the row sum")
    assert candidate.code == SOFTMAX_FIXED and candidate.coder == "llm"
    assert candidate.meta["guidance"] == "divide by the row sum"
    request = fake.requests[0]
    system, user = request.body["messages"][0]["content"], request.body["messages"][1]["content"]
    assert "You are the coder" in system
    assert "Triton DSL guide" in system and "TRITON_INTERPRET=1" in system  # cpu notes
    assert "torch.softmax(x, dim=1)" in user  # the task
    assert SOFTMAX_BROKEN.strip() in user and MISMATCH in user and "Stage: `mismatch`" in user
    assert "one row per program" in user and "divide by the row sum" in user


def test_hardware_notes_follow_backend_and_arch() -> None:
    coder = LLMCoder(chat=None)  # type: ignore[arg-type]
    job = JobSubmit(op_name="softmax", task_desc=SOFTMAX_TASK, backend="cuda", arch="h200")
    system = coder.messages(job, [])[0]["content"]
    assert "Target: cuda" in system and "H200" in system and "TRITON_INTERPRET" not in system


async def test_unusable_replies_are_retried_then_a_good_one_is_used(fake: FakeLLM) -> None:
    fake.set_script([Reply(content="Let me think about softmax first."),
                     Reply(content=fenced(SOFTMAX_FIXED.replace("@triton.jit\n", ""))),
                     Reply(content=fenced(SOFTMAX_FIXED))])
    async with chat_with(fake) as chat:
        candidate = await LLMCoder(chat).write(softmax_job(), [])
    assert candidate.code == SOFTMAX_FIXED
    assert len(fake.requests) == 3
    second = fake.requests[1].body["messages"]
    assert second[-2]["role"] == "assistant" and "think about softmax" in second[-2]["content"]
    assert "no module defining class ModelNew" in second[-1]["content"]
    assert "no @triton.jit kernel" in fake.requests[2].body["messages"][-1]["content"]


async def test_only_unusable_replies_fail_the_coder(fake: FakeLLM) -> None:
    fake.set_script([Reply(content="no code, sorry")])
    async with chat_with(fake) as chat:
        with pytest.raises(CoderError, match="3 unusable replies"):
            await LLMCoder(chat).write(softmax_job(), [])
    assert len(fake.requests) == 3


async def test_coder_reports_a_dead_endpoint_as_a_coder_error(fake: FakeLLM) -> None:
    fake.set_script([Reply(status=401, error="bad key")])
    async with chat_with(fake) as chat:
        with pytest.raises(CoderError, match="refused the key"):
            await LLMCoder(chat).write(softmax_job(), [])


async def test_designer_and_conductor_prompts(fake: FakeLLM) -> None:
    fake.set_script([Reply(content="<think>hmm</think>1. One program per row."),
                     Reply(content="Divide num by den before the store.")])
    failed = Attempt(2, Candidate(code=SOFTMAX_BROKEN, coder="llm"))
    failed.verdict = verdict(failed)
    async with chat_with(fake) as chat:
        plan = await Designer(chat).plan(softmax_job())
        instruction = await Conductor(chat).instruct(softmax_job(), failed)
    assert plan == "1. One program per row."
    assert instruction == "Divide num by den before the store."
    assert "You are the designer" in fake.requests[0].agent_role
    conductor = fake.requests[1]
    assert "You are the conductor" in conductor.agent_role
    assert MISMATCH in conductor.prompt and SOFTMAX_BROKEN.strip() in conductor.prompt


# --- workflows -----------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.verified: list[Attempt] = []
        self.events: list[tuple[str, dict]] = []

    async def verify(self, attempt: Attempt) -> VerifyResult:
        self.verified.append(attempt)
        return verdict(attempt)

    async def report(self, event: str, **fields) -> None:
        self.events.append((event, fields))


async def test_coder_only_repairs_with_the_verdict(fake: FakeLLM) -> None:
    fake.set_script(fake_llm.repair_script)
    rec = Recorder()
    async with chat_with(fake) as chat:
        result = await coder_only_workflow(WorkflowContext(
            submit=softmax_job(), verify=rec.verify, report=rec.report, coder=LLMCoder(chat)))
    assert result.passed and result.attempts == 2 and result.code == SOFTMAX_FIXED
    assert [a.number for a in rec.verified] == [1, 2]
    assert MISMATCH not in fake.requests[0].prompt and MISMATCH in fake.requests[1].prompt


async def test_default_workflow_plans_and_conducts(fake: FakeLLM) -> None:
    fake.set_script(fake_llm.repair_script)
    rec = Recorder()
    async with chat_with(fake) as chat:
        result = await default_workflow(WorkflowContext(
            submit=softmax_job(workflow="default_workflow"), verify=rec.verify,
            report=rec.report, coder=LLMCoder(chat), designer=Designer(chat),
            conductor=Conductor(chat)))
    assert result.passed and result.attempts == 2
    roles = [("designer" if "You are the designer" in r.agent_role else
              "conductor" if "You are the conductor" in r.agent_role else "coder")
             for r in fake.requests]
    assert roles == ["designer", "coder", "conductor", "coder"]
    assert fake_llm.REPAIR_PLAN in fake.requests[1].prompt
    assert fake_llm.REPAIR_GUIDANCE in fake.requests[3].prompt
    assert rec.verified[1].candidate.meta["guidance"] == fake_llm.REPAIR_GUIDANCE
    assert any(f.get("plan") == fake_llm.REPAIR_PLAN for _, f in rec.events)


async def test_attempts_stop_at_max_attempts(fake: FakeLLM) -> None:
    fake.set_script([Reply(content=fenced(SOFTMAX_BROKEN))])
    rec = Recorder()
    async with chat_with(fake) as chat:
        result = await coder_only_workflow(WorkflowContext(
            submit=softmax_job(max_attempts=2), verify=rec.verify, report=rec.report,
            coder=LLMCoder(chat)))
    assert not result.passed and result.attempts == 2 and len(rec.verified) == 2
    assert result.verdict is not None and result.verdict.stage == "mismatch"


async def test_a_task_stage_verdict_ends_the_attempts(fake: FakeLLM) -> None:
    # A task too big for the worker: the fix is the user's --shape, not a new candidate.
    fake.set_script([Reply(content=fenced(SOFTMAX_BROKEN))])
    verified: list[Attempt] = []

    async def too_big(attempt: Attempt) -> VerifyResult:
        verified.append(attempt)
        return VerifyResult(request_id="r1", job_id="job-agents", candidate_id="c1",
                            worker_id="w", device="0", passed=False, stage="task",
                            error="the task's inputs need 64 GiB; pass --shape")

    async with chat_with(fake) as chat:
        result = await coder_only_workflow(WorkflowContext(
            submit=softmax_job(max_attempts=3), verify=too_big, report=Recorder().report,
            coder=LLMCoder(chat)))
    assert not result.passed and len(verified) == 1 and result.attempts == 1
    assert result.verdict is not None and result.verdict.stage == "task"


async def test_init_code_is_the_first_candidate_of_an_llm_job(fake: FakeLLM) -> None:
    fake.set_script(fake_llm.repair_script)
    rec = Recorder()
    async with chat_with(fake) as chat:
        result = await coder_only_workflow(WorkflowContext(
            submit=softmax_job(init_code=SOFTMAX_BROKEN), verify=rec.verify,
            report=rec.report, coder=LLMCoder(chat)))
    assert [a.candidate.coder for a in rec.verified] == ["init_code", "llm"]
    assert result.passed and result.coder == "llm"
    assert len(fake.requests) == 1 and MISMATCH in fake.requests[0].prompt


async def test_resume_reawaits_the_pending_attempt_and_goes_on(fake: FakeLLM) -> None:
    fake.set_script(fake_llm.repair_script)
    rec = Recorder()
    done = Attempt(1, Candidate(code="", coder="llm"))  # earlier code is not kept
    done.verdict = verdict(Attempt(1, Candidate(code=SOFTMAX_BROKEN, coder="llm")))
    pending = Attempt(2, Candidate(code=SOFTMAX_BROKEN, coder="llm"))
    async with chat_with(fake) as chat:
        result = await coder_only_workflow(WorkflowContext(
            submit=softmax_job(), verify=rec.verify, report=rec.report,
            coder=LLMCoder(chat), history=[done, pending]))
    assert [a.number for a in rec.verified] == [2, 3]  # attempt 1 is not redone
    assert result.passed and result.attempts == 3
    assert MISMATCH in fake.requests[0].prompt and SOFTMAX_BROKEN.strip() in fake.requests[0].prompt


async def test_resume_of_a_passed_attempt_calls_nothing(fake: FakeLLM) -> None:
    rec = Recorder()
    passed = Attempt(1, Candidate(code=SOFTMAX_FIXED, coder="llm"))
    passed.verdict = verdict(passed)
    async with chat_with(fake) as chat:
        result = await coder_only_workflow(WorkflowContext(
            submit=softmax_job(), verify=rec.verify, report=rec.report, coder=LLMCoder(chat),
            history=[passed]))
    assert result.passed and rec.verified == [] and fake.requests == []


async def test_coder_giving_up_fails_with_its_reason_and_the_last_verdict(fake: FakeLLM) -> None:
    fake.set_script(lambda i, r: Reply(content=fenced(SOFTMAX_BROKEN)) if i == 0
                    else Reply(content="no idea"))
    rec = Recorder()
    async with chat_with(fake) as chat:
        with pytest.raises(WorkflowError, match="unusable replies") as info:
            await coder_only_workflow(WorkflowContext(
                submit=softmax_job(), verify=rec.verify, report=rec.report,
                coder=LLMCoder(chat)))
    assert "mismatch" in str(info.value) and len(rec.verified) == 1
    assert info.value.result is not None and info.value.result.attempts == 1
