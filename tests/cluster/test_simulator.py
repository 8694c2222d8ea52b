"""The trace-driven simulator: closed-form cases, Gavel's trace end to end, the spot market, and the
command line (including its bad-input table: one line, exit 2, no file written)."""

from __future__ import annotations

import json

import pytest

from paratrain.cluster.market import (
    PriceBook,
    PriceSeries,
    dynamic_cost,
    parse_prices,
    static_choice_costs,
    synthetic_prices,
)
from paratrain.cluster.policies import get_policy
from paratrain.cluster.simulator import simulate_cluster
from paratrain.cluster.throughputs import ThroughputTable, read_throughputs
from paratrain.cluster.trace import Job, format_trace, generate_trace, parse_trace, read_trace
from paratrain.errors import ConfigError
from paratrain.spec.hetero import parse_accelerators

TRACE = "gavel:max_min_fairness.trace"


@pytest.fixture(scope="module")
def table():
    return read_throughputs("gavel:simulation_throughputs.json")


def tiny_table(**rates: float) -> ThroughputTable:
    return ThroughputTable({("a", 1): dict(rates)})


def test_one_job_alone_by_hand():
    # 1,000 steps at 1 step/s in rounds of 360 s: 360 + 360 + 280 → JCT = makespan = 1,000 s, busy
    # the whole time.
    res = simulate_cluster([Job("a", 1000)], tiny_table(g=1.0), parse_accelerators("g=1"),
                           get_policy("max_min_fairness"))
    assert res.jct_s == {0: 1000.0}
    assert res.makespan_s == 1000.0 and res.utilization == 1.0 and res.rounds == 3


def test_two_jobs_take_turns_by_hand():
    # Two 720-step jobs on one GPU alternate rounds: A 0–360, B 360–720, A 720–1080 (done),
    # B 1080–1440 (done): JCTs 1,080 and 1,440 s.
    res = simulate_cluster([Job("a", 720), Job("a", 720)], tiny_table(g=1.0), parse_accelerators("g=1"),
                           get_policy("max_min_fairness"))
    assert res.jct_s == {0: 1080.0, 1: 1440.0}
    assert res.avg_jct_s == 1260.0 and res.makespan_s == 1440.0


@pytest.mark.parametrize("policy", ["max_min_fairness", "max_min_fairness_packed"])
def test_rounds_needed_is_a_lower_bound(table, policy):
    """The up-front round count refuses a trace only when the simulation would pass the limit: a
    limit of exactly the rounds a run takes still runs it; one below is refused before any round
    (the one-job case: 1,000 steps, at most 360 a round, need 3)."""
    cluster, pol = parse_accelerators("g=1"), get_policy("max_min_fairness")
    assert simulate_cluster([Job("a", 1000)], tiny_table(g=1.0), cluster, pol, max_rounds=3).rounds == 3
    with pytest.raises(ConfigError, match="needs at least 3 rounds"):
        simulate_cluster([Job("a", 1000)], tiny_table(g=1.0), cluster, pol, max_rounds=2)
    jobs = generate_trace(table, num_jobs=6, rate_per_hour=4.0, seed=2, multi_gpu=True)
    cluster = parse_accelerators("v100=2,p100=2,k80=2")
    done = simulate_cluster(jobs, table, cluster, get_policy(policy), round_s=60)
    assert simulate_cluster(jobs, table, cluster, get_policy(policy), round_s=60,
                            max_rounds=done.rounds).rounds == done.rounds


@pytest.mark.slow
def test_gavel_trace_end_to_end(table):
    jobs = read_trace(TRACE)
    cluster = parse_accelerators("v100=12,p100=12,k80=12")
    results = {p: simulate_cluster(jobs, table, cluster, get_policy(p), record_occupancy=True)
               for p in ("max_min_fairness", "max_min_fairness_perf")}
    for res in results.values():
        assert len(res.jct_s) == len(jobs)
        assert 0 < res.utilization <= 1
        assert res.makespan_s >= max(j.arrival_time_s + res.jct_s[i] for i, j in enumerate(jobs)) - 1e-6
        assert all(sum(b.values()) <= 36 for _, _, b in res.occupancy)
    # The paper's claim on this trace: heterogeneity awareness lowers the average JCT.
    assert results["max_min_fairness_perf"].avg_jct_s < results["max_min_fairness"].avg_jct_s
    again = simulate_cluster(jobs, table, cluster, get_policy("max_min_fairness_perf"))
    assert again.jct_s == results["max_min_fairness_perf"].jct_s  # deterministic


def test_trace_round_trip_and_generator(table):
    jobs = generate_trace(table, num_jobs=40, rate_per_hour=4.0, seed=1, multi_gpu=True)
    assert parse_trace(format_trace(jobs)) == jobs
    gaps = [b.arrival_time_s - a.arrival_time_s for a, b in zip(jobs, jobs[1:], strict=False)]
    assert 900 / 3 < sum(gaps) / len(gaps) < 900 * 3  # mean gap 1/rate = 900 s, loosely
    assert all(table.get(j.key, "v100") > 0 for j in jobs)


def test_prices_latest_and_static_vs_dynamic():
    # One type in two regions: r1 $1/h then $3/h from 1 h; r2 $2/h throughout. The latest minimum
    # is $1 then $2. A 2-hour job (7,200 steps at 1 step/s) arriving at 0: static r1 costs 1 + 3 = $4,
    # static r2 $4; moving each round to the cheaper one costs 1 + 2 = $3.
    book = PriceBook([PriceSeries("c", "r1", "g", [0.0, 3600.0], [1.0, 3.0]),
                      PriceSeries("c", "r2", "g", [0.0], [2.0])])
    assert book.latest(100.0, ["g"]) == {"g": 1.0}
    assert book.latest(3600.0, ["g"]) == {"g": 2.0}
    jobs = [Job("a", 7200)]
    assert static_choice_costs(jobs, tiny_table(g=1.0), book) == {"c/r1/g": 4.0, "c/r2/g": 4.0}
    assert dynamic_cost(jobs, tiny_table(g=1.0), book) == pytest.approx(3.0)


def test_cost_policy_re_solves_on_price_changes(table):
    jobs = generate_trace(table, num_jobs=12, rate_per_hour=6.0, seed=3)
    cluster = parse_accelerators("v100=4,p100=4,k80=4")
    book = synthetic_prices(cluster.types, duration_s=400 * 3600, seed=2, mean_change_interval_s=3600)
    assert parse_prices("time_s,cloud,region,worker_type,price_per_hour\n0,a,b,v100,1\n").series[0].prices == [1.0]
    res = simulate_cluster(jobs, table, cluster, get_policy("max_sum_throughput_normalized_by_cost_perf"),
                           prices=book)
    flat = simulate_cluster(jobs, table, cluster, get_policy("max_sum_throughput_normalized_by_cost_perf"),
                            prices=PriceBook([PriceSeries("c", "r", t, [0.0], [1.0]) for t in cluster.types]))
    assert res.total_cost is not None and res.total_cost > 0
    assert len(res.solve_times_s) > len(flat.solve_times_s)  # price changes trigger re-solves


@pytest.mark.slow
def test_cli_simulate_json_and_plot(run_cli, tmp_path):
    png = tmp_path / "occ.png"
    code, out, err = run_cli("cluster", "simulate", "--jobs", TRACE, "--accelerators", "v100=12,p100=12,k80=12",
                             "--policy", "max_min_fairness_perf", "--json", "--plot", str(png))
    assert code == 0, err
    d = json.loads(out)
    assert d["jobs"] == 96 and {"avg_jct_s", "makespan_s", "utilization"} <= set(d)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_cli_generate_and_solve(run_cli, tmp_path):
    trace = tmp_path / "jobs.trace"
    prices = tmp_path / "prices.csv"
    assert run_cli("cluster", "generate-trace", "--num-jobs", "8", "--rate", "10", "--out", str(trace))[0] == 0
    assert run_cli("cluster", "generate-prices", "--hours", "300", "--out", str(prices))[0] == 0
    code, out, err = run_cli("cluster", "solve", "--jobs", str(trace), "--json")
    assert code == 0, err
    assert len(json.loads(out)["allocation"]) == 8
    code, out, err = run_cli("cluster", "simulate", "--jobs", str(trace), "--accelerators", "v100=2,p100=2,k80=2",
                             "--policy", "max_sum_throughput_normalized_by_cost_perf", "--prices", str(prices),
                             "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["total_cost"] > 0 and d["elastic_dynamic_cost"] <= d["best_static_cost"] + 1e-9


_LINE = "ResNet-18 (batch size 128)\tcmd\tdir\t--num_steps\t1\t1000\t1\t1\t-1\t0\n"

BAD = [
    ("malformed line", {"t": "just one field\n"}, ["--jobs", "{t}"], "--jobs: line 1"),
    ("bad number", {"t": _LINE.replace("1000", "lots")}, ["--jobs", "{t}"], "--jobs: line 1"),
    ("unsorted", {"t": _LINE.replace("\t0\n", "\t50\n") + _LINE}, ["--jobs", "{t}"], "line 2: arrival"),
    ("unknown type", {"t": _LINE.replace("ResNet-18", "ResNet-19")}, ["--jobs", "{t}"], "unknown job type"),
    ("no usable type", {"t": _LINE.replace("\t1\t1\t-1", "\t8\t1\t-1")},
     ["--jobs", "{t}", "--accelerators", "v100=4,p100=4"], "--accelerators: no accelerator type can run job 1"),
    ("bad accelerators", {"t": _LINE}, ["--jobs", "{t}", "--accelerators", "v100:12"], "--accelerators"),
    ("bad policy", {"t": _LINE}, ["--jobs", "{t}", "--policy", "las"], "--policy: unknown policy"),
    ("missing trace", {}, ["--jobs", "{tmp}/nope.trace"], "--jobs: file"),
    ("bad round", {"t": _LINE}, ["--jobs", "{t}", "--round-s", "0"], "--round-s"),
    ("cost without prices", {"t": _LINE}, ["--jobs", "{t}", "--policy", "max_sum_throughput_normalized_by_cost_perf"],
     "--prices"),
    ("bad prices", {"t": _LINE, "p": "time,price\n"}, ["--jobs", "{t}", "--prices", "{p}"], "--prices"),
    ("bad throughputs", {"t": _LINE, "j": '{"v100": {"not a tuple": {"null": 1}}}'},
     ["--jobs", "{t}", "--throughputs", "{j}"], "--throughputs"),
]


@pytest.mark.parametrize("args,expect", [
    (["generate-trace", "--num-jobs", "2000000000", "--out", "{tmp}/t"], "--num-jobs: must lie in"),
    (["generate-trace", "--rate", "0", "--out", "{tmp}/t"], "--rate"),
    (["generate-prices", "--hours", "1e9", "--out", "{tmp}/t"], "--hours"),
    (["solve", "--jobs", TRACE, "--policy", "max_sum_throughput_normalized_by_cost_perf"], "--policy"),
    (["compare", "--jobs", TRACE, "--policies", "fifo,las"], "--policies: unknown policy"),
    (["simulate", "--jobs", TRACE, "--predict", "gpt3-350m"], "--predict"),
])
def test_other_commands_refuse_bad_input(run_cli, tmp_path, args, expect):
    code, out, err = run_cli("cluster", *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and expect in err and err.count("\n") == 1
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("name,files,args,expect", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_exit_2(run_cli, tmp_path, name, files, args, expect):
    paths = {}
    for key, text in files.items():
        (tmp_path / key).write_text(text)
        paths[key] = str(tmp_path / key)
    argv = [a.format(tmp=tmp_path, **paths) for a in args]
    png = tmp_path / "out.png"
    code, out, err = run_cli("cluster", "simulate", *argv, "--plot", str(png))
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expect in err
    assert not png.exists()


@pytest.mark.slow
def test_predicted_transformer_jobs_mix_with_measured_ones(run_cli, tmp_path):
    from paratrain.cluster.predict import predicted_table

    t = predicted_table([("gpt3-350m", 32)], {"fast": "h100", "slow": "k80"}, scale_factors=(1, 4))
    one, four = t.isolated[("gpt3-350m (batch size 32)", 1)], t.isolated[("gpt3-350m (batch size 32)", 4)]
    assert one["fast"] > 10 * one["slow"]  # 989 dense bf16 TFLOP/s against 4.4 fp32
    assert 3.0 < four["fast"] / one["fast"] <= 4.0  # data parallelism: at most linear
    trace = tmp_path / "mix.trace"
    trace.write_text(_LINE + "gpt3-350m (batch size 32)\t\t\t--steps\t0\t500\t4\t1\t-1\t60\n")
    code, out, err = run_cli("cluster", "simulate", "--jobs", str(trace), "--accelerators", "v100=4,k80=4,a100=4",
                             "--predict", "gpt3-350m:32", "--json")
    assert code == 0, err
    assert json.loads(out)["jobs"] == 2
