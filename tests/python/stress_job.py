"""One rank of `cpsim launch -n N -- python3 stress_job.py OUTPUTS CASES [DP]`
(tests/python/test_process_stress.py): a user's own correct CP operators (a conv
halo passed by send/recv, a recurrence passing its state, attention over gathered
K/V: user_cp.py) checked with cpsim.torch.check across processes. OUTPUTS: the
outputs the step returns ("all", or a comma list of targets, conv, recurrence_o,
attention_o); the step computes every one of them whatever it returns."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch.distributed  # noqa: E402

import cpsim.torch  # noqa: E402
import user_cp  # noqa: E402

outputs = sys.argv[1]
cases = int(sys.argv[2])
dp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
cpsim.torch.init_process_group(timeout=20)


def step(case):
    out = user_cp.operators(case)
    return out if outputs == "all" else {k: v for k, v in out.items() if k in outputs.split(",")}


n = cpsim.torch.check(step, cases=cases, dp=dp, forms=["seq_lens_padded", "seq_lens"])
print("stress_job: rank %d: %d cases hold" % (torch.distributed.get_rank(), n))
