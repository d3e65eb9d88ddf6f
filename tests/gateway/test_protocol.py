"""gateway.protocol, gateway.conversation and gateway.auth on their own: what a client may
set, what is refused by name, and keys that expire."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from gateway import auth as auth_mod
from gateway.auth import Authenticator, AuthError
from gateway.calls import Gateway
from gateway.config import MAX_OUTPUT_TOKENS, AuthConfig, ConfigError, load_config
from gateway.conversation import Conversation, Item, item_from_client
from gateway.protocol import ProtocolError, SessionConfig, parse_response_create
from stages.rings import RingNames

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


def fresh() -> SessionConfig:
    return SessionConfig(voice="en-us", instructions="be nice")


def test_session_object_round_trips_through_an_update() -> None:
    config = fresh()
    config.apply(config.to_json("sess_1"))  # what session.created says is a valid update
    assert config.to_json("sess_1") == fresh().to_json("sess_1")


def test_update_applies_known_fields() -> None:
    config = fresh()
    config.apply(
        {
            "type": "realtime",
            "instructions": "be brief",
            "output_modalities": ["text"],
            "max_output_tokens": 100,
            "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.8}}},
        }
    )
    assert config.instructions == "be brief" and not config.audio_out
    assert config.token_cap == 100
    assert config.turn_detection is not None and config.turn_detection.threshold == 0.8
    assert config.turn_detection.silence_duration_ms == 500  # unchanged knobs stay
    config.apply({"audio": {"input": {"turn_detection": None}}})
    assert config.turn_detection is None


def test_semantic_vad_is_rendered_with_its_own_fields() -> None:
    config = fresh()
    td = {"type": "semantic_vad", "eagerness": "high", "interrupt_response": False}
    config.apply({"audio": {"input": {"turn_detection": td}}})
    assert config.to_json("s")["audio"]["input"]["turn_detection"] == {
        "type": "semantic_vad",
        "eagerness": "high",
        "create_response": True,
        "interrupt_response": False,
    }
    config.apply({"audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
    rendered = config.to_json("s")["audio"]["input"]["turn_detection"]
    assert rendered["type"] == "server_vad" and rendered["idle_timeout_ms"] is None
    assert "eagerness" not in rendered


@pytest.mark.parametrize(
    ("update", "param"),
    [
        ({"audio": {"output": {"voice": "robot"}}}, "session.audio.output.voice='robot'"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 8000}}}}, "rate"),
        ({"audio": {"input": {"format": {"type": "audio/pcmu", "rate": 16000}}}}, "rate"),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "threshold": 0.9}}}},
            "turn_detection.threshold",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "x"}}}},
            "turn_detection.eagerness",
        ),
        ({"audio": {"input": {"turn_detection": {"type": "near_vad"}}}}, "turn_detection.type"),
        ({"audio": {"input": {"turn_detection": {"idle_timeout_ms": 10}}}}, "idle_timeout_ms"),
        ({"audio": {"input": {"turn_detection": {"threshold": 2}}}}, "threshold"),
        ({"audio": {"input": {"noise_reduction": "on"}}}, "noise_reduction"),
        ({"audio": {"input": {"noise_reduction": {"type": "loud"}}}}, "noise_reduction.type"),
        ({"tools": [{"type": "function", "name": "no spaces"}]}, "session.tools[0].name"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
            "session.tools[0].parameters",
        ),
        (
            {"tools": [{"name": "f", "parameters": {"type": "object", "required": 3}}]},
            "session.tools[0].parameters",
        ),
        ({"tools": [{"name": "f"}, {"name": "f"}]}, "session.tools"),
        (
            {"tools": [{"type": "mcp", "server_label": "m", "server_url": "http://127.0.0.1/"}]},
            "session.tools[0].require_approval",
        ),
        (
            {
                "tools": [
                    {
                        "type": "mcp",
                        "server_label": "m",
                        "server_url": "ftp://x",
                        "require_approval": "never",
                    }
                ]
            },
            "session.tools[0].server_url",
        ),
        ({"tool_choice": "sometimes"}, "session.tool_choice"),
        ({"tool_choice": {"type": "function", "name": "absent"}}, "session.tool_choice"),
        ({"tool_choice": "required"}, "session.tool_choice"),
        ({"parallel_tool_calls": "yes"}, "session.parallel_tool_calls"),
        ({"output_modalities": ["text", "audio"]}, "session.output_modalities"),
        ({"max_output_tokens": 0}, "session.max_output_tokens"),
        ({"type": "transcription"}, "session.type"),
        ({"colour": "blue"}, "session.colour"),
        ({"audio": {"output": {"speed": "fast"}}}, "session.audio.output.speed"),
    ],
)
def test_refused_updates_name_the_field_and_change_nothing(update, param) -> None:
    config = fresh()
    before = config.to_json("s")
    with pytest.raises(ProtocolError) as err:
        config.apply({"instructions": "changed", **update})
    assert param in (err.value.param or "")
    assert config.to_json("s") == before


def test_what_openai_takes_and_only_changes_the_sound_costs_no_update_the_rest() -> None:
    """LiveKit Agents' default session: OpenAI's voice `marin`, semantic_vad, noise reduction,
    all in one update with the instructions. The vocoder's voice speaks; the rest applies."""
    config = fresh()
    config.apply(
        {
            "instructions": "Be brief.",
            "audio": {
                "input": {
                    "turn_detection": {"type": "semantic_vad", "eagerness": "auto"},
                    "noise_reduction": {"type": "near_field"},
                    "format": {"type": "audio/pcm", "rate": 24000},
                },
                "output": {"voice": "marin", "speed": 1.2},
            },
            "truncation": "disabled",
            "include": ["item.input_audio_transcription.logprobs"],
        }
    )
    shown = config.to_json("s")
    assert shown["instructions"] == "Be brief."
    assert shown["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert shown["audio"]["output"] == {  # what is in effect
        "format": {"type": "audio/pcm", "rate": 24000},
        "voice": "en-us",
        "speed": 1.0,
    }
    assert shown["audio"]["input"]["noise_reduction"] == {"type": "near_field"}  # applied
    assert shown["truncation"] == "auto"
    config.apply({"audio": {"input": {"noise_reduction": None}}})
    assert config.noise_reduction is None  # the transport's default again


def test_pcm_input_at_16_khz_is_taken_and_shown() -> None:
    config = fresh()
    config.apply({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}})
    assert (config.input_format, config.input_rate) == ("audio/pcm", 16000)
    assert config.to_json("s")["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 16000}
    with pytest.raises(ProtocolError, match="audio/pcm is 24000 Hz"):  # output stays 24 kHz
        config.apply({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}})


def test_response_create_overrides_and_refusals() -> None:
    params = parse_response_create(
        {"output_modalities": ["text"], "instructions": "x", "max_output_tokens": 5}, fresh()
    )
    assert params.audio is False and params.instructions == "x" and params.max_output_tokens == 5
    assert parse_response_create(None, fresh()).audio is None
    for bad, param in [
        ({"conversation": "none"}, "response.conversation"),
        ({"input": []}, "response.input"),
        ({"audio": {"output": {"voice": "robot"}}}, "voice"),
        ({"metadata": "x"}, "response.metadata"),
    ]:
        with pytest.raises(ProtocolError) as err:
            parse_response_create(bad, fresh())
        assert param in (err.value.param or "")


def test_conversation_items_insert_delete_and_history() -> None:
    conv = Conversation()
    a = item_from_client(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    )
    assert conv.add(a) is None
    b = Item("item_b", "assistant", [{"type": "output_audio", "transcript": "hello"}])
    assert conv.add(b) == a.id
    c = item_from_client(
        {"id": "item_c", "role": "system", "content": [{"type": "input_text", "text": "rule"}]}
    )
    assert conv.add(c, "root") is None
    said = [(m.role, m.text) for m in conv.history()]
    assert said == [("system", "rule"), ("user", "hi"), ("assistant", "hello")]
    conv.delete(a.id)
    assert [m.role for m in conv.history()] == ["system", "assistant"]
    with pytest.raises(ProtocolError) as err:
        conv.get("nope")
    assert err.value.code == "not_found"
    with pytest.raises(ProtocolError):
        conv.add(Item("item_b", "user"))  # ids are unique
    with pytest.raises(ProtocolError) as err:
        conv.add(Item("item_d", "user"), previous_item_id="missing")
    assert err.value.param == "previous_item_id"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "function_call"}, "item.call_id"),
        ({"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}, "item.arguments"),
        ({"type": "function_call_output", "call_id": "c"}, "item.output"),
        ({"type": "mcp_call"}, "item.type='mcp_call'"),
        ({"type": "tool_result"}, "item.type"),
        ({"role": "robot", "content": [{"type": "input_text", "text": "x"}]}, "item.role"),
        ({"role": "user", "content": []}, "item.content"),
        ({"role": "user", "content": [{"type": "input_audio", "audio": "AAAA"}]}, "input_audio"),
        (
            {"role": "user", "content": [{"type": "output_text", "text": "x"}]},
            "item.content[0].type",
        ),
        ({"role": "user", "content": [{"type": "input_text", "text": 3}]}, "item.content[0].text"),
    ],
)
def test_bad_items_are_refused_by_name(item, param) -> None:
    with pytest.raises(ProtocolError) as err:
        item_from_client(item)
    assert param in (err.value.param or "")


class FakeRequest:
    def __init__(self, headers: dict[str, str], path: str = "/v1/audio/speech") -> None:
        self.headers = headers
        self.path = path


def test_keys_secrets_and_expiry(monkeypatch) -> None:
    auth = Authenticator(
        AuthConfig(api_keys=["sk-a"], api_keys_env="KEYS"), environ={"KEYS": "sk-b, sk-c"}
    )
    assert not auth.check(FakeRequest({"Authorization": "Bearer sk-c"})).ephemeral
    proto = {"Sec-WebSocket-Protocol": "realtime, openai-insecure-api-key.sk-a"}
    assert not auth.check(FakeRequest(proto)).ephemeral
    with pytest.raises(AuthError) as err:
        auth.check(FakeRequest({}))
    assert err.value.code == "missing_api_key"
    with pytest.raises(AuthError, match="incorrect"):
        auth.check(FakeRequest({"Authorization": "Bearer sk-z"}))

    now = [1000.0]
    monkeypatch.setattr(auth_mod.time, "time", lambda: now[0])
    secret = auth.mint({"type": "realtime", "instructions": "pirate"}, ttl_s=10)
    grant = auth.check(FakeRequest({"Authorization": f"Bearer {secret.value}"}))
    assert grant.ephemeral and grant.session == {"type": "realtime", "instructions": "pirate"}
    with pytest.raises(AuthError, match="/v1/audio/speech needs an API key"):
        auth.check(FakeRequest({"Authorization": f"Bearer {secret.value}"}), allow_ephemeral=False)
    now[0] += 10
    with pytest.raises(AuthError) as err:
        auth.check(FakeRequest({"Authorization": f"Bearer {secret.value}"}))
    assert err.value.code == "expired_api_key"


def test_secrets_are_signed_for_every_process_of_the_service() -> None:
    key = b"k" * 32
    minting = Authenticator(AuthConfig(api_keys=["sk-a"]), environ={}, signing_key=key)
    other_process = Authenticator(AuthConfig(api_keys=["sk-a"]), environ={}, signing_key=key)
    restarted = Authenticator(AuthConfig(api_keys=["sk-a"]), environ={})
    secret = minting.mint({"type": "realtime", "instructions": "terse"}, ttl_s=60)

    def bearer(value: str) -> FakeRequest:
        return FakeRequest({"Authorization": f"Bearer {value}"})

    assert other_process.check(bearer(secret.value)).session == {
        "type": "realtime",
        "instructions": "terse",
    }
    with pytest.raises(AuthError, match="invalid client secret"):
        restarted.check(bearer(secret.value))
    signature = secret.value.partition(".")[2]
    with pytest.raises(AuthError, match="invalid client secret"):  # settings changed
        other_process.check(
            bearer(minting.mint({"instructions": "x"}).value.partition(".")[0] + "." + signature)
        )
    with pytest.raises(ValueError, match="too large"):
        minting.mint({"instructions": secrets.token_hex(8000)})


def test_auth_on_without_keys_is_a_clear_start_up_error() -> None:
    with pytest.raises(ValueError, match=r"gateway\.auth\.enabled: false"):
        Authenticator(AuthConfig(api_keys_env="NOPE"), environ={})
    assert Authenticator(AuthConfig(enabled=False), environ={}).check(FakeRequest({})) is not None


def test_session_tracing_is_taken_and_echoed() -> None:
    """The Agents SDK sends tracing "auto" by default; a named workflow is kept for traces."""
    config = fresh()
    config.apply({"tracing": "auto"})
    assert config.to_json("sess_1", 0)["tracing"] == "auto"
    named = {"workflow_name": "support", "group_id": "g1", "metadata": {"k": "v"}}
    config.apply({"tracing": named})
    assert config.tracing == named
    for bad, param in (
        ({"tracing": "on"}, "session.tracing"),
        ({"tracing": {"workflow_name": 3}}, "session.tracing.workflow_name"),
        ({"tracing": {"other": 1}}, "session.tracing.other"),
    ):
        with pytest.raises(ProtocolError) as err:
            config.apply(bad)
        assert err.value.param == param
    assert config.tracing == named


def test_mcp_servers_allowed_by_scheme_host_port_and_path() -> None:
    from gateway.config import ToolsConfig

    tools = ToolsConfig(mcp_servers=["https://tools.example.com/mcp", "http://127.0.0.1"])
    assert tools.mcp_allowed("https://tools.example.com/mcp/weather")
    assert tools.mcp_allowed("http://127.0.0.1:8123/mcp")  # no port given: any port
    assert not tools.mcp_allowed("http://tools.example.com/mcp")  # another scheme
    assert not tools.mcp_allowed("https://tools.example.com/admin")  # another path
    assert not tools.mcp_allowed("http://127.0.0.1:80@evil.example/mcp")  # userinfo
    assert not tools.mcp_allowed("http://127.0.0.1.evil.example/mcp")
    assert not ToolsConfig().mcp_allowed("http://127.0.0.1/mcp")  # none by default
    assert ToolsConfig(mcp_servers=["*"]).mcp_allowed("https://anywhere.example/")


def test_a_new_session_starts_from_the_configured_reply_cap() -> None:
    """gateway.max_output_tokens is a new session's max_output_tokens ("inf" when unset:
    reasoning.sampling.max_tokens caps each reply); session.update still changes it."""

    def new_session(overrides: dict) -> SessionConfig:
        config = load_config(TINY, overrides)
        return Gateway(config, RingNames.fresh(), 22050, lambda: True).session_config()

    default = new_session({})
    assert default.max_output_tokens == "inf" and default.token_cap is None
    capped = new_session({"gateway.max_output_tokens": 24})
    assert capped.token_cap == 24 and capped.to_json("sess_1")["max_output_tokens"] == 24
    assert capped.updated({"max_output_tokens": "inf"}).token_cap is None
    with pytest.raises(ConfigError, match="max_output_tokens"):
        load_config(TINY, {"gateway.max_output_tokens": MAX_OUTPUT_TOKENS + 1})
