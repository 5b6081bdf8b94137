"""Every output cpsim.torch.check compares has a planted variant its comparison
must catch: for each entry of cpsim.compared.COMPARED, a correct step that
returns it (cpsim's own examples and the library adapters) with that one output
corrupted on its last rank (an integer off by one, a float off by 1, a context
field, a cached segment, the value of a layer, a loss or a training step's
logged loss) is reported, naming the output and that rank. A new output needs
its source here (test_every_compared_output_has_a_planted_variant fails until it
has one): docs/design.md, "A planted variant for every output"."""
import os
import sys

import pytest
import torch

import cpsim.torch as ct
from cpsim.compared import COMPARED

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "torch"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "libraries"))
import cp_step  # noqa: E402
import user_cp  # noqa: E402

SEED = 20261207


def _automodel_thd_step(case):
    import automodel_step
    return automodel_step.make_thd_step()(case)


def _fla_step(case):
    import fla_step
    return fla_step.make_step()(case)


def _user_loss_step(case):
    import test_user_loss
    return test_user_loss.user_step()(case)


def _train_step(case):
    import test_train_step
    return test_train_step.make_step()(case)


def _layer_step(case):
    """A layer of one weight over the gathered activation: its output at this
    rank's positions (a user's own code, compared with itself unsharded)."""
    x = case.activation("x", 3)
    w = torch.randn(3, 3, generator=case.generator("w"), dtype=x.dtype).requires_grad_(True)
    return {"layer": ct.Layer(torch.tanh(x @ w), {"x": x}, {"w": w}, tolerance=1e-9)}


# Where each output comes from, and the draw its source takes.
SOURCES = {
    **{name: (cp_step.step, {}) for name in ("batch", "doc_ids", "local_doc_ids", "cu_seqlens", "gathered", "halo",
                                               "attention_o", "targets", "loss")},
    "conv": (user_cp.operators, {"forms": ["seq_lens_padded", "seq_lens"]}),
    "recurrence_o": (user_cp.operators, {"forms": ["seq_lens_padded", "seq_lens"]}),
    "padding": (_automodel_thd_step, {"forms": ["seq_lens_padded"]}),
    "position_ids": (_automodel_thd_step, {"forms": ["seq_lens_padded"]}),
    "cp_context": (_fla_step, {"min_shard": 3}),
    "layer": (_layer_step, {}),
    "user_loss": (_user_loss_step, {}),
    "train": (_train_step, {"forms": ["seq_lens_padded", "seq_lens"], "long_every": 0}),
}


def test_every_compared_output_has_a_planted_variant():
    assert sorted(SOURCES) == sorted(COMPARED), (sorted(set(COMPARED) - set(SOURCES)),
                                                 sorted(set(SOURCES) - set(COMPARED)))


def _corrupt_tensor(t):
    """t off at its first element: an integer by 1, a bool flipped, a float by 1
    (a constant added: its gradient unchanged)."""
    if t.numel() == 0:
        return t
    delta = torch.zeros_like(t, memory_format=torch.contiguous_format)  # a view of it below, whatever t's strides
    delta.view(-1)[0] = 1
    return t ^ delta if t.dtype == torch.bool else t + delta


def _corrupt(name, value):
    if isinstance(value, torch.Tensor):
        return _corrupt_tensor(value)
    if name == "batch":
        key = "input_ids" if "input_ids" in value else sorted(value)[0]
        return dict(value, **{key: _corrupt_tensor(value[key])})
    if name == "cu_seqlens":
        first = torch.as_tensor(value[0]).clone()
        first[-1] += 1
        return [first] + list(value[1:])
    if name == "cp_context":
        context = value[0]
        if isinstance(context, dict):
            value[0] = dict(context, pre_num_ranks=context["pre_num_ranks"] + 1)
        else:
            context.pre_num_ranks = context.pre_num_ranks + 1
        return value
    if name == "layer":
        value.output = value.output + 1
    elif name == "user_loss":
        value.value = value.value + 1
    elif name == "train":
        value.loss = value.loss + 1
    else:
        raise AssertionError("no corruption for %s" % name)
    return value


def _planted(name, source):
    def step(case):
        out = source(case)
        if case.cp > 1 and case.rank == case.cp - 1 and name in out:  # the last rank of a sharded run only
            out[name] = _corrupt(name, out[name])
        return out
    return step


def _check(step, draw):
    return ct.check(step, cases=4, cps=[2, 3], seed=SEED, probes=0, **draw)


def test_every_source_holds_uncorrupted():
    # The control: each source step, as it is, holds on the draws below.
    done = set()
    for source, draw in SOURCES.values():
        if source not in done:
            done.add(source)
            assert _check(source, draw) == 4, source.__name__


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_an_output_corrupted_on_one_rank_is_reported_there(name):
    source, draw = SOURCES[name]
    with pytest.raises(ct.CheckFailed) as failure:
        _check(_planted(name, source), draw)
    first = failure.value.failure.split("\n")[0]
    # The last rank (of 2 or 3) named first, with the output.
    assert first.startswith("rank 1 %s" % name) or first.startswith("rank 2 %s" % name), failure.value.failure
