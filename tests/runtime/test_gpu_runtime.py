"""Where the runtime trains: the device choice everywhere, and the GPU path where a GPU is visible.

``runtime_device`` picks CUDA only when each local process has a GPU of its own (NCCL gives every
rank its own device) and says so when it falls back to the CPU; ``PARATRAIN_DEVICE`` overrides it.
``comm tune`` offers NCCL on the same condition. Those checks monkeypatch torch's CUDA queries and
run on any machine.

With a visible GPU (skipped elsewhere, so CI never runs them): one process trains gpt-tiny on
CUDA (NCCL) and on the CPU (gloo) in float64 from the same seed and data, and the parameters
agree to ``rtol=1e-5`` as in the layout tests; ``paratrain train --bf16`` on the GPU lowers the loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.runtime import forkrun

from paratrain.errors import ConfigError
from paratrain.runtime.mesh import DEVICE_ENV, runtime_device

HARNESS = Path(__file__).with_name("layout_harness.py")
RTOL = 1e-5


def needs_cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv(DEVICE_ENV, raising=False)


@pytest.mark.parametrize(("gpus", "procs", "want"), [(0, 1, "cpu"), (1, 1, "cuda"), (8, 4, "cuda"), (4, 8, "cpu")])
def test_cuda_only_when_every_local_process_has_a_gpu(monkeypatch, capsys, gpus, procs, want) -> None:
    _gpus(monkeypatch, gpus)
    assert runtime_device(procs, notice=True) == want
    err = capsys.readouterr().err
    if gpus and want == "cpu":
        assert f"{procs} processes on this node but {gpus} GPU(s) visible: running on the CPU" in err
    else:
        assert err == ""


def test_environment_and_argument_decide(monkeypatch) -> None:
    _gpus(monkeypatch, 2)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert runtime_device(2) == "cpu"
    assert runtime_device(2, "cuda") == "cuda"  # the argument before the environment
    monkeypatch.setenv(DEVICE_ENV, "CUDA")
    assert runtime_device(2) == "cuda"
    with pytest.raises(ConfigError, match=r"PARATRAIN_DEVICE: cuda asked for 4 process\(es\) per node, 2 GPU"):
        runtime_device(4)
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(ConfigError, match="unknown device 'tpu'.*use cpu or cuda"):
        runtime_device(1)


def test_comm_tune_offers_nccl_only_with_a_gpu_per_process(monkeypatch) -> None:
    import torch.distributed as dist

    from paratrain.runtime.comm.tune import available_backends

    _gpus(monkeypatch, 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    usable, skipped = available_backends(["gloo", "nccl"], procs=2)
    assert usable == ("gloo",) and skipped == {"nccl": "needs a GPU per process (2 processes, 1 GPU(s))"}
    _gpus(monkeypatch, 2)
    assert available_backends(["gloo", "nccl"], procs=2) == (("gloo", "nccl"), {})


def test_powersgd_on_cpu_tensors_with_cuda_visible(monkeypatch) -> None:
    """torch's PowerSGD hook synchronizes CUDA on the tensors' device whenever CUDA is available;
    on CPU tensors that raised (seen on a GPU machine). One gloo process, CUDA faked visible."""
    import torch.distributed as dist

    from paratrain.runtime.compress.powersgd import PowerSGD

    def synchronize(device=None):
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shapes = [torch.Size([16, 8]), torch.Size([8])]
        flat = torch.randn(136, generator=torch.Generator().manual_seed(0))
        PowerSGD(None, shapes, rank=2).reduce(flat)
        assert torch.isfinite(flat).all()
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="Expected a cuda device"):  # the fake is what the hook met
        torch.cuda.synchronize(torch.device("cpu"))


def _env(device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    return {**env, DEVICE_ENV: device, "OMP_NUM_THREADS": "1"}


@needs_cuda
def test_one_gpu_trains_like_the_cpu_in_float64(tmp_path: Path) -> None:
    params = {}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        out.mkdir()
        run = {"name": "run", "model": "gpt-tiny", "parallel": {"global_batch": 8, "microbatch": 2},
               "train": {"steps": 5, "seed": 3, "lr": 3e-3, "timeout_s": 120}, "fp64": True}
        (out / "runs.json").write_text(json.dumps({"out": str(out), "runs": [run]}))
        proc = subprocess.run(forkrun.command(1, HARNESS, out / "runs.json"), capture_output=True, text=True,
                              timeout=300, env=_env(device))
        assert proc.returncode == 0, proc.stderr[-3000:]
        params[device] = torch.load(out / "run.pt", map_location="cpu")
    assert params["cuda"].keys() == params["cpu"].keys()
    for key, ref in params["cpu"].items():
        got = params["cuda"][key]
        assert got.dtype == torch.float64
        if key.endswith("attn.k.bias"):  # exact gradient zero: rounding noise only (test_runtime_equivalence)
            assert float(got.abs().max()) < 1e-4
            continue
        rel = float((got - ref).norm() / ref.norm())
        assert rel <= RTOL, f"{key}: relative error {rel:.2e}"


@needs_cuda
def test_bf16_training_on_the_gpu_lowers_the_loss(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "paratrain", "train", "--model", "gpt-tiny", "--nproc", "1", "--bf16",
           "--steps", "30", "--global-batch", "8", "--microbatch", "4", "--lr", "3e-3", "--no-progress",
           "--metrics", str(metrics)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env("cuda"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(nccl)" in proc.stdout + proc.stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
