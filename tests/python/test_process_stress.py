"""Process mode holds on correct code: a user's own correct CP step (user_cp.py,
through stress_job.py) checked as 2 and 4 processes, each output alone and all
together, run again and again: every run passes, none aborts, none reports a
false failure. CI runs the step returning every output ("all": it computes
every operator in every configuration, so it carries what each alone does) at
2 and 4 processes, CPSIM_STRESS_RUNS times (default 1) with CPSIM_STRESS_CASES
cases (default 5); the long run takes each output alone too:

    CPSIM_STRESS_OUTPUTS=each CPSIM_STRESS_RUNS=50 CPSIM_STRESS_CASES=20 ctest -R Python.ProcessStress

(docs/harness.md, "Process mode under stress")."""
import os
import subprocess
import sys
import time

import pytest

RUNS = int(os.environ.get("CPSIM_STRESS_RUNS", "1"))
CASES = int(os.environ.get("CPSIM_STRESS_CASES", "5"))
OUTPUTS = (["targets", "conv", "recurrence_o", "attention_o", "all"] if os.environ.get("CPSIM_STRESS_OUTPUTS") == "each"
           else ["all"])


def _launch(n, outputs):
    binary = os.environ.get("CPSIM_BINARY")
    if not binary:
        pytest.skip("CPSIM_BINARY (the cpsim executable) is not set: run through CTest")
    script = os.path.join(os.path.dirname(__file__), "stress_job.py")
    p = subprocess.run([binary, "launch", "-n", str(n), "--grace", "30", "--", sys.executable,
                        script, outputs, str(CASES)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    return p.returncode, p.stdout.decode(errors="replace")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("outputs", OUTPUTS)
def test_a_correct_step_passes_every_run_as_processes(n, outputs):
    failed = []
    start = time.monotonic()
    for run in range(RUNS):
        rc, out = _launch(n, outputs)
        held = all("stress_job: rank %d: %d cases hold" % (r, CASES) in out for r in range(n))
        if rc != 0 or not held or "terminate called" in out or "enforce fail" in out:
            failed.append("run %d (exit %d):\n%s" % (run + 1, rc, out[-3000:]))
    assert not failed, "%d of %d runs of the correct step failed (%.0f s):\n%s" % (
        len(failed), RUNS, time.monotonic() - start, "\n".join(failed[:2]))
