"""``paratrain presets``: list model, device and cluster presets."""

from __future__ import annotations

from typing import Literal

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from paratrain.cli.options import JsonOpt, print_json


def _column(t: Table, name: str, justify: Literal["left", "right"] = "left") -> None:
    # Every cell is a name or a number that users type or compare: never wrapped inside a cell.
    t.add_column(name, justify=justify, no_wrap=True)


def _print(con: Console, t: Table) -> None:
    """Print ``t`` at its natural width: wider than the terminal, the terminal wraps whole lines
    rather than rich cutting names short (``gpt2-mediu…``)."""
    need = Measurement.get(con, con.options.update(max_width=1_000), t).maximum
    (con if need <= con.width else Console(width=need, force_terminal=con.is_terminal)).print(t)


def register(app: typer.Typer) -> None:
    app.command("presets", help="List the model, device and cluster presets.")(presets)


def presets(json_out: JsonOpt = False) -> None:
    from paratrain.spec.cluster_presets import CLUSTER_PRESETS, cluster_preset
    from paratrain.spec.device_presets import DEVICE_PRESETS
    from paratrain.spec.model import preset
    from paratrain.spec.model_presets import MODEL_PRESETS

    models = {n: preset(n) for n in sorted(MODEL_PRESETS)}
    clusters = {n: cluster_preset(n) for n in CLUSTER_PRESETS}
    if json_out:
        print_json(
            {
                "models": {n: {**m.to_dict(), "params": m.param_count()} for n, m in models.items()},
                "devices": {n: d.to_dict() for n, d in DEVICE_PRESETS.items()},
                "clusters": {n: c.to_dict() for n, c in clusters.items()},
            }
        )
        return
    con = Console()
    t = Table(title="Models")
    for col in ("name", "arch", "layers", "hidden", "heads", "kv", "ffn", "seq", "vocab", "params"):
        _column(t, col, justify="left" if col in ("name", "arch") else "right")
    for n, m in models.items():
        t.add_row(
            n,
            m.arch.value,
            str(m.layers),
            str(m.hidden),
            str(m.heads),
            str(m.num_kv_heads),
            str(m.ffn_size),
            str(m.seq),
            str(m.vocab),
            f"{m.param_count() / 1e9:.3f}B",
        )
    _print(con, t)
    t = Table(title="Devices")
    for col in ("name", "bf16 TFLOP/s", "fp32 TFLOP/s", "memory GiB", "HBM GB/s", "SMs"):
        _column(t, col, justify="left" if col == "name" else "right")
    for n, d in DEVICE_PRESETS.items():
        t.add_row(
            n,
            f"{d.peak_flops('bf16') / 1e12:.1f}",
            f"{d.peak_fp32_flops / 1e12:.1f}",
            f"{d.memory_bytes / 2**30:.0f}",
            f"{d.memory_bandwidth_Bps / 1e9:.0f}",
            str(d.sm_count),
        )
    _print(con, t)
    t = Table(title="Clusters (size with --nodes/--gpus)")
    for col in ("name", "device", "per node", "intra GB/s", "NIC GB/s", "topology"):
        _column(t, col)
    for n, c in clusters.items():
        t.add_row(
            n,
            c.device.name,
            str(c.devices_per_node),
            f"{c.intra_link.bandwidth_Bps / 1e9:.0f}",
            f"{c.inter_link.bandwidth_Bps / 1e9:.1f}",
            c.topology.kind.value,
        )
    _print(con, t)
