"""Sampling parameters (parsed from the vLLM backend's JSON) and the batched sampler.

Parameters are validated when a request arrives, so one bad request gets its own
INVALID_ARG and never reaches the batch. The sampler then turns one step's logits of all
running sequences into their next tokens in one call, each row with its own settings.

Order of the logits processors follows ``transformers`` ``generate()`` (min new tokens,
repetition penalty, temperature, top-k, top-p), so greedy and seeded outputs can be
checked token for token against it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from contract.errors import ConfigError, InputError
from contract.sampling import FIELD_NAMES, SamplingParams

# One name for the errors of sampling parameters (every path raises InputError).
SamplingParamsError = InputError


def parse_sampling_params(
    source: str | bytes | Mapping | None,
    *,
    max_tokens_limit: int,
    default_max_tokens: int = 16,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """``sampling_parameters`` (a JSON object, as bytes/str, or a dict) as SamplingParams.

    Where the values enter the served interface: unknown names, the default ``max_tokens``
    (``default_max_tokens``; ``null`` asks for the rest of the context, at most the limit) and
    ``max_tokens_limit`` are checked here; SamplingParams checks each value's own rules. A field
    the request leaves out (or sets to null) takes the model's default from ``defaults``
    (:func:`sampling_defaults`), else the field's own.
    """
    if source is None:
        data: Mapping = {}
    elif isinstance(source, Mapping):
        data = source
    else:
        if isinstance(source, bytes):
            try:
                source = source.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError("sampling_parameters", f"is not UTF-8: {exc}") from None
        if not source.strip():
            data = {}
        else:
            try:
                data = json.loads(source)
            except json.JSONDecodeError as exc:
                raise InputError("sampling_parameters", f"is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InputError("sampling_parameters", f"must be a JSON object, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in FIELD_NAMES)
    if unknown:
        raise InputError(unknown[0] or "''", f"unknown sampling parameter (known: {', '.join(FIELD_NAMES)})")
    values = {**(defaults or {}), **{k: v for k, v in data.items() if v is not None or k == "max_tokens"}}
    if "max_tokens" not in values:
        values["max_tokens"] = default_max_tokens
    elif values["max_tokens"] is None:  # vLLM's meaning: as many as the context leaves
        values["max_tokens"] = max_tokens_limit
        values["fit_to_context"] = True
    if isinstance(values["max_tokens"], int) and not isinstance(values["max_tokens"], bool):
        if values["max_tokens"] > max_tokens_limit:
            raise InputError(
                "max_tokens",
                f"must be <= {max_tokens_limit}, got {values['max_tokens']}",
                values={"maximum": max_tokens_limit, "got": values["max_tokens"]},
            )
    return SamplingParams(**values)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-sequence generator of a seeded request; the sequence keeps it for all steps."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def apply_presence_frequency(logits: torch.Tensor, output_ids: Sequence[int], presence: float, frequency: float) -> torch.Tensor:
    """One row, in place, as OpenAI and vLLM define them over the generated tokens: a token
    generated c > 0 times loses ``frequency * c + presence`` from its logit."""
    if len(output_ids) == 0 or (presence == 0.0 and frequency == 0.0):
        return logits
    idx, counts = torch.as_tensor(list(output_ids), dtype=torch.long, device=logits.device).unique(return_counts=True)
    logits[idx] -= frequency * counts.to(logits.dtype) + presence
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """One row, in place: each (token id, bias) added to its logit (ids outside the row are the
    engine's to refuse before this runs)."""
    ids = torch.as_tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
    logits[ids] += torch.as_tensor([v for _, v in bias], dtype=logits.dtype, device=logits.device)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens whose probability is below ``min_p`` times the row's largest;
    ``[B, V]``, ``[B]`` (0 keeps all). The most likely token always stays."""
    probs = torch.softmax(logits, dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * min_p.to(device=logits.device, dtype=probs.dtype)[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, token_ids: Sequence[int], penalty: float) -> torch.Tensor:
    """One row, in place, as transformers does: positive logits / penalty, negative x penalty."""
    if penalty == 1.0 or len(token_ids) == 0:
        return logits
    idx = torch.as_tensor(list(token_ids), dtype=torch.long, device=logits.device).unique()
    picked = logits[idx]
    logits[idx] = torch.where(picked < 0, picked * penalty, picked / penalty)
    return logits


# The nucleus is first looked for among this many most likely tokens (a partial top-k
# instead of sorting the whole vocabulary: far cheaper at 49k tokens); a row whose nucleus
# is wider falls back to the full sort, so the result is exact either way.
_NUCLEUS_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p drop, row by row. ``[B, V]``, ``[B]``, ``[B]``.

    top-k keeps every logit at least as large as the k-th largest (0 keeps all). top-p then
    keeps the smallest set of the most likely tokens whose probability sums to at least p
    (always at least one). Both are thresholds on values, so tokens tied with the last one
    kept are kept too (transformers' TopKLogitsWarper does the same for top-k), and a
    row's result depends on that row alone, never on the batch.
    """
    vocab = logits.shape[-1]
    neg_inf = float("-inf")
    top_k = top_k.to(logits.device)
    top_p = top_p.to(device=logits.device, dtype=torch.float32)
    if bool((top_k > 0).any()):
        k = top_k.clamp(1, vocab)
        # Values only: the k-th largest value does not depend on how many are taken.
        values = torch.topk(logits, int(k[top_k > 0].max()), dim=-1).values
        kth = values.gather(1, (k.clamp_max(values.shape[1]) - 1)[:, None])
        kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, neg_inf))
        logits = logits.masked_fill(logits < kth, neg_inf)
    if not bool((top_p < 1.0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    cand = min(vocab, _NUCLEUS_CANDIDATES)
    if bool((top_k > 0).all()):
        cand = min(cand, int(top_k.max()))  # nothing outside the top k is left anyway
    vals = torch.topk(probs, cand, dim=-1).values  # descending
    cum = torch.cumsum(vals, dim=-1)
    # Keep while the mass before a token has not reached p; the last kept value is the
    # threshold.
    keep_n = ((cum - vals) < top_p[:, None]).sum(-1).clamp_min(1)
    thresh = vals.gather(1, (keep_n - 1)[:, None])
    wide = (cum[:, -1] < top_p) & (top_p < 1.0)
    if cand < vocab and bool(wide.any()):
        rows = wide.nonzero().flatten()
        full = torch.sort(probs[rows], dim=-1, descending=True).values
        full_cum = torch.cumsum(full, dim=-1)
        n = ((full_cum - full) < top_p[rows, None]).sum(-1).clamp_min(1)
        thresh[rows] = full.gather(1, (n - 1)[:, None])
    thresh = torch.where(top_p[:, None] < 1.0, thresh, torch.full_like(thresh, neg_inf))
    return logits.masked_fill(probs < thresh, neg_inf)


class Sampler:
    """Next tokens for one step of the batch: greedy rows by argmax, others sampled.

    Sampling draws one uniform number per row and inverts that row's CDF; a seeded row
    draws it from its own generator, so its tokens are the same alone and in any batch
    (every operation here is row by row, nothing mixes rows).
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()):
        self.eos_token_ids = list(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        token_ids: Sequence[Sequence[int]] | None = None,
        num_generated: Sequence[int] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        allowed: Mapping[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``logits`` [batch, vocab] of each sequence's last position -> token ids [batch].

        ``token_ids[b]`` is the sequence so far (prompt and output: what the repetition
        penalty looks at; its last ``num_generated[b]`` tokens are the output the presence
        and frequency penalties look at), ``num_generated[b]`` how many tokens it has
        produced (EOS and ``stop_token_ids`` are suppressed while that is below ``min_tokens``), ``generators[b]``
        the seeded row's generator from :func:`make_generator`, ``allowed[b]`` a guided row's
        mask of the tokens its guide allows (structured outputs). Order: logit bias, EOS
        suppression, penalties, the guide's mask, then (sampled rows) temperature, min-p, top-k
        and top-p. A guide that allows only EOS wins over ``min_tokens``.
        """
        batch, vocab = logits.shape
        if len(params) != batch:
            raise ValueError(f"{len(params)} params for {batch} rows")
        logits = logits.float().clone()  # processors work in place; FP32 like transformers' output
        for b, p in enumerate(params):
            if p.logit_bias:
                apply_logit_bias(logits[b], p.logit_bias)
            if num_generated is not None and num_generated[b] < p.min_tokens:
                if self.eos_token_ids:
                    logits[b, self.eos_token_ids] = float("-inf")
                if p.stop_token_ids:
                    logits[b, list(p.stop_token_ids)] = float("-inf")
            if token_ids is not None:
                if p.repetition_penalty != 1.0:
                    apply_repetition_penalty(logits[b], token_ids[b], p.repetition_penalty)
                if (p.presence_penalty or p.frequency_penalty) and num_generated is not None and num_generated[b]:
                    output = token_ids[b][len(token_ids[b]) - num_generated[b] :]
                    apply_presence_frequency(logits[b], output, p.presence_penalty, p.frequency_penalty)
        for b, mask in (allowed or {}).items():
            row = logits[b].masked_fill(~mask, float("-inf"))
            if not bool(torch.isfinite(row).any()) and self.eos_token_ids:  # only EOS left, suppressed by min_tokens
                eos = torch.as_tensor(self.eos_token_ids, device=row.device)
                row[eos] = torch.where(mask[eos], 0.0, float("-inf"))
            logits[b] = row

        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        out = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return out
        rows = (~greedy).nonzero().flatten()
        sub = [params[i] for i in rows.tolist()]
        temps = torch.tensor([p.temperature for p in sub], device=logits.device)[:, None]
        scaled = (logits if len(sub) == batch else logits[rows]) / temps
        if any(p.min_p > 0.0 for p in sub):
            scaled = apply_min_p(scaled, torch.tensor([p.min_p for p in sub], device=logits.device))
        if any(p.top_k or p.top_p < 1.0 for p in sub):
            scaled = apply_top_k_top_p(
                scaled,
                torch.tensor([p.top_k for p in sub], device=logits.device),
                torch.tensor([p.top_p for p in sub], device=logits.device),
            )
        probs = torch.softmax(scaled, dim=-1)
        # Inverse-CDF sampling with one uniform number per row: a seeded row takes it from
        # its own generator (cheap, and the same draw whatever the batch), the others
        # share one batched draw.
        u = torch.empty(len(sub), device=logits.device)
        unseeded = []
        for j, i in enumerate(rows.tolist()):
            gen = generators[i] if generators is not None else None
            if gen is None:
                unseeded.append(j)
            else:
                u[j] = torch.rand((), generator=gen, device=gen.device)
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), device=logits.device)
        cdf = torch.cumsum(probs, dim=-1)
        total = cdf[:, -1:]
        # Strictly below the total, so searchsorted lands on a token whose probability is
        # not zero (right=True skips the flat stretches of masked tokens).
        target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        out[rows] = torch.searchsorted(cdf, target, right=True).flatten().clamp_max(vocab - 1)
        return out


# What a model's generation_config.json may say about sampling, as the engine's fields.
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


def sampling_defaults(generation_config: Mapping[str, Any], override: str | None = None) -> dict[str, Any]:
    """The sampling fields a request that leaves them out gets: the model's own
    (``generation_config.json``: temperature, top_p, top_k, repetition_penalty; ``do_sample``
    false is greedy), then the operator's ``override`` (config.pbtxt ``sampling_defaults``, a
    JSON object of sampling fields). Checked at load: ConfigError names the bad field."""
    defaults: dict[str, Any] = {k: generation_config[k] for k in GENERATION_CONFIG_FIELDS if generation_config.get(k) is not None}
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    if override is not None and override.strip():
        try:
            given = json.loads(override)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"sampling_defaults is not valid JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ConfigError("sampling_defaults must be a JSON object of sampling fields")
        defaults.update(given)
    unknown = sorted(k for k in defaults if k not in FIELD_NAMES or k in ("max_tokens", "fit_to_context"))
    if unknown:
        raise ConfigError(f"sampling_defaults: {unknown[0]} is not a sampling field with a model default")
    try:
        SamplingParams(**defaults)
    except InputError as exc:
        raise ConfigError(f"sampling_defaults: {exc}") from None
    return defaults
