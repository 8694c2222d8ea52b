"""A lone ``paratrain train`` process stops on SIGINT / SIGTERM even inside one long native call.

Python runs a signal handler only between the main thread's bytecodes, so a process inside a torch
kernel over a huge tensor (``train --seq 1000000``) used to go on until the kernel returned. Each
case runs a float64 matrix product that takes far longer than the test (5,000² on one thread:
2.5·10^11 FLOPs, tens of seconds here) inside ``faults.signal_handlers(alone=True)`` and signals it mid-call.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from paratrain.runtime import faults
    torch.set_num_threads(1)
    a = torch.ones(5000, 5000, dtype=torch.float64)
    try:
        with faults.signal_handlers(0, alone=True):
            print("ready", flush=True)
            if sys.argv[1] == "native":
                a @ a
            else:
                while True:
                    time.sleep(0.01)
    except faults.Interrupted as e:
        print(f"handler {e.signum}", flush=True)
        sys.exit(99)
""")


def _start(mode: str, stop_after_s: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PARATRAIN_STOP_AFTER_S": str(stop_after_s)}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # inside the product by now
    return proc


def _finish(proc: subprocess.Popen[str], within_s: float) -> tuple[int, str, str, float]:
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"still running {within_s} s after the signal")
    return proc.returncode, out, err, time.monotonic() - start


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_ends_the_process_inside_a_long_native_call(sig: signal.Signals) -> None:
    proc = _start("native", stop_after_s=1.0)
    proc.send_signal(sig)
    code, out, err, took = _finish(proc, within_s=20)
    assert code == 128 + sig, (code, err)
    assert err.strip().splitlines() == [f"paratrain: interrupted ({sig.name}); stopped inside a long computation"]
    assert took >= 0.9  # it waited for the Python handler first


def test_a_second_signal_ends_it_at_once() -> None:
    proc = _start("native", stop_after_s=600.0)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    code, _, err, _ = _finish(proc, within_s=20)
    assert code == 128 + signal.SIGINT, (code, err)


def test_a_process_back_in_python_stops_through_its_handler_as_before() -> None:
    proc = _start("python", stop_after_s=1.0)
    proc.send_signal(signal.SIGTERM)
    code, out, err, _ = _finish(proc, within_s=20)
    assert code == 99 and f"handler {int(signal.SIGTERM)}" in out, (code, out, err)
    assert "stopped inside" not in err
