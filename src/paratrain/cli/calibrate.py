"""``paratrain calibrate``: measure this machine's CPU and store it as the ``cpu`` device and the
``cpu`` cluster's links.

The measurements are :mod:`paratrain.runtime.calibrate`'s; the link fit
:mod:`paratrain.sim.fit_links`'s; ``--from-trace`` fits with :mod:`paratrain.sim.fit`. The
device goes to ``cpu_calibration_path()`` (``$PARATRAIN_CACHE/cpu.json``;
``~/.cache/paratrain/cpu.json`` by default), where ``resolve_device("cpu")`` picks it up, and the
links to ``cpu-cluster.json`` next to it, read by the ``cpu`` cluster preset. Takes about 14 s,
with a progress bar on a terminal.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from paratrain.cli.options import JsonOpt, print_json, progress_bar
from paratrain.errors import ConfigError, require_at_most
from paratrain.fileio import atomic_write_text, check_distinct_paths, check_output_path
from paratrain.spec.cluster_presets import cpu_cluster_calibration_path
from paratrain.spec.device import DeviceSpec, cpu_calibration_path
from paratrain.spec.device import from_document as device_from_document

if TYPE_CHECKING:
    from paratrain.runtime.calibrate import Progress

__all__ = ["register", "calibrate"]

_MAX_PROCS = 64  # as comm tune's --nproc: local processes joined over loopback
_MAX_THREADS = 1024  # beyond the cores of any one machine


def register(app: typer.Typer) -> None:
    app.command("calibrate", help="Measure this machine's CPU and store it as the `cpu` device.")(calibrate)


@contextmanager
def _progress_bar(procs: int, quiet: bool) -> Iterator[Progress]:
    """The measurements' progress on a terminal (nothing piped or with ``quiet``)."""
    from paratrain.runtime.calibrate import measurement_steps

    with progress_bar("calibrating", quiet) as tick:
        tick(0, measurement_steps(procs), f"starting {procs} processes" if procs > 1 else "starting")
        yield tick


def _fit_from_traces(target: Path, traces: list[Path], json_out: bool) -> None:
    """``--from-trace``: the stored calibration's compute speed and duration variation fitted to
    measured pipeline runs (:mod:`paratrain.sim.fit`), every other figure kept."""
    from paratrain.sim.fit import fit_trace, pooled_speed_factor, scaled_device

    if not target.is_file():
        raise ConfigError("--from-trace", f"there is no calibration at {str(target)!r} to update",
                          "run `paratrain calibrate` first (with the same --out, if any)")
    try:
        doc = json.loads(target.read_text())
        if isinstance(doc, dict) and "preset" in doc:
            raise ConfigError("preset", "a calibration holds measured figures, not a preset")
        device = device_from_document(doc, "calibration")
    except (ValueError, TypeError, ConfigError) as e:
        raise ConfigError("--from-trace", f"the calibration at {str(target)!r} cannot be read ({e})",
                          "run `paratrain calibrate` again to rewrite it") from None
    fits = [fit_trace(path, device) for path in traces]
    factor = pooled_speed_factor(fits)
    cv = min(1.0, statistics.fmean(f.duration_cv for f in fits))
    fitted = scaled_device(device, factor, cv)
    atomic_write_text(target, json.dumps(fitted.to_dict(), indent=2) + "\n", "--out")
    if json_out:
        print_json({"path": str(target), "device": fitted.to_dict(), "speed_factor": factor, "duration_cv": cv,
                    "previous_duration_cv": device.duration_cv,
                    "traces": [{**dataclasses.asdict(f), "speed_factor": f.speed_factor} for f in fits]})
        return
    for f in fits:
        print(f"{f.path}: compute {f.measured_busy_s:.4g} s per step measured vs {f.simulated_busy_s:.4g} s modelled "
              f"(x{f.speed_factor:.3f}); variation of action durations {f.duration_cv:.3f}")
    print(f"GEMM efficiency and memory bandwidth / {factor:.3f} (peak FLOP/s kept), kernel overheads x {factor:.3f}; "
          f"duration_cv {device.duration_cv:.3f} -> {cv:.3f}; wrote {target}")


def tp_lines(rows: list[list[str | int | float]], device: DeviceSpec,
             cpu_rows: list[list[str | int | float]] = ()) -> list[str]:
    """The tensor-parallel measurements as printed: one line per collective kind and group size
    (its time, then the CPU it cost), DTensor's dispatch."""
    cpu = {(str(k), int(g), int(b)): float(s) for k, g, b, s in cpu_rows}
    by: dict[tuple[str, int], list[str]] = {}
    for kind, group, nbytes, seconds in rows:
        key = (str(kind), int(group), int(nbytes))
        of_cpu = f" (CPU {cpu[key] * 1e3:.2f})" if key in cpu else ""
        by.setdefault((str(kind), int(group)), []).append(f"{_kib(int(nbytes))} {float(seconds) * 1e3:.2f}{of_cpu} ms")
    out = [f"tensor-parallel {kind.replace('_', '-')} over {group} processes in a layer (one group): "
           + ", ".join(v) for (kind, group), v in by.items()]
    out.append(f"DTensor dispatch per tensor-parallel module: forward {device.tp_dispatch_forward_s * 1e6:.0f} us, "
               f"backward {device.tp_dispatch_backward_s * 1e6:.0f} us")
    return out


def _fit_from_comm_table(links: Path, table_path: Path, json_out: bool) -> None:
    """``--comm-table``: the link's alpha-beta fitted to ``paratrain comm tune``'s send/recv times
    (:func:`paratrain.runtime.comm.tune.links_from_table`), the other figures of the file kept."""
    from paratrain.runtime.comm.table import load_table
    from paratrain.runtime.comm.tune import links_from_table

    table = load_table(table_path, "--comm-table")
    existing = None
    if links.is_file():
        try:
            old = json.loads(links.read_text(encoding="utf-8"))
            existing = old if isinstance(old, dict) else None
        except (OSError, ValueError):
            existing = None  # a damaged file is rewritten, as a fresh calibration would
    doc = links_from_table(table, existing)
    atomic_write_text(links, json.dumps(doc, indent=2) + "\n", "--out")
    if json_out:
        print_json({"links_path": str(links), "links": doc})
        return
    for f in doc["comm_fit"]:
        print(f"{f['op']:<15} {f['backend']:<8} alpha {f['latency_s'] * 1e6:8.1f} us  "
              f"beta {f['bandwidth_Bps'] / 1e9:7.2f} GB/s")
    print(f"link of the cpu cluster: alpha {doc['p2p_latency_s'] * 1e6:.1f} us, beta "
          f"{doc['p2p_bandwidth_Bps'] / 1e9:.2f} GB/s ({doc['comm_fit_backend']} send/recv); wrote {links}")


def _calibrate_gpu(preset: str, out: Path | None, json_out: bool) -> None:
    """``--gpu PRESET``: the preset's GEMM, memory and attention efficiencies measured on this
    machine's CUDA device (:mod:`paratrain.runtime.gpu_calibrate`), stored beside the CPU's."""
    from paratrain.runtime import gpu_calibrate
    from paratrain.spec.device import resolve_device

    device = resolve_device(preset, "--gpu")
    if device.peak_bf16_flops <= 0:
        raise ConfigError("--gpu", f"{device.name} has no bf16 tensor cores to measure", "give a GPU preset, e.g. h100")
    target = out if out is not None else gpu_calibrate.measured_calibration_path(device.name)
    check_output_path(target, "--out")
    if not gpu_calibrate.cuda_available():
        raise ConfigError("--gpu", "no CUDA device is visible to torch", "run it on the GPU machine")
    t0 = time.perf_counter()
    measured = gpu_calibrate.measure_gpu()
    doc = {**gpu_calibrate.efficiencies(measured, device), "measured": measured}
    atomic_write_text(target, json.dumps(doc, indent=2) + "\n", "--out")
    if json_out:
        print_json({"path": str(target), **doc, "seconds": time.perf_counter() - t0})
        return
    print(f"{measured['torch_device']} measured as {device.name} ({measured['dtype']}):")
    for g in doc["gemm_by_shape"]:
        print(f"  GEMM {g['m']}x{g['n']}x{g['k']}: {g['flops_per_s'] / 1e12:.1f} TFLOP/s, efficiency "
              f"{g['efficiency']:.3f}")
    ew = measured["elementwise"]
    print(f"  copy {doc['copy_efficiency']:.3f} of the bandwidth; a layer's element-wise kernels at "
          f"{ew['tokens']}x{ew['hidden']}: norm {ew['norm_s'] * 1e3:.3f} ms, residual {ew['residual_s'] * 1e3:.3f} ms, "
          f"GeLU {ew['activation_s'] * 1e3:.3f} ms")
    print(f"  host issue time {doc['host_issue_s'] * 1e6:.1f} us per modelled kernel (the runtime's block at "
          f"a negligible size, {measured['host_block_s'] * 1e3:.2f} ms forward + backward)")
    by_seq = ", ".join(f"{a['seq']}: {a['efficiency']:.3f}" for a in doc["attention_by_seq"])
    print(f"  attention efficiency by sequence: {by_seq}")
    print(f"gemm_efficiency {doc['gemm_efficiency']:.3f} (median), memory_efficiency {doc['memory_efficiency']:.3f} "
          f"(norm + residual), activation_efficiency {doc['activation_efficiency']:.3f}, "
          f"attention_efficiency {doc['attention_efficiency']:.3f} (median); wrote {target}")


def _kib(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def calibrate(
    out: Annotated[Path | None, typer.Option("--out", help="Write the device JSON here instead.")] = None,
    threads: Annotated[int | None, typer.Option(
        "--threads", help="Torch threads per process (default: torch's, i.e. OMP_NUM_THREADS or all cores).")] = None,
    procs: Annotated[int | None, typer.Option(
        "--procs", help="Processes measuring at once, joined by gloo over loopback (1: the device alone, "
        "no link figures; default 2).")] = None,
    from_trace: Annotated[list[Path] | None, typer.Option(
        "--from-trace", help="Measured pipeline runs (paratrain train --trace): fit the stored calibration's "
        "compute speed and duration variation to them instead of measuring anything. Repeatable.")] = None,
    comm_table: Annotated[Path | None, typer.Option(
        "--comm-table", help="A table from `paratrain comm tune`: fit the cpu cluster's link alpha-beta to its "
        "send/recv times (and store the per-operation fits) instead of measuring anything.")] = None,
    gpu: Annotated[str | None, typer.Option(
        "--gpu", help="Measure this machine's CUDA GPU (GEMMs, memory bandwidth, fused attention) as the named "
        "device preset, e.g. h100, and store its efficiencies; `--calibration measured` applies them.")] = None,
    json_out: JsonOpt = False,
) -> None:
    if gpu is not None:
        if from_trace or comm_table is not None or threads is not None or procs is not None:
            raise ConfigError("--gpu", "measures the GPU alone", "drop --from-trace/--comm-table/--threads/--procs")
        _calibrate_gpu(gpu, out, json_out)
        return
    target = out if out is not None else cpu_calibration_path()
    if comm_table is not None:
        if from_trace or threads is not None or procs is not None:
            raise ConfigError("--comm-table", "measures nothing and fits only the link",
                              "drop --from-trace/--threads/--procs, or run them separately")
        links_out = target.parent / cpu_cluster_calibration_path().name
        check_output_path(links_out, "--out")
        check_distinct_paths({"--out": links_out}, {"--comm-table": comm_table})
        _fit_from_comm_table(links_out, comm_table, json_out)
        return
    if from_trace:
        for flag, value in (("--threads", threads), ("--procs", procs)):
            if value is not None:
                raise ConfigError(flag, "measures nothing with --from-trace", f"drop {flag} or --from-trace")
        check_output_path(target, "--out")
        check_distinct_paths({"--out": target}, {"--from-trace": from_trace})
        _fit_from_traces(target, from_trace, json_out)
        return
    links = target.parent / cpu_cluster_calibration_path().name
    procs = 2 if procs is None else procs
    if threads is not None and threads < 1:
        raise ConfigError("--threads", f"must be at least 1, got {threads}", "use e.g. --threads 1")
    if procs < 1:
        raise ConfigError("--procs", f"must be at least 1, got {procs}", "use 2 (a pipeline of two stages) or 1")
    # Unbounded, --procs 10**12 spawns processes until the machine stalls and a huge --threads
    # overflows torch.set_num_threads.
    require_at_most("--procs", procs, _MAX_PROCS, "processes measuring on one machine")
    if threads is not None:
        require_at_most("--threads", threads, _MAX_THREADS, "threads per process")
    # fail before measuring, not after
    check_output_path(target, "--out")
    if procs > 1:
        check_output_path(links, "--out")
    from paratrain.runtime.calibrate import (
        ATTENTION_SHAPE,
        COPY_BYTES,
        EW_ELEMENTS,
        VARIATION_SHAPE,
        device_from_measurement,
        measure_machine,
        size_label,
    )
    from paratrain.sim.fit_links import links_document

    if threads is None:
        import torch

        threads = torch.get_num_threads()
    t0 = time.perf_counter()
    with _progress_bar(procs, quiet=json_out) as progress:
        m, comm = measure_machine(procs, threads, progress)
    device = device_from_measurement(m)
    cluster_doc = (
        links_document(comm["p2p_s_by_bytes"], comm["allreduce_s_by_bytes"], procs, threads,
                       comm.get("measured_collectives", ()), cores=int(m.get("cores", 0)),
                       collective_cpu=comm.get("collective_cpu", ()),
                       measured_reductions=comm.get("measured_reductions", ()),
                       measured_p2p=comm.get("measured_p2p", ()))
        if comm is not None else None
    )
    atomic_write_text(target, json.dumps(device.to_dict(), indent=2) + "\n", "--out")
    if cluster_doc is not None:
        atomic_write_text(links, json.dumps(cluster_doc, indent=2) + "\n", "--out")
    elapsed = time.perf_counter() - t0
    if json_out:
        print_json({
            "path": str(target),
            "device": device.to_dict(),
            "gemm_flops_by_size": {str(k): v for k, v in m["gemm_flops_by_size"].items()},
            "links_path": str(links) if cluster_doc is not None else None,
            "links": cluster_doc,
            "seconds": elapsed,
        })
        return
    how = f"{procs} processes measuring at once, sustained rates" if procs > 1 else "1 process, best of repeats"
    print(f"{threads} thread(s) per process, {how}")
    for n, f in m["gemm_flops_by_size"].items():
        print(f"fp32 GEMM {n}x{n}x{n}: {f / 1e9:.1f} GFLOP/s")
    print(f"memory bandwidth (copy of {COPY_BYTES // 2**20} MiB): {device.memory_bandwidth_Bps / 1e9:.2f} GB/s")
    if "elementwise_Bps" in m:
        kernels = ("add, softmax, layer norm" if "activation_Bps" in m
                   else "add, GeLU and its backward, softmax, layer norm")
        print(f"element-wise kernels ({kernels}; {EW_ELEMENTS * 4 // 2**20} "
              f"MiB): {m['elementwise_Bps'] / 1e9:.2f} GB/s = memory efficiency {device.memory_efficiency:.2f}")
    if "activation_Bps" in m:
        print(f"activation (GeLU, its backward and the bias gradient; {EW_ELEMENTS * 4 // 2**20} MiB): "
              f"{m['activation_Bps'] / 1e9:.2f} GB/s = activation efficiency {device.activation_memory_efficiency:.2f}")
    print(f"kernel overhead (per modelled kernel of the runtime's GPT block at hidden 16, forward and backward through "
          f"autograd): {device.kernel_overhead_s * 1e6:.1f} us; tiny add {m['small_add_s'] * 1e6:.1f} us, tiny 8x8 "
          f"matmul {m['small_matmul_s'] * 1e6:.1f} us")
    if "training_gemm_s" in m:
        t, h, f = VARIATION_SHAPE
        print(f"training GEMMs ({t} tokens, Linear {h}->{f}->{h}, forward and backward through autograd): "
              f"GEMM efficiency {device.gemm_efficiency:.3f} of the best square GEMM")
    if "attention_s" in m:
        b, heads, seq, head_dim = ATTENTION_SHAPE
        print(f"attention (torch SDPA, causal, {b} x {heads} heads x {seq} tokens x {head_dim}, forward and backward "
              f"through autograd): {m['attention_s'] * 1e3:.2f} ms = attention efficiency "
              f"{device.attention_efficiency:.3f} (fused attention)")
    print(f"duration variation (std / mean of a {VARIATION_SHAPE[0]}x{VARIATION_SHAPE[1]}x{VARIATION_SHAPE[2]} MLP "
          f"forward + backward, back to back): {device.duration_cv:.3f}")
    print(f"threads: {device.sm_count}; memory: {device.memory_bytes / 2**30:.1f} GiB")
    if m.get("cores"):
        share = min(1.0, m["cores"] / (procs * threads))
        print(f"cores: {m['cores']}; {procs} x {threads} thread(s) measuring at once got {share:.2f} of a core each: "
              f"stored per core (GEMM {device.peak_fp32_flops / 1e9:.1f} GFLOP/s), shared again by the simulator")
    if cluster_doc is not None:
        sizes = ", ".join(f"{int(k) // 1024} KiB {v * 1e6:.0f} us" for k, v in cluster_doc["p2p_s_by_bytes"].items())
        print(f"gloo p2p over loopback (one way): {sizes}")
        if cluster_doc["measured_p2p"]:
            loaded = ", ".join(f"{size_label(int(b))} {t * 1e3:.2f} ms" for *_, b, t in cluster_doc["measured_p2p"])
            print(f"  while the other processes compute: {loaded}")
        print(f"  fit alpha + n/beta: alpha {cluster_doc['p2p_latency_s'] * 1e6:.1f} us, "
              f"beta {cluster_doc['p2p_bandwidth_Bps'] / 1e9:.2f} GB/s")
        reductions = cluster_doc["measured_reductions"]
        for g in sorted({int(r[1]) for r in reductions}):
            ar = ", ".join(f"{size_label(int(b))} {t * 1e3:.2f} ms" for _, gg, b, t in reductions if gg == g)
            every = "" if g == procs else ", every group at once"
            print(f"gloo all-reduce over {g} processes{every}: {ar}")
        for line in tp_lines(cluster_doc["measured_collectives"], device, cluster_doc["collective_cpu"]):
            print(line)
        print(f"wrote {target} and {links} in {elapsed:.1f} s")
    else:
        print(f"wrote {target} in {elapsed:.1f} s")
