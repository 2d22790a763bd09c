"""The request bodies and inputs the load generators send: KServe v2 HTTP bodies (text, token ids, JPEG
images; outputs in Triton's binary extension), the gateway's embeddings body, the checked-in
sentences, chat prompts and sample photos they are made from, and what the drills' mixes draw
from them (``MixInputs``).
"""

from __future__ import annotations

import io
import itertools
import json
import random
import struct
from collections.abc import Sequence

from perf.lib.paths import GENERATION_PROMPTS as PROMPTS
from perf.lib.paths import SENTENCES_16TOK as SENTENCES

VOCAB = (1000, 30000)  # token ids for the encoder's direct inputs (all-MiniLM-L6-v2: 30,522)


def infer_body(inputs: list[dict], binary: bytes = b"", binary_output: bool = True) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 HTTP request; outputs come back in Triton's binary extension (cheap to skip)
    unless ``binary_output`` is False (JSON, to read them)."""
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": binary_output}}).encode()
    headers = {"Content-Type": "application/octet-stream"}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(header))
    return header + binary, headers


def text_request(text: str) -> tuple[bytes, dict[str, str]]:
    return infer_body([{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}])


def token_request(rng: random.Random, length: int = 16) -> tuple[bytes, dict[str, str]]:
    ids = [101] + [rng.randrange(*VOCAB) for _ in range(length - 2)] + [102]
    return infer_body(
        [
            {"name": "input_ids", "shape": [1, length], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, length], "datatype": "INT64", "data": [1] * length},
        ]
    )


def image_request(*blobs: bytes, binary_output: bool = True) -> tuple[bytes, dict[str, str]]:
    """A request of ``len(blobs)`` images ([n, 1] BYTES) in Triton's binary extension."""
    raw = b"".join(struct.pack("<I", len(b)) + b for b in blobs)
    tensor = {"name": "IMAGE", "shape": [len(blobs), 1], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}}
    return infer_body([tensor], raw, binary_output)


def gateway_request(text: str, api_key: str) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"model": "text_embedding", "input": text, "encoding_format": "float"}).encode()
    return body, {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}


def sentences() -> list[str]:
    return [d["TEXT"]["content"][0] for d in json.loads(SENTENCES.read_text())["data"]]


def prompts() -> list[str]:
    doc = json.loads(PROMPTS.read_text(encoding="utf-8"))
    return [e["text"] for e in doc["prompts"] if e["kind"] != "long"]


def photos(count: int = 8) -> list:
    """A few of the bundled sample photos (export.image_data's evaluation set), RGB PIL images."""
    from export.image_data import evaluation_set

    return [s.image for s in evaluation_set()[:count]]


def unique_jpegs(n: int, seed: str, base: Sequence | None = None) -> list[bytes]:
    """``n`` JPEGs, each a sample photo scaled to 256 px with one pixel set from its number:
    no two are alike, so image_preprocess's response cache never answers them."""
    base = list(base or photos())
    scaled = []
    for im in base:
        w, h = im.size
        f = 256 / min(w, h)
        scaled.append(im.resize((max(1, round(w * f)), max(1, round(h * f)))))
    rng = random.Random(seed)
    out = []
    for k in range(n):
        im = scaled[k % len(scaled)].copy()
        im.putpixel((k % 16, (k // 16) % 16), (rng.randrange(256), rng.randrange(256), k % 256))
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


class MixInputs:
    """What a mixed load draws from: a unique text per call (no cache can answer it), a set of
    ``zipf_texts`` texts drawn with Zipf weights (text k: 1 / (k + 1) ** 1.1), ``images`` sample
    photos as image requests (JPEG) and the chat prompts. ``seed`` seeds the draws and marks the texts."""

    def __init__(self, seed: str, zipf_texts: int = 500, images: int = 6):
        self.texts, self.prompts, self.seed = sentences(), prompts(), seed
        self.rng, self.count = random.Random(seed), itertools.count()
        self.zipf = [f"{self.texts[k % len(self.texts)]} (set {k})" for k in range(zipf_texts)]
        self.zipf_cum = list(itertools.accumulate(1 / (k + 1) ** 1.1 for k in range(zipf_texts)))
        self.images = []
        for im in photos(images):
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=90)
            self.images.append(image_request(buf.getvalue()))

    def unique_text(self) -> str:
        n = next(self.count)
        return f"{self.texts[n % len(self.texts)]} ({self.seed}-{n})"

    def zipf_text(self) -> str:
        return self.rng.choices(self.zipf, cum_weights=self.zipf_cum)[0]

    def image(self) -> tuple[bytes, dict[str, str]]:
        return self.rng.choice(self.images)

    def prompt(self) -> str:
        return self.rng.choice(self.prompts)
