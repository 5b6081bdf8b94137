#include "verify/properties.hpp"

#include <limits>
#include <mutex>
#include <sstream>

#include "core/conv.hpp"
#include "core/gather.hpp"
#include "core/plan.hpp"
#include "core/recurrence.hpp"
#include "core/comm/run_ranks.hpp"
#include "verify/random.hpp"
#include "verify/reference.hpp"

namespace cpsim::verify {

namespace {

// Accumulates mismatches for one property run.
struct Tally {
  Tally(std::string n, int c) : name(std::move(n)), cp(c) {}
  std::string name;
  int cp;
  std::int64_t wrong = 0;
  std::ostringstream why;
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    if (wrong == 0) why << what;
    ++wrong;
  }
  void expect_equal(const Tensor& ref, const Tensor& got, const std::string& what) {
    const std::int64_t w = count_wrong(ref, got);
    if (w && wrong == 0) why << what << ": " << w << " wrong elements";
    wrong += w;
  }
  // A sum over ranks: bitwise where the backend sums in rank order, else within
  // a relative RMSE of a few units in the last place of the dtype.
  void expect_sum(const Tensor& ref, const Tensor& got, const Capabilities& caps, const std::string& what) {
    if (caps.rank_order_sums) return expect_equal(ref, got, what);
    const double tol = ref.dtype() == DType::f64 ? 1e-12 : 1e-5;
    const double e = relative_rmse(ref, got);
    if (e <= tol) return;
    if (wrong == 0) why << what << ": relative RMSE " << e << " (tolerance " << tol << ")";
    wrong += std::max<std::int64_t>(1, count_wrong(ref, got));
  }
  PropertyResult result() const { return {name, cp, wrong == 0, static_cast<double>(wrong), why.str()}; }
};

PropertyResult failed(const std::string& name, int cp, const std::string& why) {
  return {name, cp, false, 1.0, why};
}

// The property's run ended in `failure` (by default the exception being handled):
// the code under test failed (its exception is the property's failure), or the
// run could not complete (a timeout, a lost rank, memory: aborted, no verdict on
// the code).
PropertyResult threw(const std::string& name, int cp, const std::string& doing = "threw: ",
                     const std::exception_ptr& failure = std::current_exception()) {
  const FailureReport report = classify_failure(failure);
  if (report.kind == FailureKind::aborted) return {name, cp, false, 0.0, report.what, true};
  return failed(name, cp, doing + report.what);
}

std::vector<std::int64_t> row_of(const Tensor& t, std::int64_t row) {
  const std::int64_t S = t.dim(1);
  std::vector<std::int64_t> v(S);
  for (std::int64_t s = 0; s < S; ++s) v[s] = t.get_int(row * S + s);
  return v;
}

Batch normalized(const Batch& b) {
  Batch out = b;
  normalize_batch_axis(out);
  return out;
}

RunOptions run_options(const CheckOptions& o) { return {o.backend, o.timeout, o.job}; }
// How results of this backend compare: bitwise, or within a tolerance for sums.
Capabilities capabilities_of(const CheckOptions& o) { return find_backend(o.backend).capabilities; }

}  // namespace

LayoutFn default_layout() { return derive_layout; }
ShardFn default_shard() {
  return [](int rank, int cp, const Batch& b, std::int64_t pad, bool primary) {
    return shard_batch_at(rank, cp, b, std::nullopt, pad, primary);
  };
}
GatherFn default_gather() { return gather_sequence; }
RecurrenceFn default_recurrence() {
  return [](const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g, const PackedContext& context,
            Communicator* comm) { return gated_delta_rule(q, k, v, beta, g, context, comm); };
}
HaloFn default_halo() { return convolution_history; }
ConvFn default_conv() { return packed_causal_conv; }
AnchorFn default_anchor() { return all_gather_backward_anchor; }

PropertyResult check_layout(const LayoutCase& c, const LayoutFn& layout_fn) {
  Tally t{"layout", c.cp};
  try {
    const LayoutTruth want = reference_layout(c.batch);
    const std::int64_t B = want.doc_ids.dim(0), S = want.doc_ids.dim(1);
    if (c.truth) {
      // A generated case also knows its layout by construction: a second opinion
      // that keeps the reference honest.
      t.expect_equal(c.truth->doc_ids, want.doc_ids, "reference doc ids vs the generator's construction");
      t.expect_equal(c.truth->padding, want.padding, "reference padding vs the generator's construction");
      t.expect_equal(c.truth->positions, want.positions, "reference positions vs the generator's construction");
    }
    const Batch b = normalized(c.batch);
    const Layout layout = layout_fn(b);
    t.expect_equal(want.doc_ids, layout.doc_ids, "doc ids");
    t.expect_equal(want.padding, layout.padding, "padding");
    t.expect_equal(want.positions, layout.positions, "positions");
    t.expect_equal(want.doc_ids, global_doc_ids(b), "global_doc_ids");
    for (std::int64_t r = 0; r < B; ++r) {
      const auto row = row_of(want.doc_ids, r);
      // doc ids -> segments -> doc ids.
      const auto cu = segment_cu_seqlens(row.data(), S);
      t.expect(cu == reference_segments(row), "segments of row " + std::to_string(r));
      // doc ids -> occupied lengths -> cu_seqlens / seq_lens -> doc ids: the same ids.
      std::vector<std::int64_t> lens;
      std::vector<std::int64_t> cu_docs{0};
      bool contiguous = true;  // packed documents leave no pad run between them
      for (std::size_t k = 0; k + 1 < cu.size(); ++k) {
        if (row[cu[k]] == kPadDocId) {
          contiguous = contiguous && k + 2 == cu.size();
          continue;
        }
        lens.push_back(cu[k + 1] - cu[k]);
        cu_docs.push_back(cu_docs.back() + lens.back());
      }
      if (contiguous && !lens.empty()) {
        const Tensor cu_t = Tensor::from<std::int64_t>({static_cast<std::int64_t>(cu_docs.size())}, cu_docs);
        const Tensor lens_t = Tensor::from<std::int64_t>({1, static_cast<std::int64_t>(lens.size())}, lens);
        // Ids are renumbered 1..D by the round trip; the segments must survive.
        t.expect(segment_cu_seqlens(row_of(doc_ids_from_cu_seqlens(cu_t, S), 0).data(), S) == cu,
                 "cu_seqlens round trip of row " + std::to_string(r));
        t.expect(row_of(doc_ids_from_seq_lens(lens_t, S), 0) == row_of(doc_ids_from_cu_seqlens(cu_t, S), 0),
                 "seq_lens vs cu_seqlens of row " + std::to_string(r));
      }
    }
    Tensor keep({B, S}, DType::b8);
    for (std::int64_t i = 0; i < B * S; ++i) keep.data<bool>()[i] = !want.padding.data<bool>()[i];
    validate_document_positions(keep, layout.positions);
    Batch unpacked = b;
    unpack_row_layout(unpacked);
    t.expect(!unpacked.count("seq_lens") && !unpacked.count("cu_seqlens") && !unpacked.count("cu_seqlens_padded") &&
                 !unpacked.count("seq_lens_padded"),
             "unpack kept packing metadata");
    t.expect_equal(want.padding, unpacked.at("padding_mask"), "unpacked padding_mask");
    t.expect_equal(want.positions, unpacked.at("position_ids"), "unpacked position_ids");
    t.expect_equal(b.at("input_ids"), unpacked.at("input_ids"), "unpack changed input_ids");
  } catch (...) {
    return threw("layout", c.cp);
  }
  return t.result();
}

PropertyResult check_shard(const LayoutCase& c, const ShardFn& shard) {
  Tally t{"shard", c.cp};
  try {
    const auto [B, S] = reference_shape(c.batch);
    const ReferenceGeometry g = reference_geometry(S, c.cp);
    const Batch ref = reference_padded_global(c, g.padded_len);
    const LayoutTruth truth = reference_layout(c.batch);
    const Shape local_shape{B, g.local_len};
    std::map<std::string, std::vector<Tensor>> parts;
    std::vector<Tensor> local_ids;
    for (int r = 0; r < c.cp; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      const ShardedBatch sb = shard(r, c.cp, c.batch, c.pad_token_id, false);
      const PackedContext& ctx = sb.context;
      const bool geometry = ctx.doc_ids().defined() && ctx.doc_ids().shape() == (Shape{B, g.padded_len}) &&
                            ctx.local_seq_len() == g.local_len && ctx.seq_start() == g.start(r) &&
                            ctx.cp_size() == c.cp && ctx.original_seq_len() == S && ctx.cp_enabled() == (c.cp > 1);
      t.expect(geometry, "packed context geometry of " + rank);
      for (const auto& [key, expected] : ref) {
        if (!sb.local.count(key)) {
          t.expect(false, rank + " lost " + key);
          continue;
        }
        const Tensor& got = sb.local.at(key);
        if (key == "input_ids") {
          t.expect_equal(expected, got, "global input_ids of " + rank);
        } else if (got.shape() != local_shape) {
          t.expect(false, key + " of " + rank + " has shape " + shape_str(got.shape()) + ", not " + shape_str(local_shape));
        } else {
          parts[key].push_back(got);
        }
      }
      for (const auto& [key, got] : sb.local) t.expect(ref.count(key) != 0, rank + " holds an unexpected key " + key);
      const ShardedBatch primary = shard(r, c.cp, c.batch, c.pad_token_id, true);
      t.expect(primary.local.count("input_ids") != 0, rank + " lost input_ids when sharding them");
      if (primary.local.count("input_ids"))
        t.expect_equal(narrow(ref.at("input_ids"), 1, g.start(r), g.local_len), primary.local.at("input_ids"),
                       "sharded input_ids of " + rank);
      if (!geometry) continue;  // the context's answers below would be read out of its bounds
      local_ids.push_back(ctx.local_doc_ids());
      for (std::int64_t row = 0; row < B; ++row) {
        const auto padded_ids = reference_padded_doc_ids_row(truth, static_cast<int>(row), g.padded_len);
        const FlaCpContext want = reference_cp_context(padded_ids, c.cp, r);
        t.expect(ctx.row_cu_seqlens(static_cast<int>(row)) == want.cu_seqlens,
                 "row_cu_seqlens of " + rank + " row " + std::to_string(row));
        const FlaCpContext got = build_fla_cp_context(ctx, static_cast<int>(row));
        t.expect(got.cu_seqlens == want.cu_seqlens && got.pre_num_conv_tokens == want.pre_num_conv_tokens &&
                     got.pre_num_ranks == want.pre_num_ranks && got.post_num_ranks == want.post_num_ranks &&
                     got.is_first_rank == want.is_first_rank && got.is_last_rank == want.is_last_rank,
                 "CP context of " + rank + " row " + std::to_string(row));
      }
    }
    for (const auto& [key, shards] : parts)
      if (static_cast<int>(shards.size()) == c.cp) t.expect_equal(ref.at(key), cat(shards, 1), "concatenated " + key);
    if (static_cast<int>(local_ids.size()) == c.cp) {
      Tensor ref_ids({B, g.padded_len}, DType::i64);
      for (std::int64_t row = 0; row < B; ++row) {
        const auto ids = reference_padded_doc_ids_row(truth, static_cast<int>(row), g.padded_len);
        std::copy(ids.begin(), ids.end(), ref_ids.data<std::int64_t>() + row * g.padded_len);
      }
      t.expect_equal(ref_ids, cat(local_ids, 1), "concatenated local doc ids");
    }
  } catch (...) {
    return threw("shard", c.cp);
  }
  return t.result();
}

struct ConvRun;
struct RecurrenceRun;

// Simulations several rows share, run once per case (default implementations only).
struct Prepared::Runs {
  std::shared_ptr<const ConvRun> conv;
  std::shared_ptr<const RecurrenceRun> recurrence;
};

Prepared::Prepared(LayoutCase c_in) : c(std::move(c_in)), runs(std::make_shared<Runs>()) {
  shape = reference_shape(c.batch);
  g = reference_geometry(shape.seq_len, c.cp);
  truth = reference_layout(c.batch);
  padded_ids = reference_padded_doc_ids(truth, g.padded_len);
  // Every rank's packed context, as a training step makes it (shard_batch).
  try {
    for (int r = 0; r < c.cp; ++r)
      contexts.push_back(shard_batch_at(r, c.cp, c.batch, std::nullopt, c.pad_token_id, false).context);
  } catch (...) {
    contexts.clear();
    shard_failure = std::current_exception();
  }
}

const PackedContext& Prepared::context(int rank) const {
  if (contexts.empty()) {
    const FailureReport report = classify_failure(shard_failure);
    if (report.kind == FailureKind::aborted) throw Aborted(report.what);
    throw Error("shard_batch threw: " + report.what);
  }
  return contexts.at(rank);
}

namespace {

// Rank r's slice of a global [B, P, ...] tensor, where its packed context says its
// shard lies (the model's path: a wrong context is a wrong result, not a crash).
Tensor local(const Tensor& global, const PackedContext& ctx) {
  return narrow(global, 1, ctx.seq_start(), ctx.local_seq_len());
}

// A rank's input where its backend keeps tensors (the host, or cuda:N), and a
// result back on the host for the comparison.
Tensor on(const Communicator& comm, const Tensor& t) {
  const Device device = comm.device();
  return device.is_cpu() || !t.defined() ? t : t.to(device);
}
Tensor host(const Tensor& t) { return !t.defined() || t.is_cpu() ? t : t.to(Device::host()); }

}  // namespace

PropertyResult gather_forward_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather) {
  const LayoutCase& c = s.c;
  Tally t{"gather_forward", c.cp};
  try {
    const std::vector<std::pair<DType, Shape>> cases = {
        {DType::f32, {s.shape.rows, s.g.padded_len, o.channels}}, {DType::f64, {s.shape.rows, s.g.padded_len, 2}},
        {DType::bf16, {s.shape.rows, s.g.padded_len, o.channels}}, {DType::i32, {s.shape.rows, s.g.padded_len, 3}},
        {DType::i64, {s.shape.rows, s.g.padded_len}},              {DType::b8, {s.shape.rows, s.g.padded_len, 2, 2}}};
    // One run for every dtype (a run per dtype would cost more than the gathers).
    std::vector<Tensor> globals;
    for (const auto& [dt, shape] : cases) globals.push_back(random_tensor(shape, dt, mix_seed(c.seed, static_cast<int>(dt))));
    std::vector<std::vector<Tensor>> got(cases.size(), std::vector<Tensor>(c.cp));
    RankOutputs outputs;
    for (auto& g : got) outputs.push_back(&g);
    run_ranks(c.cp, [&](Communicator& comm) {
      const int r = comm.rank();
      for (std::size_t k = 0; k < cases.size(); ++k) {
        const bool floating = is_floating(cases[k].first);
        Var x(on(comm, local(globals[k], s.context(r))), floating);
        got[k][r] = host(gather(x, &comm, floating).value());
      }
    }, run_options(o), outputs);
    for (std::size_t k = 0; k < cases.size(); ++k)
      for (int r = 0; r < c.cp; ++r)
        t.expect_equal(globals[k], got[k][r],
                       std::string("gathered ") + dtype_name(cases[k].first) + " on rank " + std::to_string(r));
  } catch (...) {
    return threw("gather_forward", c.cp);
  }
  return t.result();
}

namespace {

// Plain rank-order sum of upstream slices in the element type: the reference reduce-scatter.
template <class T>
Tensor reference_gather_grad(const std::vector<Tensor>& upstream, const std::vector<bool>& contributes,
                             const ReferenceGeometry& g, int rank) {
  const Tensor& u0 = upstream[0];
  Shape shape = u0.shape();
  shape[1] = g.local_len;
  Tensor out(shape, u0.dtype());
  const std::int64_t B = shape[0], inner = u0.numel() / (B * g.padded_len);
  bool first = true;
  for (std::size_t q = 0; q < upstream.size(); ++q) {
    if (!contributes[q]) continue;
    const T* u = upstream[q].data<T>();
    T* o = out.data<T>();
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < g.local_len; ++s)
        for (std::int64_t k = 0; k < inner; ++k) {
          const T v = u[(b * g.padded_len + g.start(rank) + s) * inner + k];
          T& dst = o[(b * g.local_len + s) * inner + k];
          dst = first ? v : static_cast<T>(dst + v);
        }
    first = false;
  }
  return out;
}

Tensor reference_grad(DType dt, const std::vector<Tensor>& upstream, const std::vector<bool>& contributes,
                      const ReferenceGeometry& g, int rank) {
  return dt == DType::f64 ? reference_gather_grad<double>(upstream, contributes, g, rank)
                          : reference_gather_grad<float>(upstream, contributes, g, rank);
}

}  // namespace

PropertyResult gather_backward_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather) {
  const LayoutCase& c = s.c;
  Tally t{"gather_backward", c.cp};
  try {
    // One dtype at a time: every rank's upstream gradient is a whole [B, P, C]
    // tensor, so the cp of them are what this row holds at its peak; a run per
    // dtype holds one dtype's at a time.
    const Shape shape{s.shape.rows, s.g.padded_len, o.channels};
    const std::vector<bool> all(c.cp, true);
    for (const DType dt : {DType::f64, DType::f32}) {
      const Tensor global = random_tensor(shape, dt, mix_seed(c.seed, 11));
      std::vector<Tensor> upstream, grads(c.cp);
      for (int q = 0; q < c.cp; ++q) upstream.push_back(random_tensor(shape, dt, mix_seed(c.seed, 100 + q)));
      run_ranks(c.cp, [&](Communicator& comm) {
        const int r = comm.rank();
        Var x(on(comm, local(global, s.context(r))), true);
        backward(dot(gather(x, &comm, true), upstream[r]));
        grads[r] = host(x.grad());
      }, run_options(o), {&grads});
      for (int r = 0; r < c.cp; ++r) {
        if (!grads[r].defined()) {
          t.expect(false, "rank " + std::to_string(r) + " got no gradient");
          continue;
        }
        t.expect_sum(reference_grad(dt, upstream, all, s.g, r), grads[r], capabilities_of(o),
                     std::string(dtype_name(dt)) + " gradient of rank " + std::to_string(r));
      }
    }
  } catch (...) {
    return threw("gather_backward", c.cp);
  }
  return t.result();
}

PropertyResult anchor_of(const Prepared& s, const CheckOptions& o, const GatherFn& gather, const AnchorFn& anchor) {
  const LayoutCase& c = s.c;
  Tally t{"anchor", c.cp};
  try {
    const Shape shape{s.shape.rows, s.g.padded_len, o.channels};
    const Tensor global = random_tensor(shape, DType::f64, mix_seed(c.seed, 21));
    std::vector<Tensor> upstream;
    std::vector<bool> uses(c.cp);  // whether rank q's loss depends on the gathered tensor
    SplitMix64 rng(mix_seed(c.seed, 22));
    int users = 0;
    for (int q = 0; q < c.cp; ++q) {
      upstream.push_back(random_tensor(shape, DType::f64, mix_seed(c.seed, 200 + q)));
      uses[q] = rng.below(2) == 1;
      users += uses[q];
    }
    auto step = [&](bool with_anchor, std::vector<Tensor>& grads) {
      run_ranks(c.cp, [&](Communicator& comm) {
        const int r = comm.rank();
        Var x(on(comm, local(global, s.context(r))), true);
        Var gathered = gather(x, &comm, true);
        Var loss = uses[r] ? dot(gathered, upstream[r]) : constant_scalar(0.0);
        if (with_anchor) loss = add(loss, anchor(gathered));
        backward(loss);
        grads[r] = host(x.grad());
        comm.barrier();  // what the next training step would do
      }, run_options(o), {&grads});
    };
    std::vector<Tensor> grads(c.cp);
    step(true, grads);
    for (int r = 0; r < c.cp; ++r) {
      if (!grads[r].defined()) {
        t.expect(false, "with the anchor, rank " + std::to_string(r) + " got no gradient");
        continue;
      }
      t.expect_sum(reference_grad(DType::f64, upstream, uses, s.g, r), grads[r], capabilities_of(o),
                   "gradient with the anchor on rank " + std::to_string(r));
    }
    if (c.cp > 1 && users > 0 && users < c.cp) {
      std::string error;
      try {
        std::vector<Tensor> unused(c.cp);
        step(false, unused);
      } catch (const CollectiveError& e) {
        error = e.what();
      }
      t.expect(error.find("reduce_scatter") != std::string::npos,
               "without the anchor the skipped reduce_scatter was not reported" +
                   (error.empty() ? std::string() : " (got: " + error + ")"));
    }
  } catch (...) {
    return threw("anchor", c.cp);
  }
  return t.result();
}

namespace {

constexpr HaloExchange kExchanges[] = {HaloExchange::all_gather, HaloExchange::send_recv};

std::string exchange_tag(HaloExchange e) { return std::string(" (") + halo_exchange_name(e) + " exchange)"; }

// Relative RMSE against a tolerance; tracks the worst error of a property.
struct ErrorTally {
  ErrorTally(std::string n, int c) : name(std::move(n)), cp(c) {}
  std::string name;
  int cp;
  double worst = 0;
  std::string why;
  void expect_close(const Tensor& ref, const Tensor& got, double tol, const std::string& what) {
    const double e = got.defined() ? relative_rmse(ref, got) : std::numeric_limits<double>::infinity();
    if (e > tol && why.empty()) why = what + ": relative RMSE " + std::to_string(e);
    worst = std::max(worst, e);
  }
  PropertyResult result(double tol) const { return {name, cp, worst <= tol && why.empty(), worst, why}; }
};

}  // namespace

PropertyResult halo_forward_of(const Prepared& s, const CheckOptions& o, const HaloFn& halo) {
  const LayoutCase& c = s.c;
  Tally t{"halo_forward", c.cp};
  try {
    const Tensor x = masked_activation(s.truth, s.g.padded_len, o.channels, mix_seed(c.seed, 31));
    std::vector<std::vector<Tensor>> got(std::size(kExchanges), std::vector<Tensor>(c.cp));
    run_ranks(c.cp, [&](Communicator& comm) {
      const int r = comm.rank();
      for (std::size_t k = 0; k < std::size(kExchanges); ++k)
        got[k][r] = host(halo(Var(on(comm, local(x, s.context(r))), true), &comm, o.conv_width, kExchanges[k]).value());
    }, run_options(o), {&got[0], &got[1]});
    for (std::size_t k = 0; k < std::size(kExchanges); ++k)
      for (int r = 0; r < c.cp; ++r)
        t.expect_equal(reference_history(x, s.g.start(r), s.g.local_len, o.conv_width), got[k][r],
                       "history of rank " + std::to_string(r) + exchange_tag(kExchanges[k]));
  } catch (...) {
    return threw("halo_forward", c.cp);
  }
  return t.result();
}

PropertyResult halo_backward_of(const Prepared& s, const CheckOptions& o, const HaloFn& halo) {
  const LayoutCase& c = s.c;
  ErrorTally t{"halo_backward", c.cp};
  try {
    const std::int64_t L = s.g.local_len, H = o.conv_width - 1, P = s.g.padded_len, C = o.channels;
    const Tensor x = masked_activation(s.truth, P, C, mix_seed(c.seed, 32));
    std::vector<Tensor> upstream;
    for (int q = 0; q < c.cp; ++q) upstream.push_back(random_tensor({s.shape.rows, L + H, C}, DType::f64, mix_seed(c.seed, 300 + q)));
    // Reference: every window slot's gradient lands on the global position it came from.
    Tensor owner_grad({s.shape.rows, P, C}, DType::f64);
    for (int q = 0; q < c.cp; ++q)
      for (std::int64_t b = 0; b < s.shape.rows; ++b)
        for (std::int64_t i = 0; i < L + H; ++i) {
          const std::int64_t p = s.g.start(q) - H + i;
          if (p < 0) continue;
          for (std::int64_t k = 0; k < C; ++k) {
            const std::int64_t at = (b * P + p) * C + k;
            owner_grad.set(at, owner_grad.get(at) + upstream[q].get((b * (L + H) + i) * C + k));
          }
        }
    std::vector<std::vector<Tensor>> grads(std::size(kExchanges), std::vector<Tensor>(c.cp));
    run_ranks(c.cp, [&](Communicator& comm) {
      const int r = comm.rank();
      for (std::size_t k = 0; k < std::size(kExchanges); ++k) {
        Var xr(on(comm, local(x, s.context(r))), true);
        backward(dot(halo(xr, &comm, o.conv_width, kExchanges[k]), upstream[r]));
        grads[k][r] = host(xr.grad());
      }
    }, run_options(o), {&grads[0], &grads[1]});
    for (std::size_t k = 0; k < std::size(kExchanges); ++k)
      for (int r = 0; r < c.cp; ++r)
        t.expect_close(narrow(owner_grad, 1, s.g.start(r), L), grads[k][r], kConvTolerance,
                       "input gradient of rank " + std::to_string(r) + exchange_tag(kExchanges[k]));
  } catch (...) {
    return threw("halo_backward", c.cp);
  }
  return t.result(kConvTolerance);
}

struct ConvRun {
  ConvReference ref;
  std::vector<std::vector<Tensor>> y, dx;  // [exchange][rank]
  std::vector<Tensor> dw, dbias;           // [exchange], summed over ranks in rank order
};

namespace {

// One conv layer per rank, forward and backward, both exchanges. With neither part
// given, the model's own layer (sharded_packed_conv on the rank's packed context);
// otherwise the same composition with the given halo and/or conv.
ConvRun run_conv(const Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  const LayoutCase& c = s.c;
  const std::int64_t P = s.g.padded_len, C = o.channels, W = o.conv_width;
  const Tensor x = masked_activation(s.truth, P, C, mix_seed(c.seed, 41));
  const Tensor w = random_tensor({C, W}, DType::f64, mix_seed(c.seed, 42));
  const Tensor bias = random_tensor({C}, DType::f64, mix_seed(c.seed, 43));
  const Tensor gy = random_tensor({s.shape.rows, P, C}, DType::f64, mix_seed(c.seed, 44));
  const bool layer = !halo && !conv;
  const HaloFn& halo_fn = halo ? halo : default_halo();
  const ConvFn& conv_fn = conv ? conv : default_conv();
  ConvRun run;
  run.ref = reference_conv(x, s.padded_ids, w, bias, gy);
  // Both exchanges in one run: [exchange][rank].
  const std::size_t E = std::size(kExchanges);
  std::vector<std::vector<Tensor>> y(E, std::vector<Tensor>(c.cp)), dx = y, dw = y, db = y;
  run_ranks(c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    const PackedContext& ctx = s.context(r);
    for (std::size_t k = 0; k < E; ++k) {
      const HaloExchange e = kExchanges[k];
      Var xr(on(comm, local(x, ctx)), true), wr(on(comm, w.clone()), true), br(on(comm, bias.clone()), true);
      Var out;
      if (layer) {
        out = sharded_packed_conv(xr, ctx, &comm, wr, br, e);
      } else {
        const Var window = halo_fn(xr, &comm, static_cast<int>(W), e);
        out = conv_fn(window,
                      on(comm, window_doc_ids(ctx.doc_ids(), ctx.seq_start(), ctx.local_seq_len(), static_cast<int>(W))),
                      wr, br);
      }
      backward(dot(out, local(gy, ctx)));
      y[k][r] = host(out.value());
      dx[k][r] = host(xr.grad());
      dw[k][r] = host(wr.grad());
      db[k][r] = host(br.grad());
    }
  }, run_options(o), {&y[0], &dx[0], &dw[0], &db[0], &y[1], &dx[1], &dw[1], &db[1]});
  for (std::size_t k = 0; k < E; ++k) {
    Tensor dw_sum = dw[k][0].defined() ? dw[k][0].clone() : Tensor();
    Tensor db_sum = db[k][0].defined() ? db[k][0].clone() : Tensor();
    for (int r = 1; r < c.cp; ++r) {
      if (dw_sum.defined() && dw[k][r].defined()) add_inplace(dw_sum, dw[k][r]);
      if (db_sum.defined() && db[k][r].defined()) add_inplace(db_sum, db[k][r]);
    }
    run.y.push_back(y[k]);
    run.dx.push_back(dx[k]);
    run.dw.push_back(dw_sum);
    run.dbias.push_back(db_sum);
  }
  return run;
}

// The shared conv run of the model's layer (the table's rows), or a fresh one.
std::shared_ptr<const ConvRun> conv_run(Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  if (halo || conv) return std::make_shared<ConvRun>(run_conv(s, o, halo, conv));
  if (!s.runs->conv) s.runs->conv = std::make_shared<ConvRun>(run_conv(s, o, halo, conv));
  return s.runs->conv;
}

}  // namespace

PropertyResult conv_forward_of(Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  const LayoutCase& c = s.c;
  ErrorTally t{"conv_forward", c.cp};
  try {
    const auto held = conv_run(s, o, halo, conv);  // keeps a fresh run alive
    const ConvRun& run = *held;
    for (std::size_t e = 0; e < run.y.size(); ++e)
      t.expect_close(run.ref.y, cat(run.y[e], 1), kConvTolerance, "conv output" + exchange_tag(kExchanges[e]));
  } catch (...) {
    return threw("conv_forward", c.cp);
  }
  return t.result(kConvTolerance);
}

PropertyResult conv_backward_of(Prepared& s, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  const LayoutCase& c = s.c;
  ErrorTally t{"conv_backward", c.cp};
  try {
    const auto held = conv_run(s, o, halo, conv);  // keeps a fresh run alive
    const ConvRun& run = *held;
    for (std::size_t e = 0; e < run.dx.size(); ++e) {
      bool all = true;
      for (const auto& g : run.dx[e]) all = all && g.defined();
      const std::string tag = exchange_tag(kExchanges[e]);
      if (!all) {
        t.expect_close(run.ref.dx, Tensor(), kConvTolerance, "dx undefined on a rank" + tag);
        continue;
      }
      t.expect_close(run.ref.dx, cat(run.dx[e], 1), kConvTolerance, "dx" + tag);
      t.expect_close(run.ref.dw, run.dw[e], kConvTolerance, "dw summed over ranks" + tag);
      t.expect_close(run.ref.dbias, run.dbias[e], kConvTolerance, "dbias summed over ranks" + tag);
    }
    s.runs->conv.reset();  // the last row of the pair: its memory goes before the next row's
  } catch (...) {
    return threw("conv_backward", c.cp);
  }
  return t.result(kConvTolerance);
}

struct RecurrenceRun {
  RecurrenceReference ref;
  Tensor o, dq, dk, dv, dbeta, dg;  // gathered, in global order
  bool grads_defined = true;
};

namespace {

// out[:, i] = t[:, perm[i]].
Tensor permute_sequence(const Tensor& t, const std::vector<std::int64_t>& perm) {
  std::vector<Tensor> cols;
  for (std::int64_t p : perm) cols.push_back(narrow(t, 1, p, 1));
  return cat(cols, 1);
}

// One recurrence layer per rank, forward and backward. Contiguous: on each rank's
// packed context from shard_batch (the model's path). Zigzag (a negative control):
// on the permuted sequence, with contexts built here.
RecurrenceRun run_recurrence(const Prepared& s, const CheckOptions& opt, const RecurrenceFn& fn, Sharding sharding) {
  const LayoutCase& c = s.c;
  const std::int64_t B = s.shape.rows, S = s.shape.seq_len;
  const ReferenceGeometry g = reference_geometry(S, c.cp, sharding == Sharding::zigzag ? 2 : 1);
  const std::int64_t P = g.padded_len;
  const Tensor ids = reference_padded_doc_ids(s.truth, P);
  const RecurrenceInputs in = random_recurrence_inputs(B, P, opt.heads, opt.key_dim, opt.value_dim, mix_seed(c.seed, 51));
  const Tensor d_o = random_tensor({B, P, opt.heads, opt.value_dim}, DType::f64, mix_seed(c.seed, 52));
  RecurrenceRun run;
  run.ref = reference_recurrence(in, ids, d_o);
  // Sequence order the ranks see: identity, or zigzag chunks r and 2c-1-r.
  std::vector<std::int64_t> perm(P), inverse(P);
  for (std::int64_t i = 0; i < P; ++i) perm[i] = i;
  if (sharding == Sharding::zigzag) {
    const std::int64_t chunk = P / (2 * c.cp);
    std::int64_t at = 0;
    for (int r = 0; r < c.cp; ++r)
      for (std::int64_t ch : {static_cast<std::int64_t>(r), static_cast<std::int64_t>(2 * c.cp - 1 - r)})
        for (std::int64_t i = 0; i < chunk; ++i) perm[at++] = ch * chunk + i;
  }
  for (std::int64_t i = 0; i < P; ++i) inverse[perm[i]] = i;
  // Contiguous: the identity, so the global tensors themselves (no copies).
  const bool permuted = sharding == Sharding::zigzag;
  auto order = [&](const Tensor& t) { return permuted ? permute_sequence(t, perm) : t; };
  const Tensor ids_p = order(ids);
  const Tensor q = order(in.q), k = order(in.k), v = order(in.v), beta = order(in.beta), gg = order(in.g),
               up = order(d_o);
  std::vector<Tensor> o(c.cp), dq(c.cp), dk(c.cp), dv(c.cp), db(c.cp), dg(c.cp);
  run_ranks(c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    const PackedContext ctx =
        sharding == Sharding::contiguous ? s.context(r) : PackedContext(ids_p, g.start(r), c.cp, S);
    auto mine = [&](const Tensor& t) { return Var(on(comm, local(t, ctx)), true); };
    Var vq = mine(q), vk = mine(k), vv = mine(v), vb = mine(beta), vg = mine(gg);
    const Var out = fn(vq, vk, vv, vb, vg, ctx, &comm);
    backward(dot(out, local(up, ctx)));
    o[r] = host(out.value());
    dq[r] = host(vq.grad()), dk[r] = host(vk.grad()), dv[r] = host(vv.grad()), db[r] = host(vb.grad()),
    dg[r] = host(vg.grad());
  }, run_options(opt), {&o, &dq, &dk, &dv, &db, &dg});
  auto global = [&](const std::vector<Tensor>& parts) {
    for (const auto& t : parts)
      if (!t.defined()) {
        run.grads_defined = false;
        return Tensor();
      }
    return permuted ? permute_sequence(cat(parts, 1), inverse) : cat(parts, 1);
  };
  run.o = global(o);
  run.dq = global(dq), run.dk = global(dk), run.dv = global(dv), run.dbeta = global(db), run.dg = global(dg);
  return run;
}

std::shared_ptr<const RecurrenceRun> recurrence_run(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn,
                                                    Sharding sharding) {
  if (fn || sharding != Sharding::contiguous)
    return std::make_shared<RecurrenceRun>(run_recurrence(s, o, fn ? fn : default_recurrence(), sharding));
  if (!s.runs->recurrence) s.runs->recurrence = std::make_shared<RecurrenceRun>(run_recurrence(s, o, default_recurrence(), sharding));
  return s.runs->recurrence;
}

}  // namespace

PropertyResult recurrence_forward_of(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn, Sharding sharding) {
  const LayoutCase& c = s.c;
  ErrorTally t{"recurrence_forward", c.cp};
  try {
    const auto held = recurrence_run(s, o, fn, sharding);  // keeps a fresh run alive
    const RecurrenceRun& run = *held;
    t.expect_close(run.ref.o, run.o, kRecurrenceTolerance, "recurrence output o");
  } catch (...) {
    return threw("recurrence_forward", c.cp);
  }
  return t.result(kRecurrenceTolerance);
}

PropertyResult recurrence_backward_of(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn, Sharding sharding) {
  const LayoutCase& c = s.c;
  ErrorTally t{"recurrence_backward", c.cp};
  try {
    const auto held = recurrence_run(s, o, fn, sharding);  // keeps a fresh run alive
    const RecurrenceRun& run = *held;
    t.expect_close(run.ref.dq, run.dq, kRecurrenceTolerance, "dq");
    t.expect_close(run.ref.dk, run.dk, kRecurrenceTolerance, "dk");
    t.expect_close(run.ref.dv, run.dv, kRecurrenceTolerance, "dv");
    t.expect_close(run.ref.dbeta, run.dbeta, kRecurrenceTolerance, "dbeta");
    t.expect_close(run.ref.dg, run.dg, kRecurrenceTolerance, "dg");
    s.runs->recurrence.reset();  // the last row of the pair: its memory goes before the next row's
  } catch (...) {
    return threw("recurrence_backward", c.cp);
  }
  return t.result(kRecurrenceTolerance);
}

// ---------------------------------------------------------------------------
// The public checks: each prepares its case and runs one row's check.

namespace {
// A failed preparation (a reference that cannot read the batch) fails the property, never the harness.
template <class F>
PropertyResult prepared(const LayoutCase& c, const char* name, F&& f) {
  std::optional<Prepared> p;
  try {
    p.emplace(c);
  } catch (...) {
    return threw(name, c.cp, "could not prepare the case: ");
  }
  return f(*p);
}
}  // namespace

PropertyResult check_gather_forward(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather) {
  return prepared(c, "gather_forward", [&](Prepared& p) { return gather_forward_of(p, o, gather); });
}
PropertyResult check_gather_backward(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather) {
  return prepared(c, "gather_backward", [&](Prepared& p) { return gather_backward_of(p, o, gather); });
}
PropertyResult check_anchor(const LayoutCase& c, const CheckOptions& o, const GatherFn& gather, const AnchorFn& anchor) {
  return prepared(c, "anchor", [&](Prepared& p) { return anchor_of(p, o, gather, anchor); });
}
PropertyResult check_halo_forward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo) {
  return prepared(c, "halo_forward", [&](Prepared& p) { return halo_forward_of(p, o, halo); });
}
PropertyResult check_halo_backward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo) {
  return prepared(c, "halo_backward", [&](Prepared& p) { return halo_backward_of(p, o, halo); });
}
PropertyResult check_conv_forward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  return prepared(c, "conv_forward", [&](Prepared& p) { return conv_forward_of(p, o, halo, conv); });
}
PropertyResult check_conv_backward(const LayoutCase& c, const CheckOptions& o, const HaloFn& halo, const ConvFn& conv) {
  return prepared(c, "conv_backward", [&](Prepared& p) { return conv_backward_of(p, o, halo, conv); });
}
PropertyResult check_recurrence_forward(const LayoutCase& c, const CheckOptions& o, const RecurrenceFn& fn,
                                        Sharding sharding) {
  return prepared(c, "recurrence_forward", [&](Prepared& p) { return recurrence_forward_of(p, o, fn, sharding); });
}
PropertyResult check_recurrence_backward(const LayoutCase& c, const CheckOptions& o, const RecurrenceFn& fn,
                                         Sharding sharding) {
  return prepared(c, "recurrence_backward", [&](Prepared& p) { return recurrence_backward_of(p, o, fn, sharding); });
}

// ---------------------------------------------------------------------------
// The table.

namespace {

std::int64_t halo_bytes(const Prepared& p, const CheckOptions& o) {
  // Both exchanges, one rank: the all_gather of its tail, and every send_recv hop.
  const HaloPlan plan = halo_plan(p.g.local_len, o.conv_width, 0, p.c.cp);
  std::int64_t positions = p.c.cp > 1 ? plan.tail : 0;
  for (const HaloHop& hop : plan.hops) positions += hop.count;
  return positions * p.shape.rows * o.channels * 8;
}

}  // namespace

const std::vector<PropertyRow>& property_table() {
  static const std::vector<PropertyRow> rows = [] {
    const auto none = [](const Prepared&, const CheckOptions&) -> std::int64_t { return 0; };
    std::vector<PropertyRow> t;
    t.push_back({"layout", "doc ids, padding and positions of the layout (docs/layout.md); round trips; unpack_row_layout",
                 Comparison::bitwise, 0, false, none,
                 [](Prepared& p, const CheckOptions&) { return check_layout(p.c); }});
    t.push_back({"shard", "shards concatenate to the padded global tensors; contexts tile each shard",
                 Comparison::bitwise, 0, false, none, [](Prepared& p, const CheckOptions&) { return check_shard(p.c); }});
    t.push_back({"gather_forward", "gather_sequence is bitwise the global tensor, every dtype", Comparison::bitwise, 0,
                 true,
                 [](const Prepared& p, const CheckOptions& o) {
                   // f32, f64, bf16, i32, i64, bool shards as gather_forward_of draws them.
                   return p.shape.rows * p.g.local_len * (o.channels * 4 + 2 * 8 + o.channels * 2 + 3 * 4 + 8 + 4);
                 },
                 [](Prepared& p, const CheckOptions& o) { return gather_forward_of(p, o, default_gather()); }});
    t.push_back({"gather_backward", "each rank's gradient is the rank-order sum of the upstream slices",
                 Comparison::bitwise, 0, true,
                 [](const Prepared& p, const CheckOptions& o) {
                   return 2 * p.shape.rows * p.g.local_len * o.channels * (8 + 4) * p.c.cp;
                 },
                 [](Prepared& p, const CheckOptions& o) { return gather_backward_of(p, o, default_gather()); }});
    t.push_back({"anchor", "the anchor makes every rank run backward; without it the skip is reported",
                 Comparison::bitwise, 0, true,
                 [](const Prepared& p, const CheckOptions& o) {
                   return 2 * p.shape.rows * p.g.local_len * o.channels * 8 * p.c.cp;
                 },
                 [](Prepared& p, const CheckOptions& o) { return anchor_of(p, o, default_gather(), default_anchor()); }});
    t.push_back({"halo_forward", "convolution_history is the zero-padded previous W-1 positions", Comparison::bitwise, 0,
                 true, halo_bytes,
                 [](Prepared& p, const CheckOptions& o) { return halo_forward_of(p, o, default_halo()); }});
    t.push_back({"halo_backward", "history gradients return to the ranks that own the positions",
                 Comparison::tolerance, kConvTolerance, true,
                 [](const Prepared& p, const CheckOptions& o) { return 2 * halo_bytes(p, o); },
                 [](Prepared& p, const CheckOptions& o) { return halo_backward_of(p, o, default_halo()); }});
    t.push_back({"conv_forward", "the sharded packed causal conv matches the unsharded one", Comparison::tolerance,
                 kConvTolerance, true, halo_bytes,
                 [](Prepared& p, const CheckOptions& o) { return conv_forward_of(p, o, {}, {}); }});
    t.push_back({"conv_backward", "dx, and dw, dbias summed over ranks, match the unsharded conv",
                 Comparison::tolerance, kConvTolerance, true,
                 [](const Prepared& p, const CheckOptions& o) { return 2 * halo_bytes(p, o); },
                 [](Prepared& p, const CheckOptions& o) { return conv_backward_of(p, o, {}, {}); }});
    t.push_back({"recurrence_forward", "the CP gated delta rule matches the unsharded recurrence (o)",
                 Comparison::tolerance, kRecurrenceTolerance, true,
                 [](const Prepared& p, const CheckOptions& o) {
                   return recurrence_state_bytes(p.shape.rows, o.heads, o.key_dim, o.value_dim);
                 },
                 [](Prepared& p, const CheckOptions& o) { return recurrence_forward_of(p, o, {}, Sharding::contiguous); }});
    t.push_back({"recurrence_backward", "gradients of q, k, v, beta, g match the unsharded recurrence",
                 Comparison::tolerance, kRecurrenceTolerance, true,
                 [](const Prepared& p, const CheckOptions& o) {
                   return 2 * recurrence_state_bytes(p.shape.rows, o.heads, o.key_dim, o.value_dim);
                 },
                 [](Prepared& p, const CheckOptions& o) { return recurrence_backward_of(p, o, {}, Sharding::contiguous); }});
    return t;
  }();
  return rows;
}

std::vector<PropertyResult> check_all(const LayoutCase& c, const CheckOptions& o) {
  std::vector<PropertyResult> out;
  std::optional<Prepared> p;
  std::exception_ptr why;
  try {
    p.emplace(c);
  } catch (...) {
    why = std::current_exception();
  }
  for (const PropertyRow& row : property_table())
    out.push_back(p ? row.check(*p, o) : threw(row.name, c.cp, "could not prepare the case: ", why));
  return out;
}

}  // namespace cpsim::verify
