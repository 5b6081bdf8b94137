"""The Python property harness (cpsim.torch.check) on the example CP step of
examples/torch/cp_step.py: the faithful step holds at CP 1-8 on every backend,
and each planted bug is reported (a shrunk counterexample, or the collective the
other ranks wait in, named in under the timeout)."""
import json
import os
import sys
import time

import pytest
import torch

import cpsim.torch as ct

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "torch"))
import cp_step  # noqa: E402

CASES = int(os.environ.get("CPSIM_HARNESS_CASES", "60"))


def test_cpsim_torch_imports_without_the_harness_and_offers_its_check():
    # One direction: the harness builds on cpsim.torch; cpsim.torch.check is the
    # harness's, imported when first asked for.
    import subprocess
    code = ("import sys, cpsim.torch as ct; assert 'cpsim.harness' not in sys.modules; "
            "from cpsim.torch import check, Checked; import cpsim.harness as h; "
            "assert check is h.check and Checked is h.Checked and 'check' in dir(ct)")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_every_documented_output_has_its_comparison_and_no_other():
    # One row of OUTPUT_TABLE (the text) and one entry of COMPARED (how it is
    # compared) per output: an output without a comparison, or a comparison of
    # an output nobody documented, fails here.
    from cpsim.compared import COMPARED
    from cpsim.outputs import OUTPUTS
    assert sorted(COMPARED) == sorted(OUTPUTS), (sorted(set(OUTPUTS) - set(COMPARED)),
                                                 sorted(set(COMPARED) - set(OUTPUTS)))


def test_the_docs_page_is_written_from_the_codes_tables():
    # docs/harness.md's tables of outputs and options are the code's (one table
    # each: cpsim.outputs, cpsim.options); the harness's help shows the same.
    from cpsim import docs, harness, outputs
    page = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "harness.md")
    with open(page) as f:
        text = f.read()
    assert docs.rendered(text) == text, ("docs/harness.md differs from the code's tables: "
                                         "PYTHONPATH=python python3 -m cpsim.docs docs/harness.md")
    for o in outputs.OUTPUT_TABLE:
        assert "| `%s` |" % o.name in text and '"%s"' % o.name in harness.__doc__, o.name


def test_options_are_grouped_and_each_keyword_is_one_groups():
    from cpsim.options import grouped
    layouts, inputs, ranks = grouped(plan="random", dtype="f32", dp=2, cps=[4, 2, 2])
    assert (layouts.plan, layouts.sizes(), inputs.dtype, ranks.dp, ranks.backend) == ("random", [2, 4], "f32", 2,
                                                                                      "threads")
    assert grouped(ranks=ct.Ranks(dp=3))[2].dp == 3
    with pytest.raises(TypeError, match="no option plans"):
        grouped(plans="equal")
    with pytest.raises(TypeError, match="dp given both in ranks= and as keywords"):
        grouped(ranks=ct.Ranks(dp=3), dp=2)
    for wrong, why in [(dict(plan="cyclic"), "plan: equal, balanced or random"), (dict(dtype="f16"), "dtype"),
                       (dict(dp=0), "dp: at least 1"), (dict(cp=2), "cp= goes with batch"),
                       (dict(batch="b.json"), "the CP size to replay"), (dict(cps=[0, 2]), "cps: CP sizes")]:
        with pytest.raises(ValueError, match=why):
            grouped(**wrong)


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_the_faithful_step_holds_at_cp_1_to_8(backend):
    assert ct.check(cp_step.step, cases=CASES, max_cp=8, backend=backend, seed=11) == CASES


def test_the_faithful_step_holds_on_every_shipped_family():
    families = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "families")
    for name in sorted(os.listdir(families)):
        with open(os.path.join(families, name)) as f:
            low = (json.load(f).get("cp") or [1])[0]  # the family's CP range, [min, max]
        if low > 8:
            continue
        assert ct.check(cp_step.step, cases=10, max_cp=8, family=os.path.join(families, name), seed=5) == 10, name


def test_an_anchor_left_out_is_named_in_under_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(cp_step.VARIANTS["no_anchor"], cases=CASES, max_cp=8, seed=11, timeout=10,
                 out=str(tmp_path / "smallest.json"))
    assert time.monotonic() - start < 60
    failure = e.value.failure
    # The rank that skipped its backward stopped while its peers wait in the gather's reduce_scatter.
    assert "reduce_scatter" in failure and "rank" in failure, failure
    assert e.value.cp >= 2
    assert os.path.exists(str(tmp_path / "smallest.json"))


def test_a_halo_from_the_wrong_neighbour_is_shrunk(tmp_path):
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(cp_step.VARIANTS["wrong_neighbour"], cases=CASES, max_cp=8, seed=11,
                 out=str(tmp_path / "smallest.json"))
    assert "halo" in e.value.failure, e.value.failure
    batch = json.loads(e.value.batch)
    tokens = torch.tensor(batch["input_ids"]).numel()
    # Shrunk: a handful of tokens on two or three ranks show it (at cp 2 only rank
    # 0 reads the wrong neighbour, seen once rank 1 holds a real token; at cp 3
    # rank 2's halo misses rank 0's tail even on one padding token).
    assert e.value.cp <= 3 and tokens <= 4, (e.value.cp, batch)
    with open(str(tmp_path / "smallest.json")) as f:
        assert json.load(f) == batch


def test_positions_restarted_per_rank_are_caught():
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(cp_step.VARIANTS["restart_positions"], cases=CASES, max_cp=8, seed=11)
    assert "position_ids" in e.value.failure, e.value.failure
    assert torch.tensor(json.loads(e.value.batch)["input_ids"]).numel() <= 4, e.value


MROPE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "families", "vision_language_mrope.json")


def test_mrope_position_ids_are_sharded_along_the_sequence_of_each_plane():
    # Qwen2-VL-style [3, S] position_ids (image spans as grids): the faithful
    # step holds (mRoPE in its RoPE, each plane cut along the sequence); a
    # sharder that cuts the planes' axis 1 (the rows) passes every [B, S]
    # layout and is caught on them.
    ct.check(cp_step.step, cases=CASES, max_cp=8, seed=11, family=MROPE)
    plain = os.path.join(os.path.dirname(MROPE), "vision_language.json")
    ct.check(cp_step.VARIANTS["mrope_rows"], cases=CASES, max_cp=8, seed=11, family=plain)
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(cp_step.VARIANTS["mrope_rows"], cases=CASES, max_cp=8, seed=11, family=MROPE)
    assert e.value.cp >= 2, e.value
    assert len(json.loads(e.value.batch)["position_ids"]) == 3, e.value.batch


def test_a_replayed_batch_whose_positions_disagree_with_its_documents_is_refused(tmp_path):
    # As cpsim check reads it: the file and the position named, no step run.
    batch = tmp_path / "positions.json"
    batch.write_text('{"input_ids": [[1, 2, 3, 4]], "seq_lens": [[4]], "position_ids": [[0, 1, 5, 6]]}')
    with pytest.raises(RuntimeError) as e:
        ct.check(cp_step.step, batch=str(batch), cp=2)
    assert "positions.json: position_ids row 0 index 2: position 5" in str(e.value), e.value
    planes = tmp_path / "planes.json"  # mRoPE: text after a grid is one past its largest position
    planes.write_text('{"input_ids": [5, 9, 9, 6], "cu_seqlens": [0, 4], '
                      '"position_ids": [[0, 1, 1, 2], [0, 1, 1, 2], [0, 1, 2, 3]]}')
    with pytest.raises(RuntimeError) as e:
        ct.check(cp_step.step, batch=str(planes), cp=2)
    assert "index 3: mRoPE position (2, 2, 3) must be (3, 3, 3)" in str(e.value), e.value


def test_rope_by_one_plane_of_mrope_is_caught():
    # A text model's RoPE (the temporal plane alone) in a vision-language step:
    # right on text, wrong on an image grid's tokens.
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(cp_step.VARIANTS["rope_one_plane"], cases=CASES, max_cp=8, seed=11, family=MROPE)
    assert "attention_o" in e.value.failure, e.value.failure
    assert len(json.loads(e.value.batch)["position_ids"]) == 3, e.value.batch


def _gather_with_backward(backward):
    """The example's sequence gather (dim 1), with a backward of the test's own."""
    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return cp_step._AllGatherSequence.forward(ctx, x, 1)

    Gather.backward = staticmethod(backward)
    return Gather


def test_a_wrong_gradient_alone_is_caught():
    # Forward right, backward wrong: the gather's gradient summed over ranks but not scattered.
    def backward(ctx, grad):
        full = grad.contiguous().clone()
        torch.distributed.all_reduce(full)
        L = full.shape[1] // torch.distributed.get_world_size()
        return full[:, :L]  # rank 0's part on every rank

    Wrong = _gather_with_backward(backward)

    def step(case):
        return {"gathered": Wrong.apply(case.x)}

    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=CASES, max_cp=8, seed=3)
    assert "gathered gradient" in e.value.failure, e.value.failure


def test_a_step_that_raises_or_returns_what_cpsim_does_not_compare_is_reported():
    def raises(case):
        if case.rank == case.cp - 1 and case.cp > 1:
            raise KeyError("no such key")
        return {}

    with pytest.raises(ct.CheckFailed) as e:
        ct.check(raises, cases=20, max_cp=4, seed=1)
    assert "raised KeyError" in e.value.failure and e.value.cp == 2, e.value.failure
    line = raises.__code__.co_firstlineno + 2  # where the step raised, in the user's file
    assert "at test_harness.py:%d in raises: raise KeyError" % line in e.value.failure, e.value.failure

    with pytest.raises(ct.CheckFailed) as e:
        ct.check(lambda case: {"logits": case.x}, cases=5, max_cp=2, seed=1)
    assert "logits" in e.value.failure and "compares" in e.value.failure, e.value.failure


def test_drawn_plans_reach_a_step_that_follows_the_cuts():
    # An equal-interval step under drawn cuts fails (it assumes equal intervals) ...
    with pytest.raises(ct.CheckFailed):
        ct.check(cp_step.step, cases=CASES, max_cp=4, plan="random", seed=2)

    # ... while one that follows case.cuts holds.
    def step(case):
        lo, hi = case.cuts[case.rank], case.cuts[case.rank + 1]
        _, doc_ids, _ = cp_step.shard_batch(case.batch, 0, 1, case.pad_token_id)
        P = case.cuts[-1]
        ids = torch.zeros(doc_ids.shape[0], P, dtype=torch.int64)
        ids[:, :doc_ids.shape[1]] = doc_ids[:, :P]
        return {"doc_ids": ids, "local_doc_ids": ids[:, lo:hi],
                "cu_seqlens": [cp_step.segment_cu_seqlens(row) for row in ids[:, lo:hi]]}

    assert ct.check(step, cases=CASES, max_cp=4, plan="random", seed=2) == CASES


def test_a_step_sets_aside_the_layouts_outside_its_contract():
    # Raised on every rank before any collective: the case is set aside, counted
    # with its reason, and another drawn in its place.
    def step(case):
        if case.S % 2:
            raise ct.OutsideContract("an odd sequence length")
        return cp_step.step(case)

    ran = ct.check(step, cases=20, max_cp=4, seed=7)
    assert ran == 20 and ran.outside > 0, (int(ran), ran.outside)
    assert ran.outside_why == {"an odd sequence length": ran.outside}


def test_the_draws_keep_to_the_forms_the_shortest_shard_and_the_pad_multiple():
    seen = set()

    def step(case):
        lengths = [case.cuts[r + 1] - case.cuts[r] for r in range(case.cp)]
        assert min(lengths) >= 3, case.cuts
        assert case.P % (2 * case.cp) == 0 and case.P >= case.S, (case.P, case.S, case.cp)
        packed = {"seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded"} & set(case.batch)
        assert not packed, sorted(case.batch)
        seen.add("position_ids" if "position_ids" in case.batch else "unpacked")
        return {}

    assert ct.check(step, cases=40, max_cp=4, seed=7, forms=["unpacked", "position_ids"], min_shard=3,
                    pad_multiple=2) == 40
    assert seen == {"unpacked", "position_ids"}


def test_a_forms_filter_of_row_forms_draws_rows_of_two_axes_only():
    # A forms filter is the batch's form to the letter: seq_lens forms as [B, S]
    # rows, never as a 1-D [S] row (only THD forms come as [S]).
    shapes = []

    def step(case):
        shapes.append(case.batch["input_ids"].dim())
        return {}

    assert ct.check(step, cases=60, max_cp=2, seed=3, forms=["seq_lens_padded", "seq_lens"], probes=0) == 60
    assert set(shapes) == {2}, sorted(set(shapes))
    shapes.clear()
    assert ct.check(step, cases=60, max_cp=2, seed=3, forms=["cu_seqlens"], probes=0) == 60
    assert set(shapes) == {1, 2}, sorted(set(shapes))  # a THD stream as [S] or [1, S]


def test_a_contract_the_draw_does_not_fit_ends_in_cpsims_own_words():
    # The step refuses every layout: drawing stops, and the report says how
    # many were drawn, how many set aside, and why.
    def step(case):
        raise ct.OutsideContract("an odd length" if case.S % 2 else "an even length")

    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=5, max_cp=2, seed=1)
    text = str(e.value)
    assert "Gave up" not in text and "RapidCheck" not in text, text
    assert "the step set aside " in text and "ran 0 of the 5 cases asked" in text, text
    assert " x an odd length" in text and " x an even length" in text, text
    assert "forms=" in text, text


@pytest.mark.parametrize("where", ["last_token", "padding", "everywhere"])
def test_a_real_target_where_cpsim_expects_none_is_reported(where):
    # targets are compared at every position, -100 included: a step that writes
    # a real target at a document's last token, on the padding, or at every
    # position that has none is caught (a comparison of the real ones only is not).
    def step(case):
        out = cp_step.step(case)
        targets = out["targets"].clone()
        L = targets.shape[1]
        start = case.rank * L
        tokens = torch.zeros((targets.shape[0], case.P), dtype=torch.int64)
        tokens[:, :case.tokens.shape[1]] = case.tokens
        none = targets == -100
        if where == "padding":
            none &= out["batch"]["padding_mask"]
        elif where == "last_token":
            none &= ~out["batch"]["padding_mask"]
        nxt = torch.cat([tokens, tokens[:, -1:]], 1)[:, start + 1:start + L + 1]
        return {"targets": torch.where(none, nxt.clamp(min=0), targets)}

    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=CASES, max_cp=4, seed=5)
    assert "targets" in str(e.value), str(e.value)


def test_an_input_its_output_does_not_reach_is_a_missing_gradient():
    # The halo returned detached: no gradient reaches case.x through it. A
    # missing gradient is compared as zero, and the expected one is not.
    def step(case):
        return {"halo": cp_step.convolution_history(case.x, case.conv_width).detach().requires_grad_()}

    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=CASES, max_cp=4, seed=5)
    assert "halo gradient (conv_dx)" in str(e.value), str(e.value)


def test_a_backward_that_writes_into_its_upstream_gradient_is_reported():
    # Right values, but the all-reduce runs on the gradient autograd handed in,
    # which the output's other consumers are given too.
    def backward(ctx, grad):
        g = grad.contiguous()
        torch.distributed.all_reduce(g)
        L = g.shape[1] // torch.distributed.get_world_size()
        r = torch.distributed.get_rank()
        return g[:, r * L:(r + 1) * L]

    InPlace = _gather_with_backward(backward)
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(lambda case: {"gathered": InPlace.apply(case.x)}, cases=CASES, max_cp=4, seed=3)
    assert "wrote into the upstream gradient" in e.value.failure, e.value.failure


def test_upstream_gradients_come_in_every_layout_autograd_makes():
    from cpsim.upstream import LAYOUTS, laid_out, layout_for
    assert {layout_for(seed, "gathered") for seed in range(40)} == set(LAYOUTS)
    u = torch.randn(2, 6, 3)
    for layout in LAYOUTS:
        t, got = laid_out(u, layout)
        assert torch.equal(t, u) and (got == "contiguous") == t.is_contiguous(), (layout, got, t.stride())
    t, got = laid_out(torch.full((2, 3), 0.5), "expanded")
    assert got == "expanded" and t.stride() == (0, 0)


def test_a_backward_right_only_for_a_contiguous_upstream_gradient_is_caught():
    # Reads the gradient's storage as if it were contiguous (as a kernel handed
    # grad.data_ptr() does): right for a fresh gradient, wrong for a transposed
    # or sliced view, which autograd hands a backward as readily.
    def backward(ctx, grad):
        raw = torch.as_strided(grad, grad.shape, torch.empty(grad.shape).stride())  # PLANTED
        moved = raw.movedim(1, 0).contiguous()
        world = torch.distributed.get_world_size()
        mine = torch.empty((moved.shape[0] // world,) + tuple(moved.shape[1:]), dtype=grad.dtype)
        torch.distributed.reduce_scatter_tensor(mine, moved)
        return mine.movedim(0, 1)

    Raw = _gather_with_backward(backward)
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(lambda case: {"gathered": Raw.apply(case.x)}, cases=CASES, max_cp=4, seed=3)
    assert "gathered gradient (gather_grad_x) from a" in e.value.failure, e.value.failure
    assert "upstream gradient" in e.value.failure, e.value.failure


# Ranks as processes: cpsim launch -n N -- python3 job_harness.py VARIANTS CASES, each
# process calling cpsim.torch.init_process_group() and then cpsim.torch.check for
# each variant in turn (one launch serves several tests: each process imports
# torch, about 5 s of CPU).
def launch_harness(n, variants, cases, _launched={}):
    import subprocess
    binary = os.environ.get("CPSIM_BINARY")
    if not binary:
        pytest.skip("CPSIM_BINARY (the cpsim executable) is not set: run through CTest")
    key = (n, tuple(variants), cases)
    if key not in _launched:
        script = os.path.join(os.path.dirname(__file__), "job_harness.py")
        start = time.monotonic()
        p = subprocess.run([binary, "launch", "-n", str(n), "--", sys.executable, script, ",".join(variants),
                            str(cases)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
        _launched[key] = (p.returncode, p.stdout.decode(), time.monotonic() - start)
    return _launched[key]


def variant_lines(out, variant):
    """What each process printed for one variant."""
    return "\n".join(line for line in out.splitlines() if "] " in line and line.split("] ")[0].endswith("[" + variant))


# One, two, an odd number, a power of two and the largest; ranks as threads hold
# at every size 1-8 above.
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_the_faithful_step_holds_with_ranks_as_processes(n):
    rc, out, _ = launch_harness(n, ["faithful"], 8)
    assert rc == 0, out
    assert all("rank %d: [faithful] 8 layouts hold at cp %d" % (r, n) in out for r in range(n)), out


PLANTED = [("no_anchor", ["calls did not match", "reduce_scatter", "returned"]),
           ("wrong_neighbour", ["halo"]),
           ("restart_positions", ["position_ids"]),
           ("per_rank_mean", ["rank 0 loss", "rank 1 loss", "rank 2 loss"])]  # every process's difference


@pytest.mark.parametrize("variant,words", PLANTED)
def test_each_planted_bug_is_reported_with_ranks_as_processes(variant, words):
    rc, out, took = launch_harness(3, [v for v, _ in PLANTED] + ["faithful"], 20)
    assert rc == 1, out
    assert took < 120 * len(PLANTED), out
    mine = variant_lines(out, variant)
    assert mine.count("\n") == 2 and all(w in mine for w in words), (words, out)
    # The job's own group outlives the failed checks: the faithful step after them holds.
    assert variant_lines(out, "faithful").count("20 layouts hold at cp 3") == 3, out


@pytest.mark.parametrize("variant,words", [
    ("targets_after_sharding", ["targets", "-100"]),  # the target at a shard edge inside a document is lost
    ("per_rank_mean", ["loss", "the step's loss is the mean of per-rank means"])])  # averaged over ranks
def test_targets_and_the_loss_across_ranks_are_checked(variant, words):
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(cp_step.VARIANTS[variant], cases=CASES, max_cp=8, seed=11)
    assert all(w in e.value.failure for w in words), e.value.failure
    assert e.value.cp >= 2


def _loss_step(convention):
    """cp_step's faithful step with its loss replaced by one of the conventions
    CP code ships by mistake."""
    def step(case):
        out = cp_step.step(case)
        targets = out["targets"]
        valid = targets != -100
        losses = torch.nn.functional.cross_entropy(case.logits.reshape(-1, case.vocab).double(),
                                                   targets.reshape(-1).clamp(min=0), reduction="none")
        local_sum = torch.where(valid.reshape(-1), losses, torch.zeros_like(losses)).sum()
        count = valid.sum().double()
        if convention == "local_mean":
            out["loss"] = local_sum / count.clamp(min=1)
        else:  # "sum": all-reduced, never divided
            total = local_sum.detach().clone()
            torch.distributed.all_reduce(total)
            out["loss"] = local_sum + (total - local_sum).detach()
        return out
    return step


@pytest.mark.parametrize("convention,named", [
    ("local_mean", "this rank's own token mean"),
    ("sum", "the sum of every rank's per-token losses, not divided by the count")])
def test_a_loss_of_another_convention_is_named(convention, named):
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(_loss_step(convention), cases=30, max_cp=4, seed=11)
    assert "the step's loss is " + named in e.value.failure, e.value.failure


def test_every_rank_s_first_difference_is_reported_values_before_gradients():
    # Rank 0's gradient is wrong; rank 1's value is wrong (and so is its gradient).
    def backward(ctx, grad):
        g, _ = cp_step._AllGatherSequence.backward(ctx, grad)
        return 2 * g if torch.distributed.get_rank() == 0 else g

    Doubled = _gather_with_backward(backward)

    def step(case):
        gathered = Doubled.apply(case.x) if case.cp > 1 else case.x
        if case.rank == 1:
            gathered = gathered + 1
        return {"gathered": gathered}

    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=CASES, cps=[2, 3], seed=4)
    lines = e.value.failure.splitlines()
    assert lines[0].startswith("rank 1 gathered:"), lines
    assert lines[1].startswith("rank 0 gathered gradient"), lines
    assert e.value.cp == 2 and len(lines) == 2, lines


def test_cp_sizes_are_chosen_and_drawn_equally_often():
    seen = []

    def step(case):
        if case.rank == 0:
            seen.append(case.cp)
        return {"gathered": cp_step.gather_sequence(case.x)}

    assert ct.check(step, cases=12, cps=[8, 3], seed=1) == 12
    assert sorted(set(seen)) == [3, 8], seen
    seen.clear()
    assert ct.check(step, cases=80, max_cp=8, seed=2) == 80
    counts = [seen.count(cp) for cp in range(1, 9)]
    assert min(counts) >= 3, counts  # uniform: 10 each on average; RapidCheck's sizes favour small ones
    with pytest.raises(ValueError):
        ct.check(step, cases=1, cps=[0])


def test_a_saved_counterexample_replays_the_user_s_step(tmp_path):
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(cp_step.VARIANTS["targets_after_sharding"], cases=CASES, max_cp=8, seed=11,
                 out=str(tmp_path / "smallest.json"))
    first = e.value
    assert "replay the step with: cpsim.torch.check(step, batch=" in str(first), str(first)
    with pytest.raises(ct.CheckFailed) as again:
        ct.check(cp_step.VARIANTS["targets_after_sharding"], batch=first.path, cp=first.cp, plan=first.plan,
                 seed=first.seed)
    assert again.value.failure == first.failure and again.value.cp == first.cp
    # The faithful step holds on it, at its CP size and at others.
    for cp in (first.cp, 1, 5):
        assert ct.check(cp_step.step, batch=first.path, cp=cp, seed=first.seed) == 1
    with pytest.raises(ValueError):
        ct.check(cp_step.step, batch=first.path)  # a replay names its CP size


def test_a_rank_stuck_in_python_ends_the_check_within_its_timeout(tmp_path):
    def step(case):
        if case.rank == case.cp - 1 and case.cp > 1:
            while True:
                pass
        return {"gathered": cp_step.gather_sequence(case.x)}

    batch = tmp_path / "batch.json"  # replayed: a draw would shrink through layouts that each wait it out
    batch.write_text('{"input_ids": [[1, 2, 3, 4]], "seq_lens": [[4]]}')
    start = time.monotonic()
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, batch=str(batch), cp=2, seed=1, timeout=2)
    assert time.monotonic() - start < 60
    assert "rank 1 is still running" in e.value.failure and "in step" in e.value.failure, e.value.failure


# --- "recurrence_o": a CP recurrence of the step's own, against cpsim's reference ---

def _padded_doc_ids(case):
    """[B, P] the raw batch's doc ids (cp_step's layout), 0 on the CP padding."""
    ids, _, _ = cp_step.layout_of(case.batch)
    padded = torch.zeros(ids.shape[0], case.P, dtype=torch.int64)
    padded[:, :case.S] = ids
    return padded


def _torch_recurrence(q, k, v, beta, g, ids, initial=None):
    """The gated delta rule token by token over one rank's shard (S from `initial`
    or 0, reset where the doc id changes), batched over heads: written here, apart
    from cpsim's reference, as a user's layer would be."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    out = []
    S = torch.zeros(B, H, K, V, dtype=q.dtype) if initial is None else initial
    for t in range(L):
        if t > 0:
            reset = (ids[:, t] != ids[:, t - 1]).to(q.dtype)[:, None, None, None]
            S = S * (1 - reset)
        S = S * g[:, t].exp()[..., None]
        kk = k[:, t]
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", kk, S)
        S = S + beta[:, t][..., None, None] * torch.einsum("bhk,bhv->bhkv", kk, err)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1), S


def _recurrence_step(carry_state=True):
    """Each rank runs its shard after the rank before it hands over its final
    state (a send/recv chain, the same document only), forward only; with
    carry_state=False the state is dropped."""
    import torch.distributed as dist

    def step(case):
        padded = _padded_doc_ids(case)
        lo, hi = case.cuts[case.rank], case.cuts[case.rank + 1]
        r = case.recurrence
        B, _, H, K = r["q"].shape
        V = r["v"].shape[-1]
        initial = None
        if case.rank > 0:
            state = torch.zeros(B, H, K, V, dtype=r["q"].dtype)
            dist.recv(state, case.rank - 1)
            same = (padded[:, lo] == padded[:, lo - 1]).to(state.dtype)[:, None, None, None]
            initial = _Handover.apply(state) * same if carry_state else None
        o, final = _torch_recurrence(r["q"], r["k"], r["v"], r["beta"], r["g"], padded[:, lo:hi], initial)
        if case.rank + 1 < case.cp:
            dist.send(final.detach().contiguous(), case.rank + 1)
        return {"recurrence_o": o}
    return step


class _Handover(torch.autograd.Function):
    """The received state, without a gradient back to the sender (forward only: the
    step checks the output, and gradients to this rank's own inputs)."""

    @staticmethod
    def forward(ctx, state):
        return state.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_recurrence_without_state_across_ranks_is_reported():
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(_recurrence_step(carry_state=False), cases=40, max_cp=4, seed=3)
    assert "recurrence_o" in e.value.failure and e.value.cp >= 2, e.value.failure


def test_a_recurrence_over_the_gathered_inputs_matches_cpsims_reference():
    # Every rank gathers the inputs (autograd all_gather) and runs the whole row,
    # keeping its own positions: forward and every gradient as cpsim's reference.
    from torch.distributed.nn.functional import all_gather

    def step(case):
        padded = _padded_doc_ids(case)
        whole = {n: torch.cat(all_gather(t.contiguous()), 1) for n, t in case.recurrence.items()}
        o, _ = _torch_recurrence(whole["q"], whole["k"], whole["v"], whole["beta"], whole["g"], padded)
        return {"recurrence_o": o[:, case.cuts[case.rank]:case.cuts[case.rank + 1]]}
    assert ct.check(step, cases=40, max_cp=4, seed=3) == 40


def test_a_precision_failure_at_cp_1_is_named_and_the_tolerance_is_an_option():
    # A recurrence right but for its arithmetic (every output off by 1e-4,
    # relative): it fails at every CP size, so at cp 1, where nothing is
    # sharded; the report says so, and check(tolerance=...) lets it pass.
    from torch.distributed.nn.functional import all_gather

    def step(case):
        padded = _padded_doc_ids(case)
        whole = {n: torch.cat(all_gather(t.contiguous()), 1) for n, t in case.recurrence.items()}
        o, _ = _torch_recurrence(whole["q"], whole["k"], whole["v"], whole["beta"], whole["g"], padded)
        return {"recurrence_o": o[:, case.cuts[case.rank]:case.cuts[case.rank + 1]] * (1 + 1e-4)}
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(step, cases=20, max_cp=4, seed=3)
    assert e.value.cp == 1, e.value.failure
    assert "at cp 1 nothing is sharded or exchanged: the difference is the step's own (its arithmetic in f64" in \
        str(e.value), e.value
    assert "check(..., tolerance=...)" in e.value.failure, e.value.failure
    assert ct.check(step, cases=20, max_cp=4, seed=3, tolerance=1e-3) == 20
    with pytest.raises(ct.CheckFailed) as e:  # a tolerance leaves bitwise outputs bitwise
        ct.check(lambda case: {"gathered": torch.cat(all_gather(case.x), 1) * (1 + 1e-9)}, cases=5, max_cp=2, seed=3,
                 tolerance=1e-3)
    assert "gathered" in e.value.failure and "at cp 1 nothing" not in e.value.failure, e.value.failure


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward is off by 1e-3 (relative)."""
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * (1 + 1e-3)


class _Case:
    """A case with some of its inputs replaced (the harness still differentiates
    with respect to the case's own leaves)."""
    def __init__(self, case, **replaced):
        self._case, self._replaced = case, replaced

    def __getattr__(self, name):
        return self._replaced[name] if name in self._replaced else getattr(self._case, name)


def test_a_wrong_gradient_of_an_output_s_last_input_alone_is_caught():
    # The harness compares every input's gradient, the last one of each output
    # included: attention's dv (of q, k, v) and the recurrence's dg (of q, k, v,
    # beta, g), each the only thing wrong.
    def attention(case):
        out = cp_step.step(_Case(case, v=_ScaleGrad.apply(case.v)))
        return {"attention_o": out["attention_o"]}
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(attention, cases=10, max_cp=2, seed=3)
    assert "attention_o gradient (attention_dv)" in e.value.failure, e.value.failure

    from torch.distributed.nn.functional import all_gather

    def recurrence(case):
        padded = _padded_doc_ids(case)
        mine = dict(case.recurrence, g=_ScaleGrad.apply(case.recurrence["g"]))
        whole = {n: torch.cat(all_gather(t.contiguous()), 1) for n, t in mine.items()}
        o, _ = _torch_recurrence(whole["q"], whole["k"], whole["v"], whole["beta"], whole["g"], padded)
        return {"recurrence_o": o[:, case.cuts[case.rank]:case.cuts[case.rank + 1]]}
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(recurrence, cases=10, max_cp=2, seed=3)
    assert "recurrence_o gradient (dg)" in e.value.failure, e.value.failure


# --- "layer": the step's own module, sharded against itself unsharded ---

# Drawn once, on no rank's thread (the rank threads share torch's generator).
_MIX_WEIGHTS = torch.randn(2, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


class _CausalMix(torch.nn.Module):
    """A toy CP layer: y_t = W x_t + sum over the document's earlier tokens of U x_s
    (a causal prefix sum over the gathered sequence), masked by document."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(_MIX_WEIGHTS[0].clone())
        self.u = torch.nn.Parameter(_MIX_WEIGHTS[1].clone())

    def forward(self, x, ids, lo, gathered_ids, gather):
        full = gather(x)  # [B, P, C]
        same = (gathered_ids[:, lo:lo + x.shape[1], None] == gathered_ids[:, None, :])
        before = torch.arange(full.shape[1])[None, :] <= torch.arange(lo, lo + x.shape[1])[:, None]
        mix = (same & before[None]).to(x.dtype)
        return x @ self.w.T + torch.einsum("bts,bsc->btc", mix, full) @ self.u.T


def _layer_step(gather_without_sum=False, one_rank_detaches=False):
    import torch.distributed as dist

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, x.contiguous())
            ctx.L = x.shape[1]
            return torch.cat(parts, 1)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            if not gather_without_sum:
                dist.all_reduce(grad)
            r = dist.get_rank()
            return grad[:, r * ctx.L:(r + 1) * ctx.L]

    def step(case):
        padded = _padded_doc_ids(case)
        module = _CausalMix()
        x = case.activation("x", 3)
        lo = case.cuts[case.rank]
        if one_rank_detaches and case.rank == 1:
            module.u.requires_grad_(False)
        y = module(x, padded[:, lo:], lo, padded, Gather.apply)
        return {"layer": ct.Layer(y, {"x": x}, module.named_parameters(), 1e-10)}
    return step


def test_a_layer_sharded_matches_itself_unsharded():
    assert ct.check(_layer_step(), cases=40, max_cp=4, seed=7) == 40


def test_a_layer_whose_gather_backward_skips_the_sum_is_reported():
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(_layer_step(gather_without_sum=True), cases=40, max_cp=4, seed=7, leaks=False)
    assert "layer gradient of x" in e.value.failure, e.value.failure


def test_a_layer_parameter_gradient_lost_on_one_rank_is_reported_summed():
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(_layer_step(one_rank_detaches=True), cases=40, max_cp=4, seed=7, leaks=False)
    assert "layer gradient of u summed over the CP ranks" in e.value.failure, e.value.failure


def test_each_output_that_differs_is_reported_on_each_rank():
    # Targets aligned after sharding make the targets and the loss (which uses them)
    # both differ: each output's first difference is shown, a line each, the rank's
    # values before its gradients (only the first rank's first one was).
    with pytest.raises(ct.CheckFailed) as e:
        ct.check(cp_step.make_step(targets_after_sharding=True), cases=30, cps=[2], seed=3)
    lines = e.value.failure.splitlines()
    mine = [line for line in lines if line.startswith("rank 0 ")]
    assert [line.split(":")[0] for line in mine] == ["rank 0 targets", "rank 0 loss"], e.value.failure
