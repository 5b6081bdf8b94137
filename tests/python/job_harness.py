"""One rank of `cpsim launch -n N -- python3 job_harness.py VARIANT`: the example
CP step under cpsim.torch.check with ranks as processes."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch"))
sys.path.insert(0, os.path.dirname(__file__))
import cp_step  # noqa: E402

import cpsim.torch as ct  # noqa: E402

variant = sys.argv[1]
cases = int(sys.argv[2])
ct.init_process_group(timeout=10)
dp = 1
if variant.startswith("dp_cp"):  # the DP x CP step of test_dp_cp_step.py at dp=2
    import test_dp_cp_step
    step, dp = test_dp_cp_step.make_step(variant.partition(":")[2] or None), 2
else:
    step = cp_step.step if variant == "faithful" else cp_step.VARIANTS[variant]
try:
    n = ct.check(step, cases=cases, seed=11, dp=dp, dtype="bf16" if dp > 1 else "f64")
    print("rank %d: %d layouts hold at cp %d" % (ct._job.rank(), n, ct._job.size() // dp))
except ct.CheckFailed as e:
    print("rank %d: %s" % (ct._job.rank(), " | ".join(e.failure.splitlines())))
    sys.exit(1)
