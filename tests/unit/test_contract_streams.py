"""Which models' streams can be continued: one rule (contract/streams.py) for the doors and the
gateway, which read it from the same configs in two forms."""

from __future__ import annotations

from contract.streams import ASK_INPUT, PREFIX_INPUT, continuable
from openai_gateway.catalog import Catalog, GenerationModel
from server.frontdoor import model_limits
from server.layout import ROOT
from server.stream_resume import continuable_models

REPOSITORY = ROOT / "model_repository"


def test_the_rule_wants_a_decoupled_model_with_both_inputs_of_their_datatypes():
    both = {ASK_INPUT: "BOOL", PREFIX_INPUT: "INT32", "text_input": "BYTES"}
    assert continuable(True, both)
    assert not continuable(False, both)
    assert not continuable(True, {ASK_INPUT: "BOOL"})
    assert not continuable(True, {**both, PREFIX_INPUT: "INT64"})  # declared, but not as the doors send it
    assert not continuable(True, {**both, ASK_INPUT: "BYTES"})


def test_the_doors_and_the_gateway_agree_on_the_repository():
    doors = continuable_models(model_limits(REPOSITORY))
    catalog = Catalog.from_repository(REPOSITORY)
    gateway = {m.id for m in catalog.models.values() if isinstance(m, GenerationModel) and m.continuable}
    assert "text_generation" in doors
    assert gateway == doors & {m.id for m in catalog.models.values() if isinstance(m, GenerationModel)}
