"""Coverage-guided (atheris) fuzz targets for the Python steps' input decoding.

Each target feeds fuzzer bytes to the functions a served model calls on a request's tensors
and parameters, and asserts the contract the shims rely on: the function returns a valid
value or raises the project's own ``InputError`` (which the shim answers with INVALID_ARG for
that request). Any other exception is what the shim would answer as an internal error (HTTP
500 / gRPC INTERNAL): atheris reports it as a crash, with the input that caused it.

    python -m tests.fuzz.targets text -runs=5000       # libFuzzer flags after the target
    python -m tests.fuzz.targets --list

``python -m tests.fuzz`` runs every target this way and counts the runs (docs/fuzzing.md).
"""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import atheris
import numpy as np

from perf.lib.paths import REPOSITORY

with atheris.instrument_imports(include=["contract", "python_backends"]):
    from contract.errors import InputError
    from contract.sampling import FIELD_NAMES
    from python_backends.cache.keys import KEY_PREFIX, KeyMaker, ModelIdentity
    from python_backends.generation import serving
    from python_backends.generation.sampling import parse_sampling_params
    from python_backends.image.preprocess import PreprocessOptions, preprocess
    from python_backends.routing.router import decide, parse_parameters
    from python_backends.shim import check_shape
    from python_backends.text.tokenization import BatchTokenizer, decode_texts


class ContractBroken(AssertionError):
    """The function returned something the shim could not send."""


def _texts(fdp: atheris.FuzzedDataProvider) -> np.ndarray:
    """A TEXT tensor as the python backend hands it over: an object array of bytes (now and
    then a str or an int, as a buggy caller of the library might pass)."""
    n = fdp.ConsumeIntInRange(0, 4)
    values: list = []
    for _ in range(n):
        kind = fdp.ConsumeIntInRange(0, 9)
        if kind == 0:
            values.append(fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 64)))
        elif kind == 1:
            values.append(fdp.ConsumeInt(4))
        else:
            values.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300)))
    array = np.empty((len(values), 1), dtype=object)
    for i, v in enumerate(values):
        array[i, 0] = v
    return array


_TOKENIZER: BatchTokenizer | None = None
_KEYS = KeyMaker(ModelIdentity("text_embedding", "text_encoder", "1", "fp32", "fuzz"))


def text(data: bytes) -> None:
    """text_tokenizer and text_embedding_cached: decode_texts, the cache key, the tokenizer."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = BatchTokenizer(REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json", 256)
    fdp = atheris.FuzzedDataProvider(data)
    max_bytes = fdp.ConsumeIntInRange(1, 512)
    values = _texts(fdp)
    try:
        texts = decode_texts(values, "TEXT", max_bytes)
    except InputError:
        return
    if len(texts) != values.size or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ContractBroken(f"decode_texts returned {texts!r} for {values!r}")
    keys = [_KEYS(t) for t in texts]
    if any(not k.startswith(KEY_PREFIX) for k in keys):
        raise ContractBroken(f"bad keys {keys}")
    batch = _TOKENIZER.encode(texts)
    if batch.input_ids.shape != batch.attention_mask.shape or batch.input_ids.shape[0] != len(texts):
        raise ContractBroken(f"tokenizer shapes {batch.input_ids.shape} {batch.attention_mask.shape}")
    if texts and not 1 <= batch.input_ids.shape[1] <= 256:
        raise ContractBroken(f"sequence length {batch.input_ids.shape[1]}")
    if not (batch.num_tokens >= batch.lengths).all() or not (batch.lengths == np.minimum(batch.num_tokens, 256)).all():
        raise ContractBroken(f"token counts {batch.num_tokens} against lengths {batch.lengths}")


def _seed_images() -> list[bytes]:
    from PIL import Image

    out = []
    for fmt, mode in (("PNG", "RGB"), ("PNG", "L"), ("PNG", "RGBA"), ("PNG", "P"), ("JPEG", "RGB"), ("JPEG", "L")):
        buf = io.BytesIO()
        Image.new(mode, (5, 3), 0).save(buf, fmt)
        out.append(buf.getvalue())
    return out


_IMAGE_OPTIONS = PreprocessOptions(resize=32, crop=16, max_megapixels=0.05)
_SEEDS: list[bytes] = []


def image(data: bytes) -> None:
    """image_preprocess: magic bytes, header size checks, decoding, resize and crop. The first
    byte picks a valid image to splice the rest into (so the decoders get past the magic bytes),
    or none: the rest is the file."""
    if not _SEEDS:
        _SEEDS.extend(_seed_images())
    if not data:
        return
    pick, rest = data[0] % (len(_SEEDS) + 1), data[1:]
    if pick < len(_SEEDS):
        seed = _SEEDS[pick]
        cut = (rest[0] if rest else 0) % len(seed)
        rest = seed[:cut] + rest[1:] + seed[cut + len(rest) :]
    try:
        pixels = preprocess(np.array([rest], dtype=object), "IMAGE", _IMAGE_OPTIONS)
    except InputError:
        return
    if pixels.shape != (1, 3, 16, 16) or pixels.dtype != np.float32 or not np.isfinite(pixels).all():
        raise ContractBroken(f"pixels {pixels.shape} {pixels.dtype}")


class _ChatTokenizer:
    """The generation model's own chat template, rendered by transformers' renderer."""

    def __init__(self):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(REPOSITORY / "text_generation" / "1"))

    def apply_chat_template(self, messages, **kw):
        return self._tok.apply_chat_template(messages, **kw)


_CHAT: _ChatTokenizer | None = None
_BOOL_KINDS = (
    None,
    True,
    False,
    1,
    "true",
    np.array([True]),
    np.array([True, False]),
    np.array([1], np.int32),
    np.array([], bool),
    np.array(["x"], object),
)


def _json_value(fdp: atheris.FuzzedDataProvider, depth: int = 0):
    kind = fdp.ConsumeIntInRange(0, 8 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeInt(9)
    if kind == 3:
        return fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat()
    if kind in (4, 5):
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 24))
    if kind == 6:
        return [_json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    keys = ("role", "content", "max_tokens", "stop", "temperature", "x")
    return {fdp.PickValueInList(list(keys)): _json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))}


def generation(data: bytes) -> None:
    """text_generation: parse_request (bool inputs, text_input, sampling_parameters JSON merged
    with request parameters, chat messages through the model's template)."""
    global _CHAT
    if _CHAT is None:
        _CHAT = _ChatTokenizer()
    fdp = atheris.FuzzedDataProvider(data)
    inputs: dict = {name: fdp.PickValueInList(list(_BOOL_KINDS)) for name in serving.BOOL_INPUTS}
    names = list(FIELD_NAMES) + ["priority", "timeout", "x", "stream", "apply_chat_template"]
    if fdp.ConsumeBool():
        # A chat: a JSON list of messages, sometimes well formed.
        messages = [
            {
                "role": fdp.PickValueInList(["user", "system", "assistant", "tool", 5]),
                "content": _json_value(fdp) if fdp.ConsumeBool() else fdp.ConsumeUnicodeNoSurrogates(12),
            }
            for _ in range(fdp.ConsumeIntInRange(0, 3))
        ]
        text_value = json.dumps(messages).encode() if fdp.ConsumeBool() else fdp.ConsumeBytes(40)
        inputs["apply_chat_template"] = np.array([True])
    else:
        text_value = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 80))
    inputs["text_input"] = np.array([text_value], dtype=object) if fdp.ConsumeIntInRange(0, 9) else None
    sampling = {fdp.PickValueInList(names): _json_value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))}
    raw = json.dumps(sampling).encode() if fdp.ConsumeBool() else fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 60))
    if fdp.ConsumeBool():
        inputs["sampling_parameters"] = np.array([raw], dtype=object)
    params = {fdp.PickValueInList(names): _json_value(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))}
    try:
        parsed = serving.parse_request(
            inputs, params, tokenizer=_CHAT, max_tokens_limit=64, default_max_tokens=16, max_text_bytes=256
        )
    except InputError:
        return
    p = parsed.params
    # An empty or blank prompt passes here: the engine's encode refuses it, on every path in.
    if not isinstance(parsed.prompt, str):
        raise ContractBroken(f"prompt {parsed.prompt!r} is not a text")
    if not (
        1 <= p.max_tokens <= 64
        and 0 <= p.min_tokens <= p.max_tokens
        and math.isfinite(p.temperature)
        and p.temperature >= 0
        and 0 < p.top_p <= 1
        and p.top_k >= 0
        and p.repetition_penalty > 0
    ):
        raise ContractBroken(f"invalid sampling params accepted: {p}")


def sampling(data: bytes) -> None:
    """parse_sampling_params on raw bytes (the sampling_parameters tensor of the vLLM interface);
    the first two bytes are the caller's max_tokens limit."""
    limit = 1 + int.from_bytes(data[:2], "little") % 4096
    try:
        p = parse_sampling_params(data[2:], max_tokens_limit=limit)
    except InputError:
        return
    if not (1 <= p.max_tokens <= limit and 0 < p.top_p <= 1 and p.temperature >= 0 and p.repetition_penalty > 0):
        raise ContractBroken(f"invalid sampling params accepted: {p}")


def routing(data: bytes) -> None:
    """text_encoder_router: the request's parameters JSON, encoder_version and routing_key."""
    fdp = atheris.FuzzedDataProvider(data)
    weights = {1: fdp.ConsumeIntInRange(0, 100), 2: fdp.ConsumeIntInRange(0, 100)}
    if not any(weights.values()):
        weights[1] = 100
    if fdp.ConsumeBool():
        params = {
            fdp.PickValueInList(["encoder_version", "routing_key", "priority_class", "x"]): _json_value(fdp)
            for _ in range(fdp.ConsumeIntInRange(0, 3))
        }
        raw = json.dumps(params)
    else:
        raw = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 80))
    try:
        decision = decide(weights, parse_parameters(raw), fdp.ConsumeUnicodeNoSurrogates(8), known_versions=(1, 2))
    except InputError:
        return
    if decision.version not in (1, 2):
        raise ContractBroken(f"routed to {decision.version}")


def shapes(data: bytes) -> None:
    """The shims' per-request shape check (shim.check_shape) against any config."""
    fdp = atheris.FuzzedDataProvider(data)
    dims = [fdp.ConsumeIntInRange(-1, 8) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    shape = [
        fdp.ConsumeIntInRange(-(1 << 62), 1 << 62) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(-1, 9)
        for _ in range(fdp.ConsumeIntInRange(0, 5))
    ]
    mbs = fdp.ConsumeIntInRange(0, 64)
    size = fdp.ConsumeIntInRange(0, 100) if fdp.ConsumeBool() else None
    try:
        check_shape("X", shape, dims, mbs, size=size)
    except InputError:
        return
    full = dims if mbs == 0 else [shape[0], *dims]
    if len(shape) != len(full) or any(s < 0 or (d >= 0 and s != d) for s, d in zip(shape, full)):
        raise ContractBroken(f"shape {shape} accepted for dims {dims} (max_batch_size {mbs})")


def seeds(target: str) -> list[bytes]:
    """A starting corpus for a target (valid inputs the mutations start from)."""
    if target == "image":
        return [bytes([i]) + b"" for i in range(3)] + [bytes([len(_seed_images())]) + s for s in _seed_images()]
    if target == "sampling":
        return [
            b"\x40\x00" + json.dumps(v).encode()
            for v in (
                {"max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 1, "stop": ["a", "b"]},
                {"min_tokens": 2, "repetition_penalty": 1.1, "ignore_eos": True, "stop": "x"},
                {},
            )
        ]
    return []


def prepare(target: str) -> None:
    """Load what a target needs (tokenizers, seed images) once, before fuzzing starts."""
    global _TOKENIZER, _CHAT
    if target == "text" and _TOKENIZER is None:
        _TOKENIZER = BatchTokenizer(REPOSITORY / "text_tokenizer" / "1" / "tokenizer.json", 256)
    elif target == "generation" and _CHAT is None:
        _CHAT = _ChatTokenizer()
    elif target == "image" and not _SEEDS:
        _SEEDS.extend(_seed_images())


TARGETS: dict[str, Callable[[bytes], None]] = {
    "text": text,
    "image": image,
    "generation": generation,
    "sampling": sampling,
    "routing": routing,
    "shapes": shapes,
}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in TARGETS:
        print(
            f"usage: python -m tests.fuzz.targets {{{','.join(TARGETS)}}} [libFuzzer flags]"
            if len(argv) < 2 or argv[1] != "--list"
            else "\n".join(TARGETS)
        )
        return 0 if len(argv) >= 2 and argv[1] == "--list" else 2
    target = TARGETS[argv[1]]
    prepare(argv[1])  # loaded before the first input: libFuzzer's -timeout is per input
    for arg in argv[2:]:
        corpus = Path(arg)
        if not arg.startswith("-") and corpus.is_dir() and not any(corpus.iterdir()):
            for i, data in enumerate(seeds(argv[1])):  # an empty corpus folder gets the seeds
                (corpus / f"seed-{i}").write_bytes(data)
    atheris.Setup([argv[0], *argv[2:]], target)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
