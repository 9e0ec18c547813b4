"""load_settings: AIKG_* variables converted to the fields' types, bad values named."""

from __future__ import annotations

import pytest

from services.common.settings import (
    CPU_MEMORY_LIMIT_BYTES,
    Settings,
    load_setting,
    load_settings,
    memory_limit_for,
)


def test_variables_convert_to_their_fields_types():
    settings = load_settings(env={"AIKG_GATEWAY_PORT": "9000", "AIKG_LLM_TEMPERATURE": "0.5",
                                  "AIKG_VERIFY_ACK_WAIT_S": "12", "AIKG_NATS_URL": "nats://h:1",
                                  "AIKG_LLM_CODER_MAX_TOKENS": "512"})
    assert settings.gateway_port == 9000 and isinstance(settings.gateway_port, int)
    assert settings.llm_temperature == 0.5
    assert settings.verify_ack_wait_s == 12.0 and isinstance(settings.verify_ack_wait_s, float)
    assert settings.nats_url == "nats://h:1"
    assert settings.llm_coder_max_tokens == 512
    # Unset variables keep the defaults; variables of no field are ignored.
    assert load_settings(env={"AIKG_NO_SUCH_FIELD": "x"}) == Settings()


@pytest.mark.parametrize(("name", "value", "kind"), [
    ("AIKG_GATEWAY_PORT", "abc", "int"),
    ("AIKG_GATEWAY_PORT", "80.5", "int"),
    ("AIKG_GATEWAY_PORT", "", "int"),
    ("AIKG_TENANT_MAX_DEVICE_SHARE", "half", "float"),
    ("AIKG_LLM_CODER_TEMPERATURE", "warm", "float"),
    ("AIKG_LLM_CODER_MAX_TOKENS", "many", "int"),
])
def test_a_bad_value_names_the_variable_and_the_type(name, value, kind):
    with pytest.raises(ValueError) as raised:
        load_settings(env={"AIKG_NATS_URL": "nats://h:1", name: value})
    assert str(raised.value) == f"{name}={value!r} is not a valid {kind}"


def test_an_empty_optional_variable_is_none():
    settings = load_settings(env={"AIKG_LLM_CODER_TEMPERATURE": "", "AIKG_LLM_TEMPERATURE": "0.7",
                                  "AIKG_LLM_DESIGNER_MAX_TOKENS": "  "})
    assert settings.llm_coder_temperature is None and settings.llm_temperature == 0.7
    assert settings.llm_designer_max_tokens is None
    # An empty string field stays an empty string.
    assert load_settings(env={"AIKG_WORKER_ARCH": ""}).worker_arch == ""


def test_overrides_win_over_the_environment_and_none_is_no_override():
    settings = load_settings(env={"AIKG_GATEWAY_PORT": "9000", "AIKG_LOG_LEVEL": "debug"},
                             gateway_port=7000, log_level=None)
    assert settings.gateway_port == 7000 and settings.log_level == "debug"
    with pytest.raises(TypeError, match="no_such_field"):
        load_settings(env={}, no_such_field=1)


def test_load_setting_reads_one_variable_only():
    env = {"AIKG_API_TOKEN": "t", "AIKG_GATEWAY_PORT": "abc"}
    assert load_setting("api_token", env=env) == "t"
    # Unset: the given default, else the field's; a bad value of another field is not read.
    assert load_setting("log_level", "warning", env=env) == "warning"
    assert load_setting("gateway_url", env=env) == Settings().gateway_url
    with pytest.raises(ValueError, match="AIKG_GATEWAY_PORT='abc' is not a valid int"):
        load_setting("gateway_port", env=env)
    with pytest.raises(TypeError):
        load_setting("no_such_field", env=env)


def test_memory_limit_for_backend():
    assert memory_limit_for("cpu", 0) == CPU_MEMORY_LIMIT_BYTES == 4 << 30
    assert memory_limit_for("cpu", 1 << 20) == 1 << 20
    assert memory_limit_for("cuda", 0) is None



def test_the_sdk_cli_and_services_take_their_defaults_from_settings():
    import inspect

    from services.generator.llm import LLMConfig
    from services.sdk.client import AIKGClient, AsyncAIKGClient
    from services.sdk.workers import RemoteWorker

    defaults = Settings()
    for client in (AIKGClient, AsyncAIKGClient):
        assert inspect.signature(client).parameters["url"].default == defaults.gateway_url
    assert (inspect.signature(RemoteWorker).parameters["result_timeout_s"].default
            == defaults.verify_result_timeout_s)
    assert LLMConfig(agent="coder", base_url="", model="").timeout_s == defaults.llm_timeout_s
