"""Inkling2's contiguous CP (`nemo_automodel.components.models.inkling2.
context_parallel`, the module of seed 000) on cpsim's ranks, for a pin that ships
it: nemo-automodel 0.7.0 ships `models/inkling` without a CP module, so this
adapter is imported only when the module exists (tests/python/test_library_glm5.py
checks which), and examples/torch/cp_step.py stays the reference user step for it.

    .venv/bin/python examples/libraries/inkling2_step.py

What it maps, by the seed's API page: `unpack_row_layout(batch)` (padding and
positions from the packer's lengths) to "padding" and "position_ids";
`gather_sequence(value, mesh, differentiable=True)` to "gathered";
`convolution_history(masked, mesh, width)` to "halo"; on the CP mesh of a real
`init_device_mesh("cpu", (cp,))`.
"""
import os
import sys

from torch.distributed.device_mesh import init_device_mesh

from nemo_automodel.components.models.inkling2 import context_parallel as inkling2_cp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import library_cli  # noqa: E402
from cpsim.torch import OutsideContract  # noqa: E402


def step(case):
    if "seq_lens" not in case.batch or "seq_lens_padded" not in case.batch:
        raise OutsideContract("unpack_row_layout takes the shared packer's seq_lens and seq_lens_padded")
    mesh = init_device_mesh("cpu", (case.cp,), mesh_dim_names=("cp",))
    batch = {k: (v.reshape(1, -1) if k in ("input_ids", "labels", "position_ids") and v.dim() == 1 else v.clone())
             for k, v in case.batch.items()}
    inkling2_cp.unpack_row_layout(batch)
    return {"padding": batch["padding_mask"], "position_ids": batch["position_ids"],
            "gathered": inkling2_cp.gather_sequence(case.x, mesh, differentiable=True),
            "halo": inkling2_cp.convolution_history(case.x, mesh, case.conv_width)}


def main():
    import cpsim.torch
    args = library_cli.arguments(__doc__, {})
    return library_cli.run(lambda: cpsim.torch.check(step, cases=args.cases, max_cp=args.max_cp, family=args.family,
                                                    seed=args.seed, forms=["seq_lens_padded"]),
                          "nemo-automodel inkling2.context_parallel")


if __name__ == "__main__":
    sys.exit(main())
