"""flash-linear-attention's own Triton CP kernels (fla-core 0.6.0, unmodified),
run on the CPU by Triton's interpreter, on cpsim's ranks
(examples/libraries/fla_kernels_step.py): chunk_kda with cp_context against
cpsim's reference recurrence, and the CP convolution with FLA's kernel.

A long run: `fla_kernels_step.py kda --cases 300` (docs/libraries.md)."""
import hashlib
import base64
import os

import pytest

from libraries_common import FAMILY, SEED, expect_reported

import fla_kernels_step  # noqa: E402 - imports triton_cpu first: Triton's interpreter, its adjustments
import triton_cpu


def test_chunk_kda_with_cp_context_matches_cpsims_recurrence():
    before = triton_cpu.LAUNCHES[0]
    ran = fla_kernels_step.check("kda", cases=16, seed=SEED)
    assert ran >= 16 and ran.outside == 0
    assert triton_cpu.LAUNCHES[0] - before > 16 * 10  # FLA's kernels ran: forward, backward, the CP merge


def test_the_cp_convolution_with_flas_triton_kernel_holds():
    assert fla_kernels_step.check("conv", cases=20, seed=SEED) >= 20


def test_the_cp_convolution_with_flas_triton_kernel_holds_on_a_thd_family():
    assert fla_kernels_step.check("conv", cases=6, seed=SEED, family=FAMILY["te_thd_2cp"]) >= 6


def test_kda_without_the_state_of_the_ranks_before_is_reported():
    expect_reported(lambda: fla_kernels_step.check("kda", fla_kernels_step.VARIANTS["kda"]["no_state_across_ranks"],
                                                   cases=16, seed=SEED),
                    "recurrence_o", "smallest failing layout (cp=2")


def test_a_gate_handed_over_as_a_decay_factor_is_reported():
    expect_reported(lambda: fla_kernels_step.check("kda", fla_kernels_step.VARIANTS["kda"]["gate_unscaled"],
                                                   cases=16, seed=SEED),
                    "recurrence_o")


def test_finding_f1_with_flas_own_kernel_ranks_shorter_than_the_window_break_the_convolution():
    expect_reported(lambda: fla_kernels_step.check("conv", fla_kernels_step.VARIANTS["conv"]["conv_always"],
                                                   cases=20, seed=SEED, family=FAMILY["fewer_tokens_than_ranks"]),
                    "raised RuntimeError")


@pytest.mark.parametrize("distribution", ["fla_core", "triton"])
def test_the_adjustments_change_no_installed_file(distribution):
    # Every file pip installed for the library hashes as its RECORD says, after the
    # adjustments ran (they live in this process only: triton_cpu.py).
    from importlib import metadata
    dist = metadata.distribution(distribution.replace("_", "-"))
    checked = 0
    for f in dist.files:
        if not f.hash or f.hash.mode != "sha256" or not str(f).endswith(".py"):
            continue
        with open(f.locate(), "rb") as source:
            digest = base64.urlsafe_b64encode(hashlib.sha256(source.read()).digest()).rstrip(b"=").decode()
        assert digest == f.hash.value, str(f)
        checked += 1
    assert checked > 20


def test_the_adjustments_are_the_ones_docs_libraries_lists():
    # The device guard is replaced in every module that imported it by name.
    assert {"fla.ops.cp.chunk_bwd", "fla.ops.cp.chunk_delta_h", "fla.ops.cp.chunk_fwd",
            "fla.ops.cp.chunk_merge"} <= set(triton_cpu.enable())
    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "libraries.md")).read()
    for words in ("TRITON_INTERPRET=1", "Autotuning without timing", "Loop counters are tensors",
                  "One kernel at a time", "Masks are booleans", "Builtins aliased by name",
                  "Every dot precision", "CP device guard"):
        assert words in docs and words in triton_cpu.__doc__, words
