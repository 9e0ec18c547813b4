"""The generator's LLM client against a real HTTP server, through the real openai client:
replies and usage, retries (429 with Retry-After, 5xx, timeouts), errors that say what
to fix and never show the key, the thinking switch, per-agent settings, the
per-endpoint concurrency limit and cancellation."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from services.common.settings import load_settings
from services.generator.llm import (
    Completion,
    LLMClient,
    LLMConfig,
    LLMConfigError,
    LLMError,
    retry_after_s,
)
from tests.fake_llm import FakeLLM, Reply

KEY = "sk-test-0123456789-SECRET"
HELLO = [{"role": "system", "content": "You are the coder."},
         {"role": "user", "content": "say hi"}]


@pytest.fixture
def fake() -> Iterator[FakeLLM]:
    with FakeLLM([Reply(content="hi")]) as server:
        yield server


def client_for(fake: FakeLLM, **overrides) -> LLMClient:
    values = {"llm_base_url": fake.url, "llm_api_key": KEY, "llm_model": "fake-coder",
              "llm_timeout_s": 5.0, "llm_max_retries": 2, **overrides}
    return LLMClient(load_settings(env={}, **values))


async def chat_once(client: LLMClient, agent: str = "coder") -> Completion:
    """One call of ``agent`` with HELLO; the client is closed after it, however it ends."""
    try:
        return await client.chat(agent, HELLO)
    finally:
        await client.aclose()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_reply_usage_metrics_and_request_parameters(fake: FakeLLM) -> None:
    client = client_for(fake, llm_temperature=0.3, llm_max_tokens=1234)
    seen: list[Completion] = []

    async def sink(completion: Completion) -> None:
        seen.append(completion)

    before_ok = sample("aikg_llm_requests_total", agent="coder", model="fake-coder", outcome="ok")
    before_tokens = sample("aikg_llm_tokens_total", agent="coder", model="fake-coder",
                           kind="completion")
    try:
        reply = await client.chat("coder", HELLO, usage=sink)
    finally:
        await client.aclose()

    assert reply.text == "hi" and reply.calls == 1
    assert reply.prompt_tokens > 0 and reply.completion_tokens > 0
    assert seen == [reply]
    request = fake.requests[0]
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body["model"] == "fake-coder"
    assert request.body["temperature"] == 0.3 and request.body["max_tokens"] == 1234
    assert request.body["messages"] == HELLO
    assert "enable_thinking" not in request.body and "reasoning_effort" not in request.body
    assert sample("aikg_llm_requests_total", agent="coder", model="fake-coder",
                  outcome="ok") == before_ok + 1
    assert sample("aikg_llm_tokens_total", agent="coder", model="fake-coder",
                  kind="completion") == before_tokens + reply.completion_tokens
    assert sample("aikg_llm_request_duration_seconds_count", agent="coder",
                  model="fake-coder") >= 1


async def test_429_with_retry_after_is_honoured_then_succeeds(fake: FakeLLM) -> None:
    fake.set_script([Reply(status=429, headers={"Retry-After": "2"}, error="slow down"),
                     Reply(content="after the wait")])
    client = client_for(fake)
    before = sample("aikg_llm_requests_total", agent="coder", model="fake-coder",
                    outcome="rate_limited")
    started = time.monotonic()
    reply = await chat_once(client)
    assert reply.text == "after the wait" and reply.calls == 2
    gap = fake.requests[1].time - fake.requests[0].time
    # Our own backoff without Retry-After would be 0.5-1 s: 2 s is the header's.
    assert gap >= 1.9, gap
    assert time.monotonic() - started < 10
    assert sample("aikg_llm_requests_total", agent="coder", model="fake-coder",
                  outcome="rate_limited") == before + 1


async def test_5xx_is_retried_with_backoff(fake: FakeLLM) -> None:
    fake.set_script([Reply(status=503, error="overloaded"), Reply(status=500),
                     Reply(content="ok now")])
    client = client_for(fake)
    reply = await chat_once(client)
    assert reply.text == "ok now" and reply.calls == 3 and len(fake.requests) == 3


async def test_5xx_until_retries_run_out_fails_with_status(fake: FakeLLM) -> None:
    fake.set_script([Reply(status=502, error="bad gateway")])
    client = client_for(fake, llm_max_retries=1)
    with pytest.raises(LLMError, match=r"HTTP 502 after 2 calls"):
        await chat_once(client)
    assert len(fake.requests) == 2


async def test_retry_after_beyond_limit_fails_at_once(fake: FakeLLM) -> None:
    fake.set_script([Reply(status=429, headers={"Retry-After": "86400"}, error="daily quota")])
    client = client_for(fake)
    with pytest.raises(LLMError, match=r"asks to wait 86400 s"):
        await chat_once(client)
    assert len(fake.requests) == 1


async def test_errors_never_show_the_key(fake: FakeLLM) -> None:
    fake.set_script([Reply(status=401, error=f"Incorrect API key provided: {KEY}")])
    client = client_for(fake)
    try:
        with pytest.raises(LLMError) as info:
            await client.chat("coder", HELLO)
        assert "AIKG_LLM_API_KEY" in str(info.value)
        assert KEY not in str(info.value) and KEY not in repr(info.value)
        assert info.value.__cause__ is None and info.value.__suppress_context__

        fake.set_script([Reply(status=400, error=f"bad field; your key {KEY} is fine")])
        with pytest.raises(LLMError, match="HTTP 400") as info:
            await client.chat("designer", HELLO)
        assert KEY not in str(info.value) and "***" in str(info.value)
    finally:
        await client.aclose()
    assert len(fake.requests) == 2  # neither 401 nor 400 is retried
    assert KEY not in repr(client.configs["coder"])
    settings = load_settings(env={"AIKG_LLM_API_KEY": KEY, "AIKG_API_TOKEN": "tok-SECRET"})
    assert KEY not in repr(settings) and "tok-SECRET" not in str(settings)


async def test_a_reply_that_never_comes_is_retried_after_the_timeout(fake: FakeLLM) -> None:
    fake.set_script([Reply(content="late", delay_s=30), Reply(content="on time")])
    client = client_for(fake, llm_timeout_s=1.0, llm_max_retries=1)
    before = sample("aikg_llm_requests_total", agent="coder", model="fake-coder",
                    outcome="timeout")
    started = time.monotonic()
    reply = await chat_once(client)
    assert reply.text == "on time" and reply.calls == 2
    assert time.monotonic() - started < 10
    assert sample("aikg_llm_requests_total", agent="coder", model="fake-coder",
                  outcome="timeout") == before + 1


async def test_a_dead_endpoint_fails_clearly_after_its_timeouts(fake: FakeLLM) -> None:
    fake.set_script([Reply(content="never", delay_s=30)])
    client = client_for(fake, llm_timeout_s=0.5, llm_max_retries=1)
    with pytest.raises(LLMError, match=r"did not answer the coder within 0.5 s \(2 calls\)"):
        await chat_once(client)


async def test_unreachable_endpoint_names_the_url() -> None:
    settings = load_settings(env={}, llm_base_url="http://127.0.0.1:9/v1", llm_model="m",
                             llm_max_retries=0, llm_timeout_s=2.0)
    client = LLMClient(settings)
    with pytest.raises(LLMError, match=r"cannot reach the LLM endpoint http://127.0.0.1:9/v1"):
        await chat_once(client)


@pytest.mark.parametrize(("value", "expected"), [
    ("", {}),
    ("off", {"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": False}}),
    ("on", {"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": True}}),
    ("high", {"reasoning_effort": "high"}),
])
async def test_reasoning_switch_reaches_the_endpoint(fake: FakeLLM, value: str,
                                                     expected: dict) -> None:
    client = client_for(fake, llm_reasoning=value)
    await chat_once(client)
    body = fake.requests[0].body
    for key in ("enable_thinking", "chat_template_kwargs", "reasoning_effort"):
        assert body.get(key) == expected.get(key), (key, body)


async def test_per_agent_settings_fall_back_to_the_general_ones(fake: FakeLLM) -> None:
    with FakeLLM([Reply(content="from the big model")], model="big") as other:
        env = {"AIKG_LLM_BASE_URL": fake.url, "AIKG_LLM_MODEL": "small",
               "AIKG_LLM_API_KEY": KEY, "AIKG_LLM_TEMPERATURE": "0.1",
               "AIKG_LLM_CODER_BASE_URL": other.url, "AIKG_LLM_CODER_MODEL": "big",
               "AIKG_LLM_CODER_TEMPERATURE": "0.7", "AIKG_LLM_CONDUCTOR_REASONING": "off",
               "AIKG_LLM_DESIGNER_MAX_TOKENS": ""}
        client = LLMClient(load_settings(env=env))
        try:
            await client.chat("coder", HELLO)
            await client.chat("designer", HELLO)
            await client.chat("conductor", HELLO)
        finally:
            await client.aclose()
        assert [r.body["model"] for r in other.requests] == ["big"]
        assert other.requests[0].body["temperature"] == 0.7
        assert [r.body["model"] for r in fake.requests] == ["small", "small"]
        assert fake.requests[0].body["temperature"] == 0.1
        assert "enable_thinking" not in fake.requests[0].body
        assert fake.requests[1].body["enable_thinking"] is False


def test_config_errors_name_the_variable() -> None:
    with pytest.raises(LLMConfigError, match="AIKG_LLM_MODEL"):
        LLMConfig.from_settings(load_settings(env={"AIKG_LLM_BASE_URL": "http://x/v1"}), "coder")
    with pytest.raises(LLMConfigError, match="AIKG_LLM_REASONING"):
        LLMConfig.from_settings(load_settings(env={"AIKG_LLM_REASONING": "maybe",
                                                   "AIKG_LLM_BASE_URL": "http://x/v1",
                                                   "AIKG_LLM_MODEL": "m"}), "coder")
    config = LLMConfig.from_settings(load_settings(env={
        "AIKG_LLM_TEMPERATURE": "-1", "AIKG_LLM_MAX_TOKENS": "0"}), "coder")
    assert config.request_params() == {"timeout": 600.0} and not config.configured


def test_retry_after_header_forms() -> None:
    assert retry_after_s({"retry-after": "3"}) == 3.0
    assert retry_after_s({"retry-after-ms": "250"}) == 0.25
    assert retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s({}) is None
    when = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= (retry_after_s({"retry-after": when}) or 0) <= 31


async def test_one_endpoint_runs_at_most_concurrency_calls(fake: FakeLLM) -> None:
    fake.set_script([Reply(content="slow", delay_s=0.5)])
    client = client_for(fake, llm_concurrency=1)
    try:
        await asyncio.gather(client.chat("coder", HELLO), client.chat("designer", HELLO))
    finally:
        await client.aclose()
    gap = fake.requests[1].time - fake.requests[0].time
    assert gap >= 0.45, gap


async def test_cancel_aborts_the_call(fake: FakeLLM) -> None:
    fake.set_script([Reply(content="late", delay_s=30)])
    client = client_for(fake)
    before = sample("aikg_llm_requests_total", agent="coder", model="fake-coder",
                    outcome="cancelled")
    task = asyncio.create_task(client.chat("coder", HELLO))
    try:
        await fake.wait_requests(1, timeout_s=10)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 1.0
    finally:
        await client.aclose()
    assert len(fake.requests) == 1
    assert sample("aikg_llm_requests_total", agent="coder", model="fake-coder",
                  outcome="cancelled") == before + 1
    for _ in range(40):  # the server sees the connection close
        if fake.disconnects:
            break
        await asyncio.sleep(0.05)
    assert fake.disconnects and fake.disconnects[0] - started < 2.0
