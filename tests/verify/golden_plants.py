#!/usr/bin/env python3
"""Planted bugs in examples/golden_check.py's numpy implementation: each must be
reported by check() at the key it breaks, with a rank and a position.

    /usr/bin/python3 tests/verify/golden_plants.py GOLDEN_DIR

GOLDEN_DIR holds `cpsim golden` vectors of a batch whose documents cross shard
edges at CP > 1, some across three ranks, with interior padding
(tests/verify/test_golden.cpp writes examples/thd_cu_seqlens.json at CP 8). Prints one line per plant; exits 1 when a plant passes or is reported at
another key.
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import numpy as np  # noqa: E402

import golden_check as gc  # noqa: E402


def rope_by_local_index(x, positions):
    return gc.numpy_rope(x, [np.broadcast_to(np.arange(p.shape[1]), p.shape) for p in positions])


def attention_without_gather(q, k, v, positions, doc_ids, padding, grad_o, **sparse):
    # Each rank attends over its own shard only: keys from other ranks are lost.
    out = []
    for r in range(len(q)):
        one = {key: [t[r]] for key, t in sparse.items() if isinstance(t, list)}
        extra = dict(sparse, **one)
        out += gc.numpy_attention([q[r]], [k[r]], [v[r]], [positions[r]], [doc_ids[r]], [padding[r]], [grad_o[r]],
                                  **extra)
    return out


def attention_ties_by_larger_position(q, k, v, positions, doc_ids, padding, grad_o, topk=None, index_q=None,
                                      index_k=None):
    right = gc.numpy_attention(q, k, v, positions, doc_ids, padding, grad_o, topk, index_q, index_k)
    if topk is None:
        return right
    # The selection again, with a tie going to the later key.
    join = lambda parts: np.concatenate(parts, axis=1)
    iq, ik, pad, ids = join(index_q), join(index_k), join(padding), join(doc_ids)
    L = q[0].shape[1]
    for r, one in enumerate(right):
        for b in range(one["kept"].shape[0]):
            for i in range(L):
                g = r * L + i
                if pad[b, g] or ids[b, g] == 0:
                    continue
                seen = [j for j in range(g + 1) if not pad[b, j] and ids[b, j] == ids[b, g]]
                chosen = sorted(sorted(seen, key=lambda j: (-float(iq[b, g] @ ik[b, j]), -j))[:topk])
                one["kept"][b, i, :] = -1
                one["kept"][b, i, :len(chosen)] = chosen
    return right


def targets_after_sharding(tokens, doc_ids, padding):
    cp_l = tokens.shape[1] // 8
    parts = [gc.numpy_targets(tokens[:, c:c + cp_l], doc_ids[:, c:c + cp_l], padding[:, c:c + cp_l])
             for c in range(0, tokens.shape[1], cp_l)]
    return np.concatenate(parts, axis=1)


def loss_mean_of_rank_means(logits, targets):
    means = []
    for z, t in zip(logits, targets):
        ((value, grad),) = gc.numpy_loss([z], [t])
        means.append((value, grad))
    mean = sum(v for v, _ in means) / len(means)
    return [(mean, g / len(means)) for _, g in means]


def halo_of_zeros(shards, width):
    B, L, C = shards[0].shape
    return [np.concatenate([np.zeros((B, width - 1, C)), s], axis=1) for s in shards]


def layout_interior_padding_as_real(batch):
    ids, pad, pos = gc.numpy_layout(batch)
    return ids, pad & (ids == 0), pos  # padding only after the last document


def context_without_reaching_back(doc_ids, cuts):
    out = gc.numpy_cp_context(doc_ids, cuts)
    for ctx in out:
        ctx["pre_num_ranks"] = [min(n, 1) for n in ctx["pre_num_ranks"]]  # a segment never spans 3 ranks
        ctx["is_first_rank"] = [n == 0 for n in ctx["pre_num_ranks"]]
    return out


def gather_backward_own_slice(upstream, cuts):
    return [upstream[r][:, cuts[r]:cuts[r + 1]] for r in range(len(upstream))]


def conv_across_documents(x, doc_ids, weight, bias, grad_y):
    one = [np.ones_like(d) for d in doc_ids]  # every tap kept: documents leak into each other
    return gc.numpy_conv(x, one, weight, bias, grad_y)


def recurrence_scaled_q(q, k, v, beta, g, doc_ids, grad_o):
    scale = q[0].shape[-1] ** -0.5
    out = gc.numpy_recurrence([t * scale for t in q], k, v, beta, g, doc_ids, grad_o)
    for one in out:
        one["dq"] = one["dq"] * scale
    return out


def shard_labels_filled_with_zero(golden):
    right = gc.numpy_shard(golden)

    def shard(batch, rank, cp, pad_token_id):
        out = right(batch, rank, cp, pad_token_id)
        if "labels" in out:
            S, lo = golden.manifest["S"], golden.cuts[rank]
            out["labels"] = out["labels"].copy()
            out["labels"][:, max(S - lo, 0):] = 0  # the padded tail filled with 0, not -100
        return out

    return shard


def gather_in_reverse_rank_order(shards):
    whole = np.concatenate(list(reversed(shards)), axis=1)
    return [whole for _ in shards]


def with_one(value, key):
    """A hook's result with one element of rank 1's `key` set to `value` (a NaN or an inf)."""
    def plant(out):
        one = out[1] if isinstance(out, list) else out
        arr = np.array(one[key], dtype=np.float64)
        arr.reshape(-1)[arr.size // 2] = value
        one[key] = arr
        return out
    return plant


def conv_with_a_nan(x, doc_ids, weight, bias, grad_y):
    return with_one(np.nan, "y")(gc.numpy_conv(x, doc_ids, weight, bias, grad_y))


def recurrence_with_an_inf(q, k, v, beta, g, doc_ids, grad_o):
    return with_one(np.inf, "dk")(gc.numpy_recurrence(q, k, v, beta, g, doc_ids, grad_o))


def attention_with_a_nan(q, k, v, positions, doc_ids, padding, grad_o, **sparse):
    return with_one(np.nan, "dq")(gc.numpy_attention(q, k, v, positions, doc_ids, padding, grad_o, **sparse))


def gather_backward_with_an_inf(upstream, cuts):
    out = gc.numpy_gather_backward(upstream, cuts)
    out[1] = np.array(out[1], dtype=np.float64)
    out[1].reshape(-1)[0] = -np.inf
    return out


PLANTS = [
    ("a NaN in one rank's conv output", {"conv": conv_with_a_nan}, "conv_y"),
    ("an inf in one rank's recurrence dk", {"recurrence": recurrence_with_an_inf}, "dk"),
    ("a NaN in one rank's attention dq", {"attention": attention_with_a_nan}, "attention_dq"),
    ("an inf in one rank's gather gradient", {"gather_backward": gather_backward_with_an_inf}, "gather_grad_x"),
    ("interior padding taken as real", {"layout": layout_interior_padding_as_real}, "layout padding"),
    ("a segment reaching back one rank at most", {"cp_context": context_without_reaching_back},
     "cp_context.pre_num_ranks"),
    ("a gather backward keeping only its own slice", {"gather_backward": gather_backward_own_slice}, "gather_grad_x"),
    ("conv taps across documents", {"conv": conv_across_documents}, "conv_dx"),
    ("q scaled by K^-0.5", {"recurrence": recurrence_scaled_q}, "o"),
    ("rope by 0..L-1", {"rope": rope_by_local_index}, "rope_q"),
    ("attention without the gathered keys", {"attention": attention_without_gather}, "attention_dk"),
    ("top-k ties to the larger position", {"attention": attention_ties_by_larger_position}, "sparse_attention_kept"),
    ("targets aligned after sharding", {"targets": targets_after_sharding}, "targets"),
    ("a mean of rank means", {"loss": loss_mean_of_rank_means}, "loss"),
    ("a halo of zeros", {"halo": halo_of_zeros}, "halo"),
    ("a gather in reverse rank order", {"gather": gather_in_reverse_rank_order}, "gathered"),
    ("labels padded with 0", {"shard": shard_labels_filled_with_zero}, "batch.labels"),
]


def main(folder):
    golden = gc.load_golden(folder)
    if golden.cp != 8:
        print("golden_plants: needs vectors written at --cp 8", file=sys.stderr)
        return 2
    missed = 0
    for what, hooks, key in PLANTS:
        hooks = {name: (hook(golden) if name == "shard" else hook) for name, hook in hooks.items()}
        try:
            gc.check(golden, log=lambda *_: None, **hooks)
        except AssertionError as e:
            said = str(e)
            ok = re.match(r"(rank \d+ )?%s:" % key, said) and ("first" in said or "rank" in said)
            print("%s %s: %s" % ("caught" if ok else "WRONG KEY", what, said))
            missed += 0 if ok else 1
            continue
        print("MISSED %s: check() passed" % what)
        missed += 1
    # The right implementation against a golden holding one NaN or inf where it
    # expects a number: a broken golden (or reference) fails too.
    for key, hook, value in (("conv_y", "conv", np.nan), ("o", "recurrence", np.inf),
                             ("gather_grad_x", "gather_backward", np.nan)):
        broken = gc.load_golden(folder)
        want = np.array(broken.ranks[1][key], dtype=np.float64)
        want.reshape(-1)[want.size // 2] = value
        broken.ranks[1][key] = want
        try:
            gc.check(broken, log=lambda *_: None, **{hook: gc.numpy_functions(broken)[hook]})
        except AssertionError as e:
            said = str(e)
            ok = re.match(r"rank 1 %s:" % key, said) and ("nan" in said or "inf" in said)
            print("%s a golden with %r in %s: %s" % ("caught" if ok else "WRONG KEY", value, key, said))
            missed += 0 if ok else 1
            continue
        print("MISSED a golden with %r in %s: check() passed" % (value, key))
        missed += 1
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
