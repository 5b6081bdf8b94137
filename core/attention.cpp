#include "core/attention.hpp"

#include <algorithm>
#include <cmath>

#include "core/gather.hpp"
#include "core/kernels/table.hpp"

namespace cpsim {

namespace {

void expect_float(const Tensor& t, const char* op) {
  CPSIM_ENFORCE(t.dtype() == DType::f32 || t.dtype() == DType::f64, op, " supports float32 and float64");
}

// `t` where `like` lives (the layout lives on the host, as cu_seqlens do).
Tensor where(const Tensor& t, const Tensor& like) {
  return !t.defined() || t.device() == like.device() ? t : t.to(like.device());
}

}  // namespace

MropeSections mrope_sections(std::int64_t dim) {
  const std::int64_t half = dim / 2;
  CPSIM_ENFORCE(half >= 2, "mRoPE: rotary dim ", dim, " has fewer than 2 pairs");
  const std::int64_t side = std::max<std::int64_t>(1, 3 * half / 8);
  return {half - 2 * side, side, side};
}

Var rope(const Var& x, const Tensor& positions, double base) {
  const Tensor& xv = x.value();
  CPSIM_ENFORCE(xv.ndim() == 4 && xv.dim(3) % 2 == 0, "rope: x ", shape_str(xv.shape()), " is not [B, L, H, D even]");
  const bool mrope = positions.ndim() == 3;
  CPSIM_ENFORCE(positions.dtype() == DType::i64 &&
                    (positions.shape() == Shape({xv.dim(0), xv.dim(1)}) ||
                     positions.shape() == Shape({3, xv.dim(0), xv.dim(1)})),
                "rope: positions ", shape_str(positions.shape()), " do not match x ", shape_str(xv.shape()),
                " ([B, L], or mRoPE's [3, B, L])");
  expect_float(xv, "rope");
  const Tensor pos = where(positions, xv);
  kernels::Rope a;
  a.pos = static_cast<const std::int64_t*>(pos.raw());
  a.rows = xv.dim(0), a.len = xv.dim(1), a.heads = xv.dim(2), a.dim = xv.dim(3), a.base = base;
  if (mrope) {
    const MropeSections sections = mrope_sections(a.dim);
    a.planes = 3, a.section_t = sections.t, a.section_h = sections.h;
  }
  auto turn = [](kernels::Rope a, const Tensor& in, int sign) {
    Tensor out(in.shape(), in.dtype(), in.device());
    a.x = in.raw();
    a.y = out.raw();
    a.sign = sign;
    kernels::kernels_for(in.device()).rope(a, in.dtype(), kernels::current_stream());
    return out;
  };
  // The rotation is orthogonal: its backward is the inverse rotation.
  return record(turn(a, xv, 1), "rope", {x}, [a, pos, turn](const Tensor& g) {
    return std::vector<Tensor>{turn(a, g, -1)};
  });
}

namespace {
// For each key position j of each row, where the run of its document starts: the
// first position a query at j of j's document sees (first_key: back over its
// document's ids and 0s, up to another document's id). On the host, [B, Lk].
Tensor run_starts(const Tensor& k_ids) {
  const Tensor ids = k_ids.is_cpu() ? k_ids : k_ids.to(Device::host());
  const std::int64_t B = ids.dim(0), L = ids.dim(1);
  Tensor first({B, L}, DType::i64);
  const auto* id = ids.data<std::int64_t>();
  auto* f = first.data<std::int64_t>();
  for (std::int64_t b = 0; b < B; ++b) {
    // The run holding position j: it starts after the last position before j
    // whose id is another document's (not 0, not j's).
    std::int64_t doc = 0, start = 0;
    for (std::int64_t j = 0; j < L; ++j) {
      const std::int64_t x = id[b * L + j];
      if (x != 0 && x != doc) {
        // A new document's first token: its run reaches back over the 0s before it.
        std::int64_t s = j;
        while (s > start && id[b * L + s - 1] == 0) --s;
        start = s;
        doc = x;
      }
      f[b * L + j] = start;
    }
  }
  return first;
}
}  // namespace

Var document_attention(const Var& q, const Var& k, const Var& v, const Tensor& q_ids, const Tensor& k_ids,
                       std::int64_t q_start, double scale, const Tensor& kept) {
  const Tensor &qv = q.value(), &kv = k.value(), &vv = v.value();
  CPSIM_ENFORCE(qv.ndim() == 4 && kv.ndim() == 4 && vv.ndim() == 4 && kv.dim(0) == qv.dim(0) &&
                    kv.dim(2) == qv.dim(2) && kv.dim(3) == qv.dim(3) && vv.dim(0) == kv.dim(0) &&
                    vv.dim(1) == kv.dim(1) && vv.dim(2) == kv.dim(2),
                "document_attention: q ", shape_str(qv.shape()), ", k ", shape_str(kv.shape()), ", v ",
                shape_str(vv.shape()));
  CPSIM_ENFORCE(q_ids.dtype() == DType::i64 && q_ids.shape() == Shape({qv.dim(0), qv.dim(1)}) &&
                    k_ids.dtype() == DType::i64 && k_ids.shape() == Shape({kv.dim(0), kv.dim(1)}),
                "document_attention: ids ", shape_str(q_ids.shape()), " and ", shape_str(k_ids.shape()),
                " do not match q and k");
  CPSIM_ENFORCE(!kept.defined() || (kept.dtype() == DType::i64 && kept.ndim() == 3 && kept.dim(0) == qv.dim(0) &&
                                    kept.dim(1) == qv.dim(1)),
                "document_attention: kept must be [B, Lq, topk] int64");
  CPSIM_ENFORCE(kv.dtype() == qv.dtype() && vv.dtype() == qv.dtype(), "document_attention: q, k, v of one dtype");
  expect_float(qv, "document_attention");
  const Tensor qi = where(q_ids, qv), ki = where(k_ids, qv), kp = where(kept, qv);
  const Tensor kf = where(run_starts(k_ids), qv);
  // For each query, the next one (itself included) with an id: the key gradient's skip list.
  const Tensor host_q_ids = q_ids.is_cpu() ? q_ids : q_ids.to(Device::host());
  Tensor next_host({qv.dim(0), qv.dim(1)}, DType::i64);
  {
    const auto* id = host_q_ids.data<std::int64_t>();
    auto* next = next_host.data<std::int64_t>();
    const std::int64_t B = qv.dim(0), Lq = qv.dim(1);
    for (std::int64_t b = 0; b < B; ++b) {
      std::int64_t after = Lq;
      for (std::int64_t t = Lq - 1; t >= 0; --t) {
        if (id[b * Lq + t] != 0) after = t;
        next[b * Lq + t] = after;
      }
    }
  }
  const Tensor nq = where(next_host, qv);
  kernels::Attention a;
  a.q = qv.raw(), a.k = kv.raw(), a.v = vv.raw();
  a.next_query = static_cast<const std::int64_t*>(nq.raw());
  a.k_first = static_cast<const std::int64_t*>(kf.raw());
  a.q_ids = static_cast<const std::int64_t*>(qi.raw());
  a.k_ids = static_cast<const std::int64_t*>(ki.raw());
  a.kept = kp.defined() ? static_cast<const std::int64_t*>(kp.raw()) : nullptr;
  a.topk = kp.defined() ? kp.dim(2) : 0;
  a.rows = qv.dim(0), a.q_len = qv.dim(1), a.k_len = kv.dim(1), a.heads = qv.dim(2), a.dim = qv.dim(3);
  a.v_dim = vv.dim(3), a.q_start = q_start;
  a.scale = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(a.dim));
  Tensor o({a.rows, a.q_len, a.heads, a.v_dim}, qv.dtype(), qv.device());
  Tensor lse({a.rows, a.q_len, a.heads}, qv.dtype(), qv.device());
  a.o = o.raw(), a.lse = lse.raw();
  kernels::kernels_for(qv.device()).attention_forward(a, qv.dtype(), kernels::current_stream());
  return record(o, "document_attention", {q, k, v}, [a, qv, kv, vv, qi, ki, kp, nq, kf, o, lse](const Tensor& g) {
    // dq is written in full; dk and dv only at the keys the local queries see
    // (zeros elsewhere: on the host, pages that are never touched).
    Tensor dq = Tensor::empty(qv.shape(), qv.dtype(), qv.device()), dk(kv.shape(), kv.dtype(), kv.device()),
           dv(vv.shape(), vv.dtype(), vv.device());
    Tensor delta({a.rows, a.q_len, a.heads}, qv.dtype(), qv.device());
    kernels::Attention b = a;
    b.d_o = g.raw();
    b.dq = dq.raw(), b.dk = dk.raw(), b.dv = dv.raw();
    b.delta = delta.raw();
    kernels::kernels_for(qv.device()).attention_backward(b, qv.dtype(), kernels::current_stream());
    return std::vector<Tensor>{dq, dk, dv};
  });
}

Tensor topk_keep(const Tensor& index_q, const Tensor& index_k, const Tensor& q_ids, const Tensor& k_ids,
                 std::int64_t q_start, std::int64_t topk) {
  CPSIM_ENFORCE(index_q.ndim() == 3 && index_k.ndim() == 3 && index_q.dim(0) == index_k.dim(0) &&
                    index_q.dim(2) == index_k.dim(2) && index_q.dtype() == index_k.dtype(),
                "topk_keep: indexer q ", shape_str(index_q.shape()), ", k ", shape_str(index_k.shape()));
  CPSIM_ENFORCE(topk >= 0, "topk_keep: topk ", topk, " is negative");
  expect_float(index_q, "topk_keep");
  const Tensor qi = where(q_ids, index_q), ki = where(k_ids, index_q), kk = where(index_k, index_q);
  Tensor kept({index_q.dim(0), index_q.dim(1), topk}, DType::i64, index_q.device());
  kernels::TopK a;
  a.q = index_q.raw(), a.k = kk.raw();
  a.q_ids = static_cast<const std::int64_t*>(qi.raw());
  a.k_ids = static_cast<const std::int64_t*>(ki.raw());
  const Tensor kf = where(run_starts(k_ids), index_q);
  a.k_first = static_cast<const std::int64_t*>(kf.raw());
  a.kept = static_cast<std::int64_t*>(kept.raw());
  a.rows = index_q.dim(0), a.q_len = index_q.dim(1), a.k_len = index_k.dim(1), a.dim = index_q.dim(2);
  a.q_start = q_start, a.topk = topk;
  kernels::kernels_for(index_q.device()).topk_select(a, index_q.dtype(), kernels::current_stream());
  return kept;
}

Tensor visible_doc_ids(const PackedContext& context, const Tensor& local_padding) {
  Tensor ids = context.local_doc_ids().clone();
  const Tensor pad = local_padding.is_cpu() ? local_padding : local_padding.to(Device::host());
  CPSIM_ENFORCE(pad.numel() == ids.numel(), "visible_doc_ids: padding ", shape_str(pad.shape()), " for doc ids ",
                shape_str(ids.shape()));
  for (std::int64_t i = 0; i < ids.numel(); ++i)
    if (pad.get_int(i) != 0) ids.set(i, 0);
  return ids;
}

CpAttention cp_document_attention(const Var& q, const Var& k, const Var& v, const Tensor& local_ids,
                                  const ShardPlan* plan, Communicator* comm, const SparseIndexer* indexer,
                                  double scale, const Tensor& probe) {
  const bool sharded = is_distributed(comm);
  const std::int64_t seq_start = !sharded ? 0 : plan ? plan->begin(comm->rank()) : comm->rank() * q.value().dim(1);
  const Var kg = gather_sequence(k, comm, true, plan), vg = gather_sequence(v, comm, true, plan);
  const Tensor key_ids = sharded ? all_gather_sequence_tensor(where(local_ids, q.value()), *comm, plan)
                                 : where(local_ids, q.value());
  // The queries evaluated: every one, or the probe's (the others as if not real).
  Tensor query_ids = local_ids;
  if (probe.defined()) {
    const Tensor on = probe.is_cpu() ? probe : probe.to(Device::host());
    CPSIM_ENFORCE(on.numel() == local_ids.numel(), "cp_document_attention: probe ", shape_str(on.shape()),
                  " for ids ", shape_str(local_ids.shape()));
    query_ids = (local_ids.is_cpu() ? local_ids : local_ids.to(Device::host())).clone();
    for (std::int64_t i = 0; i < query_ids.numel(); ++i)
      if (on.get_int(i) == 0) query_ids.set(i, 0);
  }
  const Tensor ids = where(query_ids, q.value());
  Tensor kept;
  if (indexer) {
    const Tensor index_k = sharded ? all_gather_sequence_tensor(where(indexer->k, q.value()), *comm, plan)
                                   : where(indexer->k, q.value());
    kept = topk_keep(where(indexer->q, q.value()), index_k, ids, key_ids, seq_start, indexer->topk);
  }
  CpAttention out;
  out.out = document_attention(q, kg, vg, ids, key_ids, seq_start, scale, kept);
  out.kept = kept;
  out.anchor = add(all_gather_backward_anchor(kg), all_gather_backward_anchor(vg));
  return out;
}

}  // namespace cpsim
