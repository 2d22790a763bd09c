"""What a (re)started server loads from the rollout's state file (ops/rollout.py writes it): the
encoder's versions, the router's weights and text_embedding's form, as config overrides
through the repository API. server/repository_prep.py applies it before a server takes traffic."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ops.configs import config_from_disk
from ops.repository import AnyRepositoryClient
from ops.rollout import ENTRY, RolloutState, encoder_config, router_config
from python_backends.routing.ensemble import routed_form


@dataclass(frozen=True)
class LoadPlan:
    """What a (re)started server loads from a state file: the encoder's versions, the weights
    and text_embedding's form (``routed``: the router in front, as during a rollout)."""

    encoder: str
    router: str
    versions: tuple
    weights: dict
    entry: str = ENTRY
    routed: bool = False
    repository: Path | None = None
    config_name: str | None = None

    def overridden(self) -> list[str]:
        """The models this plan loads with a config override, in load order (the router only in
        the routed form: in the direct form it is off the request path and not loaded)."""
        return [self.encoder, self.router, self.entry] if self.routed else [self.encoder]

    def override(self, model: str, repository: Path | None = None, config_name: str | None = None) -> dict | None:
        """The config override ``model`` is loaded with under this plan; None: its own config."""
        repo = repository or self.repository
        name = config_name if config_name is not None else self.config_name

        def on_disk(which: str) -> dict:
            assert repo is not None, "LoadPlan.override: no repository given and none set on the plan"
            return config_from_disk(repo, which, name)

        if model == self.encoder:
            return encoder_config(on_disk(self.encoder), list(self.versions))
        if model == self.router:  # also when a user asked for it in the direct form
            return router_config(on_disk(self.router), self.weights)
        if model == self.entry and self.routed:
            return routed_form(on_disk(self.entry), self.encoder, self.router)
        return None

    def apply(self, client: AnyRepositoryClient, repository: Path | None = None, config_name: str | None = None) -> None:
        """Load the overridden models (encoder first, then router and the routed entry)."""
        for model in self.overridden():
            client.load(model, self.override(model, repository, config_name))


def load_plan(path: Path) -> LoadPlan | None:
    state = RolloutState.load(path)
    if state is None:
        return None
    return LoadPlan(state.encoder, state.router, tuple(state.loaded), dict(state.weights), state.entry, state.routed())
