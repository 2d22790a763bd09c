"""The serving dashboard, kept as code (grafana-foundation-sdk) and rendered to Grafana's JSON.

    python -m deploy.grafana.dashboard render .grafana/dashboards   # make compose-config does this

docker-compose's Grafana provisions the rendered file (deploy/grafana/provisioning/) with the
Prometheus datasource of uid ``DATASOURCE_UID``. What each panel reads:

- Triton's own families (tritonserver 2.51): ``nv_inference_*`` counters per model and version;
  P50/P99 come from its summaries (``nv_inference_*_summary_us{quantile=...}``, on with
  ``--metrics-config=summary_latencies=true``), one per replica: the panels take the worst
  replica (a quantile cannot be summed across replicas);
- the Python steps' custom families (python_backends/): padding fill rate, tokenizer batch
  size, the result cache's L1/L2 lookups, the generation engine's ``llm_*``, the canary
  router's ``canary_encoder_*``;
- the recording rules of deploy/prometheus/rules/serving.rules.yml (names ``level:metric:ops``);
- Prometheus's ``up`` per scrape job (``triton``: every replica's metrics port; ``gateway``).

tests/unit/test_grafana_dashboard.py builds it, checks the JSON and sends every expression
to a real Prometheus. Grafana itself is not run there (docs/dashboards.md).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import (
    bargauge,
    dashboard,
    prometheus,
    stat,
    timeseries,
)
from grafana_foundation_sdk.builders.common import (
    ReduceDataOptions,
    StackingConfig,
    VizLegendOptions,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    GridPos,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
)

UID = "triton-serving"
TITLE = "Triton serving: models, priority classes, caches, generation, canary"
FILE_NAME = f"{UID}.json"
# The provisioned datasource (deploy/grafana/provisioning/datasources/prometheus.yml) has this uid.
DATASOURCE_UID = "prometheus"
DATASOURCE = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)

# The priority classes' entry models (docs/priority-classes.md): text_embedding_cached is the
# default class, the others are named by their suffix.
CLASS_ENTRIES = ("text_embedding_cached", "text_embedding_cached_interactive", "text_embedding_cached_bulk")
CLASS_MODELS = "|".join(CLASS_ENTRIES)
# Every replica's metrics port is one target of the scrape job "triton"; $instance picks some.
TRITON = 'job="triton", instance=~"$instance"'
GRID_WIDTH = 24


def by_class(expr: str) -> str:
    """``expr`` (labelled ``model``) with a ``class`` label: default for text_embedding_cached,
    the suffix for text_embedding_cached_<class>."""
    default = f'label_replace({expr}, "class", "default", "model", "text_embedding_cached")'
    return f'label_replace({default}, "class", "$1", "model", "text_embedding_cached_(.+)")'


def summary_ms(family: str, quantile: str, selector: str) -> str:
    """The worst replica's ``quantile`` of a Triton summary family, in ms, per model."""
    return f'max by (model) ({family}{{{selector}, quantile="{quantile}"}}) / 1000'


def histogram(quantile: float, metric: str, by: str, selector: str = TRITON) -> str:
    return f"histogram_quantile({quantile}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[$__rate_interval])))"


@dataclass
class Query:
    expr: str
    legend: str = ""


@dataclass
class PanelSpec:
    title: str
    queries: list[Query]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | bargauge
    width: int = 8
    height: int = 8
    description: str = ""
    # (value, color) steps above the base (green); e.g. a fill-rate floor in red below 0.6
    thresholds: list[tuple[float, str]] = field(default_factory=list)
    base_color: str = "green"
    stacked: bool = False
    min: float | None = None
    max: float | None = None


@dataclass
class RowSpec:
    title: str
    panels: list[PanelSpec]


def rows() -> list[RowSpec]:
    """Every row and panel of the dashboard, top to bottom."""
    q = Query
    classes = f'model=~"{CLASS_MODELS}", {TRITON}'
    return [
        RowSpec(
            "Replicas",
            [
                PanelSpec(
                    "Triton replicas up",
                    [q('sum(up{job="triton"})', "up"), q('count(up{job="triton"})', "scraped")],
                    kind="stat",
                    width=6,
                    height=5,
                    description="Replicas whose metrics port answered the last scrape, of all configured.",
                ),
                PanelSpec(
                    "Gateway up and Triton ready",
                    [
                        q('sum(up{job="gateway"})', "gateway up"),
                        q('min(gateway_triton_ready{job="gateway"})', "Triton ready (gateway's view)"),
                    ],
                    kind="stat",
                    width=6,
                    height=5,
                ),
                PanelSpec(
                    "Scrape targets",
                    [q('up{job=~"triton|gateway"}', "{{job}} {{instance}}")],
                    width=12,
                    height=5,
                    min=0,
                    max=1,
                    description="1 while a target answers its scrape; a killed replica drops to 0.",
                ),
            ],
        ),
        RowSpec(
            "Requests per model",
            [
                PanelSpec(
                    "Requests/s per model",
                    [q(f"sum by (model) (rate(nv_inference_request_success{{{TRITON}}}[$__rate_interval]))", "{{model}}")],
                    unit="reqps",
                    description="Successful requests per second (Triton counts a Python model's error "
                    "responses as successes: see the canary and gateway panels for errors).",
                ),
                PanelSpec(
                    "Latency P50 / P99 per model (worst replica)",
                    [
                        q(summary_ms("nv_inference_request_summary_us", "0.5", TRITON), "P50 {{model}}"),
                        q(summary_ms("nv_inference_request_summary_us", "0.99", TRITON), "P99 {{model}}"),
                    ],
                    unit="ms",
                    description="Triton's request summaries (summary_latencies=true): its sliding window, "
                    "per replica; the panel shows the worst replica.",
                ),
                PanelSpec(
                    "Mean latency per model",
                    [
                        q(
                            f"sum by (model) (rate(nv_inference_request_duration_us{{{TRITON}}}[$__rate_interval])) / 1000 "
                            f"/ sum by (model) (rate(nv_inference_request_success{{{TRITON}}}[$__rate_interval]))",
                            "{{model}}",
                        )
                    ],
                    unit="ms",
                    description="From the cumulative counters; works without summaries.",
                ),
                PanelSpec(
                    "Failures/s per model and reason",
                    [
                        q(
                            f"sum by (model, reason) (rate(nv_inference_request_failure{{{TRITON}}}[$__rate_interval])) > 0",
                            "{{model}} {{reason}}",
                        )
                    ],
                    unit="reqps",
                ),
                PanelSpec(
                    "Error rate per model (recording rule)",
                    [
                        q("model:nv_inference_error_rate:ratio_rate5m", "{{model}}"),
                        q("job:gateway_requests_5xx:ratio_rate5m", "gateway 5xx"),
                    ],
                    unit="percentunit",
                    thresholds=[(0.01, "red")],
                    description="Failures / all requests over 5 minutes as Triton counts them, "
                    "and the gateway's 5xx share; alerts above 1 %.",
                ),
                PanelSpec(
                    "Gateway requests/s by route and status",
                    [
                        q(
                            'sum by (route, status) (rate(gateway_requests_total{job="gateway"}[$__rate_interval]))',
                            "{{route}} {{status}}",
                        )
                    ],
                    unit="reqps",
                    description="The OpenAI gateway; 503 is a priority class's admission refusing (UNAVAILABLE).",
                ),
            ],
        ),
        RowSpec(
            "Priority classes",
            [
                PanelSpec(
                    "Requests/s per class",
                    [
                        q(
                            by_class(f"sum by (model) (rate(nv_inference_request_success{{{classes}}}[$__rate_interval]))"),
                            "{{class}}",
                        )
                    ],
                    unit="reqps",
                    description="The class entry models: text_embedding_cached (default), _interactive, _bulk.",
                ),
                PanelSpec(
                    "P50 / P99 per class (worst replica)",
                    [
                        q(by_class(summary_ms("nv_inference_request_summary_us", "0.5", classes)), "P50 {{class}}"),
                        q(by_class(summary_ms("nv_inference_request_summary_us", "0.99", classes)), "P99 {{class}}"),
                    ],
                    unit="ms",
                ),
                PanelSpec(
                    "Gateway P50 / P99 by route",
                    [
                        q(histogram(0.5, "gateway_request_duration_seconds", "route", 'job="gateway"'), "P50 {{route}}"),
                        q(histogram(0.99, "gateway_request_duration_seconds", "route", 'job="gateway"'), "P99 {{route}}"),
                    ],
                    unit="s",
                ),
            ],
        ),
        RowSpec(
            "Queues and batches",
            [
                PanelSpec(
                    "Queue time per model",
                    [
                        q("model:nv_inference_queue_time_us:avg_rate1m / 1000", "mean {{model}} (rule)"),
                        q(summary_ms("nv_inference_queue_summary_us", "0.99", TRITON), "P99 {{model}}"),
                    ],
                    unit="ms",
                    description="Mean from the recording rule; P99 from Triton's queue summary (worst replica).",
                ),
                PanelSpec(
                    "Tokenizer batch size (requests per execution)",
                    [
                        q(histogram(0.5, "embedding_tokenizer_batch_size", "model"), "P50 {{model}}"),
                        q(histogram(0.99, "embedding_tokenizer_batch_size", "model"), "P99 {{model}}"),
                        q(
                            f"sum by (model) (rate(nv_inference_count{{{TRITON}}}[$__rate_interval])) "
                            f"/ sum by (model) (rate(nv_inference_exec_count{{{TRITON}}}[$__rate_interval]))",
                            "mean {{model}} (Triton)",
                        ),
                    ],
                ),
                PanelSpec(
                    "Tokenizer batch size distribution",
                    [q(f"sum by (le) (increase(embedding_tokenizer_batch_size_bucket{{{TRITON}}}[$__range]))", "{{le}}")],
                    kind="bargauge",
                    description="Executions with at most `le` requests over the time range (cumulative).",
                ),
                PanelSpec(
                    "Padding fill rate",
                    [
                        q("job:embedding_padding_fill_rate:ratio_rate5m", "{{model}} (5 min, rule)"),
                        q(
                            f"sum by (model) (rate(embedding_padding_real_tokens_total{{{TRITON}}}[$__rate_interval])) "
                            f"/ sum by (model) (rate(embedding_padding_padded_tokens_total{{{TRITON}}}[$__rate_interval]))",
                            "{{model}}",
                        ),
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    thresholds=[(0.6, "green")],
                    base_color="red",
                    width=12,
                    description="Real tokens / padded tokens sent to the encoder; alert below 60 % for 5 minutes.",
                ),
                PanelSpec(
                    "Compute time per execution",
                    [
                        q(
                            f"sum by (model) (rate(nv_inference_compute_infer_duration_us{{{TRITON}}}[$__rate_interval])) / 1000 "
                            f"/ sum by (model) (rate(nv_inference_exec_count{{{TRITON}}}[$__rate_interval]))",
                            "{{model}}",
                        )
                    ],
                    unit="ms",
                    width=12,
                ),
            ],
        ),
        RowSpec(
            "Caches",
            [
                PanelSpec(
                    "Result cache hit rate per level",
                    [
                        q(
                            f'sum by (level) (rate(embedding_cache_lookups_total{{{TRITON}, result="hit"}}[$__rate_interval])) '
                            f"/ sum by (level) (rate(embedding_cache_lookups_total{{{TRITON}}}[$__rate_interval]))",
                            "{{level}}",
                        )
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    description="text_embedding_cached's L1 (per instance) and L2 (Redis, shared by the replicas).",
                ),
                PanelSpec(
                    "Texts computed by the model (misses)/s",
                    [q(f"sum by (model) (rate(embedding_cache_model_texts_total{{{TRITON}}}[$__rate_interval]))", "{{model}}")],
                    unit="short",
                ),
                PanelSpec(
                    "Redis (L2) errors/s and health",
                    [
                        q(f"sum by (kind) (rate(embedding_cache_redis_errors_total{{{TRITON}}}[$__rate_interval]))", "{{kind}}"),
                        q(f"min(embedding_cache_redis_up{{{TRITON}}})", "redis up (min over instances)"),
                    ],
                ),
                PanelSpec(
                    "Triton response cache hit rate",
                    [
                        q(
                            f"sum by (model) (rate(nv_cache_num_hits_per_model{{{TRITON}}}[$__rate_interval])) / "
                            f"(sum by (model) (rate(nv_cache_num_hits_per_model{{{TRITON}}}[$__rate_interval])) + "
                            f"sum by (model) (rate(nv_cache_num_misses_per_model{{{TRITON}}}[$__rate_interval])))",
                            "{{model}}",
                        )
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                ),
                PanelSpec(
                    "L1 bytes per replica",
                    [q(f"sum by (instance) (embedding_cache_l1_bytes{{{TRITON}}})", "{{instance}}")],
                    unit="bytes",
                    width=12,
                ),
            ],
        ),
        RowSpec(
            "Generation (text_generation)",
            [
                PanelSpec(
                    "KV cache blocks used / total",
                    [
                        q(f"sum by (instance) (llm_kv_cache_blocks_used{{{TRITON}}})", "used {{instance}}"),
                        q(f"sum by (instance) (llm_kv_cache_blocks_total{{{TRITON}}})", "total {{instance}}"),
                    ],
                ),
                PanelSpec(
                    "KV cache usage",
                    [q(f"max(instance:llm_kv_cache_usage:ratio{{{TRITON}}})", "worst replica")],
                    unit="percentunit",
                    kind="stat",
                    min=0,
                    max=1,
                    thresholds=[(0.9, "red")],
                    description="Alert above 90 %.",
                ),
                PanelSpec(
                    "Time to first token P50 / P99",
                    [
                        q(histogram(0.5, "llm_time_to_first_token_seconds", "model"), "P50 {{model}}"),
                        q(histogram(0.99, "llm_time_to_first_token_seconds", "model"), "P99 {{model}}"),
                        q(
                            histogram(0.99, "gateway_time_to_first_token_seconds", "model", 'job="gateway"'),
                            "P99 gateway {{model}}",
                        ),
                    ],
                    unit="s",
                ),
                PanelSpec(
                    "Tokens/s",
                    [
                        q(
                            f"sum by (model) (rate(llm_generation_tokens_total{{{TRITON}}}[$__rate_interval]))",
                            "generated {{model}}",
                        ),
                        q(f"sum by (model) (rate(llm_prompt_tokens_total{{{TRITON}}}[$__rate_interval]))", "prompt {{model}}"),
                    ],
                    width=12,
                ),
                PanelSpec(
                    "Running / waiting sequences",
                    [
                        q(f"sum(llm_num_requests_running{{{TRITON}}})", "running"),
                        q(f"sum(llm_num_requests_waiting{{{TRITON}}})", "waiting"),
                    ],
                    width=12,
                ),
            ],
        ),
        RowSpec(
            "Canary (text_encoder_router, during a rollout)",
            [
                PanelSpec(
                    "Canary split (share of requests per encoder version)",
                    [
                        q(
                            f"sum by (version) (rate(canary_encoder_calls_total{{{TRITON}}}[$__rate_interval])) "
                            f"/ ignoring (version) group_left sum(rate(canary_encoder_calls_total{{{TRITON}}}[$__rate_interval]))",
                            "version {{version}}",
                        )
                    ],
                    unit="percentunit",
                    stacked=True,
                    min=0,
                    max=1,
                    description="The router's calls per text_encoder version; no data outside a rollout.",
                ),
                PanelSpec(
                    "Canary error rate per version",
                    [q("version:canary_encoder_error_rate:ratio_rate2m", "version {{version}}")],
                    unit="percentunit",
                    thresholds=[(0.01, "red")],
                    description="Errors / (ok + error) over 2 minutes, as ops.rollout judges a canary (refused inputs "
                    "are not the version's fault).",
                ),
                PanelSpec(
                    "Canary call P99 per version",
                    [q(histogram(0.99, "canary_encoder_call_ms", "version"), "version {{version}}")],
                    unit="ms",
                ),
            ],
        ),
    ]


def _thresholds(spec: PanelSpec) -> dashboard.ThresholdsConfig:
    steps = [Threshold(value=None, color=spec.base_color)] + [Threshold(value=v, color=c) for v, c in spec.thresholds]
    return dashboard.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps)


def _panel(spec: PanelSpec, panel_id: int, pos: GridPos):
    builder = {"timeseries": timeseries.Panel, "stat": stat.Panel, "bargauge": bargauge.Panel}[spec.kind]()
    builder = (
        builder.id(panel_id).title(spec.title).datasource(DATASOURCE).unit(spec.unit).grid_pos(pos).thresholds(_thresholds(spec))
    )
    if spec.description:
        builder = builder.description(spec.description)
    if spec.min is not None:
        builder = builder.min(spec.min)
    if spec.max is not None:
        builder = builder.max(spec.max)
    if spec.kind == "timeseries":
        builder = builder.fill_opacity(10).legend(
            VizLegendOptions()
            .show_legend(True)
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
        )
        if spec.stacked:
            builder = builder.stacking(StackingConfig().mode(common.StackingMode.NORMAL))
    else:  # one value per series: the last one
        builder = builder.reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    for i, query in enumerate(spec.queries):
        target = prometheus.Dataquery().expr(query.expr).legend_format(query.legend or "__auto").ref_id(chr(ord("A") + i))
        if spec.kind in ("stat", "bargauge"):
            target = target.instant()
        builder = builder.with_target(target)
    return builder


def build() -> dashboard.Dashboard:
    """The dashboard builder: rows of panels laid out left to right, wrapping at the grid's width."""
    instance = (
        dashboard.QueryVariable("instance")
        .label("Triton replica")
        .datasource(DATASOURCE)
        .query('label_values(up{job="triton"}, instance)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(VariableOption(selected=True, text="All", value="$__all"))
    )
    board = (
        dashboard.Dashboard(TITLE)
        .uid(UID)
        .tags(["triton", "serving"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(instance)
    )
    next_id, y = 1, 0
    for row in rows():
        board = board.with_row(dashboard.Row(row.title).id(next_id).grid_pos(GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
        next_id, y = next_id + 1, y + 1
        x, row_height = 0, 0
        for spec in row.panels:
            if x + spec.width > GRID_WIDTH:
                x, y, row_height = 0, y + row_height, 0
            board = board.with_panel(_panel(spec, next_id, GridPos(h=spec.height, w=spec.width, x=x, y=y)))
            next_id, x, row_height = next_id + 1, x + spec.width, max(row_height, spec.height)
        y += row_height
    return board


def to_json(board: dashboard.Dashboard | None = None) -> dict:
    """The dashboard as Grafana's JSON model (a dict)."""
    return json.loads(JSONEncoder(sort_keys=True).encode((board or build()).build()))


def render(out: Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / FILE_NAME
    path.write_text(json.dumps(to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.grafana.dashboard", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help=f"write {FILE_NAME} into OUT (the folder Grafana's dashboard provider reads)")
    r.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    path = render(args.out)
    panels = sum(len(row.panels) for row in rows())
    print(f"dashboard: wrote {path} ({panels} panels in {len(rows())} rows, uid {UID})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
