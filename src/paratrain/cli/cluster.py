"""``paratrain cluster``: share a cluster of several accelerator types among many jobs (Gavel).

Examples::

    paratrain cluster simulate --jobs gavel:max_min_fairness.trace --accelerators v100=12,p100=12,k80=12 \\
        --policy max_min_fairness_perf --round-s 360 --plot occupancy.png
    paratrain cluster solve --jobs gavel:max_min_fairness.trace --accelerators v100=12,p100=12,k80=12 \\
        --policy max_min_fairness_perf --json
    paratrain cluster generate-trace --num-jobs 100 --rate 4 --out jobs.trace
    paratrain cluster generate-prices --accelerators v100=1,p100=1,k80=1 --hours 48 --out prices.csv
    paratrain cluster simulate --jobs jobs.trace --accelerators v100=4,p100=4,k80=4 \\
        --policy max_sum_throughput_normalized_by_cost_perf --prices prices.csv
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from paratrain.cli.options import JsonOpt, print_json
from paratrain.errors import ConfigError

__all__ = ["register"]

cluster_app = typer.Typer(help="Share a cluster among jobs: Gavel's policies, rounds and simulator.",
                          no_args_is_help=True)

_THROUGHPUTS = "gavel:simulation_throughputs.json"

JobsOpt = Annotated[
    str, typer.Option("--jobs", help="Trace in Gavel's format (gavel:max_min_fairness.trace: shipped).")
]
ThroughputsOpt = Annotated[
    str, typer.Option("--throughputs", help="Throughputs in Gavel's format (default: Gavel's measured table).")
]
AccelOpt = Annotated[
    str, typer.Option("--accelerators", "-a", help="Accelerators per type, e.g. v100=12,p100=12,k80=12.")
]
PolicyOpt = Annotated[str, typer.Option("--policy", "-p", help="Gavel policy name (see `cluster policies`).")]
PredictOpt = Annotated[
    str | None,
    typer.Option("--predict", help="Add job types predicted by the cost model: MODEL:GLOBAL_BATCH,… (trace type "
                 "'MODEL (batch size B)'); each accelerator type needs a device preset (TYPE=N@PRESET)."),
]


def _table(throughputs: str, predict: str | None, cluster: object) -> object:
    from paratrain.cluster.throughputs import read_throughputs

    table = read_throughputs(throughputs)
    if predict is not None:  # an empty --predict is malformed, not absent
        from paratrain.cluster.predict import parse_predict, predicted_table

        devices = {p.name: p.device or p.name for p in cluster.pools}  # type: ignore[attr-defined]
        table = table.merged(predicted_table(parse_predict(predict), devices))
    return table


def register(app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")


def _hours(s: float) -> str:
    return f"{s / 3600:.2f} h"


@cluster_app.command("policies", help="List the policy names.")
def policies(json_out: JsonOpt = False) -> None:
    from paratrain.cluster.policies import POLICY_NAMES

    if json_out:
        print_json({"policies": list(POLICY_NAMES)})
    else:
        print("\n".join(POLICY_NAMES))


@cluster_app.command("simulate", help="Simulate a job trace round by round under one policy.")
def simulate(
    jobs: JobsOpt,
    accelerators: AccelOpt = "v100=12,p100=12,k80=12",
    policy: PolicyOpt = "max_min_fairness_perf",
    throughputs: ThroughputsOpt = _THROUGHPUTS,
    predict: PredictOpt = None,
    round_s: Annotated[float, typer.Option("--round-s", help="Round length in seconds (Gavel: 360).")] = 360.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the type shuffle and of fifo's choices.")] = 0,
    prices: Annotated[Path | None, typer.Option("--prices", help="Spot-price CSV (see generate-prices).")] = None,
    clouds: Annotated[str | None, typer.Option("--clouds", help="Clouds to buy from, e.g. aws,gcp (default all).")
                      ] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of accelerators busy over time.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.cluster.market import dynamic_cost, read_prices, static_choice_costs
    from paratrain.cluster.policies import get_policy
    from paratrain.cluster.simulator import simulate_cluster
    from paratrain.cluster.trace import read_trace
    from paratrain.errors import require_positive
    from paratrain.fileio import atomic_write_png, check_distinct_paths, check_output_path
    from paratrain.spec.hetero import parse_accelerators

    require_positive("--round-s", round_s)
    if plot is not None:
        check_output_path(plot, "--plot")
        check_distinct_paths({"--plot": plot}, {"--jobs": jobs, "--throughputs": throughputs, "--prices": prices})
    cluster = parse_accelerators(accelerators)
    pol = get_policy(policy)
    table = _table(throughputs, predict, cluster)
    trace = read_trace(jobs)
    book = None
    if prices is not None:
        book = read_prices(prices)
        if clouds is not None:  # an empty --clouds names no cloud; it is not "all of them"
            book.clouds = tuple(c.strip() for c in clouds.split(","))
            if not book.usable():
                raise ConfigError("--clouds", f"no prices for clouds {clouds!r}", "name clouds of the price file")
    elif clouds is not None:
        raise ConfigError("--clouds", "given without --prices", "add --prices FILE")
    elif "normalized_by_cost" in policy:
        raise ConfigError("--prices", f"policy {policy} needs prices", "pass --prices FILE (see generate-prices)")
    res = simulate_cluster(trace, table, cluster, pol, round_s=round_s, seed=seed, prices=book,
                           record_occupancy=plot is not None)
    out = res.to_dict()
    if book is not None:
        static = static_choice_costs(trace, table, book)
        if static:
            best = min(static, key=lambda k: static[k])
            out["best_static_choice"] = best
            out["best_static_cost"] = static[best]
        out["elastic_dynamic_cost"] = dynamic_cost(trace, table, book, round_s)
    if plot is not None:
        from paratrain.cluster.plot import plot_occupancy

        fig = plot_occupancy(res)
        atomic_write_png(plot, fig, "--plot")
        import matplotlib.pyplot as plt

        plt.close(fig)
    if json_out:
        print_json(out)
        return
    print(f"policy {res.policy} on {accelerators}, rounds of {round_s:g} s: {len(res.jct_s)} jobs")
    print(f"  average JCT   {_hours(res.avg_jct_s)}")
    print(f"  makespan      {_hours(res.makespan_s)}")
    print(f"  utilization   {res.utilization:.1%}")
    print(f"  rounds        {res.rounds} (leases kept {res.lease_extensions} of {res.lease_opportunities})")
    print(f"  solves        {len(res.solve_times_s)}, {sum(res.solve_times_s):.3f} s in all")
    if res.colocated_gpu_s is not None:
        share = res.colocated_gpu_s / max(sum(res.busy_s_by_type.values()), 1e-12)
        print(f"  co-located    {res.colocated_gpu_s / 3600:.1f} GPU-h ({share:.1%} of busy GPU time)")
    if res.total_cost is not None:
        print(f"  cost          ${res.total_cost:.2f}")
        if "best_static_choice" in out:
            print(f"  best static   ${out['best_static_cost']:.2f} ({out['best_static_choice']}, every job alone)")
        print(f"  elastic, moving each round to the cheapest $/step: ${out['elastic_dynamic_cost']:.2f}")
    for note in res.notes:
        print(f"  note: {note}")


@cluster_app.command("compare", help="Simulate a trace under several policies and print one table.")
def compare(
    jobs: JobsOpt,
    accelerators: AccelOpt = "v100=12,p100=12,k80=12",
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated names, or 'all' (no cost policies).")
                        ] = "all",
    throughputs: ThroughputsOpt = _THROUGHPUTS,
    predict: PredictOpt = None,
    round_s: Annotated[float, typer.Option("--round-s", help="Round length in seconds (Gavel: 360).")] = 360.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    timing: Annotated[bool, typer.Option("--timing", help="Also print the total LP solve time.")] = False,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.cluster.policies import POLICY_NAMES, get_policy
    from paratrain.cluster.simulator import simulate_cluster
    from paratrain.cluster.trace import read_trace
    from paratrain.spec.hetero import parse_accelerators

    cluster = parse_accelerators(accelerators)
    names = [n for n in POLICY_NAMES if "by_cost" not in n] if policies == "all" else \
        [n.strip() for n in policies.split(",")]
    pols = [get_policy(n, "--policies") for n in names]
    if any("by_cost" in n for n in names):
        raise ConfigError("--policies", "cost policies need prices", "use `cluster simulate --prices`")
    table = _table(throughputs, predict, cluster)
    trace = read_trace(jobs)
    rows = [simulate_cluster(trace, table, cluster, p, round_s=round_s, seed=seed).to_dict() for p in pols]
    if json_out:
        print_json({"accelerators": cluster.counts, "round_s": round_s, "jobs": len(trace), "policies": rows})
        return
    print(f"{len(trace)} jobs on {accelerators}, rounds of {round_s:g} s")
    head = f"| {'policy':37s} | avg JCT (h) | makespan (h) | utilization |" + (" solve (s) |" if timing else "")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for d in rows:
        line = (f"| {d['policy']:37s} | {d['avg_jct_s'] / 3600:11.2f} | {d['makespan_s'] / 3600:12.2f} "
                f"| {d['utilization']:11.1%} |")
        if timing:
            line += f" {d['solve_time_total_s']:9.2f} |"
        print(line)


@cluster_app.command("solve", help="Solve one allocation for every job of a trace, as if all were active.")
def solve(
    jobs: JobsOpt,
    accelerators: AccelOpt = "v100=12,p100=12,k80=12",
    policy: PolicyOpt = "max_min_fairness_perf",
    throughputs: ThroughputsOpt = _THROUGHPUTS,
    predict: PredictOpt = None,
    json_out: JsonOpt = False,
) -> None:
    import numpy as np

    from paratrain.cluster.policies import AllocationProblem, get_policy
    from paratrain.cluster.rounds import type_order
    from paratrain.cluster.simulator import check_jobs_runnable
    from paratrain.cluster.trace import read_trace
    from paratrain.spec.hetero import parse_accelerators

    cluster = parse_accelerators(accelerators)
    pol = get_policy(policy)
    if "normalized_by_cost" in policy:
        raise ConfigError("--policy", "the cost policies need prices over time", "use `cluster simulate --prices`")
    table = _table(throughputs, predict, cluster)
    trace = read_trace(jobs)
    check_jobs_runnable(trace, table, cluster)
    types = tuple(type_order(list(cluster.types)))
    thr = np.array([[table.get(j.key, t) for t in types] for j in trace])
    problem = AllocationProblem(
        job_ids=tuple(range(len(trace))), worker_types=types, throughputs=thr,
        scale_factors=np.array([j.scale_factor for j in trace]),
        capacities=np.array([cluster.counts[t] for t in types]),
        priority_weights=np.array([j.priority_weight for j in trace]),
        steps_remaining=np.array([j.total_steps for j in trace], dtype=float),
        times_since_start_s=np.zeros(len(trace)))
    if pol.is_packed:
        problem.colocated = {(a, b): np.array([table.pair(trace[a].key, trace[b].key, t) for t in types])
                             for a in range(len(trace)) for b in range(a + 1, len(trace))
                             if trace[a].scale_factor == trace[b].scale_factor}
    alloc = pol.solve(problem)
    pairs = alloc.pairs() if hasattr(alloc, "pairs") else []
    eff = alloc.effective_throughputs(thr)
    if json_out:
        print_json({"policy": pol.name, "solve_time_s": alloc.solve_time_s, "worker_types": list(types),
                    "allocation": [[float(v) for v in row] for row in alloc.x],
                    "effective_throughputs": [float(v) for v in eff], "note": alloc.note}
                   | ({"pairs": pairs} if pol.is_packed else {}))
        return
    print(f"policy {pol.name}: {len(trace)} jobs on {accelerators}, solved in {alloc.solve_time_s * 1e3:.1f} ms")
    print(f"{'job':>4}  {'type':36s} {'GPUs':>4}  " + "  ".join(f"{t:>6s}" for t in types) + "  steps/s")
    for i, j in enumerate(trace):
        print(f"{i:>4}  {j.job_type[:36]:36s} {j.scale_factor:>4}  "
              + "  ".join(f"{v:6.3f}" for v in alloc.x[i]) + f"  {eff[i]:.3f}")
    for p in pairs:
        print(f"pair {p['jobs'][0]}+{p['jobs'][1]} on {p['worker_type']}: {p['fraction']:.3f} of the time")
    if alloc.note:
        print(f"note: {alloc.note}")


@cluster_app.command("generate-trace", help="Generate a trace: Poisson arrivals of Gavel's job mix.")
def generate_trace_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Trace file to write.")],
    num_jobs: Annotated[int, typer.Option("--num-jobs", help="Jobs in the trace.")] = 100,
    rate: Annotated[float, typer.Option("--rate", help="Arrivals per hour (Poisson), at least 0.001.")] = 4.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    multi_gpu: Annotated[bool, typer.Option("--multi-gpu", help="Draw 1/2/4/8-GPU jobs (70/10/15/5 %).")] = False,
    multi_priority: Annotated[bool, typer.Option("--multi-priority", help="20 % of jobs get weight 5.")] = False,
    throughputs: ThroughputsOpt = _THROUGHPUTS,
) -> None:
    from paratrain.cluster.throughputs import read_throughputs
    from paratrain.cluster.trace import format_trace, generate_trace
    from paratrain.fileio import atomic_write_text, check_distinct_paths, check_output_path

    check_output_path(out, "--out")
    check_distinct_paths({"--out": out}, {"--throughputs": throughputs})
    table = read_throughputs(throughputs)
    jobs = generate_trace(table, num_jobs=num_jobs, rate_per_hour=rate, seed=seed, multi_gpu=multi_gpu,
                          multi_priority=multi_priority)
    atomic_write_text(out, format_trace(jobs), "--out")
    print(f"wrote {len(jobs)} jobs arriving over {_hours(jobs[-1].arrival_time_s)} to {out}")


@cluster_app.command("generate-prices", help="Generate synthetic spot-price series (CSV).")
def generate_prices_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="CSV file to write.")],
    accelerators: AccelOpt = "v100=1,p100=1,k80=1",
    hours: Annotated[float, typer.Option("--hours", help="Length of the series.")] = 48.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    from paratrain.cluster.market import format_prices, synthetic_prices
    from paratrain.errors import require_positive
    from paratrain.fileio import atomic_write_text, check_output_path
    from paratrain.spec.hetero import parse_accelerators

    check_output_path(out, "--out")
    require_positive("--hours", hours)
    if hours > 10 * 8760:  # a decade of price changes every few hours is ~30,000 lines per series
        raise ConfigError("--hours", f"{hours:g} h is more than ten years", "pass at most 87600")
    cluster = parse_accelerators(accelerators)
    book = synthetic_prices(cluster.types, duration_s=hours * 3600, seed=seed)
    atomic_write_text(out, format_prices(book), "--out")
    changes = sum(len(s.times_s) for s in book.series)
    print(f"wrote {len(book.series)} series ({changes} prices) over {hours:g} h to {out}")
