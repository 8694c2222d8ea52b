"""``paratrain data tokenizer``, ``paratrain data prepare`` and the train flags of tokenized text,
evaluation and logging: the working path, and bad input as one line with exit 2 that writes nothing.

Each case runs in-process through ``paratrain.cli.main``; every ``train`` case fails its checks
before any worker starts. ``{tok}`` is a trained tokenizer (300 ids), ``{cache}`` a token cache made
with it, ``{text}`` a text file, ``{empty}`` an empty one, ``{badtok}`` a directory whose
tokenizer.json is not a tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.cli import main


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tokcli")
    text = d / "text.txt"
    text.write_text("".join(f"line {i}: the cat sat on the mat, {i * i}\n" for i in range(400)), encoding="utf-8")
    (d / "empty.txt").write_text("", encoding="utf-8")
    (d / "badtok").mkdir()
    (d / "badtok" / "tokenizer.json").write_text('{"model": 3}', encoding="utf-8")
    assert _run(["data", "tokenizer", "--train", str(text), "--vocab", "300", "--out", str(d / "tok")])[0] == 0
    assert _run(["data", "prepare", "--tokenizer", str(d / "tok"), "--out", str(d / "cache"), str(text)])[0] == 0
    return {"tok": d / "tok", "cache": d / "cache", "text": text, "empty": d / "empty.txt", "badtok": d / "badtok",
            "dir": d}


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        main(argv)
        return 0, ""
    except SystemExit as e:
        return int(e.code or 0), ""


def test_prepare_reports_and_reuses_the_cache(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    capsys.readouterr()
    code = _run(["data", "prepare", "--tokenizer", str(files["tok"]), "--out", str(files["cache"]),
                 str(files["text"]), "--json"])[0]
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["reused"] is True and doc["vocab_size"] == 300 and doc["documents"] == 1
    assert doc["size_bytes"] == 2 * doc["tokens"]  # uint16


CASES = [
    ("prepare-empty-file", ["data", "prepare", "--tokenizer", "{tok}", "--out", "{new}", "{empty}"], "no text"),
    ("prepare-unreadable-tokenizer", ["data", "prepare", "--tokenizer", "{badtok}", "--out", "{new}", "{text}"],
     "not a readable tokenizer"),
    ("prepare-no-tokenizer", ["data", "prepare", "--tokenizer", "{new}", "--out", "{new}", "{text}"],
     "no tokenizer.json"),
    ("prepare-missing-file", ["data", "prepare", "--tokenizer", "{tok}", "--out", "{new}", "{new}.txt"],
     "does not exist"),
    ("prepare-out-not-a-cache", ["data", "prepare", "--tokenizer", "{tok}", "--out", "{tok}", "{text}"],
     "is not a token cache"),
    ("prepare-out-under-file", ["data", "prepare", "--tokenizer", "{tok}", "--out", "{text}/cache", "{text}"],
     "is not a directory"),
    ("tokenizer-vocab-huge", ["data", "tokenizer", "--train", "{text}", "--vocab", str(10**12), "--out", "{new}"],
     "--vocab"),
    ("tokenizer-small-vocab", ["data", "tokenizer", "--train", "{text}", "--vocab", "100", "--out", "{new}"],
     "at least 257"),
    ("tokenizer-empty-file", ["data", "tokenizer", "--train", "{empty}", "--vocab", "300", "--out", "{new}"],
     "no text"),
    ("train-tokenizer-vocab-exceeds-model", ["train", "--data", "{cache}", "--vocab", "256"],
     "300 ids, more than the model's vocabulary of 256"),
    ("train-tokenizer-on-stdlib", ["train", "--tokenizer", "{tok}"], "tokenizes text files"),
    ("train-empty-data-file", ["train", "--data", "{empty}", "--tokenizer", "{tok}", "--vocab", "320"], "no text"),
    ("train-unreadable-tokenizer", ["train", "--data", "{text}", "--tokenizer", "{badtok}", "--vocab", "320"],
     "not a readable tokenizer"),
    ("train-eval-every-without-data", ["train", "--eval-every", "5"], "--eval-every: needs --eval-data"),
    ("train-eval-batches-without-data", ["train", "--eval-batches", "2"], "--eval-batches: needs --eval-data"),
    ("train-eval-batches-zero", ["train", "--eval-data", "{text}", "--eval-batches", "0"], "at least 1"),
    ("train-eval-data-missing", ["train", "--eval-data", "{new}"], "does not exist"),
    ("train-eval-bytes-with-tokens", ["train", "--data", "{cache}", "--vocab", "320", "--eval-data", "{text}"],
     "read as raw bytes"),
    ("train-eval-image-task", ["train", "--task", "image", "--data", "{dir}", "--eval-data", "{text}"],
     "evaluation covers --task gpt"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                      files: dict[str, Path], tmp_path: Path, argv: list[str], needle: str) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # train --tokenizer's cache: not the user's
    subs = {**{k: str(v) for k, v in files.items()}, "new": str(tmp_path / "new")}
    argv = [a.format(**subs) for a in argv]
    before = sorted(p.name for p in files["dir"].rglob("*"))
    capsys.readouterr()
    code = _run(argv)[0]
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("paratrain: error: ") and "fix:" in err[0] and needle in err[0], err[0]
    assert sorted(p.name for p in files["dir"].rglob("*")) == before
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


@pytest.mark.parametrize("flag, package", [("--tensorboard", "tensorboard"), ("--wandb", "wandb")])
def test_missing_logging_package_names_the_install(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path, flag: str, package: str) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    argv = ["train", flag] + ([str(tmp_path / "tb")] if flag == "--tensorboard" else [])
    capsys.readouterr()
    assert _run(argv)[0] == 2
    err = capsys.readouterr().err.strip()
    assert f"pip install {package}" in err and len(err.splitlines()) == 1
