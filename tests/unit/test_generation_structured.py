"""Structured outputs' guides (python_backends/generation/structured.py) with the model's real
tokenizer and llguidance: the checks on a guide's form, compiling once per guide, the errors that
name the field, and the mask's bit order."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.errors import InputError
from contract.sampling import MAX_GUIDE_BYTES, MAX_GUIDE_CHOICES, SamplingParams, guide_source, structural_tag_grammar
from python_backends.generation.structured import Grammars

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "text_generation" / "1"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}


@pytest.fixture(scope="module")
def tokenizer():
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("text_generation not exported (python -m export.generation)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, 49152)


def test_a_guide_is_kept_as_its_canonical_text_one_per_request():
    p = SamplingParams(guided_json=SCHEMA)
    assert p.guide == (
        "guided_json",
        '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]}',
    )
    assert SamplingParams(guided_json='{"type": "object"}').guide == ("guided_json", '{"type": "object"}')  # a JSON string too
    assert SamplingParams(guided_choice=["yes", "no"]).guide == ("guided_choice", '["yes", "no"]')
    assert SamplingParams().guide is None and hash(SamplingParams(guided_json=SCHEMA))
    with pytest.raises(InputError, match="guided_regex: only one guide per request: guided_json is set too"):
        SamplingParams(guided_json=SCHEMA, guided_regex="a+")


def test_vllms_structured_outputs_object_becomes_the_guide_it_names():
    assert SamplingParams(structured_outputs={"choice": ["red", "blue"]}).guide == ("guided_choice", '["red", "blue"]')
    assert SamplingParams(structured_outputs={"regex": "[0-9]+", "backend": "xgrammar"}).guide == ("guided_regex", "[0-9]+")
    assert SamplingParams(structured_outputs={"json": SCHEMA}).guide == SamplingParams(guided_json=SCHEMA).guide
    assert SamplingParams(structured_outputs={"json_object": True}).guide == ("guided_json", '{"type": "object"}')
    assert SamplingParams(structured_outputs={"grammar": "start: /[a-z]+/"}).guide == ("guided_grammar", "start: /[a-z]+/")
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs is None  # one form downstream


@pytest.mark.parametrize(
    "value, field, words",
    [
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag.structures", "must be a list"),
        ({"structural_tag": "{x"}, "structured_outputs.structural_tag", "not valid JSON"),
        ({"structural_tag": {"format": {}}}, "structured_outputs.structural_tag.format", "not served"),
        (
            {"structural_tag": {"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": ["<g"]}},
            "structured_outputs.structural_tag.structures[0].begin",
            "none of the triggers",
        ),
        ({"choise": ["a"]}, "structured_outputs.choise", "unknown key"),
        ({}, "structured_outputs", "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one of"),
        ({"json_object": False}, "structured_outputs.json_object", "must be true"),
        ([1], "structured_outputs", "must be an object"),
        ({"choice": []}, "guided_choice", "non-empty list of strings"),
    ],
)
def test_a_structured_outputs_key_is_served_or_refused_never_dropped(value, field, words):
    with pytest.raises(InputError) as caught:
        SamplingParams(structured_outputs=value)
    assert caught.value.field == field and words in str(caught.value)
    with pytest.raises(InputError, match="only one guide per request: guided_regex is set too"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_regex="b")


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("guided_json", "{not json", "is not valid JSON"),
        ("guided_json", [1, 2], "must be a JSON schema"),
        ("guided_choice", [], "non-empty list of strings"),
        ("guided_choice", ["a", ""], "every choice must be a non-empty string"),
        ("guided_choice", ["a", 3], "every choice must be a non-empty string"),
        ("guided_choice", ["x"] * (MAX_GUIDE_CHOICES + 1), f"at most {MAX_GUIDE_CHOICES} choices"),
        ("guided_regex", "", "non-empty string"),
        ("guided_grammar", 5, "non-empty string"),
        ("guided_regex", "a" * (MAX_GUIDE_BYTES + 1), f"the limit is {MAX_GUIDE_BYTES}"),
        ("guided_regex", "a\ud800", "not valid Unicode"),
        ("guided_json", {"description": "\udc00"}, "not valid Unicode"),
    ],
)
def test_a_guide_of_the_wrong_form_or_size_is_refused_naming_its_field(field, value, words):
    with pytest.raises(InputError) as caught:
        guide_source(field, value)
    assert caught.value.field == field and words in str(caught.value)


def test_each_guide_compiles_once_and_bad_ones_name_their_field(grammars):
    before = grammars.compiled
    first = grammars.compile("guided_json", guide_source("guided_json", SCHEMA))
    assert grammars.compile("guided_json", guide_source("guided_json", SCHEMA)) is first
    assert grammars.compiled == before + 1
    for field, value, words in (
        ("guided_json", {"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
        ("guided_regex", "a(b", "unclosed group"),
        ("guided_grammar", "start: foo", "unknown name"),
    ):
        with pytest.raises(InputError) as caught:
            grammars.compile(field, guide_source(field, value))
        assert caught.value.field == field and "cannot be compiled" in str(caught.value) and words in str(caught.value)


def test_the_mask_is_llguidances_own_bit_for_bit(grammars):
    """Our unpacking of the bitmask against llguidance's byte-per-token logit bias."""
    m = grammars.matcher("guided_choice", guide_source("guided_choice", ["yes", "no", "maybe"]))
    allowed = grammars.allowed([m, grammars.matcher("guided_regex", "[0-9]+")])
    reference = [b != 0 for b in m.compute_logit_bias()][:49152]
    assert allowed.shape == (2, 49152) and allowed[0].tolist() == reference
    assert 0 < int(allowed[0].sum()) < 100 and int(allowed[1].sum()) > int(allowed[0].sum())


WEATHER_TAG = {
    "structures": [
        {
            "begin": "<function=get_weather>",
            "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "end": "</function>",
        }
    ],
    "triggers": ["<function="],
}


def test_a_structural_tag_leaves_text_free_and_holds_the_tag_to_its_schema(grammars, tokenizer):
    """vLLM's structural tag: any text, but after the trigger only the named tag with JSON of its schema."""
    guide = SamplingParams(structured_outputs={"structural_tag": WEATHER_TAG}).guide
    assert guide == ("guided_grammar", structural_tag_grammar(WEATHER_TAG, "structural_tag"))

    def consumed(text: str) -> tuple[bool, bool]:
        m = grammars.matcher(*guide)
        ok = all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return ok, ok and m.is_accepting()

    assert consumed("Plain words, no call.") == (True, True)
    assert consumed('Sure. <function=get_weather>{"city": "Paris"}</function> Done.') == (True, True)
    assert consumed('<function=get_weather>{"city": "Paris"}') == (True, False)  # the end tag is still owed
    assert consumed('<function=get_weather>{"town": 3}')[0] is False  # the schema holds inside the tag
    assert consumed("<function=get_time>{}")[0] is False  # only the listed tags follow the trigger
