"""``/tokenize`` and ``/detokenize`` of the gateway (openai_gateway/tokenize.py), with the models'
real tokenizer files and chat template, Triton down (the routes need no Triton). The chat template
is rendered as transformers renders it, so the counts are what the engine sees."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.testclient import TestClient

from openai_gateway.app import create_app
from openai_gateway.auth import ApiKeys
from openai_gateway.settings import GatewaySettings
from openai_gateway.tokenize import ModelTokenizer
from server.supervisor import free_port

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "model_repository"
GENERATION_DIR = REPOSITORY / "text_generation" / "1"
KEY = "sk-triton-unit-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [
        {"role": "user", "content": "Écris « bonjour » 🙂"},
        {"role": "assistant", "content": "bonjour"},
        {"role": "user", "content": "merci"},
    ],
]

pytestmark = pytest.mark.skipif(
    not (GENERATION_DIR / "tokenizer.json").is_file() or not (REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json").is_file(),
    reason="the models are not exported (python -m export)",
)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(GENERATION_DIR))


@pytest.fixture(scope="module")
def client():
    settings = GatewaySettings(
        triton_url=f"127.0.0.1:{free_port()}", model_repository=REPOSITORY, api_keys=(KEY,), rate_limit_rps=0, ready_poll_s=0.2
    )
    with TestClient(create_app(settings, ApiKeys([KEY])), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_chat_template_is_rendered_as_transformers_renders_it(hf, messages, add_generation_prompt):
    tok = ModelTokenizer.load(GENERATION_DIR / "tokenizer.json", 4096, GENERATION_DIR / "chat_template.jinja")
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.render(messages, add_generation_prompt) == expected


def test_tokenize_a_chat_counts_what_the_engine_sees(client, hf):
    r = client.post("/tokenize", headers=AUTH, json={"model": "text_generation", "messages": CHATS[1]})
    assert r.status_code == 200, r.text
    body = r.json()
    text = hf.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)
    assert body["tokens"] == hf(text, add_special_tokens=False).input_ids  # what the engine encodes
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096 and body["token_strs"] is None
    back = client.post(
        "/detokenize", headers=AUTH, json={"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "tokens": body["tokens"]}
    )
    assert back.status_code == 200 and back.json() == {"prompt": text}  # by alias too


def test_tokenize_a_prompt_of_the_embedding_model_with_its_special_tokens(client):
    r = client.post(
        "/tokenize", headers=AUTH, json={"model": "text_embedding", "prompt": "hello world", "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": 4,
        "max_model_len": 256,
        "tokens": [101, 7592, 2088, 102],
        "token_strs": ["[CLS]", "hello", "world", "[SEP]"],
    }
    plain = client.post(
        "/tokenize", headers=AUTH, json={"model": "text_embedding", "prompt": "hello world", "add_special_tokens": False}
    )
    assert plain.json()["tokens"] == [7592, 2088]
    long = client.post("/tokenize", headers=AUTH, json={"model": "text_embedding", "prompt": "word " * 300})
    assert long.json()["count"] == 302  # not cut at the model's 256: the client can see it does not fit


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": "text_generation"}, 400, "prompt"),
        ("/tokenize", {"model": "text_generation", "prompt": "x", "messages": CHATS[0]}, 400, "prompt"),
        ("/tokenize", {"model": "text_embedding", "messages": CHATS[0]}, 400, "messages"),
        ("/tokenize", {"model": "text_generation", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"model": "text_generation", "prompt": "x" * 70_000}, 413, "prompt"),
        ("/detokenize", {"model": "text_embedding", "tokens": [101, 30522]}, 400, "tokens[1]"),
        ("/detokenize", {"model": "text_embedding", "tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"model": "text_embedding", "tokens": [1] * 65537}, 413, "tokens"),
        ("/detokenize", {"model": "text_embedding", "tokens": ["a"]}, 422, "tokens.0"),
    ],
)
def test_bad_requests_name_the_field(client, path, body, status, param):
    r = client.post(path, headers=AUTH, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_lone_surrogate_is_400_naming_the_field(client):
    raw = b'{"model": "text_generation", "prompt": "a\\ud800"}'  # valid JSON, no UTF-8 for it
    r = client.post("/tokenize", headers={**AUTH, "Content-Type": "application/json"}, content=raw)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_the_routes_need_a_key(client):
    r = client.post("/tokenize", json={"model": "text_embedding", "prompt": "x"})
    assert r.status_code == 401
