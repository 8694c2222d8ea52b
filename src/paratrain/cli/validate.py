"""``paratrain validate``: predicted vs measured iteration time, row by row; fit the efficiencies.

    paratrain validate vtrain-multi --plot multi.png
    paratrain validate vtrain-single --fit --lut vtrain-a100
    paratrain validate all --loso --plot sources.png
    paratrain validate public-runs --calibration none

``vtrain-multi``, ``vtrain-single`` and ``vtrain-a100`` name the measured runs and all-reduce tables
shipped in ``paratrain/data/vtrain/`` (any CSV in the same format works too). ``public-runs`` is the
table of published runs in ``paratrain/data/publicruns/``; ``all`` is every source at once (vTrain's
single-node file, every 8th row, its multi-node file, the public runs, the layers timed on an H100
in ``paratrain/data/measured/``), reported per source, with
the per-device calibrations fitted on them (``--fit``) and checked by leave-one-source-out cross
validation (``--loso``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from paratrain.cli.options import JsonOpt, print_json, progress_bar
from paratrain.errors import ConfigError
from paratrain.fileio import check_not_special

__all__ = ["register", "validate_command", "BUILTIN_DATA", "BUILTIN_LUTS"]

# Data shipped with the package, by name (paths inside paratrain/data/vtrain).
BUILTIN_DATA = {"vtrain-multi": "ground_truth_multi.csv", "vtrain-single": "ground_truth_single.csv"}
BUILTIN_LUTS = {"vtrain-a100": "allreduce_lut/a100"}
SOURCE_SETS = ("public-runs", "all")
_VTRAIN_SINGLE_STRIDE = 8  # every 8th of the 1,440 single-node rows: 180, as many as the other sources' rows
_DEFAULT_EVALUATIONS = 40
_MAX_EVALUATIONS = 10_000  # each evaluation predicts every fitted run: hours past this
_MAX_JOBS = 64


def register(app: typer.Typer) -> None:
    app.command("validate", help="Compare predicted with measured iteration times (vTrain CSV format).")(
        validate_command
    )


def _builtin(path: Path, names: dict[str, str]) -> Path:
    from paratrain.data import vtrain_path

    return vtrain_path(names[str(path)]) if str(path) in names else path


def _read(path: Path, flag: str) -> str:
    if path.is_dir():
        raise ConfigError(flag, f"{str(path)!r} is a directory", "give a CSV file")
    check_not_special(path, flag, "give a CSV file")
    if not path.is_file():
        raise ConfigError(
            flag, f"file {str(path)!r} does not exist", f"give a CSV file or one of: {', '.join(BUILTIN_DATA)}"
        )
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(flag, f"cannot read {str(path)!r}: {e}", "give a UTF-8 CSV file") from None


def _predictor(engine: str) -> Any:
    from paratrain.plan.validate import megatron_predictor

    return megatron_predictor(engine)


def _scatter(path: Path, runs: list, predicted: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meas = [r.time_s for r in runs]
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    sc = ax.scatter(meas, predicted, c=[r.gpus for r in runs], s=14, cmap="viridis", norm=matplotlib.colors.LogNorm())
    lo, hi = min(meas + predicted) * 0.8, max(meas + predicted) * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="exact")
    ax.plot([lo, hi], [lo * 1.1, hi * 1.1], "k:", lw=0.6, label="±10%")
    ax.plot([lo, hi], [lo / 1.1, hi / 1.1], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    # Log axes spanning less than two decades: label a few round values, not every minor tick.
    ticks = [t for t in (0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if lo <= t <= hi]
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_ticks(ticks)
    ax.set_xlabel("measured iteration time (s)")
    ax.set_ylabel("predicted iteration time (s)")
    ax.set_title(title, fontsize=8, wrap=True)
    bar = fig.colorbar(sc, ax=ax, label="GPUs")
    gpus = sorted({r.gpus for r in runs})
    bar.set_ticks(gpus)
    bar.set_ticklabels([str(g) for g in gpus])
    bar.ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(loc="upper left")
    fig.tight_layout()
    from paratrain.fileio import atomic_write_png

    try:
        atomic_write_png(path, fig, "--plot")
    finally:
        plt.close(fig)


def _lut_tables(lut: Path) -> list[tuple[Path, int]]:
    """The all-reduce tables (file, GPU count) in the folder ``lut`` (or the shipped ``vtrain-a100``)."""
    folder = _builtin(lut, BUILTIN_LUTS)
    fix = f"give a folder of AR_GPU<n>_*.csv tables, or one of: {', '.join(BUILTIN_LUTS)}"
    if not folder.is_dir():
        raise ConfigError("--lut", f"{str(folder)!r} is not a directory", fix)
    tables = []
    for f in sorted(folder.glob("*.csv")):
        m = re.search(r"GPU(\d+)", f.name)
        if m is not None:
            tables.append((f, int(m.group(1))))
    if not tables:
        raise ConfigError("--lut", f"no AR_GPU<n>_*.csv tables in {str(folder)!r}", fix)
    return tables


def _fit(data: Path, runs: list, cluster: Any, lut: Path | None, evaluations: int, json_out: bool) -> None:
    from paratrain.cost.collectives import collective_time
    from paratrain.plan.validate import Calibration, errors_pct, fit, fit_links, parse_allreduce_lut, predict, summary

    base = cluster
    bw, lat = base.intra_link.bandwidth_Bps, base.intra_link.latency_s
    samples: list = []
    if lut is not None:
        for f, ranks in _lut_tables(lut):
            rows = parse_allreduce_lut(_read(f, "--lut"), ranks, str(f))
            samples += rows[::32]  # 32 sizes per GPU count span 1 MiB..1 GiB evenly
        bw, lat = fit_links(samples, base, collective_time)
    dev = base.device
    start = Calibration(
        dev.gemm_efficiency,
        dev.memory_efficiency,
        dev.kernel_overhead_s,
        bw,
        lat,
        bw / base.intra_link.bandwidth_Bps,
        host_issue_s=max(dev.host_issue_s, 10e-6),  # start inside the bounds, away from the kink at 0
    )
    subset = runs[::4]
    predictor = _predictor("analytic")
    with progress_bar("fitting: runs predicted", json_out) as tick:
        count = [0]

        def counted(*a: Any) -> float:
            # The optimizer's own Jacobian steps add evaluations: the count has no known total.
            count[0] += 1
            tick(count[0], None)
            return predictor(*a)

        cal, report = fit(subset, base, counted, start=start, max_evaluations=evaluations)
    with progress_bar("predicting", json_out) as tick:
        errs = errors_pct(runs, predict(runs, base, cal, predictor, progress=tick))
    doc = {
        "calibration": cal.to_dict(),
        "fit": report,
        "fitted_on": str(data),
        "fit_rows": len(subset),
        "lut_samples": len(samples),
        "summary_all_rows": summary(errs),
    }
    if json_out:
        print_json(doc)
        return
    con = Console()
    con.print(
        f"fitted on {len(subset)} of {len(runs)} runs of {data} ({report['evaluations']} evaluations)", soft_wrap=True
    )
    for k, v in cal.to_dict().items():
        con.print(f"  {k:<22} {v:.6g}" if v is not None else f"  {k:<22} - (the device's)")
    s = doc["summary_all_rows"]
    con.print(f"all {s['rows']} runs: mean |error| {s['mean_abs_error_pct']:.1f}%, max {s['max_abs_error_pct']:.1f}%")


def validate_command(
    data: Annotated[
        Path,
        typer.Argument(
            help="CSV of measured runs (vTrain format), or vtrain-multi / vtrain-single / public-runs / all."
        ),
    ],
    cluster: Annotated[str | None, typer.Option(
        "--cluster", "-c", help="Cluster preset or file of a CSV's runs (default dgx-a100; public-runs / all: "
        "each run's own).")] = None,
    calibration: Annotated[
        str | None,
        typer.Option(
            "--calibration",
            help="vtrain-a100 (default for vTrain CSVs), fitted (default for public-runs / all: per device) or none.",
        ),
    ] = None,
    loso: Annotated[
        bool, typer.Option("--loso", help="public-runs / all: add leave-one-source-out cross validation.")
    ] = False,
    engine: Annotated[str | None, typer.Option(
        "--engine", help="sim (simulator, default) or analytic (closed forms); --fit, public-runs and all "
        "predict with the closed forms.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a scatter plot PNG.")] = None,
    rows: Annotated[int, typer.Option("--rows", help="Rows of the per-run table (largest errors first).")] = 15,
    fit_params: Annotated[bool, typer.Option("--fit", help="Fit the efficiency parameters to DATA instead.")] = False,
    lut: Annotated[
        Path | None,
        typer.Option("--lut", help="With --fit: folder of nccl-tests all-reduce tables, or vtrain-a100."),
    ] = None,
    evaluations: Annotated[int | None, typer.Option(
        "--evaluations", help="With --fit (or --loso): optimizer evaluations (default 40).")] = None,
    jobs: Annotated[int | None, typer.Option("--jobs", help="With --loso: folds run in this many processes "
                                             "(default: the CPUs, at most 8; the same figures).")] = None,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.cli.options import resolve_cluster_opts
    from paratrain.plan.calibrated import CALIBRATIONS
    from paratrain.plan.validate import errors_pct, parse_vtrain_csv, predict, summary

    # Every flag is checked before the first prediction.
    if jobs is not None and (jobs < 1 or jobs > _MAX_JOBS):
        raise ConfigError("--jobs", f"must be in 1..{_MAX_JOBS}, got {jobs}", "e.g. --jobs 2")
    if jobs is not None and not loso:
        raise ConfigError("--jobs", "sets the processes of --loso's folds", "add --loso or drop --jobs")
    sources = str(data) in SOURCE_SETS
    # Flags the chosen mode does not use are refused rather than ignored: an unknown engine or
    # cluster would otherwise pass unnoticed, and the printed figures would not be what was asked.
    if engine is not None:
        _predictor(engine)  # an unknown name is an error in every mode
        if engine != "analytic" and (fit_params or sources):
            raise ConfigError("--engine", f"{'--fit' if fit_params else data} predicts with the closed forms",
                              "drop --engine (or use --engine analytic)")
    if evaluations is not None and not (fit_params or loso):
        raise ConfigError("--evaluations", "counts the evaluations of --fit and --loso", "add --fit or drop it")
    evaluations = _DEFAULT_EVALUATIONS if evaluations is None else evaluations
    if sources:
        if cluster is not None:
            raise ConfigError("--cluster", f"{data} predicts each run on its own cluster", "drop --cluster")
        _validate_sources(str(data), "fitted" if calibration is None else calibration, loso, fit_params, plot,
                          rows, evaluations, lut, json_out,
                          jobs=jobs if jobs is not None else min(os.cpu_count() or 1, 8))
        return
    if loso:
        raise ConfigError("--loso", "needs several sources", f"use it with {' or '.join(SOURCE_SETS)}")
    cluster = "dgx-a100" if cluster is None else cluster
    engine = "sim" if engine is None else engine
    calibration = "vtrain-a100" if calibration is None else calibration
    if calibration == "fitted":  # vTrain's runs are all on A100
        calibration = "fitted-a100"
    if rows < 0:
        raise ConfigError("--rows", f"must be at least 0, got {rows}", "e.g. --rows 15")
    if not 1 <= evaluations <= _MAX_EVALUATIONS:
        raise ConfigError(
            "--evaluations", f"must be in 1..{_MAX_EVALUATIONS:,}, got {evaluations:,}", "e.g. --evaluations 40"
        )
    if calibration not in CALIBRATIONS and calibration != "none":
        raise ConfigError(
            "--calibration", f"unknown calibration {calibration!r}", f"use one of: none, {', '.join(CALIBRATIONS)}"
        )
    if plot is not None:
        from paratrain.fileio import check_distinct_paths, check_output_path

        check_output_path(plot, "--plot")
        check_distinct_paths({"--plot": plot}, {"DATA": data, "--cluster": cluster})
    if lut is not None and not fit_params:
        raise ConfigError("--lut", "is used only with --fit", "add --fit or drop --lut")
    if plot is not None and fit_params:
        raise ConfigError("--plot", "is not drawn with --fit", "drop --plot, or run without --fit to plot")
    if lut is not None:
        _lut_tables(lut)
    data = _builtin(data, BUILTIN_DATA)
    predictor_fn = _predictor(engine)
    runs = parse_vtrain_csv(_read(data, "DATA"), str(data))
    base = resolve_cluster_opts(cluster)
    if fit_params:
        _fit(data, runs, base, lut, evaluations, json_out)
        return
    cal = CALIBRATIONS.get(calibration)
    with progress_bar("predicting", json_out) as tick:
        predicted = predict(runs, base, cal, predictor_fn, progress=tick)
    errs = errors_pct(runs, predicted)
    summ = summary(errs)
    if plot is not None:
        _scatter(
            plot,
            runs,
            predicted,
            f"{data.name}: {len(runs)} runs, mean |error| {summ['mean_abs_error_pct']:.1f}%\n"
            f"(calibration {calibration}, {engine})",
        )
    table = [
        {
            "line": r.line,
            "gpus": r.gpus,
            "hidden": r.hidden,
            "layers": r.layers,
            "tp": r.tp,
            "dp": r.dp,
            "pp": r.pp,
            "microbatch": r.microbatch,
            "global_batch": r.global_batch,
            "measured_s": r.time_s,
            "predicted_s": p,
            "error_pct": e,
        }
        for r, p, e in zip(runs, predicted, errs, strict=True)
    ]
    if json_out:
        print_json({"data": str(data), "calibration": calibration, "engine": engine, "summary": summ, "rows": table})
        return
    con = Console(width=140)
    t = Table(title=f"{data.name}: the {min(rows, len(table))} largest errors of {len(table)} runs")
    for col in (
        "line",
        "GPUs",
        "hidden",
        "layers",
        "tp",
        "dp",
        "pp",
        "mb",
        "batch",
        "measured s",
        "predicted s",
        "error %",
    ):
        t.add_column(col, justify="right")
    for row in sorted(table, key=lambda x: -abs(x["error_pct"]))[:rows]:
        t.add_row(
            *(
                str(row[k])
                for k in ("line", "gpus", "hidden", "layers", "tp", "dp", "pp", "microbatch", "global_batch")
            ),
            f"{row['measured_s']:.3f}",
            f"{row['predicted_s']:.3f}",
            f"{row['error_pct']:+.1f}",
        )
    con.print(t)
    con.print(
        f"{summ['rows']} runs: mean |error| {summ['mean_abs_error_pct']:.1f}%, median "
        f"{summ['median_abs_error_pct']:.1f}%, max {summ['max_abs_error_pct']:.1f}%, mean signed error "
        f"{summ['mean_error_pct']:+.1f}% (calibration {calibration}, engine {engine})"
    )
    if plot is not None:
        con.print(f"wrote {plot}")


def _source_samples(name: str) -> tuple[list[Any], list[tuple[int, str, str]]]:
    from paratrain.data import DATA_DIR, vtrain_path
    from paratrain.plan.crossval import layer_samples, public_samples, vtrain_samples
    from paratrain.plan.publicruns import parse_public_runs
    from paratrain.plan.validate import parse_vtrain_csv

    path = DATA_DIR / "publicruns" / "h100_a100_public_runs.csv"
    public = parse_public_runs(path.read_text(encoding="utf-8"), path.name)
    samples = public_samples(public.runs)
    if name == "all":
        single = parse_vtrain_csv(vtrain_path("ground_truth_single.csv").read_text(encoding="utf-8-sig"))
        multi = parse_vtrain_csv(vtrain_path("ground_truth_multi.csv").read_text(encoding="utf-8-sig"))
        samples += vtrain_samples(single[::_VTRAIN_SINGLE_STRIDE], "vtrain-single")
        samples += vtrain_samples(multi, "vtrain-multi")
        samples += layer_samples()  # the H100 itself: layers timed on one GPU
    return samples, list(public.skipped)


def _source_calibrations(calibration: str) -> dict[str, Any]:
    from paratrain.plan.calibrated import CALIBRATIONS, FITTED_BY_DEVICE
    from paratrain.plan.publicruns import DEVICE_CLUSTERS

    if calibration == "fitted":  # each device preset's own calibration
        return {key: FITTED_BY_DEVICE[device] for key, (_, device) in DEVICE_CLUSTERS.items()}
    if calibration == "none":
        return {}
    if calibration in ("vtrain-a100", "vtrain-a100-links"):
        return {"a100": CALIBRATIONS[calibration]}
    raise ConfigError("--calibration", f"{calibration!r} does not apply to {', '.join(SOURCE_SETS)}",
                      "use fitted, none or vtrain-a100")


def _by_source(samples: list[Any], errors: list[float]) -> dict[str, dict[str, Any]]:
    from paratrain.plan.validate import summary

    groups: dict[str, list[tuple[Any, float]]] = {}
    for s, e in zip(samples, errors, strict=True):
        groups.setdefault(s.source, []).append((s, e))
    return {
        src: {"devices": sorted({s.device for s, _ in pairs}), **summary([e for _, e in pairs])}
        for src, pairs in sorted(groups.items())
    }


def _source_scatter(path: Path, samples: list[Any], predicted: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paratrain.fileio import atomic_write_png

    fig, ax = plt.subplots(figsize=(7.5, 6))
    sources = sorted({s.source for s in samples})
    cmap = plt.get_cmap("tab10" if len(sources) <= 10 else "tab20")  # one colour per source
    markers = {"a100": "o", "h100": "^", "h100-hbm2e": "v"}
    for i, src in enumerate(sources):
        for dev, marker in markers.items():
            pts = [(s.measured_s, p) for s, p in zip(samples, predicted, strict=True)
                   if s.source == src and s.device == dev]
            if pts:
                ax.scatter([m for m, _ in pts], [p for _, p in pts], s=16, marker=marker, color=cmap(i % cmap.N),
                           label=f"{src} ({dev.upper()})", alpha=0.8)
    meas = [s.measured_s for s in samples]
    lo, hi = min(meas + predicted) * 0.8, max(meas + predicted) * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
    ax.plot([lo, hi], [lo * 1.1, hi * 1.1], "k:", lw=0.6)
    ax.plot([lo, hi], [lo / 1.1, hi / 1.1], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(title, fontsize=8, wrap=True)
    ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    try:
        atomic_write_png(path, fig, "--plot")
    finally:
        plt.close(fig)


def _validate_sources(
    name: str, calibration: str, loso: bool, fit_params: bool, plot: Path | None, rows: int, evaluations: int,
    lut: Path | None, json_out: bool, *, jobs: int = 1,
) -> None:
    """Several sources at once: per-source errors, the per-device fit, leave-one-source-out."""
    from paratrain.plan.crossval import TIED, cross_validate, fit_devices, predict_samples, start_calibration
    from paratrain.plan.publicruns import public_clusters
    from paratrain.plan.validate import summary

    if rows < 0:
        raise ConfigError("--rows", f"must be at least 0, got {rows}", "e.g. --rows 15")
    if not 1 <= evaluations <= _MAX_EVALUATIONS:
        raise ConfigError(
            "--evaluations", f"must be in 1..{_MAX_EVALUATIONS:,}, got {evaluations:,}", "e.g. --evaluations 40"
        )
    if lut is not None:
        raise ConfigError("--lut", f"is not used with {name}", "drop --lut")
    if fit_params and (loso or plot is not None):
        raise ConfigError("--fit", "prints the fitted calibrations only", "drop --loso / --plot, or drop --fit")
    cals = _source_calibrations(calibration)
    if plot is not None:
        from paratrain.fileio import check_output_path

        check_output_path(plot, "--plot")
    samples, skipped = _source_samples(name)
    clusters = public_clusters()
    starts = {d: start_calibration(c) for d, c in clusters.items()}
    if fit_params:
        doc: dict[str, Any] = {}
        with progress_bar("fitting", json_out) as tick:
            fits = fit_devices(samples, starts, clusters, sorted(clusters), max_evaluations=evaluations,
                               progress=tick)
        for dev, (cal, report) in fits.items():
            doc[dev] = {"calibration": cal.to_dict(), "fit": report}
        if json_out:
            print_json(doc)
            return
        con = Console()
        for dev, d in doc.items():
            if d["fit"] is None:
                con.print(f"{dev}: no runs measure it (the presets)")
                continue
            tie = f"; GEMM and attention = {TIED[dev]}'s x clock {d['fit']['clock']:.4f}" if dev in TIED else ""
            prior = d["fit"].get("host_issue_prior_s")
            prior = f"; host issue time's measured prior {prior * 1e6:.1f} us" if prior is not None else ""
            con.print(f"{dev}: fitted on {d['fit']['rows']} runs of {', '.join(d['fit']['sources'])} "
                      f"({d['fit']['evaluations']} evaluations{tie}{prior})", soft_wrap=True)
            for k, v in d["calibration"].items():
                con.print(f"  {k:<22} {v:.6g}" if v is not None else f"  {k:<22} - (the device's)")
        return
    with progress_bar("predicting", json_out) as tick:
        predicted = predict_samples(samples, cals, clusters, progress=tick)
    errs = [100.0 * (p / s.measured_s - 1.0) for s, p in zip(samples, predicted, strict=True)]
    by_source = _by_source(samples, errs)
    loso_pred: list[float] | None = None
    if loso:
        with progress_bar("leave-one-source-out: fitting without", json_out) as tick:
            held = cross_validate(samples, starts, clusters, max_evaluations=evaluations,
                                  progress=lambda i, n, src: tick(i, n, src), jobs=jobs)
        index: dict[str, int] = {}
        loso_pred = []
        for s in samples:
            k = index.get(s.source, 0)
            loso_pred.append(held[s.source][k])
            index[s.source] = k + 1
        loso_errs = [100.0 * (p / s.measured_s - 1.0) for s, p in zip(samples, loso_pred, strict=True)]
        for src, d in _by_source(samples, loso_errs).items():
            by_source[src]["loso"] = {k: v for k, v in d.items() if k != "devices"}
    summ = summary(errs)
    loso_summ = summary([100.0 * (p / s.measured_s - 1.0) for s, p in zip(samples, loso_pred, strict=True)]) \
        if loso_pred is not None else None
    if plot is not None:
        shown = loso_pred if loso_pred is not None else predicted
        what = "leave-one-source-out" if loso_pred is not None else f"calibration {calibration}"
        s_ = loso_summ if loso_summ is not None else summ
        _source_scatter(plot, samples, shown, f"{name}: {len(samples)} runs, {what}: mean |error| "
                        f"{s_['mean_abs_error_pct']:.1f}%, max {s_['max_abs_error_pct']:.1f}%")
    table = [
        {"source": s.source, "device": s.device, "line": s.run.line, "gpus": s.run.gpus, "measured_s": s.measured_s,
         "predicted_s": p, "error_pct": e,
         **({"loso_predicted_s": loso_pred[i], "loso_error_pct": 100.0 * (loso_pred[i] / s.measured_s - 1.0)}
            if loso_pred is not None else {})}
        for i, (s, p, e) in enumerate(zip(samples, predicted, errs, strict=True))
    ]
    if json_out:
        print_json({"data": name, "calibration": calibration, "summary": summ, "loso_summary": loso_summ,
                    "by_source": by_source, "rows": table,
                    "skipped": [{"line": ln, "source": src, "reason": why} for ln, src, why in skipped]})
        return
    con = Console(width=140)
    t = Table(title=f"{name}: {len(samples)} runs by source (calibration {calibration})")
    for col in ("source", "GPU", "runs", "mean |err| %", "max |err| %", "mean err %",
                *(("LOSO mean |err| %", "LOSO max |err| %") if loso else ())):
        t.add_column(col, justify="left" if col in ("source", "GPU") else "right")
    for src, d in by_source.items():
        t.add_row(src, ",".join(d["devices"]), str(d["rows"]), f"{d['mean_abs_error_pct']:.1f}",
                  f"{d['max_abs_error_pct']:.1f}", f"{d['mean_error_pct']:+.1f}",
                  *((f"{d['loso']['mean_abs_error_pct']:.1f}", f"{d['loso']['max_abs_error_pct']:.1f}")
                    if loso else ()))
    con.print(t)
    if rows:
        w = Table(title=f"the {min(rows, len(table))} largest errors")
        for col in ("source", "line", "GPU", "GPUs", "measured s", "predicted s", "error %"):
            w.add_column(col, justify="left" if col in ("source", "GPU") else "right")
        for r in sorted(table, key=lambda x: -abs(x["error_pct"]))[:rows]:
            w.add_row(r["source"], str(r["line"]), r["device"], str(r["gpus"]), f"{r['measured_s']:.3f}",
                      f"{r['predicted_s']:.3f}", f"{r['error_pct']:+.1f}")
        con.print(w)
    con.print(f"{summ['rows']} runs: mean |error| {summ['mean_abs_error_pct']:.1f}%, max "
              f"{summ['max_abs_error_pct']:.1f}% (calibration {calibration})")
    if loso_summ is not None:
        con.print(f"leave-one-source-out: mean |error| {loso_summ['mean_abs_error_pct']:.1f}%, max "
                  f"{loso_summ['max_abs_error_pct']:.1f}%")
    reasons: dict[str, int] = {}
    for _, _, why in skipped:
        reasons[why.split(" (")[0] if why.startswith("context") else why] = reasons.get(why, 0) + 1
    if skipped:
        con.print(f"skipped {len(skipped)} public-runs rows: "
                  + "; ".join(f"{why} ×{n}" for why, n in sorted(reasons.items())), soft_wrap=True)
    if plot is not None:
        con.print(f"wrote {plot}")
