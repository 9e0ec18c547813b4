"""LLM client of the generator's agents: chat completions on any OpenAI-compatible endpoint.

One :class:`LLMClient` per generator process serves the three agents (designer,
coder, conductor). Each agent's endpoint, key, model, temperature, reply length and
thinking switch come from settings (``AIKG_LLM_*``, overridable per agent as
``AIKG_LLM_<AGENT>_*``; see :class:`services.common.settings.Settings`).

Calls go through ``openai.AsyncOpenAI`` with its own retries off
(``max_retries=0``): retries live here, with ``tenacity``, so that every HTTP call is
counted in the metrics, the endpoint's concurrency slot is released while we back
off, and ``Retry-After`` is honoured up to :data:`MAX_RETRY_AFTER_S` (the openai
client silently ignores a longer one). Retried: 408, 409, 429, 5xx, timeouts and lost
connections. Not retried: other 4xx (a wrong key or model name does not heal).

The API key is sent as a bearer token and nowhere else: it is not in any log
event, metric label, job record or exception message (error texts from the
endpoint are scrubbed of it, and :class:`LLMError` does not chain the openai
exception, whose text may quote the request).
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import openai
import structlog
from prometheus_client import Counter, Histogram
from tenacity import AsyncRetrying, RetryCallState, stop_after_attempt, wait_exponential_jitter

from services.common.settings import LLM_TIMEOUT_S, Settings

log = structlog.get_logger("aikg.llm")

AGENTS = ("designer", "coder", "conductor")
# Values of AIKG_LLM_REASONING: on/off flip `enable_thinking`; the rest are OpenAI's
# `reasoning_effort` levels.
REASONING_SWITCH = ("on", "off")
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# The longest Retry-After honoured, seconds. A longer one (a daily quota) fails the
# call with a message instead of parking the job for hours.
MAX_RETRY_AFTER_S = 120.0
# Backoff when the endpoint gives no Retry-After: 0.5 s, 1 s, 2 s ... capped at 30 s,
# plus up to 0.5 s of jitter so that a generator's jobs do not retry in lockstep.
BACKOFF = wait_exponential_jitter(multiplier=0.5, max=30.0, jitter=0.5)
# What an endpoint without auth gets as key (vLLM's and Ollama's documented placeholder).
NO_KEY = "EMPTY"

REQUESTS = Counter(
    "aikg_llm_requests_total",
    "LLM chat-completion HTTP calls, by agent, model and outcome (ok, rate_limited, "
    "server_error, client_error, timeout, connection_error, cancelled).",
    ["agent", "model", "outcome"],
)
REQUEST_SECONDS = Histogram(
    "aikg_llm_request_duration_seconds",
    "Wall time of one LLM chat-completion HTTP call, seconds.",
    ["agent", "model"],
    buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
TOKENS = Counter(
    "aikg_llm_tokens_total",
    "Tokens the LLM endpoint reported, by agent, model and kind (prompt, completion).",
    ["agent", "model", "kind"],
)


class LLMError(Exception):
    """An LLM call failed for good; the message says what to check (never the key)."""


class LLMConfigError(ValueError):
    """The LLM settings are unusable; the message names the variable to fix."""


def display_url(url: str) -> str:
    """``url`` without user info, query or fragment: safe for logs and messages."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


@dataclass(frozen=True)
class LLMConfig:
    """How one agent talks to its endpoint.

    Attributes:
        agent: ``designer`` | ``coder`` | ``conductor``.
        base_url: OpenAI-compatible base URL (``.../v1``); empty means no LLM.
        api_key: bearer token (excluded from repr).
        model: model name the endpoint serves.
        temperature: None leaves it to the endpoint.
        max_tokens: reply limit in tokens; None leaves it to the endpoint.
        reasoning: ``""`` | ``on`` | ``off`` | ``minimal`` | ``low`` | ``medium`` | ``high``.
        timeout_s: limit on one HTTP call, seconds.
        max_retries: retries after a retryable failure (so up to ``max_retries + 1`` calls).
    """

    agent: str
    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    temperature: float | None = None
    max_tokens: int | None = None
    reasoning: str = ""
    timeout_s: float = LLM_TIMEOUT_S
    max_retries: int = 4

    @classmethod
    def from_settings(cls, settings: Settings, agent: str) -> LLMConfig:
        """The agent's config: ``llm_<agent>_<name>`` where set, else ``llm_<name>``.

        Raises:
            LLMConfigError: a base URL without a model, or an unknown reasoning value.
        """
        if agent not in AGENTS:
            raise ValueError(f"unknown agent {agent!r}; one of {', '.join(AGENTS)}")

        def pick(name: str) -> Any:
            own = getattr(settings, f"llm_{agent}_{name}")
            return getattr(settings, f"llm_{name}") if own in (None, "") else own

        temperature = pick("temperature")
        max_tokens = pick("max_tokens")
        config = cls(
            agent=agent,
            base_url=pick("base_url").strip(),
            api_key=pick("api_key").strip(),
            model=pick("model").strip(),
            temperature=None if temperature is None or temperature < 0 else float(temperature),
            max_tokens=None if not max_tokens or max_tokens <= 0 else int(max_tokens),
            reasoning=pick("reasoning").strip().lower(),
            timeout_s=settings.llm_timeout_s,
            max_retries=max(0, settings.llm_max_retries),
        )
        if config.base_url and not config.model:
            raise LLMConfigError(
                f"AIKG_LLM_MODEL (or AIKG_LLM_{agent.upper()}_MODEL) is not set: name the model "
                f"that {display_url(config.base_url)} serves")
        if config.base_url and config.reasoning not in ("", *REASONING_SWITCH,
                                                        *REASONING_EFFORTS):
            raise LLMConfigError(
                f"AIKG_LLM_REASONING (or AIKG_LLM_{agent.upper()}_REASONING)={config.reasoning!r} "
                f"is not one of: empty, {', '.join(REASONING_SWITCH + REASONING_EFFORTS)}")
        return config

    @property
    def configured(self) -> bool:
        return bool(self.base_url)

    def request_params(self) -> dict[str, Any]:
        """Keyword arguments of ``chat.completions.create`` besides model and messages."""
        params: dict[str, Any] = {"timeout": self.timeout_s}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.max_tokens is not None:
            params["max_tokens"] = self.max_tokens
        if self.reasoning in REASONING_SWITCH:
            thinking = self.reasoning == "on"
            params["extra_body"] = {"enable_thinking": thinking,
                                    "chat_template_kwargs": {"enable_thinking": thinking}}
        elif self.reasoning:
            params["reasoning_effort"] = self.reasoning
        return params


@dataclass
class Completion:
    """One chat reply.

    ``text`` is the assistant message's content ("" when the endpoint sent none);
    tokens are what the endpoint reported in ``usage`` (0 when it reported nothing);
    ``duration_s`` is the wall time of the successful HTTP call, seconds;
    ``calls`` counts HTTP calls made for it, retries included.
    """

    agent: str
    model: str
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    duration_s: float = 0.0
    calls: int = 1


UsageSink = Callable[[Completion], Awaitable[None]]
Message = dict[str, str]


def retry_after_s(headers: Any) -> float | None:
    """Seconds the endpoint asks us to wait: ``retry-after-ms``, then ``retry-after``
    (seconds or an HTTP date); None when neither is there or usable."""
    if headers is None:
        return None
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            value = float(raw_ms) / 1000.0
            if math.isfinite(value) and value >= 0:
                return value
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        value = float(raw)
        return value if math.isfinite(value) and value >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, asyncio.CancelledError):
        return False
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if isinstance(exc, openai.APIStatusError):
        wait = retry_after_s(exc.response.headers)
        if wait is not None and wait > MAX_RETRY_AFTER_S:
            return False
        return exc.status_code in (408, 409, 429) or exc.status_code >= 500
    return False


def _wait(state: RetryCallState) -> float:
    exc = state.outcome.exception() if state.outcome else None
    if isinstance(exc, openai.APIStatusError):
        wait = retry_after_s(exc.response.headers)
        if wait is not None:
            return min(wait, MAX_RETRY_AFTER_S)
    return BACKOFF(state)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIConnectionError):
        return "connection_error"
    if isinstance(exc, openai.APIStatusError):
        if exc.status_code == 429:
            return "rate_limited"
        return "server_error" if exc.status_code >= 500 else "client_error"
    return "client_error"


class LLMClient:
    """Chat completions for the generator's agents, with limits, retries and metrics.

    Args:
        settings: the ``llm_*`` fields.

    Raises:
        LLMConfigError: an agent's settings are unusable (see :meth:`LLMConfig.from_settings`).
    """

    def __init__(self, settings: Settings) -> None:
        self.configs = {agent: LLMConfig.from_settings(settings, agent) for agent in AGENTS}
        self.concurrency = max(1, settings.llm_concurrency)
        self._clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}

    def configured(self, agent: str = "coder") -> bool:
        """Whether ``agent`` has an endpoint."""
        return self.configs[agent].configured

    def describe(self, agent: str = "coder") -> str:
        """``model at URL`` of an agent, for logs and messages (no key)."""
        config = self.configs[agent]
        return f"{config.model} at {display_url(config.base_url)}"

    def _client(self, config: LLMConfig) -> openai.AsyncOpenAI:
        key = (config.base_url, config.api_key)
        client = self._clients.get(key)
        if client is None:
            client = openai.AsyncOpenAI(base_url=config.base_url, api_key=config.api_key or NO_KEY,
                                        max_retries=0, timeout=config.timeout_s)
            self._clients[key] = client
        return client

    def _slot(self, base_url: str) -> asyncio.Semaphore:
        # One limit per endpoint, shared by the agents (and jobs) that use it.
        slot = self._slots.get(base_url)
        if slot is None:
            slot = self._slots[base_url] = asyncio.Semaphore(self.concurrency)
        return slot

    async def chat(self, agent: str, messages: list[Message], *,
                   usage: UsageSink | None = None) -> Completion:
        """Send ``messages`` to ``agent``'s model and return its reply.

        Args:
            agent: ``designer`` | ``coder`` | ``conductor``.
            messages: OpenAI chat messages (``{"role": ..., "content": ...}``).
            usage: awaited with the completion (tokens, seconds) once it arrived.

        Raises:
            LLMError: the agent has no endpoint, the endpoint refused the request
                (4xx other than 408/409/429), or it kept failing (429, 5xx, timeout,
                connection) for ``max_retries + 1`` calls. The message names the
                endpoint (without credentials) and what to check.
            asyncio.CancelledError: the caller was cancelled; the HTTP call is aborted.
        """
        config = self.configs[agent]
        if not config.configured:
            raise LLMError(f"no LLM endpoint configured for the {agent}: set AIKG_LLM_BASE_URL")
        client = self._client(config)
        calls = 0

        async def once() -> Completion:
            nonlocal calls
            calls += 1
            async with self._slot(config.base_url):
                return await self._call(client, config, messages)

        async def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("llm_retry", agent=agent, model=config.model,
                        endpoint=display_url(config.base_url), attempt=state.attempt_number,
                        wait_s=round(state.upcoming_sleep, 2),
                        error=self._scrub(_short(exc), config))

        retrying = AsyncRetrying(
            stop=stop_after_attempt(config.max_retries + 1), wait=_wait,
            retry=_RetryIf(_retryable), reraise=True, before_sleep=before_sleep,
        )
        try:
            completion = await retrying(once)
        except openai.OpenAIError as exc:
            raise LLMError(self._explain(exc, config, calls)) from None
        completion.calls = calls
        if usage is not None:
            await usage(completion)
        return completion

    async def _call(self, client: openai.AsyncOpenAI, config: LLMConfig,
                    messages: list[Message]) -> Completion:
        labels = {"agent": config.agent, "model": config.model}
        started = time.monotonic()
        try:
            response = await client.chat.completions.create(
                model=config.model, messages=messages, **config.request_params())
        except BaseException as exc:
            REQUESTS.labels(**labels, outcome=_outcome(exc)).inc()
            REQUEST_SECONDS.labels(**labels).observe(time.monotonic() - started)
            raise
        elapsed = time.monotonic() - started
        REQUESTS.labels(**labels, outcome="ok").inc()
        REQUEST_SECONDS.labels(**labels).observe(elapsed)
        choice = response.choices[0] if response.choices else None
        text = (choice.message.content if choice is not None and choice.message else None) or ""
        prompt_tokens = completion_tokens = 0
        if response.usage is not None:
            prompt_tokens = int(response.usage.prompt_tokens or 0)
            completion_tokens = int(response.usage.completion_tokens or 0)
        TOKENS.labels(**labels, kind="prompt").inc(prompt_tokens)
        TOKENS.labels(**labels, kind="completion").inc(completion_tokens)
        log.info("llm_reply", agent=config.agent, model=config.model,
                 duration_s=round(elapsed, 3), prompt_tokens=prompt_tokens,
                 completion_tokens=completion_tokens,
                 finish_reason=choice.finish_reason if choice is not None else None)
        return Completion(agent=config.agent, model=config.model, text=text,
                          finish_reason=choice.finish_reason if choice is not None else None,
                          prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          duration_s=elapsed)

    @staticmethod
    def _scrub(text: str, config: LLMConfig) -> str:
        if config.api_key and len(config.api_key) >= 4:
            text = text.replace(config.api_key, "***")
        return text

    def _explain(self, exc: BaseException, config: LLMConfig, calls: int) -> str:
        where = display_url(config.base_url)
        tries = f"{calls} call{'s' if calls != 1 else ''}"
        env = f"AIKG_LLM_{{}} (or AIKG_LLM_{config.agent.upper()}_{{}})"
        if isinstance(exc, openai.APITimeoutError):
            text = (f"the LLM endpoint {where} did not answer the {config.agent} within "
                    f"{config.timeout_s:g} s ({tries}); check the server, or raise "
                    f"AIKG_LLM_TIMEOUT_S")
        elif isinstance(exc, openai.APIConnectionError):
            text = (f"cannot reach the LLM endpoint {where} for the {config.agent} ({tries}): "
                    f"{_short(exc.__cause__ or exc)}; check {env.format('BASE_URL', 'BASE_URL')}")
        elif isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            detail = _short(exc)
            if status in (401, 403):
                text = (f"the LLM endpoint {where} refused the key (HTTP {status}): check "
                        f"{env.format('API_KEY', 'API_KEY')}")
            elif status == 404:
                text = (f"the LLM endpoint {where} does not know model {config.model!r} or the "
                        f"chat route (HTTP 404): check {env.format('MODEL', 'MODEL')} and that "
                        f"the base URL ends in /v1; {detail}")
            elif (wait := retry_after_s(exc.response.headers)) is not None \
                    and wait > MAX_RETRY_AFTER_S:
                text = (f"the LLM endpoint {where} asks to wait {wait:.0f} s (HTTP {status}, "
                        f"Retry-After), more than the {MAX_RETRY_AFTER_S:.0f} s AIKG waits: "
                        f"{detail}")
            elif _retryable(exc):
                text = (f"the LLM endpoint {where} still answered HTTP {status} after "
                        f"{tries}: {detail}")
            else:
                text = f"the LLM endpoint {where} rejected the {config.agent}'s request (HTTP {status}): {detail}"
        else:
            text = f"the LLM call to {where} failed: {_short(exc)}"
        return self._scrub(text, config)

    async def aclose(self) -> None:
        """Close every HTTP client."""
        for client in self._clients.values():
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._clients.clear()


class _RetryIf:
    """tenacity retry strategy from a predicate on the raised exception."""

    def __init__(self, predicate: Callable[[BaseException], bool]) -> None:
        self.predicate = predicate

    def __call__(self, state: RetryCallState) -> bool:
        if state.outcome is None or not state.outcome.failed:
            return False
        exc = state.outcome.exception()
        return exc is not None and self.predicate(exc)


def _short(exc: BaseException | None, limit: int = 500) -> str:
    if exc is None:
        return ""
    text = str(exc) or exc.__class__.__name__
    return text if len(text) <= limit else text[:limit] + " ..."
