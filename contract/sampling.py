"""The sampling fields: one table for the engine, the clients and the gateway's schema, and
:class:`SamplingParams`, which validates itself once when it is made.

Names and meanings are vLLM's (``sampling_parameters`` of Triton's vLLM backend), except
``fit_to_context``, this project's. Errors name the field and the rule it broke, with the
values as data (contract.errors). Light on purpose: no torch, so the clients and the
gateway import it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from contract.errors import InputError

MAX_STOP = 16  # stop strings per request: the per-step stop search stays cheap
MAX_STOP_LEN = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256  # stop_token_ids per request: checked per generated token, as a set
MAX_REPETITION_PENALTY = 10.0
MAX_PRESENCE_FREQUENCY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024  # entries per request: the per-step addition stays cheap
MAX_LOGPROBS = 20  # alternatives per generated token (OpenAI's top_logprobs limit)
MAX_CHOICES = 16  # n: choices per request (each a running sequence; the engine's max_num_seqs bounds it too)
GUIDE_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # structured outputs
MAX_GUIDE_BYTES = 65536  # a schema, regex or grammar; larger ones are refused before compiling
MAX_GUIDE_CHOICES = 256  # guided_choice's strings
MAX_INT64 = 2**63 - 1  # top_k and seed: above int64 torch overflows and fails the whole batch step
PRIORITY_CLASSES = ("interactive", "default", "bulk")  # priority_class, highest first (docs/priority-classes.md)


@dataclass(frozen=True)
class SamplingField:
    """One sampling field: its name, the JSON types a request may send, its default."""

    name: str
    kinds: tuple[type, ...]
    default: Any
    doc: str
    openai: bool = False  # one of OpenAI's own request fields (else an extension: the SDK's extra_body)
    items: type = str  # a list's element type (for kinds holding list)


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField(
        "max_tokens",
        (int,),
        16,
        "Most tokens to generate (the model's default_max_tokens when absent; null: the rest of the context, "
        "at most max_tokens_limit)",
        openai=True,
    ),
    SamplingField("min_tokens", (int,), 0, "Tokens generated before EOS or a stop string may end the sequence"),
    SamplingField(
        "temperature", (int, float), 1.0, "Sampling temperature; 0 is greedy (absent: the model's default)", openai=True
    ),
    SamplingField(
        "top_p", (int, float), 1.0, "Nucleus sampling: the smallest set of tokens holding this mass; 1 disables it", openai=True
    ),
    SamplingField("top_k", (int,), 0, "Sample among the k most likely tokens; 0 disables it"),
    SamplingField(
        "n",
        (int,),
        1,
        f"Choices to generate for the prompt (1..{MAX_CHOICES}): forks of one prefill sharing its KV blocks",
        openai=True,
    ),
    SamplingField(
        "seed",
        (int,),
        None,
        "A seeded request samples the same tokens every time (choice i of n draws from seed + i)",
        openai=True,
    ),
    SamplingField("stop", (str, list), (), f"Up to {MAX_STOP} strings that end the text (left out of it)", openai=True),
    SamplingField(
        "stop_token_ids",
        (list,),
        (),
        f"Up to {MAX_STOP_TOKEN_IDS} token ids that end the sequence as EOS does (their text left out, as EOS's)",
        items=int,
    ),
    SamplingField(
        "include_stop_str_in_output",
        (bool,),
        False,
        "The stop string, or the text of the stop token (EOS, stop_token_ids), that ended the sequence ends the text too",
    ),
    SamplingField(
        "skip_special_tokens", (bool,), True, "Special tokens (the chat template's markers, EOS) are left out of the text"
    ),
    SamplingField("ignore_eos", (bool,), False, "EOS does not end the sequence"),
    SamplingField("repetition_penalty", (int, float), 1.0, "Above 1 discourages tokens already in the text"),
    SamplingField(
        "presence_penalty",
        (int, float),
        0.0,
        f"In [-{MAX_PRESENCE_FREQUENCY:g}, {MAX_PRESENCE_FREQUENCY:g}]: subtracted once from the logit of every token generated so far",
        openai=True,
    ),
    SamplingField(
        "frequency_penalty",
        (int, float),
        0.0,
        f"In [-{MAX_PRESENCE_FREQUENCY:g}, {MAX_PRESENCE_FREQUENCY:g}]: subtracted from a token's logit once per time it was generated",
        openai=True,
    ),
    SamplingField(
        "min_p",
        (int, float),
        0.0,
        "Drop tokens less likely than min_p times the most likely one (after temperature); 0 disables it",
    ),
    SamplingField(
        "logit_bias",
        (dict,),
        None,
        f"Token id (a string, as JSON keys are) -> a bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] added to its logit "
        f"before sampling (at most {MAX_LOGIT_BIAS_TOKENS} tokens)",
        openai=True,
    ),
    SamplingField(
        "logprobs",
        (int,),
        None,
        f"Return each generated token's log-probability and the N (0..{MAX_LOGPROBS}) most likely tokens at its position "
        "(output logprobs); absent: none",
    ),
    SamplingField(
        "prompt_logprobs",
        (int,),
        None,
        f"Return each prompt token's log-probability (the first's is null) and the N (0..{MAX_LOGPROBS}) most likely "
        "tokens at its position; the prompt then skips the prefix cache. With it max_tokens may be 0 (the prompt only)",
    ),
    SamplingField("guided_json", (dict, str), None, "A JSON schema the output must match, enforced token by token"),
    SamplingField("guided_regex", (str,), None, "A regular expression the whole output must match"),
    SamplingField("guided_choice", (list,), None, "The output is exactly one of these strings"),
    SamplingField("guided_grammar", (str,), None, "A Lark grammar the output must match"),
    SamplingField(
        "structured_outputs",
        (dict,),
        None,
        "vLLM's current form of the guides: one of json (a schema), regex, choice, grammar, or json_object: true",
    ),
    SamplingField(
        "fit_to_context",
        (bool,),
        False,
        "max_tokens shrinks to the room the prompt leaves in the context, instead of the request being refused",
    ),
    SamplingField(
        "fit_structure_to_max_tokens",
        (bool,),
        False,
        "A guided answer is steered to its shortest valid closing once max_tokens nears, so it ends complete "
        "(finish_reason stop, structure_fitted true); absent: the model's default",
    ),
    SamplingField(
        "priority_class",
        (str,),
        "default",
        "interactive, default or bulk: the engine admits waiting requests in that order and preempts bulk first "
        "(the gateway's X-Priority-Class header)",
    ),
)
FIELD_NAMES = tuple(f.name for f in SAMPLING_FIELDS)


# vLLM's StructuredOutputsParams: the guide keys, and the options that only choose or tune its backend
# (accepted: this engine always runs llguidance, compact JSON without free whitespace).
STRUCTURED_GUIDES = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
STRUCTURED_OPTIONS = (
    "backend",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
)


MAX_STRUCTURES = 64  # a structural tag's structures (one per tool, as vLLM's clients send them)


def structural_tag_grammar(value: Any, field: str) -> str:
    """vLLM's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``, an
    object or its JSON text) as the Lark grammar llguidance compiles (its ``StructTag`` layout): free
    text, and once a trigger appears the structure whose ``begin`` starts with it: the rest of
    ``begin``, JSON of its schema, ``end``; then free text again. InputError names what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InputError(field, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InputError(field, f"must be an object with structures and triggers, got {type(value).__name__}")
    if "format" in value:
        raise InputError(f"{field}.format", "the tag-format form is not served; send structures and triggers")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not 0 < len(structures) <= MAX_STRUCTURES:
        raise InputError(f"{field}.structures", f"must be a list of 1 to {MAX_STRUCTURES} structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InputError(f"{field}.triggers", "must be a non-empty list of non-empty strings")
    rules = []
    for i, structure in enumerate(structures):
        where = f"{field}.structures[{i}]"
        if not isinstance(structure, dict):
            raise InputError(where, "must be an object with begin, schema and end")
        begin, end, schema = structure.get("begin"), structure.get("end"), structure.get("schema")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InputError(where, "needs begin and end strings")
        if not isinstance(schema, dict):
            raise InputError(f"{where}.schema", "must be a JSON schema object")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise InputError(f"{where}.begin", f"starts with none of the triggers {triggers}")
        body = " ".join(part for part in (_literal(begin[len(trigger) :]), "%json " + json.dumps(schema), _literal(end)) if part)
        rules.append(f"tag_{i}_trigger[lazy]: TAG_TEXT {json.dumps(trigger)}\ntag_{i}: tag_{i}_trigger {body}")
    tags = " | ".join(f"tag_{i}" for i in range(len(structures)))
    return "%llguidance {}\nstart: (" + tags + ")* tag_end\ntag_end: TAG_TEXT\nTAG_TEXT: /(.|\\n)*/\n" + "\n".join(rules)


def _literal(text: str) -> str:
    return json.dumps(text) if text else ""


def _structured_outputs(value: Any) -> tuple[str, Any]:
    """(guided_* field, its value) of vLLM's ``structured_outputs`` object; a key this engine does not
    knows nothing of is refused, never dropped."""
    if not isinstance(value, dict):
        raise InputError("structured_outputs", f"must be an object, got {type(value).__name__}")
    guides = []
    for key, item in value.items():
        if item is None or key in STRUCTURED_OPTIONS:
            continue
        if key in STRUCTURED_GUIDES:
            guides.append((STRUCTURED_GUIDES[key], item))
        elif key == "json_object":
            if item is not True:
                raise InputError("structured_outputs.json_object", f"must be true, got {item!r}")
            guides.append(("guided_json", {"type": "object"}))
        elif key == "structural_tag":
            guides.append(("guided_grammar", structural_tag_grammar(item, "structured_outputs.structural_tag")))
        else:
            known = ", ".join([*STRUCTURED_GUIDES, "json_object", *STRUCTURED_OPTIONS])
            raise InputError(f"structured_outputs.{key}", f"unknown key (known: {known})")
    if len(guides) != 1:
        raise InputError(
            "structured_outputs", f"needs exactly one of {', '.join([*STRUCTURED_GUIDES, 'json_object'])}, got {len(guides)}"
        )
    return guides[0]


def _int(name: str, value: Any) -> int:
    # bool is an int in Python; a client that sends true for max_tokens made a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(name, f"must be an integer, got {type(value).__name__} {value!r}", values={"got": repr(value)})
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(name, f"must be a number, got {type(value).__name__} {value!r}", values={"got": repr(value)})
    value = float(value)
    if not math.isfinite(value):
        raise InputError(name, f"must be finite, got {value!r}", values={"got": repr(value)})
    return value


def _range(name: str, value, ok: bool, rule: str, **limits) -> None:
    if not ok:
        raise InputError(name, f"{rule}, got {value}", values={**limits, "got": value})


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, valid once made (InputError names the field otherwise).

    ``top_k`` 0 and ``top_p`` 1.0 disable those filters; ``temperature`` 0 is greedy.
    ``ignore_eos`` is the engine's stop check's business: EOS may still be sampled, it
    just does not end the sequence (as in vLLM). ``fit_to_context``: the engine lowers
    ``max_tokens`` to what the context leaves after the prompt instead of refusing.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    # ((token id, bias), ...) sorted by id; a dict of {"id": bias} is accepted and normalised
    logit_bias: tuple[tuple[int, float], ...] | None = None
    logprobs: int | None = None  # None: no log-probabilities; N: the chosen token's and N alternatives
    # At most one guide (structured outputs), each kept as its canonical text (guide_source).
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: Any = None
    guided_grammar: str | None = None
    # vLLM's current name for the guides ({"choice": [...]} ...): turned into the guided_* field it names.
    structured_outputs: Any = None
    fit_to_context: bool = False
    fit_structure_to_max_tokens: bool = False  # a guide's answer closes within max_tokens (structured.Fitting)
    n: int = 1  # choices of the prompt
    stop_token_ids: tuple[int, ...] = ()  # sorted, without repeats
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's and N alternatives
    priority_class: str = "default"  # one of PRIORITY_CLASSES: the scheduler's admission and preemption order

    def __post_init__(self):
        put = object.__setattr__  # frozen: normalised values are set once, here
        max_tokens = _int("max_tokens", self.max_tokens)
        if self.prompt_logprobs is None:
            _range("max_tokens", max_tokens, max_tokens > 0, "must be > 0", minimum=1)
        else:  # the prompt's log-probabilities alone (an evaluation's loglikelihood request)
            _range("max_tokens", max_tokens, max_tokens >= 0, "must be >= 0", minimum=0)
        min_tokens = _int("min_tokens", self.min_tokens)
        _range(
            "min_tokens",
            min_tokens,
            0 <= min_tokens <= max_tokens,
            f"must be between 0 and max_tokens ({max_tokens})",
            minimum=0,
            maximum=max_tokens,
        )
        temperature = _float("temperature", self.temperature)
        _range("temperature", temperature, temperature >= 0, "must be >= 0", minimum=0)
        top_p = _float("top_p", self.top_p)
        _range("top_p", top_p, 0 < top_p <= 1, "must be in (0, 1]", above=0, maximum=1)
        top_k = _int("top_k", self.top_k)
        _range(
            "top_k",
            top_k,
            0 <= top_k <= MAX_INT64,
            f"must be between 0 (0 disables it) and {MAX_INT64}",
            minimum=0,
            maximum=MAX_INT64,
        )
        n = _int("n", self.n)
        _range("n", n, 1 <= n <= MAX_CHOICES, f"must be between 1 and {MAX_CHOICES}", minimum=1, maximum=MAX_CHOICES)
        if self.seed is not None:
            seed = _int("seed", self.seed)
            _range("seed", seed, 0 <= seed <= MAX_INT64, f"must be between 0 and {MAX_INT64}", minimum=0, maximum=MAX_INT64)
        penalty = _float("repetition_penalty", self.repetition_penalty)
        _range(
            "repetition_penalty",
            penalty,
            0 < penalty <= MAX_REPETITION_PENALTY,
            f"must be in (0, {MAX_REPETITION_PENALTY:g}]",
            above=0,
            maximum=MAX_REPETITION_PENALTY,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            bound = MAX_PRESENCE_FREQUENCY
            _range(
                name, value, -bound <= value <= bound, f"must be between -{bound:g} and {bound:g}", minimum=-bound, maximum=bound
            )
            put(self, name, value)
        min_p = _float("min_p", self.min_p)
        _range("min_p", min_p, 0 <= min_p <= 1, "must be between 0 and 1", minimum=0, maximum=1)
        put(self, "min_p", min_p)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                value = _int(name, getattr(self, name))
                _range(
                    name,
                    value,
                    0 <= value <= MAX_LOGPROBS,
                    f"must be between 0 and {MAX_LOGPROBS}",
                    minimum=0,
                    maximum=MAX_LOGPROBS,
                )
        if self.logit_bias is not None:
            put(self, "logit_bias", _logit_bias(self.logit_bias) or None)
        if self.structured_outputs is not None:
            name, value = _structured_outputs(self.structured_outputs)
            if getattr(self, name) is not None:
                raise InputError("structured_outputs", f"only one guide per request: {name} is set too")
            put(self, name, value)
            put(self, "structured_outputs", None)
        guides = [name for name in GUIDE_FIELDS if getattr(self, name) is not None]
        if len(guides) > 1:
            raise InputError(guides[1], f"only one guide per request: {guides[0]} is set too")
        for name in guides:
            put(self, name, guide_source(name, getattr(self, name)))
        for name in (
            "ignore_eos",
            "fit_to_context",
            "fit_structure_to_max_tokens",
            "include_stop_str_in_output",
            "skip_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InputError(
                    name, f"must be true or false, got {getattr(self, name)!r}", values={"got": repr(getattr(self, name))}
                )
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InputError("stop", "must be a string or a list of strings")
        _range("stop", len(stop), len(stop) <= MAX_STOP, f"at most {MAX_STOP} stop strings", maximum=MAX_STOP)
        for s in stop:
            if not s:
                raise InputError("stop", "stop strings must not be empty")
            _range(
                "stop",
                len(s),
                len(s) <= MAX_STOP_LEN,
                f"each stop string must be <= {MAX_STOP_LEN} characters",
                maximum=MAX_STOP_LEN,
            )
        put(self, "temperature", temperature)
        put(self, "top_p", top_p)
        put(self, "repetition_penalty", penalty)
        put(self, "stop", tuple(stop))
        put(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        if self.priority_class not in PRIORITY_CLASSES:
            raise InputError(
                "priority_class",
                f"must be one of {', '.join(PRIORITY_CLASSES)}, got {str(self.priority_class)[:40]!r}",
                values={"allowed": list(PRIORITY_CLASSES), "got": repr(self.priority_class)[:40]},
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def guide(self) -> tuple[str, str] | None:
        """(field, canonical source) of the request's guide, or None."""
        for name in GUIDE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def penalises_history(self) -> bool:
        """Whether the sampler needs the tokens so far (a repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _stop_token_ids(value: Any) -> tuple[int, ...]:
    """The ids as a sorted tuple without repeats (the engine checks them against its vocabulary)."""
    if not isinstance(value, (list, tuple)):
        raise InputError("stop_token_ids", f"must be a list of token ids, got {type(value).__name__}")
    _range(
        "stop_token_ids",
        len(value),
        len(value) <= MAX_STOP_TOKEN_IDS,
        f"at most {MAX_STOP_TOKEN_IDS} token ids",
        maximum=MAX_STOP_TOKEN_IDS,
    )
    for i, token in enumerate(value):
        token = _int(f"stop_token_ids[{i}]", token)
        _range(f"stop_token_ids[{i}]", token, 0 <= token <= MAX_INT64, "must be a token id >= 0", minimum=0)
    return tuple(sorted(set(value)))


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` (or an already normalised tuple of pairs) as sorted pairs."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        items = list(value)
    else:
        raise InputError("logit_bias", f"must be an object of token id -> bias, got {type(value).__name__}")
    pairs: dict[int, float] = {}
    for key, bias in items:
        field = f"logit_bias[{str(key)[:24]!r}]"
        if isinstance(key, int) and not isinstance(key, bool):
            token = key
        elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
            token = int(key)
        else:
            raise InputError(field, "keys must be token ids (non-negative integers)", values={"got": repr(key)[:40]})
        _range(field, token, 0 <= token <= MAX_INT64, "token ids are >= 0", minimum=0)
        number = _float(field, bias)
        _range(
            field,
            number,
            abs(number) <= MAX_LOGIT_BIAS,
            f"must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}",
            minimum=-MAX_LOGIT_BIAS,
            maximum=MAX_LOGIT_BIAS,
        )
        pairs[token] = number
    _range(
        "logit_bias",
        len(pairs),
        len(pairs) <= MAX_LOGIT_BIAS_TOKENS,
        f"at most {MAX_LOGIT_BIAS_TOKENS} tokens",
        maximum=MAX_LOGIT_BIAS_TOKENS,
    )
    return tuple(sorted(pairs.items()))


def guide_source(field: str, value: Any) -> str:
    """The canonical text of one guide field's value (what the grammar cache keys on);
    InputError naming ``field`` for a value of the wrong form or size."""
    if field == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InputError(field, f"is not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise InputError(field, f"must be a JSON schema (an object), got {type(value).__name__}")
        text = json.dumps(value, ensure_ascii=False)  # key order kept: properties come out in it
    elif field == "guided_choice":
        if not isinstance(value, (list, tuple)) or not value:
            raise InputError(field, "must be a non-empty list of strings")
        if len(value) > MAX_GUIDE_CHOICES:
            raise InputError(
                field, f"at most {MAX_GUIDE_CHOICES} choices, got {len(value)}", values={"maximum": MAX_GUIDE_CHOICES}
            )
        if not all(isinstance(c, str) and c for c in value):
            raise InputError(field, "every choice must be a non-empty string")
        text = json.dumps(list(value), ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value:
            raise InputError(field, "must be a non-empty string")
        text = value
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InputError(field, f"is not valid Unicode: {exc.reason} at character {exc.start}") from None
    if size > MAX_GUIDE_BYTES:
        raise InputError(
            field, f"is {size} bytes; the limit is {MAX_GUIDE_BYTES}", values={"maximum": MAX_GUIDE_BYTES, "got": size}
        )
    return text
