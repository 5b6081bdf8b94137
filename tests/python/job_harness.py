"""One rank of `cpsim launch -n N -- python3 job_harness.py VARIANT[,VARIANT...] CASES`:
each variant's step under cpsim.torch.check with ranks as processes, one after
another in the same job (a failing check leaves the job's own group as it was).
Prints "rank R: [VARIANT] ..." for each; exits 1 when any failed."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch"))
sys.path.insert(0, os.path.dirname(__file__))
import cp_step  # noqa: E402

import cpsim.torch as ct  # noqa: E402

variants = sys.argv[1].split(",")
cases = int(sys.argv[2])
ct.init_process_group(timeout=10)
failed = False


def say(line):
    # One write of at most PIPE_BUF bytes: the processes share the pipe, and a
    # longer or split write can land inside another process's line.
    os.write(1, line.encode()[:4000] + b"\n")


for variant in variants:
    dp = 1
    if variant.startswith("dp_cp"):  # the DP x CP step of test_dp_cp_step.py at dp=2
        import test_dp_cp_step
        step, dp = test_dp_cp_step.make_step(variant.partition(":")[2] or None), 2
    else:
        step = cp_step.step if variant == "faithful" else cp_step.VARIANTS[variant]
    try:
        n = ct.check(step, cases=cases, seed=11, dp=dp, dtype="bf16" if dp > 1 else "f64")
        say("rank %d: [%s] %d layouts hold at cp %d" % (ct._job.rank(), variant, n, ct._job.size() // dp))
    except ct.CheckFailed as e:
        say("rank %d: [%s] %s" % (ct._job.rank(), variant, " | ".join(e.failure.splitlines())))
        failed = True
sys.exit(1 if failed else 0)
