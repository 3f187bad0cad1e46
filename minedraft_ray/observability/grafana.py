"""The minedraft Grafana dashboard, built in code with grafana-foundation-sdk, and `minedraft grafana push`.

    python -m minedraft_ray.observability.grafana > deployments/grafana/minedraft-dashboard.json
    minedraft grafana push --url http://grafana:3000 --token $GRAFANA_TOKEN --folder MineDraft

The dashboard is the classic (v1) JSON model: what `POST /api/dashboards/db` takes and what Ray's own
generated dashboards use. Every query reads a `ray_minedraft_*` series of `metrics.SERIES` and filters
by the `$model`, `$mode` and `$replica` variables; `$datasource` picks the Prometheus data source.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

with warnings.catch_warnings():
    # the v1 dashboard builder warns "prefer dashboardv2" when imported; v2 needs Grafana 12's /apis endpoints,
    # v1 is what /api/dashboards/db (Grafana 9-12) and Ray's own dashboards speak
    warnings.simplefilter("ignore", DeprecationWarning)
    from grafana_foundation_sdk.builders import prometheus, stat, timeseries
    from grafana_foundation_sdk.builders.common import ReduceDataOptions
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import dashboard as dashboard_model
    from grafana_foundation_sdk.models.common import DataSourceRef

DASHBOARD_UID = "minedraft-engine"
DASHBOARD_TITLE = "MineDraft engine"
DASHBOARD_JSON = Path(__file__).resolve().parents[2] / "deployments" / "grafana" / "minedraft-dashboard.json"

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'model=~"$model", mode=~"$mode", replica=~"$replica"'   # every query's label filter
RATE = "$__rate_interval"


def _query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().datasource(DATASOURCE).expr(expr).legend_format(legend).ref_id(ref).range()


def _timeseries(title: str, unit: str, queries: list[tuple[str, str]], description: str = "",
                width: int = 8, min_val: float | None = 0) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
             .height(8).span(width).fill_opacity(10).line_width(1))
    if min_val is not None:
        panel = panel.min(min_val)
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_query(expr, legend, chr(ord("A") + i)))
    return panel


def _stat(title: str, unit: str, expr: str, description: str = "", decimals: int = 2) -> stat.Panel:
    return (stat.Panel().title(title).description(description).unit(unit).decimals(decimals)
            .datasource(DATASOURCE).height(4).span(4).reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
            .with_target(_query(expr, "", "A")))


def _quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    """p50/p90/p99 of a histogram over all selected series (optionally per label `by`)."""
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
             f"p{round(q * 100)}{suffix}") for q in (0.5, 0.9, 0.99)]


def _mean(total: str, histogram: str) -> str:
    """Mean per observation: an exact seconds counter over the histogram's count (Ray exports a
    histogram's _sum from bucket midpoints, so _sum / _count would be approximate)."""
    return f"sum(rate({total}{{{SEL}}}[{RATE}])) / sum(rate({histogram}_count{{{SEL}}}[{RATE}]))"


def _label_variable(name: str, label: str) -> QueryVariable:
    # label_values over the steps counter: every engine that ran a step has it, whatever its traffic
    return (QueryVariable(name).label(label).datasource(DATASOURCE)
            .query(f"label_values(ray_minedraft_steps_total, {name})")
            .definition(f"label_values(ray_minedraft_steps_total, {name})")
            .refresh(dashboard_model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dashboard_model.VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(dashboard_model.VariableOption(selected=True, text="All", value="$__all")))


def build_dashboard() -> Dashboard:
    accepted = f"sum(rate(ray_minedraft_spec_decode_num_accepted_tokens_total{{{SEL}}}[{RATE}]))"
    draft_tokens = f"sum(rate(ray_minedraft_spec_decode_num_draft_tokens_total{{{SEL}}}[{RATE}]))"
    drafts = f"sum(rate(ray_minedraft_spec_decode_num_drafts_total{{{SEL}}}[{RATE}]))"
    tokens = f"sum(rate(ray_minedraft_generation_tokens_total{{{SEL}}}[{RATE}]))"
    return (
        Dashboard(DASHBOARD_TITLE).uid(DASHBOARD_UID)
        .description("Batch-parallel speculative decoding (MineDraft) on Ray: requests, latency, acceptance, "
                     "step timing and the two batches. Series come from ray.util.metrics (ray_minedraft_*).")
        .tags(["minedraft", "ray", "llm", "speculative-decoding"])
        .editable().time("now-30m", "now").refresh("10s").timezone("browser")
        .tooltip(dashboard_model.DashboardCursorSync.CROSSHAIR)
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(_label_variable("model", "Model"))
        .with_variable(_label_variable("mode", "Mode"))
        .with_variable(_label_variable("replica", "Replica"))

        .with_row(Row("Overview"))
        .with_panel(_stat("Generated tokens/s", "short", tokens, "completion tokens handed to requests"))
        .with_panel(_stat("Finished requests/s", "reqps",
                          f'sum(rate(ray_minedraft_requests_total{{{SEL}, status="finished"}}[{RATE}]))'))
        .with_panel(_stat("Acceptance rate", "percentunit", f"{accepted} / {draft_tokens}",
                          "accepted / drafted tokens (vLLM's acceptance rate)"))
        .with_panel(_stat("Acceptance length", "none", f"1 + {accepted} / {drafts}",
                          "tokens per verify step per request: 1 + accepted / drafts (vLLM's definition)"))
        .with_panel(_stat("Running requests", "short", f"sum(ray_minedraft_running_requests{{{SEL}}})", decimals=0))
        .with_panel(_stat("Queued requests", "short", f"sum(ray_minedraft_queue_depth{{{SEL}}})", decimals=0))

        .with_row(Row("Requests and tokens"))
        .with_panel(_timeseries("Requests by status", "reqps", [
            (f"sum by (status) (rate(ray_minedraft_requests_total{{{SEL}}}[{RATE}]))", "{{status}}")]))
        .with_panel(_timeseries("Token throughput", "short", [
            (f"sum by (replica) (rate(ray_minedraft_generation_tokens_total{{{SEL}}}[{RATE}]))",
             "generated {{replica}}"),
            (f"sum by (replica) (rate(ray_minedraft_prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt {{replica}}")],
            "tokens per second"))
        .with_panel(_timeseries("Queue and running requests", "short", [
            (f"sum by (replica) (ray_minedraft_queue_depth{{{SEL}}})", "queued {{replica}}"),
            (f"sum by (replica) (ray_minedraft_running_requests{{{SEL}}})", "running {{replica}}")]))

        .with_row(Row("Latency"))
        .with_panel(_timeseries("Time to first token", "s", _quantiles("ray_minedraft_time_to_first_token_seconds"),
                                "arrival (queueing included) to first token, finished requests"))
        .with_panel(_timeseries("Inter-token latency", "s", _quantiles("ray_minedraft_inter_token_latency_seconds"),
                                "per request: (e2e - ttft) / (output tokens - 1)"))
        .with_panel(_timeseries("End-to-end latency", "s", _quantiles("ray_minedraft_e2e_request_latency_seconds"),
                                "arrival to last token, finished requests"))

        .with_row(Row("Speculative decoding"))
        .with_panel(_timeseries("Acceptance rate and length", "none", [
            (f"{accepted} / {draft_tokens}", "acceptance rate"),
            (f"1 + {accepted} / {drafts}", "acceptance length")],
            "rate = accepted / draft tokens; length = 1 + accepted / drafts"))
        .with_panel(_timeseries("Acceptance length per verify step", "none",
                                _quantiles("ray_minedraft_spec_decode_acceptance_length"),
                                "distribution over steps of 1 + accepted / rows with drafts", min_val=1))
        .with_panel(_timeseries("Acceptance rate by draft position", "percentunit", [
            (f"sum by (position) (rate(ray_minedraft_spec_decode_num_accepted_tokens_per_pos_total{{{SEL}}}[{RATE}]))"
             f" / sum by (position) (rate(ray_minedraft_spec_decode_num_draft_tokens_per_pos_total{{{SEL}}}[{RATE}]))",
             "position {{position}}")],
            "share of drafts at position j that were accepted (counted when requests finish)"))

        .with_row(Row("Step timing"))
        .with_panel(_timeseries("Draft vs verify device time (mean)", "s", [
            (_mean("ray_minedraft_draft_time_seconds_total", "ray_minedraft_draft_seconds"), "draft"),
            (_mean("ray_minedraft_verify_time_seconds_total", "ray_minedraft_verify_seconds"), "verify"),
            (_mean("ray_minedraft_step_time_seconds_total", "ray_minedraft_step_seconds"), "step (wall)"),
            (_mean("ray_minedraft_ray_overhead_time_seconds_total", "ray_minedraft_ray_overhead_seconds"),
             "Ray overhead")],
            "per step; psd overlaps draft and verify (step = max + overhead), other regimes run them in turn"))
        .with_panel(_timeseries("Verifier busy fraction", "percentunit", [
            (f"sum(rate(ray_minedraft_verify_time_seconds_total{{{SEL}}}[{RATE}])) / "
             f"sum(rate(ray_minedraft_step_time_seconds_total{{{SEL}}}[{RATE}]))", "verify / step time"),
            (f"avg by (replica) (ray_minedraft_verifier_busy_fraction{{{SEL}}})", "last ~1 s {{replica}}")],
            "share of step wall time the verifier (target model) computes", width=8))
        .with_panel(_timeseries("Steps by regime", "ops", [
            (f"sum by (regime) (rate(ray_minedraft_steps_total{{{SEL}}}[{RATE}]))", "{{regime}}")],
            "psd = two batches in parallel; seq = draft then verify; ar = target only (no drafter)"))
        .with_panel(_timeseries("Ray overhead per step", "s", _quantiles("ray_minedraft_ray_overhead_seconds"),
                                "step wall time - device time (psd: max(draft, verify); else draft + verify)"))
        .with_panel(_timeseries("Draft time per step", "s", _quantiles("ray_minedraft_draft_seconds")))
        .with_panel(_timeseries("Verify time per step", "s", _quantiles("ray_minedraft_verify_seconds")))
        .with_panel(_timeseries("Prompt tokens prefilled", "short", [
            (f"sum by (replica) (rate(ray_minedraft_prefill_tokens_total{{{SEL}}}[{RATE}]))", "{{replica}}")],
            "prompt tokens per second through the verifier (chunks fused into verifies included)"))
        .with_panel(_timeseries("Prompt chunk launch per step", "short", [
            (f"max by (replica) (ray_minedraft_prompt_chunk_limit_tokens{{{SEL}}})", "{{replica}}")],
            "tokens of the launch that carries a step's prompt chunk while requests decode: the budget, or the "
            "adaptive launch (chunk_gap_ratio) priced from step times, for a chunk at a prompt's start (deeper "
            "chunks take less)"))

        .with_row(Row("Batches"))
        .with_panel(_timeseries("Batch sizes", "short", [
            (f"sum by (batch) (ray_minedraft_batch_size{{{SEL}}})", "batch {{batch}}"),
            (f"max(ray_minedraft_batch_imbalance{{{SEL}}})", "imbalance (max)")],
            "psd keeps | |A| - |B| | <= 1"))
        .with_panel(_timeseries("KV slots", "short", [
            (f"sum by (replica) (ray_minedraft_slots_in_use{{{SEL}}})", "in use {{replica}}"),
            (f"sum by (replica) (ray_minedraft_num_slots{{{SEL}}})", "total {{replica}}")]))
        .with_panel(_timeseries("Drafter alive", "short", [
            (f"min by (replica) (ray_minedraft_drafter_alive{{{SEL}}})", "{{replica}}")],
            "0 while the drafter restarts and the engine serves target-only"))

        .with_row(Row("KV cache"))
        .with_panel(_timeseries("KV cache usage", "percentunit", [
            (f"max by (kv_cache) (ray_minedraft_kv_cache_usage{{{SEL}}})", "{{kv_cache}}")],
            "KV blocks held by requests / blocks in the pool, per model (the fullest replica)"))
        .with_panel(_timeseries("Prefix cache hit rate", "percentunit", [
            (f"sum by (kv_cache) (rate(ray_minedraft_prefix_cache_hits_total{{{SEL}}}[{RATE}])) / "
             f"sum by (kv_cache) (rate(ray_minedraft_prefix_cache_queries_total{{{SEL}}}[{RATE}]))",
             "{{kv_cache}}")],
            "tokens found cached / tokens looked up at admission, per model"))
        .with_panel(_timeseries("Preemptions", "ops", [
            (f"sum by (replica) (rate(ray_minedraft_preemptions_total{{{SEL}}}[{RATE}]))", "{{replica}}")],
            "requests preempted per second when a KV pool ran short (recomputed when resumed)"))
        .with_panel(_timeseries("Collector pauses", "s", _quantiles("ray_minedraft_gc_pause_seconds", by="process"),
                                "garbage-collector pauses of the ingress and the manager (full collections, young "
                                "ones of >= 1 ms): every stream the process serves stalls meanwhile"))
        .with_panel(_timeseries("Objects frozen at startup", "short", [
            (f"max by (process) (ray_minedraft_gc_frozen_objects{{{SEL}}})", "{{process}}")],
            "kept out of the collector's scans; 0 means every full collection scans them"))
    )


def build() -> dashboard_model.Dashboard:
    """The typed dashboard, panels (rows included) numbered 1.. in grid order (Grafana keys panel links,
    edits and repeats by id)."""
    dash = build_dashboard().build()
    for i, panel in enumerate(dash.panels, 1):
        panel.id_val = i
    return dash


def dashboard_json() -> dict:
    """The dashboard as Grafana's JSON model (a plain dict)."""
    return json.loads(JSONEncoder(sort_keys=True).encode(build()))


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build()) + "\n"


def load_checked(path: Path = DASHBOARD_JSON) -> dashboard_model.Dashboard:
    """Parse a dashboard JSON file into the SDK's typed model (raises on a shape the model rejects)."""
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    register_default_plugins()
    return dashboard_model.Dashboard.from_json(json.loads(Path(path).read_text()))


def dashboard_queries(dash: dict) -> list[str]:
    """Every PromQL expression of a dashboard JSON: panel targets (rows included) and query variables."""
    exprs = []

    def panels(items):
        for p in items or []:
            yield p
            yield from panels(p.get("panels"))

    for p in panels(dash.get("panels")):
        exprs += [t["expr"] for t in p.get("targets") or [] if t.get("expr")]
    for v in (dash.get("templating") or {}).get("list", []):
        q = v.get("query")
        if v.get("type") == "query":
            exprs.append(q["query"] if isinstance(q, dict) else q)
    return exprs


# ---- push ------------------------------------------------------------------------------------------
def push_dashboard(api, dashboard: dict, folder: str | None = None, message: str = "minedraft grafana push") -> dict:
    """Create or update the dashboard through Grafana's HTTP API (`api`: grafana_client.GrafanaApi).

    folder: a folder title or uid; created (title) when missing. None: the General folder.
    """
    payload = {"dashboard": {**dashboard, "id": None}, "overwrite": True, "message": message}
    if folder:
        payload["folderUid"] = ensure_folder(api, folder)
    return api.dashboard.update_dashboard(payload)


def ensure_folder(api, folder: str) -> str:
    """The uid of the folder titled (or with uid) `folder`, created if missing."""
    for f in api.folder.get_all_folders():
        if folder in (f.get("title"), f.get("uid")):
            return f["uid"]
    return api.folder.create_folder(folder)["uid"]


def make_api(url: str | None, token: str | None = None, user: str | None = None, password: str | None = None,
             timeout: float = 10.0):
    from grafana_client import GrafanaApi
    if not url:
        raise SystemExit("no Grafana URL: pass --url or set GRAFANA_URL")
    credential = token or ((user, password) if user else None)
    return GrafanaApi.from_url(url, credential=credential, timeout=timeout)


def add_grafana_commands(subparsers) -> None:
    """`minedraft grafana push|export`; `subparsers` is the CLI's `add_subparsers()` result. Sets
    `func=cmd_grafana` and `parser`, so both `ns.func(ns)` and `ns.func(ns, ns.parser)` dispatch."""
    grafana = subparsers.add_parser("grafana", help="the minedraft Grafana dashboard")
    sub = grafana.add_subparsers(dest="grafana_command", required=True)
    push = sub.add_parser("push", help="create or update the dashboard through Grafana's HTTP API")
    push.add_argument("--url", default=os.environ.get("GRAFANA_URL"),
                      help="Grafana base URL, e.g. http://127.0.0.1:3000 (env GRAFANA_URL)")
    push.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                      help="service account token (env GRAFANA_TOKEN)")
    push.add_argument("--user", default=os.environ.get("GRAFANA_USER"), help="basic auth user (env GRAFANA_USER)")
    push.add_argument("--password", default=os.environ.get("GRAFANA_PASSWORD"),
                      help="basic auth password (env GRAFANA_PASSWORD)")
    push.add_argument("--folder", default=os.environ.get("GRAFANA_FOLDER"),
                      help="folder title or uid, created if missing (default: General)")
    push.add_argument("--file", type=Path, default=None,
                      help="push this dashboard JSON instead of the built-in one")
    push.set_defaults(func=cmd_grafana, parser=push)
    export = sub.add_parser("export", help="print the dashboard JSON (or write it with --out)")
    export.add_argument("--out", type=Path, default=None)
    export.set_defaults(func=cmd_grafana, parser=export)


def cmd_grafana(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    if args.grafana_command == "export":
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(render())
        else:
            sys.stdout.write(render())
        return 0
    dash = json.loads(args.file.read_text()) if args.file else dashboard_json()
    api = make_api(args.url, args.token, args.user, args.password)
    result = push_dashboard(api, dash, args.folder)
    print(f"pushed dashboard {dash.get('uid')!r} ({result.get('status')}, version {result.get('version')}): "
          f"{args.url.rstrip('/')}{result.get('url', '')}")
    return 0


if __name__ == "__main__":
    sys.stdout.write(render())
