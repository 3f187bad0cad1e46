"""Plots of bench results, drawn from their Parquet files (matplotlib; the GPU machine has none, so plots
are made here from the files that come back).

    python -m bench.plot bench/results/psd_vs_sd.parquet [--out bench/results/psd_vs_sd.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

COLORS = {"psd": "C0", "sd": "C1", "sd_split": "C2", "ar": "C3", "sd_dp2": "C4", "ar_dp2": "C5"}


def read_rows(path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for r in pq.read_table(path).to_pylist() if r.get("status", "ok") == "ok"]


def plot_psd_vs_sd(parquet, png) -> Path:
    """Four panels: closed tokens/s per GPU against k; draft and verify time against k (psd);
    verifier_busy against k (psd); online P99 latency and TTFT against the arrival rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(parquet)
    closed = [r for r in rows if r["workload"] == "closed" and r.get("acceptance") != "real"]
    groups = sorted({(r["m"], r["alpha_group"]) for r in closed if r["mode"] == "psd"}, key=lambda g: (-g[0], -g[1]))
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    tput, times, busy, online = ax[0, 0], ax[0, 1], ax[1, 0], ax[1, 1]

    for style, (m, a) in zip(styles, groups):
        def curve(mode):
            pts = sorted((r for r in closed if r["mode"] == mode and r["m"] == m and r["batch"] == m
                          and r["alpha_group"] == a and r["replicas"] == 1), key=lambda r: r["k"])
            return [r["k"] for r in pts], pts

        for mode in ("psd", "sd"):
            ks, rs = curve(mode)
            if ks:
                tput.plot(ks, [r["tokens_per_s_per_gpu"] for r in rs], style, marker="o", color=COLORS[mode],
                          label=f"{mode} m={m} α={a}")
        ks, rs = curve("psd")
        if ks:
            times.plot(ks, [r["t_draft_ms"] for r in rs], style, marker="o", color="C0", label=f"draft m={m} α={a}")
            times.plot(ks, [r["t_verify_ms"] for r in rs], style, marker="s", color="C3", label=f"verify m={m} α={a}")
            times.plot(ks, [r["step_ms"] for r in rs], style, marker="^", color="0.4", label=f"step m={m} α={a}")
            busy.plot(ks, [r["verifier_busy"] for r in rs], style, marker="o", color="C0", label=f"m={m} α={a}")
    for m in sorted({g[0] for g in groups}, reverse=True):
        ar = [r for r in closed if r["mode"] == "ar" and r["m"] == m and r["replicas"] == 1]
        if ar:
            best = max(ar, key=lambda r: r["tokens_per_s_per_gpu"])
            tput.axhline(best["tokens_per_s_per_gpu"], color=COLORS["ar"], lw=0.8,
                         ls=styles[[g[0] for g in groups].index(m) % len(styles)],
                         label=f"ar m={m} (b={best['batch']})")
    tput.set(xlabel="k (draft tokens per verify step)", ylabel="output tokens/s per GPU",
             title="Closed workload: throughput per GPU (psd: 2 GPUs, sd: 1)")
    times.set(xlabel="k", ylabel="ms", title="psd: device time per draft phase / verify step, step wall time")
    busy.axhline(0.9, color="0.5", lw=0.8, ls="--")
    busy.set(xlabel="k", ylabel="verify time / step wall time", title="psd: verifier busy (steady state)",
             ylim=(0, 1.05))

    on = [r for r in rows if r["workload"] == "online"]
    online_m = sorted({r["m"] for r in on})
    # a curve per mode and k: runs at another k are other configurations, not more points of one curve
    curves = sorted({(r["mode"], r["k"]) for r in on})
    for mode, k in curves:
        pts = sorted((r for r in on if r["mode"] == mode and r["k"] == k), key=lambda r: r["rate_rps"])
        rates, name = [r["rate_rps"] for r in pts], mode if mode == "ar_dp2" else f"{mode} k={k}"
        width = 1.6 if k == max(kk for mm, kk in curves if mm == mode) else 0.8   # a mode's highest k stands out
        online.plot(rates, [r["lat_p99_s"] for r in pts], "-", marker="o", lw=width, color=COLORS.get(mode),
                    label=f"{name} P99 latency")
        online.plot(rates, [r["ttft_p99_s"] for r in pts], "--", marker="x", lw=width, color=COLORS.get(mode),
                    label=f"{name} P99 TTFT")
    online.set(xlabel="arrival rate (requests/s)", ylabel="s",
               title=f"Online (Poisson), m={'/'.join(map(str, online_m))}: P99 latency and TTFT")
    online.set_yscale("log")
    for a in ax.flat:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    first = rows[0] if rows else {}
    shas = list(dict.fromkeys(r.get("git_sha") for r in rows))   # in row order, once each
    git = f"git {shas[0]}" if len(shas) == 1 else f"rows from {len(shas)} commits (psd_vs_sd.md names each)"
    fig.suptitle(f"PSD vs SD — {first.get('device', '')}, {git}", fontsize=10)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def plot_engine_speed(parquet, png) -> Path:
    """Step time against batch for decode (q=1) and verify (q=5), with the HBM floor and transformers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_rows(parquet) if r.get("lengths", str(r["context"])) == str(r["context"])]
    # the full sweep is one commit's; rows re-measured at a later commit are drawn as separate points
    shas = [r.get("git_sha") for r in rows]
    main_sha = max(set(shas), key=shas.count)
    later = [r for r in rows if r.get("git_sha") != main_sha]
    rows = [r for r in rows if r.get("git_sha") == main_sha]
    models = sorted({r["model"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for q, style in ((1, "-"), (5, "--")):
            pts = sorted((r["batch"], r) for r in rows if r["model"] == model and r["q"] == q)
            if not pts:
                continue
            batches = [b for b, _ in pts]
            ax.plot(batches, [r["ms"] for _, r in pts], "o" + style, color="C0", label=f"minedraft q={q}")
            ax.plot(batches, [r["floor_ms"] for _, r in pts], style, color="C2", label=f"HBM floor q={q}")
            if any(r.get("ms_transformers") for _, r in pts):
                ax.plot(batches, [r.get("ms_transformers") for _, r in pts], "x" + style, color="C3",
                        label=f"transformers eager q={q}")
        for r in (r for r in later if r["model"] == model):
            ax.plot([r["batch"]], [r["ms"]], "*", markersize=10, color="C1" if r["q"] == 1 else "C4",
                    label=f"minedraft q={r['q']} at git {r['git_sha']}")
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms per step (context 512)",
               title=f"{model} step time")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def bar_plot(label_of, value: str, ylabel: str, title: str):
    """A one-panel bar chart of `value` per row that has one, labelled by `label_of(row)` (a bar per row, repeats
    included)."""
    def plot(parquet, png) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in read_rows(parquet) if r.get(value) is not None]
        fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 2, 3.6))
        ax.bar(range(len(rows)), [r[value] for r in rows], color=[f"C{i % 10}" for i in range(len(rows))])
        ax.set_xticks(range(len(rows)), [label_of(r) for r in rows])
        ax.set(ylabel=ylabel, title=title)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        return Path(png)
    return plot


def plot_chunked_prefill_cpu(parquet, png) -> Path:
    """Per mode and workload, the median CPU seconds of a pass at each budget (0: whole prompts)."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(parquet)
    groups = sorted({(r["mode"], r["workload"]) for r in rows})
    budgets = sorted({r["budget"] for r in rows})
    fig, ax = plt.subplots(figsize=(1.1 * len(groups) + 2, 3.6))
    width = 0.8 / len(budgets)
    for i, budget in enumerate(budgets):
        medians = [statistics.median([r["cpu_s"] for r in rows if (r["mode"], r["workload"]) == g
                                      and r["budget"] == budget] or [0.0]) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], medians, width, label=f"budget {budget}")
    ax.set_xticks([x + width * (len(budgets) - 1) / 2 for x in range(len(groups))], [f"{m} {w}" for m, w in groups])
    ax.set(ylabel="CPU s per pass (median)", title="Chunked prefill vs whole prompts on the CPU")
    ax.tick_params(axis="x", labelsize=8, rotation=20)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def plot_gemm_sweep(parquet, png) -> Path:
    """Each variant's time relative to `linear`, per GEMM and M: below 1 is faster."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(parquet)
    cells = list(dict.fromkeys((r["m"], r["gemm"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(cells) + 2), 4))
    for i, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        at = {(r["m"], r["gemm"]): r["vs_linear"] for r in rows if r["variant"] == variant}
        ax.plot(range(len(cells)), [at.get(c) for c in cells], "o", color=f"C{i}", label=variant)
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(cells)), [f"M={m} {g}" for m, g in cells])
    ax.set(ylabel="time / linear's", title="GEMM variants at Llama-3.1-8B shapes")
    ax.tick_params(axis="x", labelsize=7, rotation=45)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def plot_serve_vs_offline(parquet, png) -> Path:
    """Left: closed tok/s of the HTTP and the offline path per configuration (the ratio above the bars); right:
    online chunk-gap and TTFT percentiles against the arrival rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(parquet)
    label = lambda r: (f"{r['label']}: " if r.get("label") else "") + f"{r['mode']}" + \
        (f" k={r['k']}" if r.get("k") else "") + f" b={r['max_batch']}"
    closed = [r for r in rows if r["workload"] == "closed"]
    fig, (bars, online) = plt.subplots(1, 2, figsize=(13, 5))
    xs = range(len(closed))
    bars.bar([x - 0.2 for x in xs], [r["http_tokens_per_s"] or 0 for r in closed], 0.4, label="HTTP (Serve)")
    bars.bar([x + 0.2 for x in xs], [r["offline_tokens_per_s"] or 0 for r in closed], 0.4, label="offline LLM")
    for x, r in zip(xs, closed):
        top = max(r["http_tokens_per_s"] or 0, r["offline_tokens_per_s"] or 0)
        bars.annotate(f"{r['http_over_offline'] or 0:.2f}x", (x, top), ha="center", va="bottom")
    bars.set_xticks(list(xs), [label(r) for r in closed], rotation=20)
    bars.set(ylabel="output tokens/s", title="Closed workload: HTTP vs offline")
    bars.legend()
    for i, r0 in enumerate(closed):
        pts = sorted((r for r in rows if r["workload"] == "online" and label(r) == label(r0)
                      and r["n_requests"] == r0["n_requests"]), key=lambda r: r["load"])
        if not pts:
            continue
        loads = [r["rate_rps"] for r in pts]   # the load is relative to each row's own capacity: rates compare
        color = f"C{i}"
        online.plot(loads, [r["chunk_gap_p50_ms"] for r in pts], "-o", color=color, label=f"{label(r0)} gap P50")
        online.plot(loads, [r["chunk_gap_p99_ms"] for r in pts], "--o", color=color, label=f"{label(r0)} gap P99")
        online.plot(loads, [r["ttft_p99_ms"] for r in pts], ":x", color=color, label=f"{label(r0)} TTFT P99")
    online.set(xlabel="arrival rate (requests/s; 30/60/90 % of each row's HTTP capacity)", ylabel="ms", yscale="log",
               title="Online (Poisson): chunk gap and TTFT")
    if online.get_legend_handles_labels()[0]:   # no online rows: no legend (matplotlib warns of an empty one)
        online.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return Path(png)


def plot_host_overhead(parquet, png) -> Path:
    """Each run's median host ms per psd step, parent and change, in run order (alternating), with each tree's
    median over its runs; the load average before each run on the right axis."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(parquet)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    load_ax = ax.twinx()
    for i, tree in enumerate(dict.fromkeys(r["tree"] for r in rows)):
        mine = [r for r in rows if r["tree"] == tree]
        ax.plot([r["run"] for r in mine], [r["host_ms_median"] for r in mine], "o-", color=f"C{i}",
                label=f"{tree} ({mine[0]['git_sha']})")
        ax.axhline(statistics.median(r["host_ms_median"] for r in mine), color=f"C{i}", ls="--", lw=1)
        load_ax.plot([r["run"] for r in mine], [r["load_before"] for r in mine], "x", color=f"C{i}", alpha=0.4)
    ax.set(xlabel="run (the trees alternate)", ylabel="median host ms per psd step",
           title="psd host overhead per step (CPU); dashed: median over runs")
    load_ax.set_ylabel("load average before the run (x)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def plot_real_traffic(parquet, png) -> Path:
    """Left: closed prompt tokens/s in prefill and output tokens/s per mode and engine; right: online TTFT P99
    and the P99 gap between a request's outputs against the arrival rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(parquet)
    closed = [r for r in rows if r["workload"] == "closed"]
    fig, (bars, online) = plt.subplots(1, 2, figsize=(13, 5))
    xs = range(len(closed))
    bars.bar([x - 0.2 for x in xs], [r["prefill_tokens_per_s"] or 0 for r in closed], 0.4,
             label="prompt tokens/s in prefill")
    twin = bars.twinx()
    twin.bar([x + 0.2 for x in xs], [r["tokens_per_s"] or 0 for r in closed], 0.4, color="C1",
             label="output tokens/s (right)")
    bars.set_xticks(list(xs), [f"{r['mode']} {r['engine']}" for r in closed], rotation=20)
    bars.set(ylabel="prompt tokens/s in prefill", title="Closed workload")
    twin.set_ylabel("output tokens/s")
    bars.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    for i, (mode, engine) in enumerate(sorted({(r["mode"], r["engine"]) for r in rows})):
        pts = sorted((r for r in rows if r["workload"] == "online" and r["mode"] == mode and r["engine"] == engine),
                     key=lambda r: r["load"])
        if not pts:
            continue
        rates = [r["rate_rps"] for r in pts]
        online.plot(rates, [r["ttft_p99_ms"] for r in pts], "-o", color=f"C{i}", label=f"{mode} {engine} TTFT P99")
        online.plot(rates, [r["gap_p99_ms"] for r in pts], "--x", color=f"C{i}", label=f"{mode} {engine} gap P99")
    online.set(xlabel="arrival rate (requests/s; 30/60/90 % of the padded engine's capacity)", ylabel="ms",
               yscale="log", title="Online (Poisson, long-tailed prompts)")
    if online.get_legend_handles_labels()[0]:   # no online rows: no legend (matplotlib warns of an empty one)
        online.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return Path(png)


def plot_real_traffic_steps(parquet, png) -> Path:
    """A panel per mode and engine: each verifier cycle of online_long in step order, those carrying a prompt chunk
    coloured by the token bucket of the launch that carried it, those without in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minedraft_ray.engine.launch_buckets import token_bucket
    from minedraft_ray.runtime.chunk_budget import LAUNCH_CLASSES

    rows = read_rows(parquet)
    runs = list(dict.fromkeys((r["mode"], r["engine"]) for r in rows))
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for ax, (mode, engine) in zip(axes[:, 0], runs):
        mine = [r for r in rows if (r["mode"], r["engine"]) == (mode, engine)]
        plain = [r for r in mine if not r["prefill_tokens"]]
        ax.scatter([r["step"] for r in plain], [r["step_ms"] for r in plain], s=3, color="0.6", label="no chunk")
        past = LAUNCH_CLASSES[-1] + 1   # launches past the largest bucket (whole prompts) share a colour
        by_class: dict[int, list[dict]] = {}
        for r in mine:
            if r["prefill_tokens"]:
                by_class.setdefault(token_bucket(r["launch_tokens"], LAUNCH_CLASSES) or past, []).append(r)
        for i, (c, pts) in enumerate(sorted(by_class.items())):
            ax.scatter([r["step"] for r in pts], [r["step_ms"] for r in pts], s=6, color=f"C{i % 10}",
                       label=f"launch <= {c}" if c < past else f"launch > {past - 1}")
        ax.set(ylabel="cycle ms", yscale="log", title=f"{mode} {engine}: online_long's verifier cycles")
        ax.legend(fontsize=7, ncol=4, loc="upper right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def plot_fused_step_profile(parquet, png) -> Path:
    """Left: step ms against the chunk's tokens per batch (0: the decode step) and chunk start (line styles), the
    2x-decode line dashed; right: one layer's attention of the rows by the decode kernel and the packed kernel's
    two row layouts (GPU runs) or the longest program's key tiles of each layout (any run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(parquet)
    fig, (steps, attn) = plt.subplots(1, 2, figsize=(12, 4.5))
    timed = [r for r in rows if r["part"] == "step"]
    # a line per chunk start and graph bucket set (runs before the sets have none)
    lines = sorted({(r["chunk_start"], r.get("buckets") or "") for r in timed if r["chunk_tokens"]})
    for i, batch in enumerate(sorted({r["batch"] for r in timed})):
        decode = next((r for r in timed if r["batch"] == batch and r["chunk_tokens"] == 0), None)
        for j, (start, buckets) in enumerate(lines):
            pts = [decode] * (decode is not None) + sorted(
                (r for r in timed if r["batch"] == batch and r["chunk_tokens"] and r["chunk_start"] == start
                 and (r.get("buckets") or "") == buckets), key=lambda r: r["chunk_tokens"])
            steps.plot([r["chunk_tokens"] for r in pts], [r["ms"] for r in pts], ["-o", ":s", "-.^", "--x"][j % 4],
                       color=f"C{i}", label=f"b={batch} @{start} {buckets}".rstrip())
        if decode:
            steps.axhline(2 * decode["ms"], color=f"C{i}", ls="--", lw=0.8)
    steps.set(xlabel="chunk tokens in the launch (0: decode step)", ylabel="ms per step",
              title="Fused step vs decode (dashed: 2x decode)")
    steps.legend(fontsize=8)
    attention = [r for r in rows if r["part"] == "rows_attention" and r["ms"]]
    value, ylabel = ("ms", "ms, one layer") if attention else ("longest_tiles", "longest program's key tiles")
    bars = attention or [r for r in rows if r["part"].startswith("plan_")]
    attn.bar(range(len(bars)), [r[value] for r in bars])
    attn.set_xticks(range(len(bars)), [f"{r['variant']} b={r['batch']}" for r in bars], rotation=30, fontsize=8)
    attn.set(ylabel=ylabel, title="The rows' attention by layout")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def plot_packed_attention(parquet, png) -> Path:
    """Per chunk size: us per layer against the chunk's start in the prompt for the baseline kernel, the current
    one at its own launch, its best variant and torch's flash SDPA (bench/packed_attention.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.packed_attention import summary

    lines = summary(read_rows(parquet))
    chunks = sorted({r["chunk"] for r in lines})
    fig, axes = plt.subplots(1, len(chunks), figsize=(4 * len(chunks), 3.4), squeeze=False)
    for ax, chunk in zip(axes[0], chunks):
        mine = [r for r in lines if r["chunk"] == chunk]
        for key, label in [("baseline_us", "baseline"), ("default_us", "current"), ("best_us", "best variant"),
                           ("sdpa_us", "SDPA flash, no mask")]:
            points = [(r["start"], r[key]) for r in mine if r[key] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set(title=f"chunk of {chunk} tokens", xlabel="prompt tokens before the chunk", ylabel="us per layer")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


plot_ingress_burst = bar_plot(lambda r: f"{r['label']}\n{r['running']}+{r['burst']}", "gap_during_p99_ms",
                              "P99 chunk gap during the burst (ms)",
                              "Running streams' chunk gaps while a burst is admitted")

PLOTS = {
    "ingress_burst": plot_ingress_burst,
    "ingress_burst_cpu": plot_ingress_burst,
    "fused_step_profile": plot_fused_step_profile,
    "fused_buckets": plot_fused_step_profile,   # fused_step_profile --bucket-sets, kept under its own name
    "fused_step_profile_waves2": plot_fused_step_profile,   # the same call at PREFILL_WAVES 2
    "packed_attention": plot_packed_attention,
    "prefill_order_sim": bar_plot(lambda r: f"{r['order']} {r['budget']}\n+{r['long_prompts']} long", "ttft_p99_ms",
                                  "TTFT P99, ms (mean of runs)", "Prefill order on the scheduler alone (a cost model)"),
    "real_traffic": plot_real_traffic,
    "real_traffic_steps": plot_real_traffic_steps,
    "host_overhead_cpu": plot_host_overhead,
    "gpt_fast_peer": bar_plot(lambda r: f"{r['engine']} {r['step']} b={r['batch']}", "ms", "ms per step",
                              "gpt-fast vs minedraft: step times at the same shape"),
    "serve_vs_offline": plot_serve_vs_offline,
    "serve_vs_offline_cpu": plot_serve_vs_offline,
    "gemm_sweep": plot_gemm_sweep,
    "chunked_prefill_cpu": plot_chunked_prefill_cpu,
    "prefill_speed": bar_plot(lambda r: f"{r['prompts']}x{r['length']} {r['path']}", "wall_ms", "ms per prefill",
                              "Prefill: graphed vs eager vs packed (8B shape)"),
    "prefill_longtail": bar_plot(lambda r: r["path"], "tokens_per_s", "prompt tokens/s",
                                 "Prefill of long-tailed prompts: packed vs padded"),
    "psd_vs_sd": plot_psd_vs_sd,
    "runtime_parity": bar_plot(lambda r: f"{r['mode']} m={r['m']}" + (f" k={r['k']}" if r["k"] else "")
                               + f" {r.get('repeat') or ''}",
                               "change_over_parent", "tok/s, change / parent",
                               "The runtime change against its parent (same call)"),
    "engine_speed": plot_engine_speed,
    "engine_parity": bar_plot(lambda r: f"{r['model']} b={r['batch']} q={r['q']} {r['lengths']}", "change_over_parent",
                              "step ms, change / parent", "The engine step against its parent (same call)"),
    "paged_kv": bar_plot(lambda r: f"{r['part']} {r['variant']}" + (f" q={r['q']}" if r["q"] else "")
                         + (f" T={r['tokens']}" if r.get("tokens") else ""), "ratio",
                         "paged / static, cached / uncached, tile / 128x64",
                         "Paged KV: concurrency, prefix cache, decode step, attention tiles"),
    "vs_vllm_cpu": bar_plot(lambda r: f"{r['engine']} {r['mode']} ({r['workload']})", "tokens_per_s", "tokens/s",
                            "vLLM vs minedraft on the CPU (informational)"),
    "default_pair_speed_cpu": bar_plot(lambda r: r["mode"], "tokens_per_s", "tokens/s",
                                       "default pair: ar / sd / psd (CPU, informational)"),
    "default_pair_speed_gpu": bar_plot(lambda r: r["mode"], "tokens_per_s", "tokens/s", "default pair on a GPU"),
    "transport_overhead_cpu": bar_plot(lambda r: f"{r['transport']}, overlap {'on' if r['verifier_overlap'] else 'off'}",
                                       "step_ms", "ms per psd step (wall)",
                                       "psd step time by draft channel (CPU, 2 cores)"),
    **{f"payload_hop_{where}": bar_plot(lambda r: f"{r['route']} / {r['container']}" + (f" / q {r['probs_width']}"
                                                                    if r.get("probs_width") else ""), "hop_ms",
                                        "ms, drafter end -> verifier start", f"a draft's hop to the verifier ({where})")
       for where in ("cpu", "gpu")},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parquet")
    p.add_argument("--out", default=None, help="PNG path (default: next to the Parquet file)")
    args = p.parse_args(argv)
    path = Path(args.parquet)
    kind = path.stem
    if kind not in PLOTS:
        p.error(f"no plot for {kind!r}; known: {', '.join(PLOTS)}")
    print(PLOTS[kind](path, args.out or path.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
