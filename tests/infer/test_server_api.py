"""What the server describes about itself and how it refuses a malformed body: ``/version``;
``/openapi.json`` and ``/docs`` list every endpoint with its request model (open without the
API key); ``/v1/models`` reports when the model was loaded, the context a request may use and
the context the model was trained for; the time-per-output-token histogram moves with each
request; a body that fails its pydantic model is OpenAI's 400 naming the field, never
FastAPI's 422; a JSON body sent as a form (``curl -d``) is still read as JSON."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

import trainforge
from tests.infer.test_server import serving
from trainforge.data.tokenizer import eos_id, load_tokenizer
from trainforge.infer.engine import Engine, EngineConfig
from trainforge.infer.server import ServerConfig
from trainforge.model import FLAVORS, build_model
from trainforge.monitor.sinks import read_exposition

KEY = "k"
TRAINED_CONTEXT, SERVED_CONTEXT = 128, 96


@pytest.fixture(scope="module")
def server(small_data):
    tok = load_tokenizer(small_data / "tokenizer.json")
    model = build_model(dataclasses.replace(FLAVORS["debug"], vocab_size=tok.get_vocab_size(),
                                            max_seq_len=TRAINED_CONTEXT), seed=0)
    engine = Engine(model, EngineConfig(max_batch_size=2, max_queue=2, max_context=SERVED_CONTEXT, block_size=8),
                    tokenizer=tok, eos_ids=(eos_id(tok),))
    before = time.time()
    with serving(engine, tok, ServerConfig(api_key=KEY, model_name="tiny", access_log=False)) as url:
        yield SimpleNamespace(url=url, engine=engine, tok=tok, before=before, after=time.time(),
                              http=httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30))


def test_version_names_trainforge_and_torch(server):
    r = server.http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": trainforge.__version__, "torch": torch.__version__}
    assert httpx.get(server.url + "/version").status_code == 401  # behind the key like the API


def test_openapi_lists_every_endpoint_with_its_request_model_and_docs_need_no_key(server):
    r = httpx.get(server.url + "/openapi.json")  # no key: a browser opening /docs cannot send one
    assert r.status_code == 200, r.text
    spec = r.json()
    want = {"/v1/completions": "post", "/v1/chat/completions": "post", "/tokenize": "post", "/detokenize": "post",
            "/v1/models": "get", "/health": "get", "/metrics": "get", "/version": "get"}
    assert {p: m for p, ops in spec["paths"].items() for m in ops} == want
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model)
    completion = schemas["CompletionRequest"]
    assert completion["required"] == ["prompt"]
    temperature = next(s for s in completion["properties"]["temperature"]["anyOf"] if s.get("type") == "number")
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    assert "max_tokens" in completion["properties"] and "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert spec["components"]["securitySchemes"]["api_key"]["scheme"] == "bearer"  # /docs' "Authorize"
    assert spec["paths"]["/v1/completions"]["post"]["security"] == [{"api_key": []}]
    assert "security" not in spec["paths"]["/health"]["get"]
    docs = httpx.get(server.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_models_reports_load_time_and_both_context_lengths(server):
    card = server.http.get("/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "trainforge"
    assert int(server.before) <= card["created"] <= server.after  # when the app was made, not 0 or "now"
    assert card["max_model_len"] == SERVED_CONTEXT and card["trained_context_length"] == TRAINED_CONTEXT
    time.sleep(1.1)
    assert server.http.get("/v1/models").json()["data"][0]["created"] == card["created"]  # stable, not per request


def test_models_created_can_be_the_checkpoints_time(small_data):
    from fastapi.testclient import TestClient

    from trainforge.infer.server import create_app

    tok = load_tokenizer(small_data / "tokenizer.json")
    model = build_model(dataclasses.replace(FLAVORS["debug"], vocab_size=tok.get_vocab_size(), max_seq_len=64))
    app = create_app(Engine(model, EngineConfig(max_batch_size=1, max_context=64), tokenizer=tok), tok,
                     ServerConfig(model_created=1_700_000_000.7))
    assert TestClient(app).get("/v1/models").json()["data"][0]["created"] == 1_700_000_000


def histogram(server, name: str) -> tuple[float, float]:
    m = read_exposition(server.http.get("/metrics").text)
    return m.get(f"trainforge_{name}_count", 0.0), m.get(f"trainforge_{name}_sum", 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_time_per_output_token_histogram_moves_with_each_request(server, stream):
    tpot = "inference_time_per_output_token_seconds"
    count0, sum0 = histogram(server, tpot)
    ttft0, _ = histogram(server, "inference_time_to_first_token_seconds")
    body = {"prompt": "def ", "max_tokens": 12, "ignore_eos": True, "stream": stream}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200
    count1, sum1 = histogram(server, tpot)
    assert count1 == count0 + 1 and sum1 > sum0
    assert histogram(server, "inference_time_to_first_token_seconds")[0] == ttft0 + 1
    # One token has no time between tokens: TTFT counts it, TPOT does not.
    r = server.http.post("/v1/completions", json={**body, "max_tokens": 1})
    assert r.status_code == 200
    assert histogram(server, tpot)[0] == count1
    assert histogram(server, "inference_time_to_first_token_seconds")[0] == ttft0 + 2


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,param,says", [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature",
     "'temperature' must be a number in [0, 2], got 'hot'"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens", "'max_tokens' must be an integer >= 1"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n", "'n' must be an integer >= 1, got '2'"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt", "'prompt' must be a string, a list of token ids"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "one-element list"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ("/v1/completions", {"prompt": "x", "seed": True}, "seed", "'seed' must be an integer in"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": [1]}, "stream_options",
     "'stream_options' must be an object"),
    ("/v1/chat/completions", {"messages": []}, "messages", "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages", "'messages[0].role' is required"),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "user", "content": None}]}, "messages",
     "'messages[1].content' must be a string or a list of content parts"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     "'max_completion_tokens' must be an integer >= 1, got 0"),
    ("/detokenize", {"tokens": [1, True]}, "tokens", "'tokens' must be a list of token ids"),
    ("/tokenize", {"prompt": 5}, "prompt", "'prompt' must be a string, got 5"),
])
def test_a_body_that_fails_its_model_is_an_openai_400_naming_the_field(server, path, body, param, says):
    r = server.http.post(path, json=body)
    assert r.status_code == 400, r.text  # not FastAPI's 422
    assert set(r.json()) == {"error"}
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and says in err["message"], err


def test_unknown_fields_are_ignored_and_null_is_the_default(server):
    body = {"prompt": "def ", "max_tokens": 3, "user": "u1", "logit_bias": {"5": 1}, "temperature": None,
            "ignore_eos": True, "n": None}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_is_read_whatever_its_content_type(server, content_type):
    """``curl -d '{...}'`` sends application/x-www-form-urlencoded; the body is JSON all the same."""
    headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": content_type} if content_type else {})}
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "def ", "max_tokens": 2}', headers=headers,
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
