"""``plan`` says whether ``paratrain train`` runs its winner: the cost model prices layouts (a
vocabulary or head count tp does not divide, gTop-k over a dp x cp group that is not a power of
two, FSDP2 under a split-backward schedule) that the runtime refuses, and the plan should not leave the user
to find out at launch."""

from __future__ import annotations

import json

import pytest

from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.config import TrainConfig, default_dp_impl, train_refusal
from paratrain.spec.model import resolve_model

TINY = resolve_model("gpt-tiny").with_overrides(layers=4)
LAYOUTS = {  # name -> (layout, a word of the refusal or None)
    "dp2-pp2-zero1": (dict(dp=2, pp=2, sharding="zero1", global_batch=8), None),
    "dp2-pp2-zero3-interleaved": (dict(dp=2, pp=2, sharding="zero3", schedule="interleaved", virtual_stages=2,
                                       global_batch=8), None),
    "tp2-sp": (dict(tp=2, sequence_parallel=True, global_batch=8), None),
    "pp2-tp2-sp": (dict(pp=2, tp=2, sequence_parallel=True, global_batch=8), None),
    "tp3": (dict(tp=3, global_batch=8), "tp"),
    "dp2-pp2-zero3-zb": (dict(dp=2, pp=2, sharding="zero3", schedule="zb-h1", global_batch=8), None),
    "dp2-pp2-zero3-pipedream": (dict(dp=2, pp=2, sharding="zero3", schedule="pipedream", global_batch=8), "FSDP2"),
    "tp2-sp-async-tp": (dict(tp=2, sequence_parallel=True, tp_overlap="async", global_batch=8), "--tp-overlap"),
    "dp2-fp8": (dict(dp=2, gemm_dtype="fp8", global_batch=8), "gemm_dtype"),
    "dp2-fp8-cached": (dict(dp=2, gemm_dtype="fp8-delayed", fp8_weight_cache=True, global_batch=8), "fp8-delayed"),
    "dp2-pp2-zero3-chimera": (dict(dp=2, pp=2, sharding="zero3", schedule="chimera", global_batch=8), None),
    "dp2-pp2-zero1-chimera": (dict(dp=2, pp=2, sharding="zero1", schedule="chimera", global_batch=8), None),
    "dp2-pp2-zero1-2bw": (dict(dp=2, pp=2, sharding="zero1", schedule="2bw", global_batch=8), None),
    "cp2": (dict(cp=2, global_batch=8), None),
    "dp2-cp2-tp2-sp": (dict(dp=2, cp=2, tp=2, sequence_parallel=True, global_batch=8), None),
    "cp2-pp2": (dict(cp=2, pp=2, global_batch=8), None),
    "cp2-dp2-compressed": (dict(cp=2, dp=2, compression="oktopk", global_batch=8), None),
    "cp2-dp3-gtopk": (dict(cp=2, dp=3, compression="gtopk", global_batch=12), "gtopk"),
    "dp2-cp2-zero1": (dict(dp=2, cp=2, sharding="zero1", global_batch=8), None),
    "dp2-cp2-zero3": (dict(dp=2, cp=2, sharding="zero3", global_batch=8), None),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_refusal_is_what_train_says_before_starting(name: str) -> None:
    """The reason is the one ``validate_run`` (what ``train`` checks before any process starts)
    raises with the same default options, and None exactly when it raises nothing."""
    from paratrain.errors import ConfigError
    from paratrain.runtime.train import validate_run

    layout, word = LAYOUTS[name]
    config = ParallelConfig(**layout)
    refusal = train_refusal(TINY, config)
    try:
        validate_run(TINY, config, TrainConfig(dp_impl=default_dp_impl(config)))
        raised = None
    except ConfigError as e:
        raised = str(e)
    assert refusal == raised
    assert (refusal is None) == (word is None) and (word is None or word in refusal), refusal


def test_vocabulary_tp_does_not_divide_is_reported_by_plan(run_cli) -> None:
    code, out, err = run_cli("plan", "--model", "gpt3-175b", "--cluster", "dgx-a100", "--gpus", "1024",
                             "--global-batch", "1536", "--no-simulate", "--json")
    assert code == 0, err
    refusal = json.loads(out)["train_refusal"]
    assert refusal.startswith("tp: tp(8) does not divide the vocabulary 50257"), refusal
    code, out, err = run_cli("plan", "--model", "gpt3-175b", "--vocab", "50264", "--cluster", "dgx-a100", "--gpus",
                             "1024", "--global-batch", "1536", "--no-simulate", "--json")
    assert code == 0, err
    doc = json.loads(out)  # padded as Megatron pads it: the winner (zero1, sequence parallel, a pipeline) runs
    assert doc["train_refusal"] is None and doc["config"]["parallel"]["pp"] > 1, doc["config"]
    code, out, err = run_cli("plan", "--model", "gpt-tiny", "--cluster", "cpu", "--gpus", "4", "--global-batch", "8")
    assert code == 0, err
    assert "runs it (plan -o FILE, then train --config FILE)" in out


def test_train_says_when_the_model_asks_for_dropout_it_does_not_run() -> None:
    """A model that sets dropout (a HF GPT-2 config's resid_pdrop) trains without it: train says
    so in one line; unset or false dropout says nothing."""
    from paratrain.runtime.config import dropout_notice
    from paratrain.spec.model import from_hf_config, preset

    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "resid_pdrop": 0.1}
    notice = dropout_notice(from_hf_config(gpt2))
    assert notice is not None and "dropout" in notice and "\n" not in notice
    assert dropout_notice(preset("gpt-tiny")) is None  # dropout: false
    assert dropout_notice(preset("gpt3-1.3b")) is None  # unset: the cost model's family default


def test_the_search_leaves_out_fsdp2_under_pipedream_and_2bw() -> None:
    """zero2/zero3 run as FSDP2, which train refuses under PipeDream's and 2BW's weight versions:
    the search does not offer the pair, and pinning both is one error naming the fix."""
    from paratrain.errors import ConfigError
    from paratrain.plan.space import Layout, Pins, variants

    for sched in ("pipedream", "2bw", "1f1b"):
        got = {c.sharding for c in variants(TINY, 8, Layout(dp=2, tp=1, pp=2), Pins(schedule=sched), 2)}
        assert got == ({"none", "zero1"} if sched != "1f1b" else {"none", "zero1", "zero2", "zero3"}), sched
    with pytest.raises(ConfigError, match="sharding: zero3 is FSDP2.*use --sharding zero1 or none"):
        Pins(schedule="2bw", sharding="zero3")
    assert Pins(schedule="2bw", sharding="zero3", pp=1).sharding == "zero3"  # one stage: no weight versions
