"""``paratrain data``: input pipelines and their stalls (DS-Analyzer, CoorDL).

Examples::

    paratrain data generate --items 2048 --image-size 64 --out imgs
    paratrain data analyze --data imgs --workers 2 --batch-size 16 --batches 24 --json > stalls.json
    paratrain data analyze --data imgs --fetch-ms 5        # storage that waits 5 ms per item
    paratrain data analyze --pipeline my_pipeline:make_loader --data imgs --compute-ms 20
    paratrain data whatif --from stalls.json --cache-fraction 0.5 --workers 4 --plot whatif.png
    paratrain data tokenizer --train corpus/ --vocab 8000 --out tok      # byte-level BPE tokenizer.json
    paratrain data prepare --tokenizer tok --out cache corpus/ more.jsonl   # token cache for train --data
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from paratrain.cli.options import JsonOpt, flag_errors, print_json
from paratrain.errors import ConfigError

__all__ = ["register", "generate", "analyze", "whatif", "tokenizer", "prepare"]

data_app = typer.Typer(help="Input pipelines: generate a dataset, measure data stalls, predict what-ifs.",
                       no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")


def _console() -> Console:
    c = Console()
    return c if c.is_terminal else Console(width=120)


@data_app.command("generate", help="Write N JPEG images (class sub-directories) for the image pipeline.")
@flag_errors
def generate(
    items: Annotated[int, typer.Option("--items", help="Number of images.")] = 512,
    image_size: Annotated[int, typer.Option("--image-size", help="Width and height in pixels.")] = 64,
    # str, not Path: typer would turn an empty --out into ".", the current directory
    out: Annotated[str, typer.Option("--out", help="New or empty directory to write into.")] = "images",
    classes: Annotated[int, typer.Option("--classes", help="Classes (sub-directories).")] = 10,
    quality: Annotated[int, typer.Option("--quality", help="JPEG quality (1-95).")] = 90,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the pictures.")] = 0,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.runtime.data.images import generate_images

    made = generate_images(out, items, image_size, classes=classes, seed=seed, quality=quality)
    if json_out:
        print_json({**made.to_dict(), "avg_item_bytes": made.total_bytes / made.items})
        return
    typer.echo(f"wrote {made.items} JPEGs of {made.image_size}x{made.image_size} in {made.classes} classes to "
               f"{made.root} ({made.total_bytes / 1e6:.2f} MB, {made.total_bytes / made.items / 1e3:.1f} kB each)")


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _print_report(r: Any) -> None:
    console = _console()
    console.print(f"DS-Analyzer: {r.batches} batches of {r.batch_size} after {r.warmup} warm-up, "
                  f"{r.workers} loader workers, {r.cores} cores", soft_wrap=True, markup=False, highlight=False)
    runs = Table()
    for col in ("run", "time (s)", "items/s", "CPU (s)", "CPU util", "host CPU util"):
        runs.add_column(col, justify="left" if col == "run" else "right")
    what = {"synthetic": "synthetic (compute)", "cold": f"cold ({r.cold_method})",
            "cached": f"cached ({r.cached_method})", "prep_only": "prep only (no compute)"}
    for t in r.runs:
        host = "-" if t.host_cpu_util is None else f"{100 * t.host_cpu_util:.0f}%"
        runs.add_row(what.get(t.name, t.name), f"{t.seconds:.3f}", f"{r.batches * r.batch_size / t.seconds:,.1f}",
                     f"{t.cpu_s:.2f}", f"{100 * t.cpu_util:.0f}%", host)
    console.print(runs)
    disk = "-" if r.disk_read_bytes_s is None else f"{r.disk_read_bytes_s / 1e6:.1f} MB/s"
    lines = [
        f"compute rate {_rate(r.compute_rate_items_s)} items/s, prep rate {_rate(r.prep_rate_items_s)} items/s "
        f"(capacity {_rate(r.prep_capacity_items_s)}), fetch rate {_rate(r.fetch_rate_items_s)} items/s",
        f"per epoch of {r.dataset_items} items ({r.avg_item_bytes / 1e3:.1f} kB each): {r.epoch_time_s:.2f} s, "
        f"prep stall {r.prep_stall_s:.2f} s ({100 * r.prep_stall_fraction:.0f}%), "
        f"fetch stall {r.fetch_stall_s:.2f} s ({100 * r.fetch_stall_fraction:.0f}%)",
        f"throughput {_rate(r.throughput_items_s)} items/s; CPU {100 * r.cpu_util:.0f}% of this machine; "
        f"disk read {disk}",
    ]
    for line in lines:
        console.print(line, soft_wrap=True, markup=False, highlight=False)


@data_app.command("analyze", help="Measure data stalls with DS-Analyzer's differential method.")
@flag_errors
def analyze(
    data: Annotated[str | None, typer.Option("--data", help="Directory of images (the built-in pipeline), or "
                    "the files a --pipeline reads (evicted from the page cache for the cold run).")] = None,
    pipeline: Annotated[str, typer.Option("--pipeline", help="'image' (built in) or module:function returning a "
                        "torch DataLoader (called once per run, no arguments).")] = "image",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Items per batch (built-in pipeline).")] = 16,
    workers: Annotated[int, typer.Option("--workers", help="DataLoader worker processes (built-in).")] = 2,
    batches: Annotated[int, typer.Option("--batches", help="Timed batches per run.")] = 16,
    warmup: Annotated[int | None, typer.Option("--warmup", help="Untimed batches first (default: workers, "
                      "at least 1).")] = None,
    image_size: Annotated[int, typer.Option("--image-size", help="Crop size in pixels (built-in).")] = 32,
    fetch_ms: Annotated[float, typer.Option("--fetch-ms", help="Throttled storage: wait this long per item "
                        "read (built-in).")] = 0.0,
    compute_ms: Annotated[float | None, typer.Option("--compute-ms", help="A compute step of this many ms per "
                          "batch instead of the CNN's (an accelerator's time).")] = None,
    cache_mb: Annotated[float, typer.Option("--cache-mb", help="MinIO cache in front of storage, filled "
                        "(built-in).")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the order and augmentation.")] = 0,
    drop_caches: Annotated[bool, typer.Option("--drop-caches/--no-drop-caches", help="Drop the page cache for "
                           "the cold run where allowed (root); else a fresh copy.")] = True,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.runtime.data.minio import check_cache_fits
    from paratrain.runtime.data.pipelines import AnalyzeOptions, analyze_pipeline

    opts = AnalyzeOptions(pipeline=pipeline, data=data, batch_size=batch_size, workers=workers, batches=batches,
                          warmup=warmup, image_size=image_size, fetch_ms=fetch_ms, compute_ms=compute_ms,
                          cache_mb=cache_mb, seed=seed, drop_caches=drop_caches)
    check_cache_fits(int(cache_mb * 2**20))
    if data is not None and not Path(data).exists():
        raise ConfigError("--data", f"{data!r} does not exist", "give a directory of images")
    report = analyze_pipeline(opts)
    if json_out:
        print_json(report.to_dict())
    else:
        _print_report(report)


def _load_report(path: Path) -> Any:
    from paratrain.fileio import check_not_special
    from paratrain.runtime.data.analyzer import StallReport

    check_not_special(path, "--from", "write it with `paratrain data analyze --json > FILE`")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return StallReport.from_dict(doc)
    except FileNotFoundError:
        raise ConfigError("--from", f"{str(path)!r} does not exist",
                          "write it with `paratrain data analyze --json > FILE`") from None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ConfigError("--from", f"{str(path)!r} is not a `paratrain data analyze --json` report "
                          f"({type(e).__name__})", "write it with `paratrain data analyze --json > FILE`") from None


@data_app.command("whatif", help="Predict stalls and throughput for another cache size, workers or storage.")
@flag_errors
def whatif(
    source: Annotated[Path, typer.Option("--from", help="JSON of `paratrain data analyze --json`.")],
    cache_fraction: Annotated[list[float] | None, typer.Option("--cache-fraction", help="Share of the dataset "
                              "cached (MinIO); repeat for several (default 0, .25, .5, .75, 1).")] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="Loader workers (default: as measured).")] = None,
    bandwidth_mbs: Annotated[float | None, typer.Option("--bandwidth-mbs", help="Storage bandwidth in MB/s "
                             "(default: as measured).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of throughput vs cache size.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.fileio import check_distinct_paths, check_output_path
    from paratrain.runtime.data.whatif import measured_from, plot_cache_sweep, predict

    if plot is not None:
        check_output_path(plot, "--plot")
        check_distinct_paths({"--plot": plot}, {"--from": source})
    report = _load_report(source)
    m = measured_from(report)
    bw = None if bandwidth_mbs is None else bandwidth_mbs * 1e6
    fractions = cache_fraction or [0.0, 0.25, 0.5, 0.75, 1.0]
    preds = [predict(m, cache_fraction=x, workers=workers, storage_bytes_s=bw) for x in fractions]
    if plot is not None:
        ws = sorted({m.workers, workers if workers is not None else m.workers})
        # the measured point belongs on the plot only where the storage is the measured one
        plot_cache_sweep(plot, m, workers=ws, storage_bytes_s=bw,
                         measured=(0.0, report.throughput_items_s) if bw is None else None)
    if json_out:
        print_json({"measured": report.to_dict(), "predictions": [p.to_dict() for p in preds]})
        return
    w = preds[0].workers
    store = preds[0].storage_bytes_s
    console = _console()
    storage = "not a bottleneck" if store is None else f"{store / 1e6:.2f} MB/s"
    console.print(f"what-if: {w} worker{'s' if w != 1 else ''}, storage {storage} (measured: {report.workers} "
                  f"workers, {report.throughput_items_s:,.1f} items/s)", soft_wrap=True, markup=False, highlight=False)
    t = Table()
    for col in ("cache", "epoch (s)", "items/s", "prep stall", "fetch stall"):
        t.add_column(col, justify="right")
    for p in preds:
        t.add_row(f"{100 * p.cache_fraction:.0f}%", f"{p.epoch_time_s:.2f}", f"{p.throughput_items_s:,.1f}",
                  f"{100 * p.prep_stall_fraction:.0f}%", f"{100 * p.fetch_stall_fraction:.0f}%")
    console.print(t)


# ----- tokenized text (runtime/data/tokenized.py) ------------------------------------------------------

@data_app.command("tokenizer", help="Train a byte-level BPE tokenizer (tokenizer.json) on local text files.")
@flag_errors
def tokenizer(
    train: Annotated[list[str] | None, typer.Option("--train", help="Text files or directories (.txt, .jsonl with "
                     "a 'text' field, .parquet with a 'text' column; a named file of another suffix is read as "
                     "text); repeat the flag, or list more files after the options.")] = None,
    more: Annotated[list[str] | None, typer.Argument(help="More files or directories to train on.",
                                                     metavar="FILES", show_default=False)] = None,
    vocab: Annotated[int, typer.Option("--vocab", help="Vocabulary size (256 bytes, <|endoftext|>, merges).")] = 8000,
    out: Annotated[str, typer.Option("--out", help="Directory to write tokenizer.json into.")] = "tokenizer",
    json_out: JsonOpt = False,
) -> None:
    from paratrain.runtime.data.tokenized import find_documents, train_tokenizer

    info = train_tokenizer(find_documents([*(train or []), *(more or [])], "--train"), vocab, out)
    if json_out:
        print_json({"tokenizer": str(info.path), "vocab_size": info.vocab_size, "eos_token": info.eos_token,
                    "eos_id": info.eos_id, "sha256": info.sha256})
        return
    typer.echo(f"wrote {info.path}: byte-level BPE, {info.vocab_size:,} ids, end of document {info.eos_token} "
               f"(id {info.eos_id})")


@data_app.command("prepare", help="Tokenize text files into a memory-mapped token cache for train --data.")
@flag_errors
def prepare(
    files: Annotated[list[str], typer.Argument(help="Text files or directories (.txt, .jsonl, .parquet).",
                                               metavar="FILES", show_default=False)],
    tokenizer_dir: Annotated[str, typer.Option("--tokenizer", help="Directory with a tokenizer.json (a Hugging "
                             "Face model directory, or `paratrain data tokenizer --out`).")],
    out: Annotated[str, typer.Option("--out", help="Cache directory (new, empty, or an earlier cache).")],
    json_out: JsonOpt = False,
) -> None:
    from paratrain.runtime.data.tokenized import find_documents, load_tokenizer
    from paratrain.runtime.data.tokenized import prepare as prepare_cache

    done = prepare_cache(find_documents(files, "FILES"), load_tokenizer(tokenizer_dir), out, "FILES")
    c = done.cache
    if json_out:
        print_json({"cache": str(c.path), "reused": done.reused, "tokens": c.num_tokens,
                    "documents": c.index["documents"], "vocab_size": c.vocab_size, "dtype": c.index["dtype"],
                    "size_bytes": c.size_bytes})
        return
    what = "up to date, nothing tokenized" if done.reused else "tokenized"
    typer.echo(f"{c.path}: {what}: {c.num_tokens:,} tokens from {c.index['documents']:,} documents in "
               f"{len(c.index['sources'])} file(s), {c.index['dtype']} ({c.size_bytes:,} bytes)")
