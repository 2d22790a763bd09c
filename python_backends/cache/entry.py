"""The cached entry model (``text_embedding_cached`` and its priority-class entries) without Triton.

``CachedEntry`` reads and checks the entry's config at load: the class it serves, its
admission into the class's lane, the cache levels. ``embed`` serves one batch: keys for the
encoder identity that serves now, L1 and L2 lookups, ONE call of ``compute`` (the shim's BLS
call to the target model) for the misses, admitted into the lane, and each request's rows:
its vectors and each text's token count. A cache entry holds both: the vector's ``dim``
float32 values, then the token count as one more float32 (exact below 2**24). See
docs/result-cache.md and docs/priority-classes.md.

Truncation (contract/truncation.py, docs/embeddings.md#truncation): a text over the
limit is refused unless its request asked to truncate it. Left truncation gives another vector,
so it has keys of its own; right truncation and none share keys (a text that fits gets the same
vector either way), so a refusing request that hits an entry whose count is over the limit is
refused from the cache. Misses go to the model truncated only where some request in the batch
asked for it; a refused text is not embedded: the tokenizer step's error names it (data: its
index, tokens and limit), that text is set aside and the other misses are sent again.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from contract.errors import CONTEXT_LENGTH, ConfigError, RequestError
from contract.model_config import ModelConfig
from contract.truncation import REFUSE, ContextLengthError, Truncation, refuse_over_limit
from python_backends.admission.classes import check_request_class, class_named
from python_backends.admission.controller import Admission
from python_backends.admission.inflight import SharedInflight, default_directory
from python_backends.cache.identity import IdentityResolver
from python_backends.cache.keys import KeyMaker
from python_backends.cache.lru import LRUCache
from python_backends.cache.redis_l2 import RedisL2
from python_backends.cache.settings import CacheSettings
from python_backends.cache.tiered import EmbeddingCache

log = logging.getLogger(__name__)

# texts and each one's Truncation -> their vectors [len(texts), dim] and token counts [len(texts)],
# from the target model in one call (a text over the limit that may not be truncated: ContextLengthError's data)
ComputeFn = Callable[[list, list], tuple[np.ndarray, np.ndarray]]
_PARAMETER = re.compile(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


def tokenizer_config(repository: Path, tokenizer: str) -> ModelConfig:
    """The tokenizer step's config.pbtxt parameters (their one source), read as ModelConfig reads
    them: its ``max_sequence_length``, the limit a refusing request's cached count is checked
    against, and its ``truncate``, what a request that leaves TRUNCATE out gets."""
    path = Path(repository) / tokenizer / "config.pbtxt"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {tokenizer}'s config: {exc}") from None
    config = ModelConfig({"name": tokenizer, "parameters": {k: {"string_value": v} for k, v in _PARAMETER.findall(text)}})
    if config.param("max_sequence_length") is None:
        raise ConfigError(f"{path} has no max_sequence_length parameter")
    return config


Rows = tuple[np.ndarray, np.ndarray]  # one request's vectors [n, dim] float32 and token counts [n] int32


def pack(vectors: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Cache entries [n, dim + 1]: each vector, then its text's token count."""
    counts = np.asarray(counts).reshape(-1)
    if len(counts) != len(vectors):
        raise ValueError(f"the model returned {len(counts)} token counts for {len(vectors)} vectors")
    return np.concatenate([np.asarray(vectors, dtype=np.float32), counts.astype(np.float32)[:, None]], axis=1)


def unpack(entries: np.ndarray) -> Rows:
    """(vectors, token counts) of cache entries [n, dim + 1]."""
    return entries[:, :-1], entries[:, -1].astype(np.int32)


class CachedEntry:
    """One instance's cache, admission and identity; ``compute`` is called only for misses
    (or for every text while no single encoder version serves)."""

    def __init__(
        self,
        config: ModelConfig,
        repository: Path,
        is_ready: Callable[[str, str], bool],
        compute: ComputeFn,
        environ: Mapping[str, str] = os.environ,
        admission_dir: Path | None = None,
    ):
        self.text = config.require("input", "TEXT", "TYPE_STRING", (1,)).name
        config.require("input", "TRUNCATE", "TYPE_BOOL", (1,))
        config.require("input", "TRUNCATION_DIRECTION", "TYPE_STRING", (1,))
        out = config.require("output", "EMBEDDING", "TYPE_FP32")
        if len(out.dims) != 1 or out.dims[0] < 1:
            raise ValueError(f"output EMBEDDING must have dims [d], config says {list(out.dims)}")
        self.dim = out.dims[0]
        config.require("output", "NUM_TOKENS", "TYPE_INT32", (1,))
        self.target = config.param("target_model", "text_embedding")
        self.max_text_bytes = config.param_int("max_text_bytes", 65536, minimum=1)
        self.cls = class_named(config.param("priority_class", "default"), "parameter priority_class")
        limit = config.param_int("admission_rows", 128, minimum=1)
        inflight = SharedInflight(admission_dir or default_directory(), self.cls.name, limit)
        self.admission = Admission(self.cls, inflight)
        # A flood is refused only while an instance is free to refuse it: the instances that
        # can wait in the lane with full batches must hold more than the limit.
        if limit > (config.instance_count() - 1) * max(1, config.max_batch_size):
            log.warning(
                "%s: admission_rows %d >= (instances - 1) x max_batch_size: "
                "a flood queues instead of being refused (docs/priority-classes.md)",
                config.name,
                limit,
            )
        settings = CacheSettings.from_config(config, environ)
        encoder = config.param("encoder_model", "text_encoder")
        tokenizer = config.param("tokenizer_model", "text_tokenizer")
        tokenizer_params = tokenizer_config(Path(repository), tokenizer)
        self.max_tokens = tokenizer_params.param_int("max_sequence_length", 0, minimum=1)
        self.truncate = tokenizer_params.param_bool("truncate", False)  # TRUNCATE when a request leaves it out
        self.resolver = IdentityResolver(Path(repository), self.target, encoder, None, is_ready)
        l1 = LRUCache(settings.l1_max_bytes, settings.l1_ttl_s)
        l2 = None
        if settings.l2_redis_url:
            l2 = RedisL2(
                settings.l2_redis_url,
                self.dim + 1,
                settings.l2_ttl_s,
                settings.l2_timeout_s,
                settings.l2_retry_interval_s,
                settings.warn_interval_s,
            )
        self.cache = EmbeddingCache(self.dim + 1, l1, l2)  # entries: pack()
        self.compute = compute
        self.metrics: Any = None
        self._keys: KeyMaker | None = None

    def use_metrics(self, metrics: Any) -> None:
        """Report to ``metrics`` (a cache.triton_metrics.CacheMetrics) from now on."""
        self.metrics = metrics
        metrics.sync(self.cache.l1, self.cache.l2)

    def check_class(self, parameters: str | dict | None) -> None:
        """InputError for a request naming another class (the entry that serves it is named)."""
        check_request_class(parameters, self.cls)

    def key_maker(self, version: str | None = None) -> KeyMaker | None:
        """The one place the key's model identity comes from (``version``: a caller's choice);
        None while no single version serves (the cache is then bypassed)."""
        identity = self.resolver.identity(version)
        if identity is None:
            return None
        if self._keys is None or self._keys.identity != identity:
            self._keys = KeyMaker(identity)
        return self._keys

    def _compute(self, texts: list, options: list) -> tuple[np.ndarray, dict[int, int], BaseException | None]:
        """Cache entries of ``texts`` (pack()) from admitted calls of ``compute``, each text
        truncated as ``options`` says. Returns (entries of the texts embedded, {index: tokens} of
        those refused as over the limit, the failure that left others without entries, or
        None). The entries' rows follow ``texts`` without the refused ones and, after a
        failure, are empty."""
        refused: dict[int, int] = {}
        todo = list(range(len(texts)))
        while todo:
            try:
                with self.admission.rows(len(todo)):
                    vectors, counts = self.compute([texts[i] for i in todo], [options[i] for i in todo])
            except RequestError as exc:
                index = exc.values.get("index") if exc.code == CONTEXT_LENGTH else None
                if not isinstance(index, int) or not 0 <= index < len(todo):
                    return np.empty((0, self.dim + 1), np.float32), refused, exc
                # The tokenizer refused one text (the first over the limit): set it aside, send the rest.
                refused[todo.pop(index)] = int(exc.values.get("tokens", self.max_tokens + 1))
                continue
            except Exception as exc:
                return np.empty((0, self.dim + 1), np.float32), refused, exc
            return pack(vectors, counts), refused, None
        return np.empty((0, self.dim + 1), np.float32), refused, None

    def _rows(self, entries: np.ndarray | None, options: Sequence[Truncation]) -> Rows | BaseException:
        """One request's rows from its entries (None: some text has none), or its refusal: the
        first text over the limit that it did not allow to be truncated (counts in the entries)."""
        if entries is None:
            return RuntimeError("no embedding was produced")
        vectors, counts = unpack(entries)
        return refuse_over_limit(counts, options, self.max_tokens, self.text) or (vectors, counts)

    def embed(
        self, batch: Sequence[Sequence[str]], options: Sequence[Sequence[Truncation]] | None = None
    ) -> list[Rows | BaseException]:
        """For each request's texts in ``batch`` (truncated as that request's ``options`` say;
        default: refused when over the limit), their (vectors [len(texts), dim], token counts
        [len(texts)]) or the exception that failed them. A request answered entirely from cache
        succeeds even when the model call failed."""
        if not batch:
            return []
        if options is None:
            options = [[REFUSE] * len(request) for request in batch]
        texts = [text for request in batch for text in request]
        flat = [option for request in options for option in request]
        spans, start = [], 0
        for request in batch:
            spans.append((start, start + len(request)))
            start += len(request)
        keys = self.key_maker()
        if keys is None:  # no single encoder version serves: no identity, no cache; the model answers
            entries, refused, error = self._compute(texts, flat)
            rows: list[np.ndarray | None] = [None] * len(texts)
            if error is None:
                for row, i in enumerate(i for i in range(len(texts)) if i not in refused):
                    rows[i] = entries[row]
            return [self._request(rows, refused, flat, a, b, error) for a, b in spans]

        text_keys = [keys(t, left=o.left) for t, o in zip(texts, flat)]
        plan = self.cache.plan(texts, text_keys)
        failure: BaseException | None = None
        refused_keys: dict[str, int] = {}
        if plan.miss_texts:
            # A key shared by a refusing and a truncating request is computed truncated (the
            # refusing one is then refused by its count).
            wants: dict[str, Truncation] = {}
            for key, option in zip(text_keys, flat):
                if key in plan.found or (key in wants and wants[key].truncate):
                    continue
                wants[key] = option
            miss_options = [wants[k] for k in plan.miss_keys]
            entries, refused, failure = self._compute(plan.miss_texts, miss_options)
            refused_keys = {plan.miss_keys[i]: n for i, n in refused.items()}
            if failure is None and len(entries):
                # Written back only if the identity did not change during the call (a hot swap
                # in between could have computed them with the new model under the old keys).
                after = self.key_maker()
                done = [k for k in plan.miss_keys if k not in refused_keys]
                self.cache.fill(plan, entries, store=after is not None and after.identity == keys.identity, keys=done)
                if self.metrics is not None:
                    self.metrics.model_computed(len(done))
        if self.metrics is not None:
            self.metrics.record(plan.counts, self.cache.l1, self.cache.l2)
        full = [plan.found.get(k) for k in text_keys]
        refused_rows = {i: refused_keys[k] for i, k in enumerate(text_keys) if k in refused_keys}
        return [self._request(full, refused_rows, flat, a, b, failure) for a, b in spans]

    def _request(
        self,
        full: list,
        refused: dict[int, int],
        options: Sequence[Truncation],
        start: int,
        stop: int,
        failure: BaseException | None,
    ) -> Rows | BaseException:
        """The result of the request of texts[start:stop]: its refusal (a text the model refused,
        or one over the limit in its entries), its rows, or the failure that left it without."""
        for i in range(start, stop):
            if i in refused and not options[i].truncate:
                return ContextLengthError(self.text, i - start, refused[i], self.max_tokens)
        if any(full[i] is None for i in range(start, stop)):
            return failure or RuntimeError("no embedding was produced")
        return self._rows(np.stack(full[start:stop]), options[start:stop])

    def close(self) -> None:
        if self.cache.l2 is not None:
            self.cache.l2.close()
