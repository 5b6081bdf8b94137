#!/usr/bin/env python3
"""Measures the tolerances `cpsim golden --dtype f32|bf16` writes: the worst
relative RMSE of examples/golden_check.py's numpy implementation, computing in
float32 from the rounded inputs, against the expected values stored in the dtype,
over every example at CP 1-8, by key family. verify/golden.cpp's
golden_tolerances() holds these with a margin.

    /usr/bin/python3 scripts/measure-golden-tolerances.py build/cpsim examples/
"""
import glob
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import golden_check as gc  # noqa: E402


def family(key):
    if key.startswith("conv_") or key in ("halo_grad", "gather_grad_x", "conv_dw (the partials summed)"):
        return "conv"
    if key.startswith(("rope_", "attention_", "sparse_attention_", "loss")):
        return "layers"
    return "recurrence"


def main(cpsim, examples):
    for dtype in ("f32", "bf16"):
        worst = {}
        for example in sorted(glob.glob(os.path.join(examples, "*.json"))):
            for cp in range(1, 9):
                with tempfile.TemporaryDirectory() as out:
                    subprocess.run([cpsim, "golden", example, "--cp", str(cp), "--out", out, "--dtype", dtype],
                                   check=True, stdout=subprocess.DEVNULL)
                    golden = gc.load_golden(out)
                    gc.MEASURED = {}
                    gc.check(golden, log=lambda *_: None, **gc.numpy_functions(golden))
                    for key, err in gc.MEASURED.items():
                        f = family(key)
                        if err > worst.get(f, (0, ""))[0]:
                            worst[f] = (err, "%s %s cp=%d" % (os.path.basename(example), key, cp))
        for f in ("conv", "recurrence", "layers"):
            err, where = worst.get(f, (0, "-"))
            print("%-5s %-11s worst relative RMSE %.3g (%s)" % (dtype, f, err, where))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
