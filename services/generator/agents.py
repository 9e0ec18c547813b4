"""LLM agents of the generator: the designer plans, the coder writes, the conductor repairs.

Each agent builds its prompt from the prompt files in ``prompts/`` (role, Triton DSL
guide, notes on the target backend and arch) plus the job at hand, and talks to its
model through a ``chat(agent, messages)`` callable (the service binds
:meth:`services.generator.llm.LLMClient.chat` to the job, so usage lands in the job
record). Agents know nothing of NATS (docs/architecture.md, "Where the code is").

The coder's reply is only a candidate once :func:`extract_code` found one complete
module in it that parses, defines ``class ModelNew`` with a ``forward`` and at least
one ``@triton.jit`` kernel. A reply without one is answered with what was wrong and
asked again (:data:`UNUSABLE_RETRIES` times), never sent to a worker.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Awaitable, Callable
from functools import cache
from pathlib import Path

import structlog

from schemas import JobSubmit, VerifyResult
from services.common.pyast import parse
from services.generator.coders.base import Attempt, Candidate, CoderError
from services.generator.llm import Completion, LLMError, Message

log = structlog.get_logger("aikg.agents")

PROMPTS = Path(__file__).resolve().parent / "prompts"
# Further replies asked of the coder after an unusable one, per attempt.
UNUSABLE_RETRIES = 2
# Bounds on what goes into a prompt, characters: a verifier log can be long, and the
# repair only needs its end (where the traceback or the mismatch is).
LOG_TAIL_CHARS = 4000
ERROR_CHARS = 3000
PLAN_CHARS = 4000
INSTRUCTION_CHARS = 2000
# Short notes per arch, added to the backend's notes (unknown arches get none).
ARCH_NOTES = {
    "h200": "NVIDIA H200 (Hopper, sm_90): 132 SMs, 141 GB HBM3e at ~4.8 TB/s, 228 KB shared "
            "memory per SM; bf16/fp16/fp8 tensor cores.",
    "h100": "NVIDIA H100 (Hopper, sm_90): 132 SMs, HBM3 at ~3.3 TB/s, 228 KB shared memory "
            "per SM; bf16/fp16/fp8 tensor cores.",
    "a100": "NVIDIA A100 (Ampere, sm_80): 108 SMs, HBM2e at ~2 TB/s, 164 KB shared memory per "
            "SM; tf32/bf16/fp16 tensor cores.",
    "l40s": "NVIDIA L40S (Ada, sm_89): 142 SMs, GDDR6 at ~0.86 TB/s, 100 KB shared memory "
            "per SM.",
    "ascend910b4": "Ascend 910B4: 20 AI cores (cube + vector units), 32 GB HBM.",
    "ascend910b3": "Ascend 910B3: 20 AI cores (cube + vector units), 64 GB HBM.",
    "ascend910b2": "Ascend 910B2: 24 AI cores (cube + vector units), 64 GB HBM.",
}

ChatFn = Callable[[str, list[Message]], Awaitable[Completion]]


class UnusableReply(ValueError):
    """The reply holds no usable module; the message says what is missing."""


@cache
def prompt(name: str) -> str:
    """The text of ``prompts/<name>.md``."""
    return (PROMPTS / f"{name}.md").read_text(encoding="utf-8").strip()


def hardware_notes(backend: str, arch: str | None) -> str:
    """The backend's notes (``prompts/hardware_<backend>.md``) plus a line on the arch."""
    notes = prompt(f"hardware_{backend}") if (PROMPTS / f"hardware_{backend}.md").exists() else ""
    arch_line = ARCH_NOTES.get((arch or "").lower())
    if arch_line:
        notes = f"{notes}\n- Arch `{arch}`: {arch_line}"
    elif arch:
        notes = f"{notes}\n- Arch: `{arch}`."
    return notes


def system_prompt(role: str, submit: JobSubmit) -> str:
    """Role prompt + Triton guide + target notes for ``submit``'s backend and arch."""
    return "\n\n".join(p for p in (prompt(role), prompt("triton"),
                                   hardware_notes(submit.backend, submit.arch)) if p)


def task_section(submit: JobSubmit) -> str:
    """The task as the agents see it: operator, target, shape overrides, source."""
    lines = [f"## Task `{submit.op_name}`",
             f"Target: backend `{submit.backend}`, arch `{submit.arch or 'any'}`, DSL Triton, "
             f"framework {submit.framework}."]
    if submit.shape_overrides:
        overrides = ", ".join(f"{k} = {v!r}" for k, v in submit.shape_overrides.items())
        lines.append(f"Before get_inputs()/get_init_inputs() run, these module-level names "
                     f"are rebound: {overrides}.")
    lines += ["", "```python", submit.task_desc.rstrip(), "```"]
    return "\n".join(lines)


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "... (earlier lines cut)\n" + text[-limit:]


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " ... (cut)"


def verdict_section(verdict: VerifyResult) -> str:
    """A failed verdict as the coder and conductor read it: stage, error, log tail."""
    lines = [f"Stage: `{verdict.stage}`", f"Error: {_head(verdict.error or 'no detail', ERROR_CHARS)}"]
    if verdict.max_abs_error is not None:
        lines.append(f"Max abs error: {verdict.max_abs_error:g}; max rel error: "
                     f"{verdict.max_rel_error if verdict.max_rel_error is not None else 'n/a'}; "
                     f"tolerance atol={verdict.atol} rtol={verdict.rtol}.")
    if verdict.log.strip():
        lines += ["Log (end):", "```", _tail(verdict.log.strip(), LOG_TAIL_CHARS), "```"]
    return "\n".join(lines)


def _one_line(verdict: VerifyResult | None) -> str:
    if verdict is None:
        return "not verified"
    if verdict.passed:
        return "passed"
    first = (verdict.error or "no detail").strip().splitlines()[0] if verdict.error else "no detail"
    return f"failed at stage '{verdict.stage}': {_head(first, 300)}"


# --- extraction ----------------------------------------------------------------------

_THINK = re.compile(r"<think>.*?</think>", re.S | re.I)
_PYTHON_TAGS = ("", "python", "py", "python3")


def _strip_thinking(text: str) -> str:
    """Drop ``<think>...</think>`` (drafts of reasoning models), also an unclosed start."""
    text = _THINK.sub("", text)
    if "</think>" in text.lower():
        text = text[text.lower().rindex("</think>") + len("</think>"):]
    return text


def fenced_blocks(text: str) -> list[tuple[str, str, bool]]:
    """Markdown code blocks of ``text``: ``(language tag, body, closed)`` in order.

    An unclosed last block (a reply cut at the token limit) is returned with
    ``closed`` False.
    """
    blocks: list[tuple[str, str, bool]] = []
    tag: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if tag is None:
            if stripped.startswith("```"):
                tag = stripped[3:].strip().lower()
                body = []
        elif stripped == "```" or (stripped.startswith("```") and not stripped[3:].strip()):
            blocks.append((tag, "\n".join(body) + "\n", True))
            tag = None
        else:
            body.append(line)
    if tag is not None:
        blocks.append((tag, "\n".join(body) + "\n", False))
    return blocks


def check_module(code: str) -> str | None:
    """Why ``code`` cannot be a candidate, or None when it can.

    A candidate parses, defines ``class ModelNew`` with a ``forward`` method and at
    least one module-level function under ``@triton.jit`` (docs/verification.md, "Input").
    """
    try:
        tree = parse(code)
    except SyntaxError as exc:
        return f"the module does not parse: line {exc.lineno}: {exc.msg}"
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew"),
                 None)
    if model is None:
        return "it defines no class ModelNew"
    if not any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == "forward"
               for n in model.body):
        return "class ModelNew has no forward method"

    def is_jit(dec: ast.expr) -> bool:
        target = dec.func if isinstance(dec, ast.Call) else dec
        return ast.unparse(target) in ("triton.jit", "jit")

    if not any(isinstance(n, ast.FunctionDef) and any(is_jit(d) for d in n.decorator_list)
               for n in tree.body):
        return "it defines no @triton.jit kernel"
    return None


def _json_code(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, dict) and isinstance(value.get("code"), str):
        return value["code"]
    return None


def extract_code(reply: str, finish_reason: str | None = None) -> str:
    """The candidate module in a model's reply.

    Looks, in order, at: a JSON object with a ``code`` field (bare or in a ```json
    block); fenced ```python (or untagged) blocks, preferring the last one that
    defines ``ModelNew``; all Python blocks joined (a model that split kernel and
    module); and, without fences, the reply itself or its part from the first
    ``import``. ``<think>`` sections are ignored.

    Returns:
        Module source that passes :func:`check_module`.

    Raises:
        UnusableReply: nothing usable; the message says what was wrong (shown to the
            model when it is asked again).
    """
    text = _strip_thinking(reply or "").strip()
    if not text:
        raise UnusableReply("the reply was empty")
    blocks = fenced_blocks(text)
    options: list[str] = []
    json_code = _json_code(text)
    if json_code is not None:
        options.append(json_code)
    for tag, body, _closed in blocks:
        if tag == "json" and (code := _json_code(body)) is not None:
            options.append(code)
    python = [body for tag, body, closed in blocks if tag in _PYTHON_TAGS and closed]
    defining = [b for b in python if re.search(r"^class\s+ModelNew\b", b, re.M)]
    options += list(reversed(defining))
    if len(python) > 1:
        options.append("\n\n".join(python))
    options += [b for b in python if b not in defining]
    if not blocks:
        options.append(text + "\n")
        start = re.search(r"^(import|from)\s+\w", text, re.M)
        if start:
            options.append(text[start.start():] + "\n")
    for code in options:
        if check_module(code) is None:
            return code
    if blocks and not blocks[-1][2] and blocks[-1][0] in _PYTHON_TAGS:
        raise UnusableReply("the code block was cut off before its closing ``` "
                            f"(finish_reason={finish_reason or 'unknown'}); write a shorter module")
    if finish_reason == "length":
        raise UnusableReply("the reply was cut off at the token limit before the module was "
                            "complete")
    # Say what is wrong with the option that looked most like a module.
    modules = [c for c in options if re.search(r"^class\s+ModelNew\b", c, re.M)]
    if not modules:
        raise UnusableReply("the reply holds no module defining class ModelNew")
    raise UnusableReply(check_module(modules[0]) or "no usable module found")


# --- agents --------------------------------------------------------------------------


class LLMCoder:
    """Writes candidates: the first from the task (and plan), later ones as repairs.

    Args:
        chat: ``chat(agent, messages) -> Completion`` bound to the job.
        unusable_retries: further replies asked for after an unusable one.
    """

    name = "llm"

    def __init__(self, chat: ChatFn, unusable_retries: int = UNUSABLE_RETRIES) -> None:
        self.chat = chat
        self.unusable_retries = unusable_retries

    def messages(self, submit: JobSubmit, history: list[Attempt], plan: str | None = None,
                 instruction: str | None = None) -> list[Message]:
        """The coder's prompt: system (role, DSL guide, target notes) and the job."""
        parts = [task_section(submit)]
        if plan:
            parts.append(f"## Plan (from the designer)\n{plan}")
        if history:
            lines = [f"- attempt {a.number} ({a.candidate.coder}): {_one_line(a.verdict)}"
                     for a in history]
            parts.append("## Attempts so far\n" + "\n".join(lines))
            last = history[-1]
            if last.verdict is not None and not last.verdict.passed:
                if last.candidate.code.strip():
                    parts.append(f"## Your previous candidate (attempt {last.number})\n"
                                 f"```python\n{last.candidate.code.rstrip()}\n```")
                parts.append(f"## Verifier's verdict on attempt {last.number}\n"
                             f"{verdict_section(last.verdict)}")
        if instruction:
            parts.append(f"## Repair instruction (from the conductor)\n{instruction}")
        if history:
            parts.append("Fix the previous candidate so that it passes verification. Reply with "
                         "the complete corrected module in one ```python block.")
        else:
            parts.append("Write the module. Reply with the complete module in one ```python "
                         "block.")
        return [{"role": "system", "content": system_prompt("coder", submit)},
                {"role": "user", "content": "\n\n".join(parts)}]

    async def write(self, submit: JobSubmit, history: list[Attempt], plan: str | None = None,
                    instruction: str | None = None) -> Candidate:
        """One candidate for the next attempt.

        Args:
            history: the job's attempts so far, oldest first; the last failed one's
                code and verdict are what the coder repairs.
            plan: the designer's plan, if any.
            instruction: the conductor's repair instruction, if any.

        Raises:
            CoderError: the endpoint failed for good (the LLM client's message), or
                ``1 + unusable_retries`` replies in a row held no usable module.
        """
        meta = {"guidance": instruction} if instruction else {}
        return await ask_coder(self.chat, self.messages(submit, history, plan, instruction),
                               coder=self.name, retries=self.unusable_retries, meta=meta)


async def ask_coder(chat: ChatFn, messages: list[Message], *, coder: str,
                    retries: int = UNUSABLE_RETRIES,
                    meta: dict[str, str] | None = None) -> Candidate:
    """Ask the ``coder`` agent for a module and return it as a candidate.

    A reply with no usable module (:func:`extract_code`) is answered with what was
    wrong and asked again, up to ``retries`` more times; the candidate's ``meta``
    gets the replying model's name on top of ``meta``.

    Raises:
        CoderError: the endpoint failed for good (the LLM client's message), or
            ``1 + retries`` replies in a row held no usable module.
    """
    base = messages
    reasons: list[str] = []
    for _ in range(1 + retries):
        try:
            completion = await chat("coder", messages)
        except LLMError as exc:
            raise CoderError(f"LLM coder: {exc}") from None
        try:
            code = extract_code(completion.text, completion.finish_reason)
        except UnusableReply as exc:
            reasons.append(str(exc))
            log.warning("llm_reply_unusable", agent="coder", reason=str(exc))
            messages = [*base,
                        {"role": "assistant", "content": _head(completion.text, 8000)},
                        {"role": "user", "content":
                         f"That reply cannot be used: {exc}. Reply with the complete module "
                         "(imports, the @triton.jit kernel(s), class ModelNew) in one "
                         "```python block."}]
            continue
        return Candidate(code=code, coder=coder, meta={**(meta or {}), "model": completion.model})
    raise CoderError(f"the LLM coder gave {len(reasons)} unusable replies in a row "
                     f"({'; '.join(reasons)})")


class Designer:
    """Writes a short implementation plan that the coder follows (``default_workflow``)."""

    def __init__(self, chat: ChatFn) -> None:
        self.chat = chat

    def messages(self, submit: JobSubmit) -> list[Message]:
        return [{"role": "system", "content": system_prompt("designer", submit)},
                {"role": "user", "content": task_section(submit) + "\n\nWrite the plan."}]

    async def plan(self, submit: JobSubmit) -> str:
        """The plan (at most :data:`PLAN_CHARS` characters; "" when the reply was empty).

        Raises:
            LLMError: the endpoint failed for good.
        """
        completion = await self.chat("designer", self.messages(submit))
        return _head(_strip_thinking(completion.text).strip(), PLAN_CHARS)


class Conductor:
    """Reads a failed attempt and writes a short repair instruction for the coder."""

    def __init__(self, chat: ChatFn) -> None:
        self.chat = chat

    def messages(self, submit: JobSubmit, attempt: Attempt) -> list[Message]:
        assert attempt.verdict is not None
        parts = [task_section(submit)]
        if attempt.candidate.code.strip():
            parts.append(f"## Candidate (attempt {attempt.number})\n"
                         f"```python\n{attempt.candidate.code.rstrip()}\n```")
        parts.append(f"## Verdict\n{verdict_section(attempt.verdict)}")
        parts.append("Write the repair instruction.")
        return [{"role": "system", "content": system_prompt("conductor", submit)},
                {"role": "user", "content": "\n\n".join(parts)}]

    async def instruct(self, submit: JobSubmit, attempt: Attempt) -> str:
        """The instruction (at most :data:`INSTRUCTION_CHARS` characters).

        Raises:
            LLMError: the endpoint failed for good.
        """
        completion = await self.chat("conductor", self.messages(submit, attempt))
        return _head(_strip_thinking(completion.text).strip(), INSTRUCTION_CHARS)
