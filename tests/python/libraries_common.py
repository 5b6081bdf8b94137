"""What the library suites share: where the adapters and the families are, and
the check that a planted bug (or a known finding) is reported."""
import glob
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "examples", "libraries"))
FAMILIES = sorted(glob.glob(os.path.join(ROOT, "examples", "families", "*.json")))
FAMILY = {os.path.basename(f)[:-len(".json")]: f for f in FAMILIES}

# Each suite draws from fixed seeds (printed on a failure with the replay line),
# so that a run in CI is the run measured here.
SEED = 20261203


def expect_reported(run, *texts):
    """run() must raise CheckFailed whose report names every one of texts."""
    import cpsim.torch
    with pytest.raises(cpsim.torch.CheckFailed) as failed:
        run()
    report = str(failed.value)
    for text in texts:
        assert text in report, report
    return failed.value
