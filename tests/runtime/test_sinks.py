"""TensorBoard and wandb receive what the JSON lines hold.

One ``paratrain train`` run (one process) on text files tokenized on first use, evaluating every
2 steps, with ``--metrics``, ``--tensorboard`` and ``--wandb`` (offline, no network): the event
file read back with TensorBoard's EventAccumulator and the history records of the offline wandb
run hold, step by step, the values of the metrics rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from paratrain.runtime.data.tokenized import find_documents, train_tokenizer
from paratrain.runtime.sinks import TAGS, scalars

pytestmark = pytest.mark.slow

STEPS = 4


def _wandb_history(run_file: Path) -> Iterator[dict[str, Any]]:
    """History records of a ``.wandb`` file: a LevelDB-style log (32 KiB blocks, 7-byte record
    headers: CRC32, length, type FULL/FIRST/MIDDLE/LAST) of wandb's protobuf ``Record``s after a
    7-byte file header (``:W&B``, magic, version)."""
    from wandb.proto import wandb_internal_pb2 as pb

    buf = run_file.read_bytes()
    assert buf[:4] == b":W&B"
    block, pos, parts = 32768, 7, []
    while pos + 7 <= len(buf):
        left = block - pos % block
        if left < 7:  # a block's trailer too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(buf[pos + 4: pos + 6], "little"), buf[pos + 6]
        parts.append(buf[pos + 7: pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            if record.WhichOneof("record_type") == "history":
                yield {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}


def test_tensorboard_and_offline_wandb_hold_the_metrics_rows(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    text = tmp_path / "text"
    text.mkdir()
    for i, f in enumerate(sorted(Path(os.__file__).parent.glob("*.py"))[:4]):
        (text / f"{i}.txt").write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    train_tokenizer(find_documents([str(text)]), 300, tmp_path / "tok")
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true",
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "paratrain", "train", "--model", "gpt-tiny", "--vocab", "320", "--seq", "32",
           "--global-batch", "4", "--steps", str(STEPS), "--data", str(text), "--tokenizer", str(tmp_path / "tok"),
           "--eval-data", str(text / "3.txt"), "--eval-every", "2", "--eval-batches", "1", "--metrics", str(metrics),
           "--tensorboard", str(tb), "--wandb", "--wandb-project", "sinks-test", "--wandb-run", "r1", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval_loss" in proc.stdout and "eval_ppl" in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["step"] for r in rows if "eval_loss" in r] == [1, 3]
    assert all(r["tokens"] == (r["step"] + 1) * 4 * 32 and r["max_memory_bytes"] > 0 for r in rows)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    logged = set(acc.Tags()["scalars"])
    for key, tag in TAGS.items():
        expected = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not expected:
            assert tag not in logged
            continue
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected], tag
        # event files store float32
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), tag

    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history = list(_wandb_history(runs[0]))
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    for h, r in zip(history, rows, strict=True):
        assert {k: v for k, v in h.items() if not k.startswith("_")} == scalars(r)  # JSON: exact
