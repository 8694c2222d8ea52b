"""CLI shell: presets listing and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import assert_one_line_error


def test_presets_json(run_cli):
    code, out, _ = run_cli("presets", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["models"]["llama2-7b"]["params"] == 6_738_415_616
    assert "dgx-a100" in doc["clusters"] and "h100" in doc["devices"]


def test_unknown_option_is_one_line(run_cli):
    code, _, err = run_cli("presets", "--bogus")
    assert_one_line_error(code, err, "--bogus")


def test_console_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "paratrain", "presets", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["models"]["gpt-tiny"]["vocab"] == 256


def test_preset_names_are_never_cut(run_cli):
    """Piped (rich's 80 columns) the tables keep their natural width: every name in full."""
    from paratrain.spec.cluster_presets import CLUSTER_PRESETS
    from paratrain.spec.device_presets import DEVICE_PRESETS
    from paratrain.spec.model_presets import MODEL_PRESETS

    code, out, _ = run_cli("presets")
    assert code == 0
    assert "…" not in out
    cells = {c.strip() for line in out.splitlines() for c in line.split("│")}
    for name in [*MODEL_PRESETS, *DEVICE_PRESETS, *CLUSTER_PRESETS]:
        assert name in cells, name
