"""``paratrain train``: real training with torch.distributed (see the README, "Real training").

Runs in this process when launched by torchrun (``torchrun --nproc-per-node 4 -m paratrain train
…``) or for a single process; with ``--nproc N`` it starts N local workers itself through torch's
elastic launcher.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from paratrain.cli.options import (
    CompressOpt,
    CpOpt,
    DensityOpt,
    DpOpt,
    FfnOpt,
    GlobalBatchOpt,
    HeadsOpt,
    HiddenOpt,
    KvHeadsOpt,
    LayersOpt,
    MicrobatchOpt,
    ModelOpt,
    OptimizerShardingOpt,
    PpOpt,
    ScheduleOpt,
    SeqOpt,
    SequenceParallelOpt,
    ShardingOpt,
    TpOpt,
    VirtualStagesOpt,
    VocabOpt,
    check_density_applies,
    flag_errors,
    parallel_from_opts,
    resolve_model_opts,
)
from paratrain.errors import ConfigError, require_finite

_P = "Parallel layout"
_T = "Training"
_O = "Output"
_C = "Checkpointing"
_E = "Evaluation"


def register(app: typer.Typer) -> None:
    app.command("train", help="Train a model for real on torch.distributed: NCCL on the GPUs when each local "
                              "process has one, gloo on the CPU otherwise (PARATRAIN_DEVICE=cpu|cuda decides).")(
        flag_errors(train)
    )


def _token_cache_named(*paths: str | None) -> bool:
    # a directory `paratrain data prepare` wrote (runtime/data/tokenized.py)
    return any(p is not None and os.path.isfile(os.path.join(p, "index.json")) for p in paths)


def _model_from_doc(doc: Any) -> Any:
    from paratrain.spec.model import from_document, resolve_model

    if isinstance(doc, dict):
        return from_document(doc, "--config model")
    return resolve_model(str(doc), "--config model")


def _initial_weights(model: str | None, init: str | None) -> dict[str, Any]:
    """``--init``: pretrained by default when ``--model`` is a HF directory holding weights."""
    hf_dir = model is not None and os.path.isfile(os.path.join(model, "config.json"))
    weights = hf_dir and any(f.endswith(".safetensors") for f in os.listdir(model or "."))
    if init is None:
        init = "pretrained" if weights else "random"
    if init == "pretrained" and not hf_dir:
        raise ConfigError("--init", f"pretrained needs --model to be a HF model directory, got {model!r}",
                          "give --model DIR (config.json + *.safetensors) or use --init random")
    return {"init": init, "init_from": model if init == "pretrained" else None}


def _with_optimizer(tcfg: Any, spec: Any, pcfg: Any, optimizer: str, damping: float, refresh: int | None,
                    fill_bubbles: bool, fill_cluster: str) -> Any:
    """The run's optimizer options; with ``--fill-bubbles`` the bubble-filled schedule from the
    simulator's fill pass (this layer may import sim; the runtime receives it as JSON)."""
    import dataclasses
    import json

    from paratrain.runtime.config import check_kfac

    if fill_bubbles and optimizer != "kfac":
        raise ConfigError("--fill-bubbles", f"fills the bubbles with K-FAC's work, got --optimizer {optimizer}",
                          "add --optimizer kfac")
    if fill_bubbles and pcfg.pp < 2:
        raise ConfigError("--fill-bubbles", f"fills pipeline bubbles and needs --pp > 1, got pp={pcfg.pp}",
                          "add --pp 2 (or more), or drop --fill-bubbles")
    tcfg = dataclasses.replace(tcfg, optimizer=optimizer, kfac_damping=damping,
                               kfac_refresh=refresh if refresh is not None else 1)
    check_kfac(pcfg, tcfg)
    if not fill_bubbles:
        return tcfg
    from paratrain.sim.fill import fill_kfac_config
    from paratrain.spec.cluster import resolve_cluster

    cluster = resolve_cluster(fill_cluster, "--fill-cluster", nodes=1, gpus=pcfg.world_size)
    fill = fill_kfac_config(spec, cluster, pcfg)
    if refresh is not None and refresh != fill.refresh_steps:
        raise ConfigError("--kfac-refresh", f"is {refresh} but the fill pass needs {fill.refresh_steps} steps per "
                          "K-FAC cycle in this schedule's bubbles", "leave --kfac-refresh out with --fill-bubbles")
    return dataclasses.replace(tcfg, kfac_refresh=fill.refresh_steps, kfac_filled=json.dumps(fill.filled.to_dict()))


def train(
    model: ModelOpt = None,  # type: ignore[assignment]
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    kv_heads: KvHeadsOpt = None,
    ffn: FfnOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    init: Annotated[str | None, typer.Option("--init", help="Initial weights: pretrained (the HF --model "
                    "directory's safetensors; default when it has them) or random (from --seed).",
                    rich_help_panel=_T)] = None,
    config: Annotated[str | None, typer.Option("--config", help="Run document from `paratrain plan --json` or a "
                                               "ParallelConfig file; flags override it.", rich_help_panel=_P)] = None,
    dp: DpOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    cp: CpOpt = None,
    schedule: ScheduleOpt = None,
    virtual_stages: VirtualStagesOpt = None,
    microbatch: MicrobatchOpt = None,
    global_batch: GlobalBatchOpt = None,
    sequence_parallel: SequenceParallelOpt = None,
    optimizer_sharding: OptimizerShardingOpt = None,
    sharding: ShardingOpt = None,
    compress: CompressOpt = None,
    density: DensityOpt = None,
    compress_warmup: Annotated[int, typer.Option("--compress-warmup", help="Dense steps before --compress "
                               "starts.", rich_help_panel=_P)] = 5,
    compress_momentum_correction: Annotated[bool, typer.Option(
        "--compress-momentum-correction/--no-compress-momentum-correction",
        help="DGC (Lin et al. 2018): with --optimizer sgd, accumulate the momentum on each rank before "
             "compression and clip locally.", rich_help_panel=_P)] = False,
    compress_momentum_masking: Annotated[bool, typer.Option(
        "--compress-momentum-masking/--no-compress-momentum-masking",
        help="DGC's momentum factor masking: zero the momentum of sent entries.", rich_help_panel=_P)] = True,
    compress_density_warmup: Annotated[int, typer.Option(
        "--compress-density-warmup", help="DGC's warm-up: compressed steps over which the density falls "
        "exponentially from 25 % to --density (0: none).", rich_help_panel=_P)] = 0,
    compress_lr_weighted_residual: Annotated[bool, typer.Option(
        "--compress-lr-weighted-residual/--no-compress-lr-weighted-residual",
        help="Keep the sparse compressors' residuals in units of the update: rescaled by lr_prev/lr each "
             "step, so an entry sent late applies the learning rates it was produced at.",
        rich_help_panel=_P)] = True,
    dp_impl: Annotated[str | None, typer.Option("--dp-impl", help="Gradient reduction: paratrain (bucketed, "
                       "overlapped), ddp (torch DDP), fsdp (FSDP2; default with --optimizer-sharding).",
                       rich_help_panel=_P)] = None,
    bucket_mb: Annotated[float, typer.Option("--bucket-mb", help="Gradient bucket size (MiB) of paratrain's "
                         "all-reduce and of DDP.", rich_help_panel=_P)] = 25.0,
    prefetch_receives: Annotated[int | None, typer.Option("--prefetch-receives", help="Pipeline receives posted "
                                 "ahead of their actions, per peer (default 2 on gloo, 0 on NCCL).",
                                 rich_help_panel=_P)] = None,
    nproc: Annotated[int | None, typer.Option("--nproc", help="Launch this many local worker processes "
                     "(torch elastic launcher). Omit under torchrun.", rich_help_panel=_P)] = None,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps.", rich_help_panel=_T)] = 20,
    seed: Annotated[int, typer.Option("--seed", help="Seed of initialization and data.", rich_help_panel=_T)] = 0,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW; SGD's with --optimizer kfac or sgd).",
                                      rich_help_panel=_T)] = 1e-3,
    optimizer: Annotated[str, typer.Option("--optimizer", help="adamw, kfac (K-FAC-preconditioned SGD with "
                         "momentum on the blocks' linear layers), or sgd (SGD with momentum 0.9, decoupled "
                         "weight decay).", rich_help_panel=_T)] = "adamw",
    kfac_damping: Annotated[float, typer.Option("--kfac-damping", help="K-FAC: damping added to each Kronecker "
                            "factor before inversion.", rich_help_panel=_T)] = 1e-3,
    kfac_refresh: Annotated[int | None, typer.Option("--kfac-refresh", help="K-FAC: steps per curvature cycle "
                            "(curvature from the cycle's first step, inverses active from the next cycle; default 1, "
                            "with --fill-bubbles the fill pass's).", rich_help_panel=_T)] = None,
    fill_bubbles: Annotated[bool, typer.Option("--fill-bubbles", help="K-FAC with --pp > 1: run its pieces in the "
                            "schedule's bubbles as the fill pass places them (PipeFisher).",
                            rich_help_panel=_T)] = False,
    fill_cluster: Annotated[str, typer.Option("--fill-cluster", help="Cluster preset or file whose cost model "
                            "times the schedule and the K-FAC pieces for --fill-bubbles.",
                            rich_help_panel=_T)] = "cpu",
    warmup: Annotated[int | None, typer.Option("--warmup", help="Warm-up steps (default 10% of --steps), then "
                      "cosine decay to lr/10.", rich_help_panel=_T)] = None,
    grad_clip: Annotated[float, typer.Option("--grad-clip", help="Clip the global gradient norm to this.",
                                             rich_help_panel=_T)] = 1.0,
    bf16: Annotated[bool, typer.Option("--bf16", help="bf16 autocast (fp32 weights and optimizer).",
                                       rich_help_panel=_T)] = False,
    data: Annotated[str, typer.Option("--data", help="'stdlib' (the Python standard library's .py files), "
                    "'synthetic', or a file/directory.", rich_help_panel=_T)] = "stdlib",
    task: Annotated[str, typer.Option("--task", help="gpt (the --model on the byte corpus) or image (a small CNN "
                    "on the image folder --data, data parallelism only).", rich_help_panel=_T)] = "gpt",
    loader_workers: Annotated[int, typer.Option("--loader-workers", help="DataLoader worker processes of "
                              "--task image (0: load in the training process).", rich_help_panel=_T)] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before a silent peer or unreachable "
                       "rendezvous ends the job.", rich_help_panel=_T)] = 300.0,
    metrics: Annotated[str | None, typer.Option("--metrics", help="JSON line per step (rank 0; '{rank}' in the "
                       "path: every rank).", rich_help_panel=_O)] = None,
    trace: Annotated[str | None, typer.Option("--trace", help="Measured Chrome trace of all ranks (JSON).",
                                              rich_help_panel=_O)] = None,
    comm_log: Annotated[str | None, typer.Option("--comm-log", help="Every collective and transfer of every "
                        "rank, one JSON line each (op, bytes, group, start_s, time_s, backend, ...).",
                        rich_help_panel=_O)] = None,
    comm_table: Annotated[str | None, typer.Option("--comm-table", help="Tuning table from `paratrain comm "
                          "tune`: the backend of each call by op, size and group size.", rich_help_panel=_P)] = None,
    save_final: Annotated[str | None, typer.Option("--save-final", help="torch.save the final unsharded "
                          "parameters here (rank 0).", rich_help_panel=_O)] = None,
    checkpoint_dir: Annotated[str | None, typer.Option("--checkpoint-dir", help="Write checkpoints (DCP, "
                              "two-phase, CheckFreq) under this directory; the last step is always saved.",
                              rich_help_panel=_C)] = None,
    checkpoint_every: Annotated[str, typer.Option("--checkpoint-every", help="auto (tuned to cost at most "
                                "--checkpoint-overhead of step time), N (steps) or Ns (seconds).",
                                rich_help_panel=_C)] = "auto",
    checkpoint_overhead: Annotated[float, typer.Option("--checkpoint-overhead", help="auto's bound on "
                                   "checkpointing's share of step time.", rich_help_panel=_C)] = 0.035,
    keep: Annotated[int, typer.Option("--keep", help="Complete checkpoints kept, newest first (0: all).",
                                      rich_help_panel=_C)] = 2,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest complete checkpoint in "
                      "--checkpoint-dir (checksums verified; any dp/tp/pp layout).", rich_help_panel=_C)] = False,
    log_every: Annotated[int, typer.Option("--log-every", help="Print every N-th step.", rich_help_panel=_O)] = 1,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Rich progress bar on rank 0.",
                                           rich_help_panel=_O)] = True,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="Directory with a tokenizer.json: --data "
                         "text files (.txt, .jsonl, .parquet) are tokenized into a cache on first use.",
                         rich_help_panel=_T)] = None,
    eval_data: Annotated[str | None, typer.Option("--eval-data", help="Validation text (file, directory or token "
                         "cache): eval_loss and eval_ppl in the metrics.", rich_help_panel=_E)] = None,
    eval_every: Annotated[int | None, typer.Option("--eval-every", help="Evaluate every N steps (default: after "
                          "the last step only).", rich_help_panel=_E)] = None,
    eval_batches: Annotated[int | None, typer.Option("--eval-batches", help="Global batches per evaluation "
                            "(default 4).", rich_help_panel=_E)] = None,
    tensorboard: Annotated[str | None, typer.Option("--tensorboard", help="Write TensorBoard scalars to this "
                           "directory (rank 0).", rich_help_panel=_O)] = None,
    wandb: Annotated[bool, typer.Option("--wandb", help="Log to Weights & Biases (offline unless WANDB_MODE is "
                     "set; rank 0).", rich_help_panel=_O)] = False,
    wandb_project: Annotated[str, typer.Option("--wandb-project", help="wandb project name.",
                             rich_help_panel=_O)] = "paratrain",
    wandb_run: Annotated[str | None, typer.Option("--wandb-run", help="wandb run name.", rich_help_panel=_O)] = None,
) -> None:
    from paratrain.fileio import check_distinct_paths
    from paratrain.parallel.config import load_run_document

    # Each output replaces its file at the end of the run: on an input it destroys the input, and
    # two outputs on one path leave only the last.
    check_distinct_paths(
        {"--metrics": None if metrics is None else metrics.replace("{rank}", "0"), "--trace": trace,
         "--comm-log": comm_log, "--save-final": save_final},
        {"--config": config, "--model": model, "--data": data, "--eval-data": eval_data, "--comm-table": comm_table},
    )
    base = None
    doc_model = None
    if config is not None:
        doc = load_run_document(config, "--config")
        base = doc["parallel"]
        doc_model = doc.get("model")
    if model is not None or doc_model is None:
        spec = resolve_model_opts("gpt-tiny" if model is None else model, layers, hidden, heads, kv_heads, ffn, seq,
                                  vocab)
    else:
        spec = _model_from_doc(doc_model).with_overrides(
            layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, seq=seq, vocab=vocab)
    pcfg = parallel_from_opts(base, dp=dp, tp=tp, pp=pp, cp=cp, microbatch=microbatch, global_batch=global_batch,
                              optimizer_sharding=optimizer_sharding, sequence_parallel=sequence_parallel,
                              schedule=schedule, virtual_stages=virtual_stages, compression=compress,
                              compression_density=density, sharding=sharding)
    check_density_applies(pcfg.compression, density)  # after a run document's compression
    if global_batch is None and base is None:
        pcfg = pcfg.with_overrides(global_batch=pcfg.dp * pcfg.microbatch * max(pcfg.pp, 4))
    # zero1 is paratrain's distributed optimizer, zero2 / zero3 FSDP2; runtime.config.check_sharding
    # (in validate_run, before any worker starts) refuses an impl that does not run the level
    from paratrain.runtime.config import default_dp_impl

    impl = dp_impl or default_dp_impl(pcfg)
    if nproc is not None and nproc < 1:
        raise ConfigError("--nproc", f"must be at least 1, got {nproc}",
                          f"use --nproc {pcfg.world_size} (dp*tp*pp) or leave it out under torchrun")
    require_finite("--bucket-mb", bucket_mb)
    from paratrain.runtime.config import TrainConfig

    tcfg = TrainConfig(steps=steps, seed=seed, lr=lr, warmup_steps=warmup, grad_clip=grad_clip, bf16=bf16,
                       data=data, dp_impl=impl, bucket_bytes=int(bucket_mb * 2**20), metrics=metrics, trace=trace,
                       save_final=save_final, prefetch_receives=prefetch_receives, compress_warmup=compress_warmup,
                       compress_momentum_masking=compress_momentum_masking,
                       compress_density_warmup=compress_density_warmup,
                       compress_lr_weighted_residual=compress_lr_weighted_residual,
                       timeout_s=timeout, log_every=log_every, progress=progress, task=task,
                       loader_workers=loader_workers, checkpoint_dir=checkpoint_dir,
                       checkpoint_every=checkpoint_every, keep=keep, resume=resume,
                       checkpoint_overhead=checkpoint_overhead, tokenizer=tokenizer, eval_data=eval_data,
                       eval_every=eval_every, eval_batches=eval_batches, tensorboard=tensorboard, wandb=wandb,
                       wandb_project=wandb_project, wandb_run=wandb_run, comm_log=comm_log, comm_table=comm_table,
                       **_initial_weights(model, init))
    if tcfg.init_from is not None:  # names and shapes from the safetensors headers, before any worker starts
        from paratrain.runtime.models.hf import check_weights

        check_weights(tcfg.init_from, spec)
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if nproc is not None and under_launcher:
        raise ConfigError("--nproc", "given inside a launched worker (RANK/WORLD_SIZE are set)",
                          "drop --nproc when running under torchrun")
    from paratrain.runtime.config import (
        check_checkpointing,
        check_compression,
        check_eval,
        check_host_memory,
        check_model_layout,
        check_outputs,
        check_sinks,
        check_task,
        check_world_size,
        dropout_notice,
    )
    from paratrain.schedule import check_rules

    # Before torch's import (seconds): the launcher and each worker check the whole run again.
    launching = nproc is not None and nproc > 1 or (nproc == 1 and pcfg.world_size != 1)
    if not under_launcher:
        check_world_size(pcfg, nproc if launching and nproc is not None else 1)
    check_model_layout(spec, pcfg)
    notice = dropout_notice(spec)
    if notice is not None and int(os.environ.get("RANK", "0")) == 0:
        typer.echo(f"paratrain: {notice}", err=True)
    if pcfg.pp > 1:
        check_rules(pcfg.schedule, stages=pcfg.pp, microbatches=pcfg.num_microbatches,
                    virtual_stages=pcfg.virtual_stages)
    check_host_memory(spec, nproc or int(os.environ.get("LOCAL_WORLD_SIZE", "1")), pcfg)
    if not launching:  # launch checks it for the workers it starts
        from paratrain.runtime.mesh import runtime_device

        runtime_device(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # a PARATRAIN_DEVICE the node can honour
    check_task(pcfg, tcfg)
    check_compression(pcfg, tcfg)
    check_checkpointing(pcfg, tcfg)
    tcfg = _with_optimizer(tcfg, spec, pcfg, optimizer, kfac_damping, kfac_refresh, fill_bubbles, fill_cluster)
    if compress_momentum_correction:  # set with the optimizer it needs (SGD's momentum)
        from dataclasses import replace

        tcfg = replace(tcfg, compress_momentum_correction=True)
        check_compression(pcfg, tcfg)
    check_eval(pcfg, tcfg)
    check_sinks(tcfg)
    check_outputs(tcfg)
    if tcfg.task == "gpt" and (tokenizer is not None or _token_cache_named(data, eval_data)):
        # tokenize once here, before the workers start (they find the cache made); vocabulary checks
        from paratrain.runtime.data.tokenized import resolve_run_data

        resolve_run_data(spec, data, eval_data, tokenizer)
    if launching:
        from paratrain.runtime.launch import Interrupted, LaunchError, launch

        try:
            launch(spec, pcfg, tcfg, nproc)
        except LaunchError as e:
            typer.echo(f"paratrain: error: {e}", err=True)
            raise SystemExit(e.exit_code) from None
        except Interrupted as e:
            typer.echo(f"paratrain: {e}", err=True)
            raise SystemExit(e.exit_code) from None
        return
    from paratrain.runtime.train import worker_main

    worker_main(spec, pcfg, tcfg)
