"""The two forms of the text_embedding ensemble: direct (steady state) and routed (a rollout).

- **direct**: ``text_tokenizer -> text_encoder``; what ``model_repository/text_embedding/config.pbtxt``
  says. One version is loaded and serves everything; no Python hop after the tokenizer. The
  ensemble's outputs: ``EMBEDDING`` only (which version computed it is the one ready version of
  the encoder: ``GET /v2/models/text_encoder`` lists it).
- **routed**: ``text_tokenizer -> text_encoder_router -> text_encoder`` (BLS). The router's
  weights choose the version per request and it adds the output ``ENCODER_VERSION``.

The rollout command (ops/rollout.py) puts the routed form in front before it loads a new
version and the direct form back once one version serves everything; the launcher
(server/process.py) loads the form the rollout state calls for. Both go through a config
override of the repository API, built here from a config in Triton's JSON form (the served
config, or ``config.pbtxt`` parsed): the encoder's step and the router's step have the same
inputs (``input_ids``, ``attention_mask``) and embedding output (``sentence_embedding``), so
a form differs from the other only in the step's model, the router's extra output and the
ensemble output it feeds. Pure functions, no Triton import.
"""

from __future__ import annotations

import copy

from contract.errors import ConfigError

DIRECT = "direct"
ROUTED = "routed"
# The router's output and the ensemble output it becomes in the routed form.
ROUTER_VERSION_OUTPUT = "encoder_version"
VERSION_OUTPUT = "ENCODER_VERSION"


def _steps(config: dict) -> list:
    return (config.get("ensemble_scheduling") or {}).get("step") or []


def _step_index(config: dict, model: str) -> int | None:
    for i, step in enumerate(_steps(config)):
        if step.get("model_name") == model:
            return i
    return None


def form_of(config: dict, encoder: str = "text_encoder", router: str = "text_encoder_router") -> str:
    """DIRECT or ROUTED; ConfigError when neither the encoder nor the router is a step."""
    if _step_index(config, router) is not None:
        return ROUTED
    if _step_index(config, encoder) is not None:
        return DIRECT
    raise ConfigError(f"model {config.get('name', '?')!r}: no ensemble step is {encoder!r} or {router!r}")


def routed_form(config: dict, encoder: str = "text_encoder", router: str = "text_encoder_router") -> dict:
    """``config`` with the router as the encoder's step and the output ENCODER_VERSION (a copy;
    an already routed config comes back unchanged)."""
    out = copy.deepcopy(config)
    if form_of(out, encoder, router) == ROUTED:
        return out
    index = _step_index(out, encoder)
    assert index is not None  # form_of found it
    step = _steps(out)[index]
    step["model_name"] = router
    # The router serves the version its weights choose; its own version is the newest loaded.
    step["model_version"] = -1
    step.setdefault("output_map", {})[ROUTER_VERSION_OUTPUT] = VERSION_OUTPUT
    outputs = out.setdefault("output", [])
    if not any(o.get("name") == VERSION_OUTPUT for o in outputs):
        outputs.append({"name": VERSION_OUTPUT, "data_type": "TYPE_INT32", "dims": [1]})
    return out


def direct_form(config: dict, encoder: str = "text_encoder", router: str = "text_encoder_router") -> dict:
    """``config`` with the encoder itself as the step (newest loaded version: ``model_version``
    -1) and no ENCODER_VERSION (a copy; an already direct config comes back unchanged)."""
    out = copy.deepcopy(config)
    if form_of(out, encoder, router) == DIRECT:
        return out
    index = _step_index(out, router)
    assert index is not None  # form_of found it
    step = _steps(out)[index]
    step["model_name"] = encoder
    step["model_version"] = -1
    step["output_map"] = {k: v for k, v in (step.get("output_map") or {}).items() if k != ROUTER_VERSION_OUTPUT}
    out["output"] = [o for o in out.get("output") or [] if o.get("name") != VERSION_OUTPUT]
    return out


def describe_form(form: str, encoder: str = "text_encoder", router: str = "text_encoder_router") -> str:
    return (
        f"tokenizer -> {router} -> {encoder} (BLS; ENCODER_VERSION)"
        if form == ROUTED
        else f"tokenizer -> {encoder} (one version; no router)"
    )
