"""A PyTorch implementation of contiguous packed CP, after the functions of NeMo
Automodel's `glm5_next.cp` and `inkling2.context_parallel` modules, checked by
cpsim's property harness on cpsim's simulated ranks:

    PYTHONPATH=build/python /usr/bin/python3 examples/torch/cp_step.py            # the faithful step
    PYTHONPATH=build/python /usr/bin/python3 examples/torch/cp_step.py --variant no_anchor
    cpsim launch -n 3 -- python3 examples/torch/cp_step.py --job           # ranks as processes

`step` is what one rank runs in a training step: derive the document layout from
the raw packed batch, shard it contiguously, gather K/V with autograd (with the
backward anchor), prepend the convolution halo, and attend within documents.
`VARIANTS` plant the bugs CP stacks have shipped; the harness must report each.
Everything here is plain torch.distributed: the same code runs on NCCL.
"""
import argparse
import sys

import torch
import torch.distributed as dist

PAD_DOC_ID = 0
_LENGTH_KEYS = ("seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded")
# The fill of each key beyond the sequence when it is padded to the CP multiple.
# The collectives every torch gloo backend has (older ones lack the tensor forms
# of all_gather and any reduce_scatter): list all_gather, and all_reduce in backward.
PORTABLE = False
_FILL = {"labels": -100, "padding_mask": True, "loss_mask": 0, "attention_mask": 0}


def _rows(t):
    return t.reshape(1, -1) if t.dim() == 1 else t


def _position_planes(batch, B, S):
    """The given position_ids as [K, B, S] int64: K = 1, or mRoPE's 3 planes
    (temporal, height, width; [3, S] beside [S] tokens is one row's)."""
    given = batch["position_ids"].to(torch.int64)
    return given.reshape(-1, B, S)


# --- the layout of the raw batch (glm5_next.cp: doc ids; inkling2: positions) ---

def doc_ids_from_seq_lens(seq_lens, seq_len, padding_value=-1000):
    """Per-document lengths [batch, documents] (entries equal to padding_value
    unused) to ids [batch, sequence]: i + 1 over document i, 0 beyond."""
    seq_lens = _rows(seq_lens)
    ids = torch.full((seq_lens.shape[0], seq_len), PAD_DOC_ID, dtype=torch.int64)
    for b in range(seq_lens.shape[0]):
        start = 0
        for i, n in enumerate(int(n) for n in seq_lens[b] if int(n) != padding_value and int(n) >= 0):
            ids[b, start:min(start + n, seq_len)] = i + 1
            start += n
    return ids


def doc_ids_from_cu_seqlens(cu_seqlens, seq_len):
    """Cumulative boundaries (entries < 0 unused) to ids [1, sequence]."""
    cu = cu_seqlens.reshape(-1).to(torch.int64)
    cu = cu[cu >= 0]
    return doc_ids_from_seq_lens((cu[1:] - cu[:-1]).reshape(1, -1), seq_len)


def segment_cu_seqlens(doc_ids_row):
    """Boundaries of the runs of equal ids covering the whole row: [0, ..., len]."""
    n = doc_ids_row.numel()
    change = (doc_ids_row[1:] != doc_ids_row[:-1]).nonzero().reshape(-1) + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), change.to(torch.int64),
                      torch.tensor([n], dtype=torch.int64)]) if n else torch.zeros(1, dtype=torch.int64)


def layout_of(batch):
    """(doc_ids, padding, position_ids), each [B, S] (mRoPE's position_ids
    [3, B, S]), from the raw batch. Padding comes from the lengths (or the mask
    of an unpacked row), never from token ids: a real EOS stays valid even when
    the tokenizer uses it as PAD."""
    tokens = _rows(batch["input_ids"])
    B, S = tokens.shape

    def occupied_and_real():
        if "seq_lens" in batch:
            real = doc_ids_from_seq_lens(batch["seq_lens"], S)
            occupied = doc_ids_from_seq_lens(batch["seq_lens_padded"], S) if "seq_lens_padded" in batch else real
            return occupied, real
        if "cu_seqlens" in batch or "cu_seqlens_padded" in batch:
            real = doc_ids_from_cu_seqlens(batch["cu_seqlens" if "cu_seqlens" in batch else "cu_seqlens_padded"], S)
            occupied = doc_ids_from_cu_seqlens(
                batch["cu_seqlens_padded" if "cu_seqlens_padded" in batch else "cu_seqlens"], S)
            return occupied.expand(B, S), real.expand(B, S)
        return None, None

    occupied, real = occupied_and_real()
    planes = _position_planes(batch, B, S) if "position_ids" in batch else None
    given = planes[0] if planes is not None and len(planes) == 1 else planes
    if occupied is not None:
        ids = occupied.clone()
        # A token is real when it lies within its document's real length.
        starts = torch.zeros_like(ids)
        padding = torch.ones(B, S, dtype=torch.bool)
        for b in range(B):
            for d in ids[b].unique().tolist():
                if d == PAD_DOC_ID:
                    continue
                span = (ids[b] == d).nonzero().reshape(-1)
                n_real = int((real[b] == d).sum())
                padding[b, span[:n_real]] = False
                starts[b, span] = int(span[0])
    else:  # unpacked: one document per row, or one per reset of the given positions
        if "padding_mask" in batch:
            padding = _rows(batch["padding_mask"]) != 0
        elif "attention_mask" in batch:
            padding = _rows(batch["attention_mask"]) == 0
        else:
            padding = torch.zeros(B, S, dtype=torch.bool)
        ids = torch.zeros(B, S, dtype=torch.int64)
        for b in range(B):
            documents = 0
            for s in (~padding[b]).nonzero().reshape(-1).tolist():
                if documents == 0 or (planes is not None and not bool(planes[:, b, s].any())):
                    documents += 1
                ids[b, s] = documents if given is not None else 1
    if given is not None:
        return ids, padding, given
    positions = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        nonzero = ids[b].nonzero()
        real_end = int(nonzero.max()) + 1 if len(nonzero) else 0
        for s in range(1, S):
            same = ids[b, s] == ids[b, s - 1] or s >= real_end
            positions[b, s] = positions[b, s - 1] + 1 if same else 0
    return ids, padding, positions


# --- sharding (glm5_next.cp.shard_batch_for_glm5_next_cp) ---

def padded_length(S, cp):
    return -(-S // cp) * cp


def shard_batch(batch, rank, cp, pad_token_id=0, shard_primary=False, restart_positions=False, mrope_rows=False):
    """Every token stream padded to P (a multiple of cp) and cut into cp equal
    contiguous intervals; input_ids stay global unless shard_primary (a VLM
    splices image features in first). Returns (local batch, global doc ids [B, P],
    global padding [B, P])."""
    ids, padding, positions = layout_of(batch)
    B, S = ids.shape
    P = padded_length(S, cp)
    L = P // cp
    lo, hi = rank * L, (rank + 1) * L

    def pad(t, fill):
        out = torch.full((B, P), fill, dtype=t.dtype)
        out[:, :S] = t
        return out

    local = {}
    for key, value in batch.items():
        if key in _LENGTH_KEYS or key in ("padding_mask", "position_ids"):
            continue
        fill = pad_token_id if key == "input_ids" else _FILL.get(key, 0)
        padded = pad(_rows(value).to(torch.int64), fill)
        local[key] = padded if key == "input_ids" and not shard_primary else padded[:, lo:hi]
    local["padding_mask"] = pad(padding, True)[:, lo:hi]
    # Positions continue through the tail padding (in every plane of mRoPE's [3, B, S]).
    full = torch.cat([positions, positions[..., S - 1:S] + torch.arange(1, P - S + 1)], dim=-1)
    local["position_ids"] = full[:, lo:hi] if mrope_rows else full[..., lo:hi]  # PLANTED: mrope_rows
    if restart_positions:  # PLANTED: each rank counts the document it starts inside from 0
        local_ids = pad(ids, PAD_DOC_ID)[:, lo:hi]
        restarted = local["position_ids"].clone()
        for b in range(B):
            if L:
                first = (local_ids[b] != local_ids[b, 0]).nonzero()
                end = int(first[0]) if len(first) else L
                restarted[b, :end] -= restarted[b, 0].clone()
        local["position_ids"] = restarted
    return local, pad(ids, PAD_DOC_ID), pad(padding, True)


# --- gathers with autograd (glm5_next.cp._AllGatherSequence and the anchor) ---

class _AllGatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, dim):
        ctx.dim = dim
        world = dist.get_world_size()
        moved = local.movedim(dim, 0).contiguous()
        if PORTABLE:
            parts = [torch.empty_like(moved) for _ in range(world)]
            dist.all_gather(parts, moved)
            return torch.cat(parts).movedim(0, dim)
        out = torch.empty((world * moved.shape[0],) + tuple(moved.shape[1:]), dtype=local.dtype)
        dist.all_gather_into_tensor(out, moved)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size()
        moved = grad.movedim(ctx.dim, 0).contiguous()
        L = moved.shape[0] // world
        if PORTABLE:
            dist.all_reduce(moved)
            return moved[dist.get_rank() * L:(dist.get_rank() + 1) * L].movedim(0, ctx.dim), None
        mine = torch.empty((L,) + tuple(moved.shape[1:]), dtype=grad.dtype)
        dist.reduce_scatter_tensor(mine, moved)
        return mine.movedim(0, ctx.dim), None


def gather_sequence(value, dim=1):
    """Equal contiguous shards [B, L, ...] concatenated in rank order; the
    gradient of each goes back to its source rank (a reduce_scatter)."""
    if dist.get_world_size() == 1:
        return value
    return _AllGatherSequence.apply(value, dim)


class _AllGatherBackwardAnchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gathered):
        ctx.shape = gathered.shape
        return gathered.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(ctx.shape)


def all_gather_backward_anchor(gathered):
    """Zero, with a backward edge to `gathered`: added to a rank's output, it keeps
    that rank in the gather's backward collective even when nothing else uses it."""
    return _AllGatherBackwardAnchor.apply(gathered)


# --- the convolution halo (inkling2.context_parallel.convolution_history) ---

def convolution_history(masked, width, wrong_neighbour=False):
    """[B, L, C] -> [B, L + width - 1, C]: the width - 1 positions before this
    rank's first (zeros before position 0), from however many ranks hold them."""
    halo = width - 1
    if halo == 0:
        return masked
    B, L, C = masked.shape
    rank, world = dist.get_rank(), dist.get_world_size()
    m = min(L, halo)
    tails = gather_sequence(masked[:, L - m:], dim=1)  # every rank's last m positions, in rank order
    if wrong_neighbour:  # PLANTED: a ring's recv from (rank - 1) % world: rank 0 takes the last rank's tail
        before = tails[:, ((rank - 1) % world) * m:((rank - 1) % world + 1) * m] if world > 1 else tails[:, :0]
    else:
        before = tails[:, :rank * m]
    before = before[:, max(0, before.shape[1] - halo):]
    zeros = masked.new_zeros((B, halo - before.shape[1], C))
    return torch.cat([zeros, before, masked], dim=1)


# --- the layer that consumes the layout: RoPE, then document-masked attention ---

def mrope_section(D):
    """Rotary pairs per mRoPE plane (temporal, height, width): height and width
    3/8 of the D/2 pairs each (at least 1), as Qwen2-VL's [16, 24, 24] of 64."""
    side = max(1, (D // 2) * 3 // 8)
    return [D // 2 - 2 * side, side, side]


def rope(x, positions, base):
    """x [B, L, H, D] turned pairwise by position: interleaved pairs, angle pos * base^(-2m/D).
    mRoPE's positions [3, B, L]: pair m by the plane of its section."""
    D = x.shape[-1]
    freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    if positions.dim() == 3:  # [3, B, L] -> each pair's plane: [B, L, D/2]
        plane = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section(D)))
        angle = positions.to(torch.float64)[plane].permute(1, 2, 0)[:, :, None, :] * freq
    else:
        angle = positions.to(torch.float64)[..., None, None] * freq  # [B, L, 1, D/2]
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def document_attention(q, k, v, positions, doc_ids, padding, rank_start, scale, base, anchor=True):
    """This rank's queries over the gathered keys: a query at global position i
    sees key j iff both are real, their doc ids are equal and not 0, and j <= i."""
    qr, kr = rope(q, positions, base), rope(k, positions, base)
    keys, values = gather_sequence(kr), gather_sequence(v)
    B, L = q.shape[:2]
    P = keys.shape[1]
    real = ~padding
    i = torch.arange(rank_start, rank_start + L)
    j = torch.arange(P)
    local_ids, local_real = doc_ids[:, rank_start:rank_start + L], real[:, rank_start:rank_start + L]
    visible = ((local_ids[:, :, None] == doc_ids[:, None, :]) & (local_ids[:, :, None] != PAD_DOC_ID)
               & local_real[:, :, None] & real[:, None, :] & (j[None, None, :] <= i[None, :, None]))  # [B, L, P]
    if not anchor and not bool(local_real.any()):
        # PLANTED: nothing to attend on this rank, so skip the work (and, without the
        # anchor, this rank's backward never reaches the gathers' reduce_scatter).
        return q.new_zeros(q.shape[:3] + (v.shape[-1],)).detach()
    scores = torch.einsum("blhd,bjhd->bhlj", qr, keys) * scale
    mask = visible[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.where(mask, weights, torch.zeros_like(weights))  # a query with no key: 0, not NaN
    o = torch.einsum("bhlj,bjhd->blhd", weights, values)
    return o + all_gather_backward_anchor(keys) + all_gather_backward_anchor(values) if anchor else o


# --- targets and the token-mean loss across ranks ---

def next_token_targets(tokens, doc_ids, padding):
    """[B, N] -> [B, N]: tokens[t + 1] where t and t + 1 are real tokens of one
    document, else -100 (a document's last token, padding)."""
    targets = torch.full_like(tokens, -100)
    same = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] != PAD_DOC_ID) & ~padding[:, :-1] & ~padding[:, 1:]
    targets[:, :-1] = torch.where(same, tokens[:, 1:], targets[:, :-1])
    return targets


class _SumOverRanks(torch.autograd.Function):
    """The sum of a value over the ranks; its gradient is the local one (every
    rank's loss is the same sum, and each differentiates its own term)."""

    @staticmethod
    def forward(ctx, local):
        total = local.detach().clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def token_mean_loss(logits, targets, per_rank_mean=False):
    """Cross entropy over every rank's targets: the per-token sum and the target
    count all-reduced, sum / count (0 when no rank has a target)."""
    valid = targets != -100
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(torch.float64),
                                               targets.reshape(-1).clamp(min=0), reduction="none")
    local_sum = torch.where(valid.reshape(-1), losses, torch.zeros_like(losses)).sum()
    count = valid.sum().to(torch.float64).reshape(1)
    if per_rank_mean:  # PLANTED: each rank's mean, averaged over the ranks
        mean = local_sum / count.clamp(min=1)[0]
        return _SumOverRanks.apply(mean) / dist.get_world_size()
    dist.all_reduce(count)
    return _SumOverRanks.apply(local_sum) / count.clamp(min=1)[0]


# --- one rank's step, as cpsim.torch.check runs it ---

def make_step(restart_positions=False, wrong_neighbour=False, anchor=True, targets_after_sharding=False,
              per_rank_mean=False, mrope_rows=False, rope_one_plane=False):
    def step(case):
        local, doc_ids, padding = shard_batch(case.batch, case.rank, case.cp, case.pad_token_id,
                                              case.shard_primary, restart_positions, mrope_rows)
        L = local["padding_mask"].shape[1]
        start = case.rank * L
        P = doc_ids.shape[1]
        tokens = torch.zeros(doc_ids.shape, dtype=torch.int64)
        tokens[:, :case.tokens.shape[1]] = case.tokens
        if targets_after_sharding:  # PLANTED: aligned on this rank's slice, after sharding
            targets = next_token_targets(tokens[:, start:start + L], doc_ids[:, start:start + L],
                                         padding[:, start:start + L])
        else:
            targets = next_token_targets(tokens, doc_ids, padding)[:, start:start + L]
        assert P == case.cp * L
        positions = local["position_ids"]
        if rope_one_plane and positions.dim() == 3:  # PLANTED: mRoPE turned by the temporal plane alone
            positions = positions[0]
        return {
            "targets": targets,
            "loss": token_mean_loss(case.logits, targets, per_rank_mean),
            "batch": local,
            "doc_ids": doc_ids,
            "local_doc_ids": doc_ids[:, start:start + L],
            "cu_seqlens": [segment_cu_seqlens(row) for row in doc_ids[:, start:start + L]],
            "gathered": gather_sequence(case.x),
            "halo": convolution_history(case.x, case.conv_width, wrong_neighbour),
            "attention_o": document_attention(case.q, case.k, case.v, positions, doc_ids, padding,
                                              start, case.softmax_scale, case.rope_base, anchor),
        }
    return step


step = make_step()
# The planted bugs: each must be reported by the harness.
VARIANTS = {
    "no_anchor": make_step(anchor=False),               # a named call mismatch, not a hang
    "wrong_neighbour": make_step(wrong_neighbour=True),  # a shrunk counterexample in the halo
    "restart_positions": make_step(restart_positions=True),  # positions restarted per rank
    "targets_after_sharding": make_step(targets_after_sharding=True),  # a target lost at every shard edge
    "per_rank_mean": make_step(per_rank_mean=True),     # the mean of per-rank means
    "mrope_rows": make_step(mrope_rows=True),  # mRoPE's [3, B, S] cut along axis 1 (rows), not the sequence
    "rope_one_plane": make_step(rope_one_plane=True),  # a text model's RoPE on mRoPE's positions
}


def main():
    import cpsim.torch as ct
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), help="run a planted bug instead of the faithful step")
    p.add_argument("--cases", type=int, default=100)
    p.add_argument("--max-cp", type=int, default=8)
    p.add_argument("--backend", default="threads")
    p.add_argument("--family", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--job", action="store_true",
                   help="run as one process of a job (cpsim launch -n N, torchrun): the ranks are the job's processes")
    a = p.parse_args()
    fn = VARIANTS[a.variant] if a.variant else step
    if a.job:
        ct.init_process_group(timeout=30)
    try:
        n = ct.check(fn, cases=a.cases, max_cp=a.max_cp, family=a.family, backend=a.backend, seed=a.seed)
    except ct.CheckFailed as e:
        print(e)
        return 1
    if a.job:
        import torch.distributed as dist
        print("cp_step: rank %d: %d layouts hold at cp %d (processes)" % (dist.get_rank(), n, dist.get_world_size()))
    else:
        print("cp_step: %d layouts hold at cp 1-%d (%s)" % (n, a.max_cp, a.backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
