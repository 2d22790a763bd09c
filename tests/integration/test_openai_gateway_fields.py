"""No request fails open: every field of OpenAI's chat and completion requests (as the installed
openai SDK types them) and of vLLM's (its ChatCompletionRequest and CompletionRequest) is served,
refused with 400 naming it, or on the documented list of fields that change nothing here
(openai_gateway/request_fields.py). Checked through the real gateway and tritonserver."""

from __future__ import annotations

import typing

import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from transformers import AutoTokenizer

from openai_gateway.request_fields import IGNORED, UNSERVED
from openai_gateway.schemas import ChatCompletionRequest, CompletionRequest
from server.layout import ROOT

GENERATION = "text_generation"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]

# vLLM's request fields beyond OpenAI's (vllm/entrypoints/openai/{chat_completion,completion}/protocol.py):
# its sampling parameters, then its extra parameters.
VLLM_SAMPLING = (
    "use_beam_search top_k min_p repetition_penalty watermarking length_penalty stop_token_ids "
    "include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens "
    "truncate_prompt_tokens truncation_side prompt_logprobs logprob_token_ids allowed_token_ids bad_words"
).split()
VLLM_CHAT_EXTRA = (
    "echo add_generation_prompt continue_final_message add_special_tokens documents chat_template "
    "chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs priority request_id session_id "
    "return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets return_prompt_text "
    "return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection stream_interval "
    "thinking_token_budget include_reasoning reasoning_effort"
).split()
VLLM_COMPLETION_EXTRA = (
    "add_special_tokens response_format structured_outputs priority request_id return_tokens_as_token_ids "
    "return_token_ids cache_salt kv_transfer_params vllm_xargs"
).split()

# A value of each refused field that asks for what is not served.
ASKING = {
    "use_beam_search": True,
    "length_penalty": 0.5,
    "prompt_logprobs": 1,
    "logprob_token_ids": [5],
    "allowed_token_ids": [5, 6],
    "bad_words": ["Paris"],
    "truncate_prompt_tokens": 8,
    "truncation_side": "left",
    "spaces_between_special_tokens": False,
    "watermarking": True,
    "thinking_token_budget": 16,
    "repetition_detection": {"min_pattern_size": 2},
    "logits_processors": ["my.module:Processor"],
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "documents": [{"title": "a", "text": "b"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"size": 1},
    "priority": 5,
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_prefill": True},
    "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "return_prompt_text": True,
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "store": True,
    "moderation": {"enabled": True},
}


def _fields(params_class) -> set[str]:
    return set(typing.get_type_hints(params_class)) | {"stream"}


def _classified(schema) -> tuple[set[str], set[str], set[str]]:
    return set(schema.model_fields), set(UNSERVED), set(IGNORED)


@pytest.mark.parametrize(
    "schema, fields",
    [
        (
            ChatCompletionRequest,
            _fields(chat_create_params.CompletionCreateParamsBase) | set(VLLM_SAMPLING) | set(VLLM_CHAT_EXTRA),
        ),
        (
            CompletionRequest,
            _fields(completion_create_params.CompletionCreateParamsBase) | set(VLLM_SAMPLING) | set(VLLM_COMPLETION_EXTRA),
        ),
    ],
    ids=["chat", "completions"],
)
def test_every_field_of_openais_and_vllms_requests_is_served_refused_or_listed(schema, fields):
    served, refused, ignored = _classified(schema)
    assert not served & refused and not served & ignored and not refused & ignored
    unplaced = sorted(fields - served - refused - ignored - {"echo"})  # chat's echo: refused by name
    assert not unplaced, f"fields nobody decided on: {unplaced}"
    assert set(ASKING) == refused, "each refused field needs a value that asks for it"


@pytest.mark.parametrize("name", sorted(UNSERVED))
def test_a_refused_field_is_a_400_naming_it_and_its_no_op_value_is_served(openai_client, name):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=2, extra_body={name: ASKING[name]})
    error = caught.value.response.json()["error"]
    assert (error["param"], error["code"]) == (name, "unsupported_parameter"), error
    assert error["message"].startswith(f"{name}: ")
    no_op = UNSERVED[name][0][-1]
    answer = openai_client.completions.create(model=GENERATION, prompt="Paris is", max_tokens=2, extra_body={name: no_op})
    assert answer.choices[0].text


def test_chat_echo_is_refused_and_the_ignored_fields_change_nothing(openai_client):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=2, extra_body={"echo": True})
    assert caught.value.response.json()["error"]["param"] == "echo"
    plain = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=12, temperature=0)
    hints = {
        "prompt_cache_key": "k",
        "service_tier": "auto",
        "safety_identifier": "u1",
        "request_id": "r1",
        "include_reasoning": False,
        "stream_interval": 4,
    }
    hinted = openai_client.chat.completions.create(
        model=GENERATION, messages=QUESTION, max_tokens=12, temperature=0, extra_body=hints
    )
    assert hinted.choices[0].message.content == plain.choices[0].message.content


def test_stop_token_ids_include_stop_str_and_skip_special_tokens_are_served(openai_client):
    """vLLM's three output fields the schema used to drop: each changes the answer as vLLM's does."""
    tok = AutoTokenizer.from_pretrained(str(ROOT / "model_repository" / "text_generation" / "1"))
    plain = openai_client.chat.completions.create(model=GENERATION, messages=QUESTION, max_tokens=24, temperature=0)
    text = plain.choices[0].message.content
    ids = tok.encode(text, add_special_tokens=False)
    stop_id = ids[3]
    first = ids.index(stop_id)
    cut = openai_client.chat.completions.create(
        model=GENERATION, messages=QUESTION, max_tokens=24, temperature=0, extra_body={"stop_token_ids": [stop_id]}
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == tok.decode(ids[:first])
    assert cut.usage.completion_tokens == first + 1  # the stop token is generated, not written
    kept = openai_client.chat.completions.create(
        model=GENERATION,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stop=["Paris"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content.endswith("Paris") and text.startswith(kept.choices[0].message.content)
    assert plain.choices[0].finish_reason == "stop"  # ended by EOS
    shown = openai_client.chat.completions.create(
        model=GENERATION,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True},
    )
    assert shown.choices[0].message.content == text + tok.eos_token
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(
            model=GENERATION, messages=QUESTION, max_tokens=2, extra_body={"stop_token_ids": [len(tok) + 10]}
        )
    assert caught.value.response.json()["error"]["param"] == "stop_token_ids"


def test_models_say_their_context_length_creation_time_and_owner(openai_client):
    """vLLM's max_model_len, the export's time as created, the Hugging Face organisation as owner."""
    listed = {m.id: m for m in openai_client.models.list().data}
    generation = listed[GENERATION]
    assert generation.max_model_len == 4096 and generation.owned_by == "HuggingFaceTB"
    folder = ROOT / "model_repository" / GENERATION / "1"
    assert generation.created == int(folder.stat().st_mtime)
    embedding = listed["text_embedding"]
    assert embedding.max_model_len == 256 and embedding.owned_by == "sentence-transformers"
    assert embedding.created > 1_600_000_000
    assert openai_client.models.retrieve(GENERATION).max_model_len == 4096


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model=GENERATION,
            messages=QUESTION,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    counts = [c.usage.completion_tokens for c in content]
    assert content and counts == sorted(counts) and counts[0] >= 1, counts
    last = chunks[-1].usage
    assert all(c.usage.prompt_tokens == last.prompt_tokens for c in content)
    assert last.completion_tokens >= counts[-1] and last.total_tokens == last.prompt_tokens + last.completion_tokens
