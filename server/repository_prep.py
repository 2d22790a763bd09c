"""The model repository made ready to serve, once before a tritonserver starts.

The launcher (`python -m server`) and serve-cluster call these before they start anything:

- ``export_missing``: export what the repository lacks (`python -m export --no-speed`);
- ``resolve_precision``: the precision variant (``--model-config-name``) every served model
  that has variants will load (export/variants.py);
- ``prepare``: the priority-class lanes rendered from their models' current configs and
  versions (export/lanes.py), pinned to a rollout's most-weighted version while one runs, and
  the rollout state's load plan (ops/rollout.py): which models tritonserver must not load at
  start, because they are loaded through the repository API with the state's versions and
  weights once it is up (``Prepared.load_deferred``).

serve-cluster prepares again before each replica (re)start: the rollout state may have moved
on since the cluster started, and a restarted replica loads what it says now.

A container's repository is mounted read-only: there the lanes cannot be rendered in place. When the
files on the mount are not what a rollout's pin needs (a replica restarted mid-rollout), the pinned
lanes are loaded through the repository API instead, with the rendered config as an override, after
the encoder and before the models that reach them; a repository whose lanes were never rendered
(no `make export` on the host) is refused with what to run.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from server.models import closure, variant_models, with_dependencies

if TYPE_CHECKING:
    from ops.load_plan import LoadPlan


def export_missing(repository: Path) -> bool:
    """Export what ``repository`` lacks (no speed measurements); False when the export failed."""
    from export import __main__ as export_main

    return export_main.main(["--repository", str(repository), "--no-speed"]) == 0


def resolve_precision(
    repository: Path, models: Sequence[str], precision: str, tritonserver_home: Path | None = None
) -> tuple[str | None, dict[str, str]]:
    """(``--model-config-name``, {model: variant}) for ``precision`` over the models ``models``
    reach that have variants; ValueError when a model cannot serve it. A trt_plan variant needs
    the TensorRT backend: an installed tritonserver that has it (NVIDIA's container), not the wheel."""
    from export import variants

    tensorrt = tritonserver_home is not None and (tritonserver_home / "backends" / "tensorrt").is_dir()
    loadable = tuple(name for name in variants.VARIANTS if tensorrt or name != "trt_plan")
    return variants.resolve_precision(repository, variant_models(repository, models), precision, loadable=loadable)


def rollout_plan(rollout_state: Path | None):
    """The rollout state's load plan (ops.load_plan.LoadPlan), or None without a state file."""
    if rollout_state is None or not Path(rollout_state).is_file():
        return None
    from ops.load_plan import load_plan

    return load_plan(Path(rollout_state))


def deferred_models(repository: Path, models: Sequence[str], plan, pinned_lanes: Sequence[str] = ()) -> list[str]:
    """Models loaded through the repository API after start, in order: the rollout plan's
    encoder (its versions), the router (its weights) when the plan puts it in front of
    text_embedding or a requested model reaches it, the lanes pinned by an override (a read-only
    repository) that a requested model reaches, then the requested models that reach any of
    them (text_embedding in the form the plan calls for). None without a plan."""
    if plan is None:
        return []
    wanted = with_dependencies(repository, models)
    reached = {m for model in wanted for m in closure(repository, model)}
    first = [plan.encoder] + ([plan.router] if plan.routed or plan.router in reached else [])
    first += [lane for lane in pinned_lanes if lane in reached]
    out = list(first)
    for model in wanted:
        if model not in first and set(first) & set(closure(repository, model)):
            out.append(model)
    return out


@dataclass(frozen=True)
class Prepared:
    """A repository ready for one tritonserver start: what to leave out of ``--load-model``
    (``deferred``) and how to load it once the server is up (``load_deferred``)."""

    repository: Path
    rollout_state: Path | None = None
    plan: LoadPlan | None = None
    deferred: tuple[str, ...] = field(default_factory=tuple)
    # lane -> the version it is pinned to through an override (a read-only repository; above)
    lane_pins: Mapping[str, int] = field(default_factory=dict)

    def load_deferred(self, triton_http_url: str, token: str = "", config_name: str | None = None) -> None:
        """Load the deferred models with the plan's overrides, in order (each load returns when
        that model is ready)."""
        if self.plan is None:
            return
        from ops.repository import RepositoryClient

        client = RepositoryClient(triton_http_url, token=token)
        for model in self.deferred:
            if model in self.lane_pins:
                client.load(model, pinned_lane_config(self.repository, model, self.lane_pins[model], config_name))
            else:
                client.load(model, self.plan.override(model, self.repository, config_name))


class RepositoryNotWritable(ValueError):
    """The repository is read-only and its lanes are not rendered as this start needs them."""


def pinned_lane_config(repository: Path, lane_name: str, version: int, config_name: str | None = None) -> dict:
    """The lane's config pinned to ``version``, rendered from its model's config (the variant
    ``config_name`` picks, as tritonserver would), in Triton's JSON form for a load override."""
    from export.lanes import render_config, repository_lanes
    from ops.configs import config_from_text, config_path

    (lane,) = [lane for lane in repository_lanes(repository) if lane.name == lane_name]
    source = config_path(repository, lane.model, config_name)
    rendered = render_config(source.read_text(encoding="utf-8"), lane, version)
    return config_from_text(rendered, lane.name)


def prepare(repository: Path, models: Sequence[str], rollout_state: Path | None = None) -> Prepared:
    """Render the priority-class lanes and read the rollout state for a start of ``models``."""
    from export.lanes import render_all

    plan = rollout_plan(rollout_state)
    # Lanes follow their model's current config and versions; while a rollout runs they serve
    # its most-weighted version, not the canary.
    pins = {plan.encoder: max(plan.weights, key=plan.weights.get)} if plan is not None and plan.weights else None
    lane_pins: dict[str, int] = {}
    try:
        render_all(repository, pins)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        try:  # the files as they are, unpinned: are they what the host rendered?
            render_all(repository)
        except OSError as unpinned:
            if unpinned.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise RepositoryNotWritable(
                f"{repository} is read-only ({exc.strerror}) and its priority-class lanes are not rendered from its "
                f"models' current configs (never rendered, or pinned to a rollout's version by a server that wrote "
                f"there): run `python -m export.lanes` (or `make export`) where it is writable"
            ) from None
        from export.lanes import repository_lanes

        lane_pins = {lane.name: pins[lane.model] for lane in repository_lanes(repository) if pins and lane.model in pins}
    deferred = deferred_models(repository, models, plan, tuple(lane_pins))
    return Prepared(Path(repository), rollout_state, plan, tuple(deferred), lane_pins)
