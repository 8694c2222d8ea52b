"""`paratrain cost`: output consistent with the library; bad input is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.conftest import assert_one_line_error

from paratrain.cost.flops import elementwise_flops_per_iteration, matmul_flops_per_iteration
from paratrain.cost.memory import activation_bytes_per_layer
from paratrain.spec.model import preset


def test_json_keys_and_values(run_cli) -> None:
    code, out, err = run_cli("cost", "--model", "gpt3-175b", "--device", "a100-80gb", "--tp", "8",
                             "--microbatch", "1", "--recompute", "selective", "--sequence-parallel",
                             "--attention", "math", "--json")  # Korthikanti's closed forms: explicit s×s
    assert code == 0, err
    doc = json.loads(out)
    assert doc["attention"] == "math"
    m = preset("gpt3-175b")
    assert doc["params"] == m.param_count()
    assert doc["matmul_flops_per_sample"] == matmul_flops_per_iteration(m, 1, "selective")
    assert doc["elementwise_flops_per_sample"] == elementwise_flops_per_iteration(m, 1)
    assert doc["activation_bytes_per_layer"] == activation_bytes_per_layer(
        m, microbatch=1, tp=8, sequence_parallel=True, recompute="selective")
    assert doc["activation_bytes_per_layer"] * 8 == 34 * m.seq * m.hidden  # Korthikanti: sbh·34/t
    assert doc["time_per_microbatch_s"] == pytest.approx(doc["forward_s"] + doc["backward_s"] + doc["recompute_s"])
    assert doc["time_per_microbatch_s"] > 0 and doc["tp_comm_s"] > 0
    layer_rows = [r for r in doc["ops"] if r["part"] == "layer"]
    assert {r["name"] for r in layer_rows} >= {"qkv", "attn_scores", "softmax", "attn_v", "attn_proj", "fc1", "fc2"}
    assert all(r["bound"] in ("compute", "memory") for r in doc["ops"])
    assert doc["per_layer"]["fwd_s"] == pytest.approx(sum(r["fwd_s"] for r in layer_rows))


def test_overrides_and_fused(run_cli) -> None:
    code, out, _ = run_cli("cost", "--model", "gpt-tiny", "--layers", "3", "--hidden", "128", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["params"] == preset("gpt-tiny").with_overrides(layers=3, hidden=128).param_count()
    code, fused_out, _ = run_cli("cost", "--model", "gpt-tiny", "--layers", "3", "--hidden", "128", "--fused", "--json")
    assert code == 0
    fused = json.loads(fused_out)
    # gpt-tiny trains without dropout, so eager and fused kernels move the same bytes: the bias is in
    # nn.Linear's GEMM, the residual add reads two tensors and writes one either way
    assert fused["per_layer"]["fwd_bytes"] == doc["per_layer"]["fwd_bytes"]
    # with dropout, eager PyTorch runs it as a kernel of its own: more bytes than the fused kernel
    args = ("cost", "--model", "gpt-tiny", "--layers", "3", "--hidden", "128", "--dropout", "--json")
    eager = json.loads(run_cli(*args)[1])
    fused = json.loads(run_cli(*args, "--fused")[1])
    assert fused["per_layer"]["fwd_bytes"] < eager["per_layer"]["fwd_bytes"]
    assert eager["per_layer"]["fwd_bytes"] > doc["per_layer"]["fwd_bytes"]


def test_fp8_gemms_read_one_byte_inputs_and_add_their_casts(run_cli) -> None:
    """--gemm-dtype fp8: each linear GEMM of a layer reads FP8 inputs (1 byte) and writes the
    training dtype (bf16, 2 bytes), after a cast kernel of its own; the embedding and head keep bf16."""
    args = ("cost", "--model", "llama3-8b", "--device", "h100-sxm", "--tp", "2", "--json")
    code, out, err = run_cli(*args, "--gemm-dtype", "fp8")
    assert code == 0, err
    fp8 = json.loads(out)
    bf16 = json.loads(run_cli(*args)[1])
    assert (fp8["gemm_dtype"], bf16["gemm_dtype"]) == ("fp8", "bf16")
    layer = {r["name"]: r for r in fp8["ops"] if r["part"] == "layer"}
    for name in ("qkv", "attn_proj", "fc1", "fc2"):
        m, n, k = layer[name]["gemm_mnk"]
        assert layer[name]["fwd_bytes"] == m * k + k * n + 2 * m * n
        assert f"{name}_fp8_cast" in layer
    assert [r for r in fp8["ops"] if r["part"] != "layer"] == [r for r in bf16["ops"] if r["part"] != "layer"]
    assert fp8["forward_s"] < bf16["forward_s"]  # FP8 tensor cores at twice the bf16 peak


def test_table(run_cli) -> None:
    code, out, _ = run_cli("cost", "--model", "gpt3-1.3b", "--tp", "2")
    assert code == 0
    for needle in ("qkv", "fc2", "lm_head", "compute", "memory", "time per micro-batch"):
        assert needle in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "gpt3-175b", "--layers", "0"], "layers"),
        (["--model", "gpt3-175b", "--hidden", "-4"], "hidden"),
        (["--model", "gpt3-175b", "--seq", "0"], "seq"),
        (["--model", "gpt3-175b", "--heads", "7"], "heads"),
        (["--model", "gpt3-175b", "--tp", "5"], "tp"),
        (["--model", "gpt3-175b", "--tp", "0"], "--tp"),
        (["--model", "gpt3-175b", "--microbatch", "-1"], "--microbatch"),
        (["--model", "gpt3-175b", "--recompute", "partial"], "--recompute"),
        (["--model", "gpt3-175b", "--dtype", "fp7"], "--dtype"),
        (["--model", "no-such-model"], "--model"),
        (["--model", "gpt3-175b", "--device", "no-such-gpu"], "--device"),
        (["--model", "gpt-tiny", "--tp", "16", "--cluster", "cpu"], "tp"),
    ],
)
def test_bad_input_one_line_exit_2(run_cli, args: list[str], needle: str) -> None:
    code, out, err = run_cli("cost", *args)
    assert_one_line_error(code, err, needle)


def test_malformed_files(run_cli, tmp_path) -> None:
    bad_json = tmp_path / "model.json"
    bad_json.write_text("{layers: 2,")
    code, _, err = run_cli("cost", "--model", str(bad_json))
    assert_one_line_error(code, err, "--model", "malformed")
    bad_yaml = tmp_path / "model.yaml"
    bad_yaml.write_text("layers: [1, 2\n")
    code, _, err = run_cli("cost", "--model", str(bad_yaml))
    assert_one_line_error(code, err, "--model")
    wrong_key = tmp_path / "m.json"
    wrong_key.write_text(json.dumps({"layers": 2, "hidden": 64, "heads": 4, "seq": 8, "vocab": 10, "colour": 1}))
    code, _, err = run_cli("cost", "--model", str(wrong_key))
    assert_one_line_error(code, err, "colour")


def test_subprocess_exit_code_and_single_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "paratrain", "cost", "--model", "gpt3-175b", "--tp", "5"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "tp" in proc.stderr
