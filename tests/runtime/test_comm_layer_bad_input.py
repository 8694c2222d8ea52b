"""``paratrain train --comm-table/--comm-log`` with bad input: one line, exit 2, nothing written,
before any worker starts; and the layer's own refusals (a backend this process cannot run).

Each case runs in-process through ``paratrain.cli.main``, as tests/cli/test_bad_input.py does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.errors import ConfigError
from paratrain.runtime.comm.backends import check_available


def _table(backend: str = "gloo", **changes: object) -> str:
    doc = {"format": "paratrain-comm-table", "version": 1, "world_size": 2, "default_backend": "gloo",
           "backends": ["gloo", backend], "measurements": [],
           "choices": [{"op": "all_reduce", "group_size": 2, "min_bytes": 0, "max_bytes": None, "backend": backend}]}
    return json.dumps({**doc, **changes})


FILES = {
    "truncated.json": _table()[:40],
    "unknown_backend.json": _table("infiniband"),
    "nccl.json": _table("nccl"),
    "not_a_table.json": json.dumps({"format": "paratrain-calibration"}),
}

CASES = [
    ("missing", ["--comm-table", "{tmp}/nope.json"], "does not exist"),
    ("truncated", ["--comm-table", "{tmp}/truncated.json"], "not a readable JSON table"),
    ("unknown-backend", ["--comm-table", "{tmp}/unknown_backend.json"], "unknown backend 'infiniband'"),
    ("not-a-table", ["--comm-table", "{tmp}/not_a_table.json"], "not a tuning table"),
    ("nccl-on-cpu", ["--comm-table", "{tmp}/nccl.json"], "needs CUDA"),
    ("log-is-a-directory", ["--comm-log", "{tmp}"], "--comm-log"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_comm_flags_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, argv: list[str], needle: str) -> None:
    if needle == "needs CUDA":
        import torch

        if torch.cuda.is_available():
            pytest.skip("NCCL can run here")
    for name, text in FILES.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    args = ["train", "--model", "gpt-tiny", "--steps", "1", "--data", "synthetic", "--no-progress",
            *[a.replace("{tmp}", str(tmp_path)) for a in argv]]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert len(err) == 1 and err[0].startswith("paratrain: error: ") and "fix:" in err[0], err
    assert needle in err[0], err[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_backend_torch_lacks_is_refused_by_name() -> None:
    import torch.distributed as dist

    if dist.is_mpi_available():
        pytest.skip("this torch has MPI")
    with pytest.raises(ConfigError, match="without MPI"):
        check_available("mpi", "cpu")
    with pytest.raises(ConfigError, match="unknown backend"):
        check_available("ucc2", "cpu")
