"""A scripted OpenAI-compatible server for tests: real HTTP on a loopback port.

``POST /v1/chat/completions`` records each request (JSON body and headers) and
answers with whatever the test's script says: a chat reply with ``usage``, an HTTP
error with headers (``Retry-After``), or a reply held back for a while (a slow or
dead model). ``GET /v1/models`` lists one model. It runs in a thread
(``http.server``), so it answers whatever the test's event loop is doing, and a
generator running as a subprocess can use it too.

Also holds the softmax kernels the scripted "LLM" writes: a correct one-program-per-row
Triton softmax, and a broken one that forgets to divide by the row sum.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.helpers import scaled

SOFTMAX_FIXED = '''\
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride,
                   BLOCK_SIZE: tl.constexpr):
    # One program per row; the whole row fits in one block.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf"))
    x = x.to(tl.float32)
    x = x - tl.max(x, axis=0)
    num = tl.exp(x)
    den = tl.sum(num, axis=0)
    y = num / den
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        n_rows, n_cols = x.shape
        out = torch.empty_like(x)
        BLOCK_SIZE = triton.next_power_of_2(n_cols)
        softmax_kernel[(n_rows,)](x, out, n_cols, x.stride(0), out.stride(0),
                                  BLOCK_SIZE=BLOCK_SIZE)
        return out
'''

# Runs fine but forgets to divide by the row sum: every value mismatches.
SOFTMAX_BROKEN = SOFTMAX_FIXED.replace("    y = num / den\n", "    y = num\n")
assert SOFTMAX_BROKEN != SOFTMAX_FIXED


def fenced(code: str, prose: str = "Here is the kernel.") -> str:
    """A typical model reply: prose, then the module in a ```python block."""
    return f"{prose}\n\n```python\n{code}```\n\nIt launches one program per row."


@dataclass
class Reply:
    """What the server answers to one request.

    Attributes:
        content: the assistant message (a 200 chat completion) when ``status`` is 200.
        status: HTTP status; not 200 sends ``error`` as an OpenAI-style error body.
        headers: extra response headers (``Retry-After``).
        error: error message of a non-200 reply.
        delay_s: hold the reply this long first (released early by :meth:`FakeLLM.close`;
            a client that hangs up meanwhile gets nothing and is noted in ``disconnects``).
        finish_reason: ``stop`` or ``length``.
    """

    content: str | None = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    error: str = "scripted error"
    delay_s: float = 0.0
    finish_reason: str = "stop"


@dataclass
class Recorded:
    """One request as the server saw it."""

    body: dict[str, Any]
    headers: dict[str, str]
    time: float

    @property
    def prompt(self) -> str:
        """Every message's content, joined: what the model was asked."""
        return "\n".join(str(m.get("content") or "") for m in self.body.get("messages", []))

    @property
    def agent_role(self) -> str:
        """The system message (tells designer, coder and conductor apart)."""
        for m in self.body.get("messages", []):
            if m.get("role") == "system":
                return str(m.get("content") or "")
        return ""


Script = Callable[[int, Recorded], Reply]


class FakeLLM:
    """Scripted OpenAI-compatible chat server on ``127.0.0.1``, served from a thread.

    Args:
        script: ``(index, request) -> Reply`` (index counts chat requests from 0), or a
            list of replies served in order (the last one repeats).
        model: model name reported in replies and by ``/v1/models``.
    """

    def __init__(self, script: Script | list[Reply], model: str = "fake-coder") -> None:
        self.model = model
        self.requests: list[Recorded] = []
        # When clients hung up on a held reply (time.monotonic()).
        self.disconnects: list[float] = []
        self._script = script
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name="fake-llm", daemon=True)

    @property
    def url(self) -> str:
        """Base URL to give the openai client (``http://127.0.0.1:PORT/v1``)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> FakeLLM:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release held replies and stop serving."""
        self._release.set()
        self._server.shutdown()
        self._server.server_close()

    def set_script(self, script: Script | list[Reply]) -> None:
        with self._lock:
            self._script = script

    def chat_requests(self, role_word: str | None = None) -> list[Recorded]:
        """Recorded chat requests, optionally only those whose system prompt has ``role_word``."""
        with self._lock:
            recorded = list(self.requests)
        if role_word is None:
            return recorded
        return [r for r in recorded if role_word in r.agent_role]

    async def wait_requests(self, count: int, timeout_s: float = 60.0,
                            role_word: str | None = None) -> list[Recorded]:
        """Poll until at least ``count`` requests (of that agent) arrived."""
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            found = self.chat_requests(role_word)
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"fake LLM got {len(found)} of {count} requests in {timeout_s} s")
            await asyncio.sleep(0.05)

    def _reply_for(self, recorded: Recorded) -> Reply:
        with self._lock:
            index = len(self.requests)
            self.requests.append(recorded)
            script = self._script
        if isinstance(script, list):
            return script[min(index, len(script) - 1)]
        return script(index, recorded)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

            def _send(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for name, value in (headers or {}).items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout or cancel)

            def _hold(self, seconds: float) -> bool:
                """Wait ``seconds`` (or until the server closes); False as soon as the
                client hangs up (its timeout, or its task was cancelled)."""
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline and not fake._release.is_set():
                    readable, _, _ = select.select([self.connection], [], [], 0.05)
                    if readable:
                        try:
                            if not self.connection.recv(1, socket.MSG_PEEK):
                                return False
                        except OSError:
                            return False
                return True

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [
                        {"id": fake.model, "object": "model", "owned_by": "test"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b"{}"
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                recorded = Recorded(body=json.loads(raw or b"{}"),
                                    headers={k.lower(): v for k, v in self.headers.items()},
                                    time=time.monotonic())
                reply = fake._reply_for(recorded)
                if reply.delay_s > 0 and not self._hold(reply.delay_s):
                    with fake._lock:
                        fake.disconnects.append(time.monotonic())
                    self.close_connection = True
                    return
                if reply.status != 200:
                    self._send(reply.status, {"error": {"message": reply.error,
                                                        "type": "scripted", "code": None}},
                               reply.headers)
                    return
                content = reply.content or ""
                prompt_tokens = max(1, len(recorded.prompt) // 4)
                completion_tokens = max(1, len(content) // 4)
                self._send(200, {
                    "id": f"chatcmpl-{len(fake.requests)}",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": fake.model,
                    "choices": [{"index": 0, "finish_reason": reply.finish_reason,
                                 "message": {"role": "assistant", "content": reply.content}}],
                    "usage": {"prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens},
                }, reply.headers)

        return Handler


# What the worker's mismatch verdicts say; :func:`repair_script` only fixes its kernel
# once it has been shown this.
MISMATCH_MARK = "elements differ beyond"
# The designer's plan and the conductor's guidance in :func:`repair_script`.
REPAIR_PLAN = "1. One program per row; subtract the row max; divide by the sum."
REPAIR_GUIDANCE = "Divide num by den before storing."


def repair_script(index: int, request: Recorded) -> Reply:
    """A scripted model that plans and conducts, writes SOFTMAX_BROKEN first and
    SOFTMAX_FIXED only once it was shown a mismatch verdict."""
    if "You are the designer" in request.agent_role:
        return Reply(content=REPAIR_PLAN)
    if "You are the conductor" in request.agent_role:
        return Reply(content=REPAIR_GUIDANCE)
    if MISMATCH_MARK in request.prompt:
        return Reply(content=fenced(SOFTMAX_FIXED))
    return Reply(content=fenced(SOFTMAX_BROKEN, "Here is a first version."))
