#!/usr/bin/env python3
"""Planted bugs in examples/golden_check.py's numpy implementation: each must be
reported by check() at the key it breaks, with a rank and a position.

    /usr/bin/python3 tests/golden_plants.py GOLDEN_DIR

GOLDEN_DIR holds `cpsim golden` vectors of a batch whose documents cross shard
edges at CP > 1 (tests/test_golden.cpp writes examples/packed_two_rows.json at
CP 3). Prints one line per plant; exits 1 when a plant passes or is reported at
another key.
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
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
    cp_l = tokens.shape[1] // 3
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


PLANTS = [
    ("rope by 0..L-1", {"rope": rope_by_local_index}, "rope_q"),
    ("attention without the gathered keys", {"attention": attention_without_gather}, "attention_dk"),
    ("top-k ties to the larger position", {"attention": attention_ties_by_larger_position}, "sparse_attention_kept"),
    ("targets aligned after sharding", {"targets": targets_after_sharding}, "targets"),
    ("a mean of rank means", {"loss": loss_mean_of_rank_means}, "loss"),
    ("a halo of zeros", {"halo": halo_of_zeros}, "halo"),
]


def main(folder):
    golden = gc.load_golden(folder)
    if golden.cp != 3:
        print("golden_plants: needs vectors written at --cp 3", file=sys.stderr)
        return 2
    missed = 0
    for what, hooks, key in PLANTS:
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
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
