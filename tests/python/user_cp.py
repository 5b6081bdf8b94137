"""A user's own CP operators and DP x CP training step, written as training code
is (not from cpsim's examples), as a user brought it (tests/python/stress_job.py
runs it as processes; it aborted in Gloo about half the time before the process
wire posted each message's header and bytes together):

  embedding -> gated-delta-rule layer (projection, depthwise causal conv of
  width W over a halo passed rank to rank, SiLU, L2-normed q/k, a recurrence
  whose state is passed rank to rank) -> softmax attention (RoPE by position in
  document, K/V all-gathered with autograd, document-masked causal) -> lm head
  -> token-mean cross entropy over every DP x CP rank's labels.

Context parallelism: every packed row is padded to P (a multiple of cp) and CP
rank r holds positions [r*L, (r+1)*L), L = P / cp.  Data parallelism: DP
replicas each run a CP group; gradients are all-reduced over all DP x CP ranks.

Planted bugs are switched on by setting `BUG` (one name at a time).
"""
import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn as nn
import torch.nn.functional as F

BUG = ""        # the planted bug ("" = the correct step)
IGNORE = -100
V, D, H, DK, DV, W = 16, 8, 2, 4, 4, 4
LR = 0.5
MAX_NORM = 3.0  # gradient clipping (global norm)


# --------------------------------------------------------------------------- layout
def layout(batch):
    """doc ids [B, S] (i + 1 on document i's occupied span, 0 beyond), padding
    [B, S] (True where not a real token) and positions [B, S] (offset inside the
    document) from my packer's seq_lens / seq_lens_padded (-1000 sentinel)."""
    ids = batch["input_ids"]
    B, S = ids.shape
    real = batch["seq_lens"]
    occ = batch.get("seq_lens_padded", real)
    doc = torch.zeros(B, S, dtype=torch.long)
    pad = torch.ones(B, S, dtype=torch.bool)
    pos = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        start = 0
        for i in range(real.shape[1]):
            n_real, n_occ = int(real[b, i]), int(occ[b, i])
            if n_real < 0:
                break
            doc[b, start:start + n_occ] = i + 1
            pad[b, start:start + n_real] = False
            pos[b, start:start + n_occ] = torch.arange(n_occ)
            start += n_occ
        pos[b, start:] = torch.arange(S - start) + (pos[b, start - 1] + 1 if start else 0)
    return doc, pad, pos


def next_token_labels(ids, doc, pad):
    """labels[t] = ids[t + 1] when t and t + 1 are real tokens of one document,
    else IGNORE; over whole rows (before sharding)."""
    labels = torch.full_like(ids, IGNORE)
    same = (doc[:, 1:] == doc[:, :-1]) & ~pad[:, 1:] & ~pad[:, :-1] & (doc[:, :-1] > 0)
    if BUG == "padding_in_loss":  # padding tokens counted: only the document test kept
        same = (doc[:, 1:] == doc[:, :-1])
    labels[:, :-1] = torch.where(same, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
    return labels


class CPBatch:
    """One rank's share of a packed batch: local token ids, labels and positions,
    and the global doc ids / padding every layer needs for its masks."""

    def __init__(self, batch, cp, cp_rank, rows=None, ids=None):
        ids = (batch["input_ids"] if ids is None else ids).long() % V
        doc, pad, pos = layout(batch)
        if rows is not None:  # the rows of this DP replica
            ids, doc, pad, pos = ids[rows], doc[rows], pad[rows], pos[rows]
        labels = next_token_labels(ids, doc, pad)
        B, S = ids.shape
        P = -(-S // cp) * cp
        L = P // cp
        extra = P - S

        def padded(t, value):
            return torch.cat([t, torch.full((B, extra), value, dtype=t.dtype)], 1)
        ids, labels = padded(ids, 0), padded(labels, IGNORE)
        doc, pad = padded(doc, 0), padded(pad, True)
        pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(extra)], 1) if extra else pos
        self.B, self.S, self.P, self.L, self.cp, self.rank = B, S, P, L, cp, cp_rank
        self.lo, self.hi = cp_rank * L, (cp_rank + 1) * L
        sl = slice(self.lo, self.hi)
        self.ids, self.pos = ids[:, sl], pos[:, sl]
        self.labels = labels[:, sl]
        if BUG == "label_shift_local":  # the shift done on the shard: its last token loses its label
            ldoc, lpad = doc[:, sl], pad[:, sl]
            self.labels = next_token_labels(self.ids, ldoc, lpad)
        if BUG == "pos_restart":  # positions re-derived on the shard: a document cut at lo restarts at 0
            ldoc = doc[:, sl]
            local = torch.zeros_like(ldoc)
            for t in range(1, L):
                local[:, t] = torch.where(ldoc[:, t] == ldoc[:, t - 1], local[:, t - 1] + 1, 0)
            self.pos = local
        self.doc, self.pad = doc, pad  # global [B, P]


# --------------------------------------------------------------------------- CP communication
class CPComm:
    """The process groups of one rank: its CP group (neighbours by CP rank), its DP
    group, and the whole DP x CP world the gradients are reduced over."""

    def __init__(self, mesh):
        self.cp_group = mesh["cp"].get_group()
        self.dp_group = mesh["dp"].get_group()
        self.cp = dist.get_world_size(self.cp_group)
        self.cp_rank = dist.get_rank(self.cp_group)
        self.cp_ranks = dist.get_process_group_ranks(self.cp_group)  # global ranks, by CP rank

    def peer(self, cp_rank):
        """The global rank of a CP peer (send/recv take global ranks)."""
        if BUG == "halo_global_rank":  # a CP rank used as a global rank: right only in replica 0
            return cp_rank
        return self.cp_ranks[cp_rank]


def _send(t, comm, cp_rank):
    dist.send(t.contiguous(), comm.peer(cp_rank), group=comm.cp_group)


def _recv(like, comm, cp_rank):
    buf = torch.empty_like(like)
    dist.recv(buf, comm.peer(cp_rank), group=comm.cp_group)
    return buf


class HaloChain(torch.autograd.Function):
    """[halo ; x]: the W-1 positions before this shard, passed rank to rank (a chain,
    so a shard shorter than W-1 forwards its predecessor's positions too).
    Backward: the halo's gradient goes back to the ranks that own it."""

    @staticmethod
    def forward(ctx, x, comm, n):
        ctx.comm, ctx.n = comm, n
        B, L, C = x.shape
        r, cp = comm.cp_rank, comm.cp
        halo = x.new_zeros(B, n, C)
        if r > 0:
            halo = _recv(halo, comm, r - 1)
        ext = torch.cat([halo, x], 1)
        if r < cp - 1:
            if BUG == "halo_forwarded":  # sends on the halo it received, not its own last positions
                _send(ext[:, :n], comm, r + 1)
            else:
                _send(ext[:, -n:], comm, r + 1)
        return ext

    @staticmethod
    def backward(ctx, grad_ext):
        comm, n = ctx.comm, ctx.n
        r, cp = comm.cp_rank, comm.cp
        grad_ext = grad_ext.clone()
        if r < cp - 1:
            grad_ext[:, -n:] += _recv(grad_ext[:, -n:], comm, r + 1)
        if r > 0:
            _send(grad_ext[:, :n], comm, r - 1)
        return grad_ext[:, n:], None, None


class RecvState(torch.autograd.Function):
    """The recurrent state at the end of the previous CP rank (0 on the first).
    `anchor` is any tensor that requires grad (the layer's input): without one
    autograd records no node and the state's gradient is never sent back."""

    @staticmethod
    def forward(ctx, anchor, shape, comm):
        ctx.comm = comm
        zeros = anchor.new_zeros(shape)
        if comm.cp_rank == 0:
            return zeros
        return _recv(zeros, comm, comm.cp_rank - 1)

    @staticmethod
    def backward(ctx, grad):
        if ctx.comm.cp_rank > 0:
            _send(grad, ctx.comm, ctx.comm.cp_rank - 1)
        return None, None, None


# --------------------------------------------------------------------------- the model
def operators(case):
    """The step of a user's own CP operators on cpsim's ranks: targets, the conv
    (halo by send/recv), the recurrence (state passed rank to rank) and attention
    over gathered K/V, on rows with seq_lens (the packer's)."""
    import cpsim.torch
    b = case.batch
    if "seq_lens" not in b:
        raise cpsim.torch.OutsideContract("the packer emits rows with seq_lens")
    if b["input_ids"].dim() == 1:
        b = {k: v[None] for k, v in b.items()}
    comm = CPComm(case.device_mesh())
    cb = CPBatch(b, case.cp, case.rank)
    tb = CPBatch(b, case.cp, case.rank, ids=case.tokens)
    r = case.recurrence
    return {"targets": tb.labels,
            "conv": packed_causal_conv(case.x, case.conv_weight, case.conv_bias, cb, comm),
            "recurrence_o": gated_delta_rule(r["q"], r["k"], r["v"], r["beta"], r["g"], cb, comm),
            "attention_o": doc_attention(case.q, case.k, case.v, cb, comm, case.softmax_scale, case.rope_base)}


def rope(x, pos, base=10000.0):
    """Rotary embedding of x [B, L, H, K] by positions pos [B, L]."""
    K = x.shape[-1]
    inv = base ** (-torch.arange(0, K, 2, dtype=x.dtype) / K)
    ang = pos.to(x.dtype)[..., None] * inv  # [B, L, K/2]
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
    return out.flatten(-2)


def packed_causal_conv(u, w, bias, cb, comm):
    """Depthwise causal conv of u [B, L, C] with w [C, W] (w[:, W-1] on the token
    itself) and bias [C], a tap before the token's document dropped; the first
    W-1 taps read the halo passed from the previous CP ranks. No activation."""
    B, L, C = u.shape
    Wd = w.shape[1]
    n = Wd - 1
    ext = HaloChain.apply(u, comm, n)  # [B, n + L, C]
    if BUG == "halo_detached":  # halo received without autograd: its gradient never goes back
        ext = torch.cat([ext[:, :n].detach(), ext[:, n:]], 1)
    gpos = cb.lo + torch.arange(L)  # global positions of the shard
    y = bias.expand(B, L, C)
    for j in range(Wd):  # tap j reads position t - j
        src = gpos - j
        ok = (src >= 0)[None, :] & (cb.doc[:, src.clamp(min=0)] == cb.doc[:, gpos])
        if BUG == "halo_no_doc_mask":  # taps in the halo not tested for the document
            ok = (src >= 0)[None, :] & ((src < cb.lo)[None, :] | (cb.doc[:, src.clamp(min=0)] == cb.doc[:, gpos]))
        y = y + w[:, Wd - 1 - j] * ext[:, n - j:n - j + L] * ok[..., None]
    return y


def gated_delta_rule(q, k, v, beta, g, cb, comm):
    """The gated delta rule / KDA recurrence on this shard: q, k [B, L, H, K],
    v [B, L, H, V], beta [B, L, H], g [B, L, H, K] (log decay <= 0);
    S_t = (I - beta k k^T) Diag(exp g) S_(t-1) + beta k v^T, o_t = S_t^T q_t,
    S = 0 at every document start; the state at the shard's start comes from the
    previous CP rank, the state at its end goes to the next."""
    B, L, Hh, K = k.shape
    Vd = v.shape[-1]
    state = RecvState.apply(k, (B, Hh, K, Vd), comm)
    gpos = cb.lo + torch.arange(L)
    prev = (gpos - 1).clamp(min=0)
    starts = (cb.doc[:, gpos] != cb.doc[:, prev]) | (gpos == 0)[None, :]  # [B, L]
    if BUG == "state_across_docs":  # the received state kept even when the shard starts a document
        starts = starts.clone()
        starts[:, 0] = False
    outs = []
    for t in range(L):
        keep = (~starts[:, t]).to(k.dtype)[:, None, None, None]
        state = state * keep * torch.exp(g[:, t])[..., None]
        kt, vt, qt, bt = k[:, t], v[:, t], q[:, t], beta[:, t]
        pred = torch.einsum("bhkv,bhk->bhv", state, kt)
        state = state + bt[..., None, None] * torch.einsum("bhk,bhv->bhkv", kt, vt - pred)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, qt))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, Hh, Vd)
    if BUG == "state_no_anchor":  # the send left out of the graph: its backward never runs
        if comm.cp_rank < comm.cp - 1:
            _send(state.detach(), comm, comm.cp_rank + 1)
        return o
    return StateSend.apply(o, state, comm)


class StateSend(torch.autograd.Function):
    """Sends the final state to the next CP rank and returns `o` unchanged, so that
    the send's backward (receiving the state's gradient) runs with o's."""

    @staticmethod
    def forward(ctx, o, state, comm):
        ctx.comm, ctx.shape = comm, state.shape
        if comm.cp_rank < comm.cp - 1:
            _send(state, comm, comm.cp_rank + 1)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, grad_o):
        comm = ctx.comm
        grad_state = None
        if comm.cp_rank < comm.cp - 1:
            grad_state = _recv(torch.zeros(ctx.shape, dtype=grad_o.dtype), comm, comm.cp_rank + 1)
        return grad_o, grad_state, None


def doc_attention(q, k, v, cb, comm, scale=None, base=10000.0):
    """RoPE by position in document, then causal attention of this shard's queries
    over the all-gathered K/V (autograd), a key visible iff it is a real token of
    the query's document at or before it; 0 for a query that sees none."""
    B, L, Hh, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    q, k = rope(q, cb.pos, base), rope(k, cb.pos, base)
    if BUG == "attn_gather_no_grad":  # all_gather without autograd: other ranks' dK/dV lost
        ks = [torch.empty_like(k) for _ in range(comm.cp)]
        vs = [torch.empty_like(v) for _ in range(comm.cp)]
        dist.all_gather(ks, k.contiguous(), group=comm.cp_group)
        dist.all_gather(vs, v.contiguous(), group=comm.cp_group)
        ks[comm.cp_rank], vs[comm.cp_rank] = k, v
    else:
        ks = dnn.all_gather(k.contiguous(), group=comm.cp_group)
        vs = dnn.all_gather(v.contiguous(), group=comm.cp_group)
    Kg, Vg = torch.cat(ks, 1), torch.cat(vs, 1)  # [B, P, H, *]
    P = Kg.shape[1]
    qpos = cb.lo + torch.arange(L)
    kpos = torch.arange(P)
    visible = (kpos[None, :] <= qpos[:, None])[None]  # [1, L, P]
    same_doc = cb.doc[:, qpos][:, :, None] == cb.doc[:, None, :]  # [B, L, P]
    if BUG == "attn_no_doc_mask":
        same_doc = torch.ones_like(same_doc)
    visible = visible & same_doc & ~cb.pad[:, None, :] & ~cb.pad[:, qpos][:, :, None]
    scores = torch.einsum("blhk,bphk->bhlp", q, Kg) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    any_key = visible.any(-1)[:, None, :, None]  # a padding query sees no key
    probs = torch.softmax(scores.masked_fill(~any_key, 0.0), -1) * any_key
    return torch.einsum("bhlp,bphv->blhv", probs, Vg)


class GatedDeltaLayer(nn.Module):
    def __init__(self, g):
        super().__init__()
        C = H * (2 * DK + DV)
        self.w_in = nn.Parameter(torch.randn(D, C, generator=g, dtype=torch.float64) * D ** -0.5)
        self.conv_w = nn.Parameter(torch.randn(C, W, generator=g, dtype=torch.float64) * 0.5)
        self.conv_b = nn.Parameter(torch.randn(C, generator=g, dtype=torch.float64) * 0.1)
        self.w_beta = nn.Parameter(torch.randn(D, H, generator=g, dtype=torch.float64) * D ** -0.5)
        self.w_g = nn.Parameter(torch.randn(D, H, generator=g, dtype=torch.float64) * D ** -0.5)
        self.w_out = nn.Parameter(torch.randn(H * DV, D, generator=g, dtype=torch.float64) * (H * DV) ** -0.5)

    def forward(self, x, cb, comm):
        B, L, _ = x.shape
        u = F.silu(packed_causal_conv(x @ self.w_in, self.conv_w, self.conv_b, cb, comm))
        q, k, v = u.split([H * DK, H * DK, H * DV], -1)
        q = F.normalize(q.view(B, L, H, DK), dim=-1)
        k = F.normalize(k.view(B, L, H, DK), dim=-1)
        v = v.view(B, L, H, DV)
        beta = torch.sigmoid(x @ self.w_beta)                     # [B, L, H]
        g = (-F.softplus(x @ self.w_g))[..., None].expand(B, L, H, DK)  # one decay per head (GDN)
        o = gated_delta_rule(q, k, v, beta, g, cb, comm)
        return x + o.reshape(B, L, H * DV) @ self.w_out


class Attention(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(D, H * DK, generator=g, dtype=torch.float64) * D ** -0.5)
        self.wk = nn.Parameter(torch.randn(D, H * DK, generator=g, dtype=torch.float64) * D ** -0.5)
        self.wv = nn.Parameter(torch.randn(D, H * DV, generator=g, dtype=torch.float64) * D ** -0.5)
        self.wo = nn.Parameter(torch.randn(H * DV, D, generator=g, dtype=torch.float64) * (H * DV) ** -0.5)

    def forward(self, x, cb, comm):
        B, L, _ = x.shape
        q = (x @ self.wq).view(B, L, H, DK)
        k = (x @ self.wk).view(B, L, H, DK)
        v = (x @ self.wv).view(B, L, H, DV)
        o = doc_attention(q, k, v, cb, comm)
        return x + o.reshape(B, L, H * DV) @ self.wo


class TinyHybrid(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(V, D, generator=g, dtype=torch.float64))
        self.gdr = GatedDeltaLayer(g)
        self.attn = Attention(g)
        self.lm_head = nn.Parameter(torch.randn(D, V, generator=g, dtype=torch.float64) * D ** -0.5)

    def forward(self, cb, comm):
        x = self.emb[cb.ids]
        x = self.gdr(x, cb, comm)
        x = self.attn(x, cb, comm)
        return x @ self.lm_head


# --------------------------------------------------------------------------- the training step
def cp_loss(logits, labels, comm):
    """Token-mean cross entropy over every DP x CP rank's labels: this rank's sum
    divided by the global count of labels (so the gradients simply add up)."""
    ce_sum = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
    count = (labels != IGNORE).sum().to(logits.dtype)
    if BUG == "loss_local_count":  # divided by this rank's own count
        return ce_sum / count.clamp(min=1)
    if BUG in ("dp_avg_local_mean", "loss_cp_count"):  # normalised by the replica's (CP group's) count only
        dist.all_reduce(count, group=comm.cp_group)
        return ce_sum / count.clamp(min=1)
    dist.all_reduce(count)  # every DP x CP rank (the default group)
    return ce_sum / count.clamp(min=1)


def all_reduce_grads(model, comm):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if BUG == "grad_dp_only":
        dist.all_reduce(flat, group=comm.dp_group)
    elif BUG == "grad_cp_only":
        dist.all_reduce(flat, group=comm.cp_group)
    elif BUG == "dp_avg_local_mean":
        dist.all_reduce(flat, group=comm.cp_group)
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=comm.dp_group)
    else:
        dist.all_reduce(flat)
    i = 0
    for g in grads:
        g.copy_(flat[i:i + g.numel()].view_as(g))
        i += g.numel()


def sgd(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def clip(model, max_norm):
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        p.grad.mul_(scale)
    return total


def train_step(model, cb, comm, lr=LR, retain_graph=False):
    """One DP x CP step: forward, loss, backward, gradient all-reduce over every
    rank, global-norm clipping, SGD.  Returns (loss for logging, logits, loss)."""
    model.zero_grad(set_to_none=True)
    logits = model(cb, comm)
    loss = cp_loss(logits, cb.labels, comm)
    loss.backward(retain_graph=retain_graph)
    if BUG == "sgd_before_allreduce":
        sgd(model, lr)  # the update made from this rank's partial gradient
        all_reduce_grads(model, comm)
        return loss.detach(), logits, loss
    if BUG == "clip_local_norm":
        clip(model, MAX_NORM)  # the norm of this rank's partial gradient
        all_reduce_grads(model, comm)
    else:
        all_reduce_grads(model, comm)
        clip(model, MAX_NORM)
    sgd(model, lr)
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return logged, logits, loss
