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


# Triton's interpreter runs a case in seconds (one in 8 layouts has two chunks a
# rank: tens of seconds): CPSIM_FLA_KDA_CASES=N for long runs.
KDA_CASES = int(os.environ.get("CPSIM_FLA_KDA_CASES", "8"))


def test_chunk_kda_with_cp_context_matches_cpsims_recurrence():
    before = triton_cpu.LAUNCHES[0]
    ran = fla_kernels_step.check("kda", cases=KDA_CASES, seed=SEED)
    assert ran >= KDA_CASES and ran.outside == 0
    assert triton_cpu.LAUNCHES[0] - before > KDA_CASES * 10  # FLA's kernels ran: forward, backward, the CP merge


def test_chunk_kda_carries_a_live_state_over_chunks_inside_and_across_ranks(tmp_path):
    # One document over three ranks of 67 tokens (two of FLA's 64-token chunks
    # each: the state goes chunk to chunk inside a rank, then through the CP
    # summaries of ranks 0 and 1), gates live (heads decaying apart, a state
    # that outlives a chunk). FLA's fix #1115 reverted (the backward summary
    # decaying every head by head 0's gate) fails here and passes every short
    # case; drawn gates in [-1, 0] hide it too.
    batch = tmp_path / "one_long_document.json"
    batch.write_text('{"input_ids": [[%s]]}' % ", ".join(str(1 + i % 5) for i in range(201)))
    assert fla_kernels_step.check("kda", batch=str(batch), cp=3, seed=SEED, live_gates_every=1) == 1


# --- bf16 (triton_cpu.py's adjustment 9) ---

def test_chunk_kda_and_the_convolution_in_bf16_match_cpsims_references():
    # The dtype models train in, within the manifest's bf16 tolerance; without
    # the adjustment the interpreter's bf16 dots compute on the values' bits
    # (a relative RMSE of 5e9 on the first case).
    assert fla_kernels_step.check("kda", cases=3, seed=SEED, dtype="bf16") >= 3
    assert fla_kernels_step.check("conv", cases=3, seed=SEED, dtype="bf16") >= 3


def test_in_bf16_kda_without_the_state_of_the_ranks_before_is_still_reported(tmp_path):
    # The bf16 tolerance does not hide a CP bug of the kernels (one document
    # over both ranks, replayed: a drawn failure shrinks through interpreted runs).
    batch = tmp_path / "one_document.json"
    batch.write_text('{"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8]], "seq_lens": [[8]]}')
    expect_reported(lambda: fla_kernels_step.check("kda", fla_kernels_step.VARIANTS["kda"]["no_state_across_ranks"],
                                                   batch=str(batch), cp=2, seed=SEED, dtype="bf16"),
                    "recurrence_o", "rank 1")


def test_in_bf16_a_state_carried_through_a_quiet_rank_arrives_as_the_unsharded_runs(tmp_path):
    # One 192-token document at CP 3 in bf16; rank 1's tokens write nothing
    # (beta 0) and every head keeps its state over a chunk (log-decay in
    # [-0.01, 0]), so the state rank 2 receives is rank 0's carried through rank
    # 1's CP summary transform alone. FLA keeps that transform in fp32 (its
    # #740): FLA's sharded run equals its unsharded one (0 on five seeds;
    # tolerance 2e-4). The transform rounded to bf16 at every chunk (#740
    # reverted): rank 2's output 0.0013-0.0037 and rank 0's dk 0.0013-0.0074 on
    # those seeds (the forward and the backward chain each caught alone), where
    # the comparison against cpsim's float64 reference cannot tell it from
    # bf16's own rounding.
    batch = tmp_path / "one_document_three_ranks.json"
    batch.write_text('{"input_ids": [[%s]]}' % ", ".join(str(1 + i % 5) for i in range(192)))
    step = fla_kernels_step.make_kda_step(quiet=(64, 128))
    assert fla_kernels_step.check("kda", step, batch=str(batch), cp=3, seed=SEED, live_gates_every=0,
                                  dtype="bf16") == 1


def test_the_interpreters_bf16_arithmetic_is_the_hardwares():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(a_ptr, b_ptr, c_ptr, x_ptr, y_ptr, z_ptr, o_ptr, d_ptr, f_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        at = i[:, None] * N + i[None, :]
        tl.store(c_ptr + at, tl.dot(tl.load(a_ptr + at), tl.load(b_ptr + at)))  # bf16 operands, fp32 accumulator
        x, y, z = tl.load(x_ptr + i), tl.load(y_ptr + i), tl.load(z_ptr + i)
        tl.store(o_ptr + i, x * y + z)  # bf16 arithmetic
        tl.store(d_ptr + i, x - y)
        f = tl.load(f_ptr + i)
        tl.store(f_ptr + i, f.to(tl.bfloat16).to(tl.float32))  # fp32 to bf16 and back

    N = 16
    g = torch.Generator().manual_seed(SEED)
    a, b = (torch.randn(N, N, generator=g).bfloat16() for _ in range(2))
    x, y, z = (torch.randn(N, generator=g).bfloat16() for _ in range(3))
    # halfway cases round to even: 1 + 2^-8 down to 1, 1 + 3 x 2^-8 up to 1 + 2^-6; NaN stays NaN
    f = torch.cat([torch.randn(N - 4, generator=g), torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("inf"),
                                                                   float("nan")])])
    c, o, d, f_out = torch.empty(N, N), torch.empty(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16), \
        f.clone()
    kernel[(1,)](a, b, c, x, y, z, o, d, f_out, N)
    # The dot against float64 products of the same bf16 values (exact), summed: fp32 accumulation's error only.
    exact = a.double() @ b.double()
    assert float((c.double() - exact).abs().max()) <= 1e-6 * float(exact.abs().max())
    # Elementwise: each operation in fp32, rounded to bf16 (torch's bf16 rounding is to nearest even).
    assert torch.equal(o, ((x.float() * y.float()).bfloat16().float() + z.float()).bfloat16())
    assert torch.equal(d, (x.float() - y.float()).bfloat16())
    assert torch.equal(f_out[:-1], f[:-1].bfloat16().float()) and bool(f_out[-1].isnan())
    assert f_out[N - 4].item() == 1.0 and f_out[N - 3].item() == 1 + 2 ** -6


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


def _conv_by_definition(x, weight, bias, cu_seqlens):
    """The packed causal depthwise convolution of every row, document by
    document (weight[:, W - 1] on the token itself), as cpsim's conv defines it."""
    import torch
    out = torch.zeros_like(x)
    W = weight.shape[1]
    bounds = cu_seqlens.tolist()
    for r in range(x.shape[0]):
        for start, end in zip(bounds[:-1], bounds[1:]):
            for t in range(start, end):
                acc = bias.clone()
                for j in range(W):
                    if t - j >= start:
                        acc = acc + weight[:, W - 1 - j] * x[r, t - j]
                out[r, t] = acc
    return out


def test_finding_f3_causal_conv1d_with_cu_seqlens_and_two_rows_computes_row_zero_only():
    # Live in fla-core 0.6.0: with cu_seqlens its kernels address row 0 only
    # (p_x = x + bos * stride_x_t, no batch offset; the backward's dw slot
    # i_tg = i_t), so for B = 2 row 1's output is never written and the weight
    # and bias gradients sum B * NT slots of which NT were written. Every CP
    # caller passes B = 1; a varlen batch of two rows is silently wrong. When a
    # pin fixes it, this test fails: revisit docs/libraries.md (F3).
    import torch
    import fla_step
    from fla.modules.causal_conv1d.ops import causal_conv1d
    saved, fla_step.STAND_IN[0] = fla_step.STAND_IN[0], False  # FLA's own Triton kernel, interpreted
    try:
        _f3(torch, causal_conv1d)
    finally:
        fla_step.STAND_IN[0] = saved


def _f3(torch, causal_conv1d):
    torch.manual_seed(0)
    B, T, D, W = 2, 6, 16, 4
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    x = torch.randn(B, T, D, requires_grad=True)
    weight = torch.randn(D, W, requires_grad=True)
    bias = torch.randn(D, requires_grad=True)
    y, _ = causal_conv1d(x, weight, bias, cu_seqlens=cu_seqlens)
    upstream = torch.randn_like(y)
    dw, db = torch.autograd.grad(y, [weight, bias], upstream)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    want = _conv_by_definition(*leaves, cu_seqlens)
    want_dw, want_db = torch.autograd.grad(want, leaves[1:], upstream)
    # Row 0 is right; row 1 is not computed; the weight's gradient is wrong.
    torch.testing.assert_close(y[0], want[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y[1], want[1], rtol=1e-3, atol=1e-3), "row 1 is right: F3 fixed?"
    assert not torch.allclose(dw, want_dw, rtol=1e-3, atol=1e-3), "dweight is right: F3 fixed?"
    # With one row the same documents are right: the finding is the batch axis.
    y1, _ = causal_conv1d(x[:1], weight, bias, cu_seqlens=cu_seqlens)
    dw1 = torch.autograd.grad(y1, weight, upstream[:1])[0]
    want1 = _conv_by_definition(*[t[:1] if i == 0 else t for i, t in enumerate(leaves)], cu_seqlens)
    torch.testing.assert_close(y1, want1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw1, torch.autograd.grad(want1, leaves[1], upstream[:1])[0], rtol=1e-4, atol=1e-4)


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
                  "Every dot precision", "CP device guard", "bf16 arithmetic as the hardware does"):
        assert words in docs and words in triton_cpu.__doc__, words
