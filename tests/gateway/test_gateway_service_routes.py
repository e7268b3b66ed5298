"""Models, readiness, Prometheus metrics, OpenAPI and API keys, over real HTTP against the Core double."""

from __future__ import annotations

import hashlib

import anthropic
import httpx
import openai
import pytest

from services.gateway.auth import API_KEY_ENV, key_digest, key_matches, load_api_keys

from .conftest import GatewayThread
from .core_double import MODEL_ID, CoreDouble
from .test_gateway_openai_client import MESSAGES, sync_client


def test_model_by_id(gateway_url: str, core: CoreDouble) -> None:
    model = sync_client(gateway_url).models.retrieve(MODEL_ID)
    assert (model.id, model.object, model.owned_by) == (MODEL_ID, "model", "moe-mesh")
    with pytest.raises(openai.NotFoundError) as raised:
        sync_client(gateway_url).models.retrieve("nope")
    assert raised.value.code == "model_not_found"


def test_ready_follows_core_health(gateway_url: str, core: CoreDouble, core_server) -> None:
    assert httpx.get(gateway_url + "/ready").json() == {"status": "ready", "core": "SERVING"}
    core_server.set_serving(False)
    response = httpx.get(gateway_url + "/ready")
    assert response.status_code == 503 and response.json()["error"]["code"] == "core_not_ready"
    assert httpx.get(gateway_url + "/health").status_code == 200  # liveness is unaffected
    assert httpx.head(gateway_url + "/health").status_code == 200  # uptime checkers send HEAD
    assert httpx.head(gateway_url + "/ready").status_code == 503


def test_anthropic_clients_list_the_models(gateway_url: str, core: CoreDouble) -> None:
    page = anthropic.Anthropic(base_url=gateway_url, api_key="unused", max_retries=0).models.list()
    (model,) = page.data
    assert (model.id, model.type, model.display_name) == (MODEL_ID, "model", MODEL_ID)
    assert model.created_at.year >= 1970 and page.has_more is False


def test_nan_and_infinity_are_refused_as_such(gateway_url: str, core: CoreDouble) -> None:
    for value in ("NaN", "Infinity"):
        body = '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": %s}'
        reply = httpx.post(
            gateway_url + "/v1/chat/completions",
            content=body % (MODEL_ID, value),
            headers={"content-type": "application/json"},
        )
        assert reply.status_code == 400 and "finite" in reply.json()["error"]["message"], reply.text


def test_ready_is_503_when_core_is_unreachable() -> None:
    gateway = GatewayThread("unix:///nonexistent/core.sock", unary_timeout_s=0.5).start()
    try:
        assert httpx.get(gateway.url + "/ready").status_code == 503
        assert httpx.get(gateway.url + "/health").json()["core"] == "UNREACHABLE"
        assert httpx.get(gateway.url + "/metrics").status_code == 200  # scrapes still work
        chat = httpx.post(gateway.url + "/v1/chat/completions", json={"messages": MESSAGES}, timeout=10)
        assert chat.status_code == 503 and chat.json()["error"]["type"] == "service_unavailable_error"
        body = {"model": MODEL_ID, "max_tokens": 5, "messages": MESSAGES[1:]}
        messages = httpx.post(gateway.url + "/v1/messages", json=body, timeout=10)
        assert messages.status_code == 503 and messages.json()["error"]["type"] == "overloaded_error"
    finally:
        gateway.stop()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one series in a Prometheus text exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            if all(f'{key}="{wanted}"' in series for key, wanted in labels.items()):
                return float(value)
    return 0.0


def test_metrics_use_vllm_names(gateway_url: str, core: CoreDouble) -> None:
    before = httpx.get(gateway_url + "/metrics").text
    core.script.delay_per_chunk_s = 0.01
    sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES)
    list(sync_client(gateway_url).chat.completions.create(model=MODEL_ID, messages=MESSAGES, stream=True))
    response = httpx.get(gateway_url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    after = response.text
    m = {"model_name": MODEL_ID}

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **m, **labels) - sample(before, name, **m, **labels)

    assert grew("vllm:prompt_tokens_total") == 2 * 11
    assert grew("vllm:generation_tokens_total") == 2 * 7
    assert grew("vllm:request_success_total", finished_reason="stop") == 2
    assert grew("vllm:time_to_first_token_seconds_count") == 2
    assert grew("vllm:e2e_request_latency_seconds_count") == 2
    assert grew("vllm:inter_token_latency_seconds_count") == 2 * 6
    assert grew("vllm:time_per_output_token_seconds_count") == 2 * 6
    # 6 gaps of >= 10 ms each, per request
    assert grew("vllm:inter_token_latency_seconds_sum") >= 2 * 6 * 0.009
    assert grew("vllm:request_queue_time_seconds_sum") == pytest.approx(2 * 0.002)
    assert grew("vllm:request_prefill_time_seconds_sum") == pytest.approx(2 * 0.003)
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert f'{gauge}{{model_name="{MODEL_ID}"}} 0.0' in after


def test_running_gauge_is_cores(gateway_url: str, core: CoreDouble) -> None:
    # a stream far longer than the wait below: only a cancellation can end it in time
    core.script.words = [f" w{i}" for i in range(2000)]
    core.script.delay_per_chunk_s = 0.05
    body = {"model": MODEL_ID, "messages": MESSAGES, "stream": True}
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", gateway_url + "/v1/chat/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()  # kept referenced: a collected iterator closes the response
        next(lines)  # generating now
        assert sample(httpx.get(gateway_url + "/metrics").text, "vllm:num_requests_running") == 1
    assert core.cancelled.wait(30)  # a loaded 2-core machine may take seconds to notice the close
    assert sample(httpx.get(gateway_url + "/metrics").text, "vllm:num_requests_running") == 0


def test_openapi_lists_every_route(gateway_url: str, core: CoreDouble) -> None:
    schema = httpx.get(gateway_url + "/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/models",
        "/v1/models/{model_id}",
    ):
        assert path in schema["paths"], path
    chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"]["$ref"].endswith("ChatCompletionRequest")


@pytest.fixture
def keyed_gateway(core_server, core: CoreDouble):
    gateway = GatewayThread(core_server.target, api_keys=("sk-first", "sk-second")).start()
    yield gateway.url
    gateway.stop()


def test_api_keys(keyed_gateway: str, core: CoreDouble) -> None:
    url = keyed_gateway
    for key in ("sk-first", "sk-second"):
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert (
            good.chat.completions.create(model=MODEL_ID, messages=MESSAGES).choices[0].finish_reason == "stop"
        )
    for key in ("sk-wrong", "sk-firs", "sk-first-and-more"):
        with pytest.raises(openai.AuthenticationError) as raised:
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).models.list()
        assert raised.value.body["type"] == "authentication_error"
    missing = httpx.post(url + "/v1/chat/completions", json={"model": MODEL_ID, "messages": MESSAGES})
    assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]["message"]
    assert missing.headers["x-request-id"]
    missing = httpx.post(
        url + "/v1/messages", json={"model": MODEL_ID, "max_tokens": 5, "messages": MESSAGES[1:]}
    )
    assert missing.status_code == 401 and "x-api-key" in missing.json()["error"]["message"]
    # Anthropic clients send x-api-key and get Anthropic-shaped errors
    good = anthropic.Anthropic(base_url=url, api_key="sk-second", max_retries=0)
    assert (
        good.messages.create(model=MODEL_ID, max_tokens=5, messages=MESSAGES[1:]).stop_reason == "max_tokens"
    )
    with pytest.raises(anthropic.AuthenticationError) as raised_anthropic:
        anthropic.Anthropic(base_url=url, api_key="bad", max_retries=0).messages.create(
            model=MODEL_ID, max_tokens=5, messages=MESSAGES[1:]
        )
    assert raised_anthropic.value.body["error"]["type"] == "authentication_error"
    # probes and scrapes stay open
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert httpx.get(url + path).status_code == 200, path
    assert len(core.requests) == 3  # refused requests never reached core


def test_key_sources_merge(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-file-1\n\nsk-file-2\n")
    keys = load_api_keys(["sk-flag"], key_file, environ={API_KEY_ENV: "sk-env-1, sk-env-2,"})
    assert keys == ("sk-flag", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2")
    assert load_api_keys(environ={}) == ()
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(key_file=tmp_path / "missing", environ={})
    # keys asked for but none given: refused, never an open gateway
    (tmp_path / "empty").write_text("# no keys yet\n\n")
    with pytest.raises(ValueError, match="none is set"):
        load_api_keys(key_file=tmp_path / "empty", environ={})
    with pytest.raises(ValueError, match=API_KEY_ENV):
        load_api_keys(environ={API_KEY_ENV: " , "})
    with pytest.raises(ValueError, match="--api-key"):
        load_api_keys([" "], environ={})
    assert load_api_keys(environ={API_KEY_ENV: ""}) == ()  # set but empty: as if unset
    digests = tuple(key_digest(key) for key in keys)
    assert key_matches("sk-env-2", digests) and not key_matches("sk-env", digests)
    assert not key_matches("", digests)


def test_a_key_file_may_hold_hashes_instead_of_keys(tmp_path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sha256:" + hashlib.sha256(b"sk-hashed").hexdigest().upper() + "\n")
    keys = load_api_keys(key_file=key_file, environ={})
    digests = tuple(key_digest(key) for key in keys)
    assert key_matches("sk-hashed", digests) and not key_matches("sk-hashe", digests)
    assert not key_matches(keys[0], digests)  # the hash itself is not a key
    key_file.write_text("sha256:abc\n")
    with pytest.raises(ValueError, match="64 hex"):
        load_api_keys(key_file=key_file, environ={})


def test_protected_metrics_need_a_key_and_a_hashed_key_serves(core_server, core: CoreDouble) -> None:
    hashed = "sha256:" + hashlib.sha256(b"sk-ops").hexdigest()
    gateway = GatewayThread(core_server.target, api_keys=(hashed,), protect_metrics=True).start()
    try:
        assert httpx.get(gateway.url + "/metrics").status_code == 401
        assert (
            httpx.get(gateway.url + "/metrics", headers={"Authorization": "Bearer sk-ops"}).status_code == 200
        )
        assert httpx.get(gateway.url + "/health").status_code == 200  # liveness stays open
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-ops", max_retries=0)
        assert client.chat.completions.create(model=MODEL_ID, messages=MESSAGES).choices[0].finish_reason
    finally:
        gateway.stop()
