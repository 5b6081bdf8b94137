#include "core/recurrence.hpp"

#include <cstring>
#include <vector>

#include "core/kernels/recurrence.hpp"
#include "core/exchange_plan.hpp"

namespace cpsim {

namespace {

// Every row's plan, flattened for the kernel: built on the host, then copied to
// the device the inputs live on.
struct FlatPlan {
  std::vector<std::int64_t> segments, seg_at{0}, fold_fwd, fwd_at{0}, fold_bwd, bwd_at{0}, transition_segment;
  std::vector<std::uint8_t> publishes;
  explicit FlatPlan(const std::vector<RecurrencePlan>& plans) {
    for (const RecurrencePlan& p : plans) {
      segments.insert(segments.end(), p.segments.begin(), p.segments.end());
      seg_at.push_back(static_cast<std::int64_t>(segments.size()));
      fold_fwd.insert(fold_fwd.end(), p.fold_forward.begin(), p.fold_forward.end());
      fwd_at.push_back(static_cast<std::int64_t>(fold_fwd.size()));
      fold_bwd.insert(fold_bwd.end(), p.fold_backward.begin(), p.fold_backward.end());
      bwd_at.push_back(static_cast<std::int64_t>(fold_bwd.size()));
      transition_segment.push_back(static_cast<std::int64_t>(p.transition_segment));
      publishes.push_back(static_cast<std::uint8_t>((p.publishes_transition ? 1 : 0) | (p.publishes_state_gradient ? 2 : 0)));
    }
  }
  // The plan's arrays on `device`; the view points into them.
  std::vector<Tensor> arrays;
  kernels::RecurrencePlanView on(Device device) {
    arrays.clear();
    auto put = [&](const auto& v, DType dtype) {
      Tensor t({static_cast<std::int64_t>(v.size())}, dtype);
      if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * sizeof(v[0]));
      arrays.push_back(device.is_cpu() ? t : t.to(device));
      return arrays.back().raw();
    };
    const auto i64 = [&](const std::vector<std::int64_t>& v) { return static_cast<const std::int64_t*>(put(v, DType::i64)); };
    kernels::RecurrencePlanView view{};
    view.segments = i64(segments), view.seg_at = i64(seg_at);
    view.fold_fwd = i64(fold_fwd), view.fwd_at = i64(fwd_at);
    view.fold_bwd = i64(fold_bwd), view.bwd_at = i64(bwd_at);
    view.transition_segment = i64(transition_segment);
    static_assert(sizeof(bool) == sizeof(std::uint8_t));
    view.publishes = static_cast<const std::uint8_t*>(put(publishes, DType::b8));
    return view;
  }
};

// Every rank's block, all-gathered (every rank takes part, even with nothing to send).
Tensor exchange(Communicator* comm, const Tensor& mine) {
  if (!is_distributed(comm)) return mine;
  Tensor all({comm->size() * mine.numel()}, DType::f64, mine.device());
  comm->all_gather(mine.raw(), all.raw(), static_cast<std::size_t>(mine.numel()), DType::f64);
  return all;
}

double* f64(Tensor& t) { return static_cast<double*>(t.raw()); }
const double* f64(const Tensor& t) { return static_cast<const double*>(t.raw()); }

}  // namespace

Var gated_delta_rule(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g,
                     const PackedContext& context, Communicator* comm, const RecurrencePlanEdit& edit) {
  const Tensor &Q = q.value(), &Kt = k.value(), &Vt = v.value(), &Bt = beta.value(), &G = g.value();
  CPSIM_ENFORCE(Q.ndim() == 4 && Q.dtype() == DType::f64, "gated_delta_rule takes float64 q [B, L, H, K]");
  const std::int64_t B = Q.dim(0), L = Q.dim(1), H = Q.dim(2), K = Q.dim(3), V = Vt.dim(3);
  CPSIM_ENFORCE(Kt.shape() == Q.shape() && G.shape() == Q.shape() && Bt.shape() == Shape({B, L, H}) &&
                    Vt.shape() == Shape({B, L, H, V}) && L == context.local_seq_len(),
                "gated_delta_rule shapes disagree");
  const int c = comm ? comm->size() : 1, r = comm ? comm->rank() : 0;
  CPSIM_ENFORCE(c == context.cp_size() && r == context.rank(), "communicator rank ", r, " of ", c,
                " runs the packed context of rank ", context.rank(), " of ", context.cp_size());

  std::vector<RecurrencePlan> plans;
  for (std::int64_t b = 0; b < B; ++b) {
    plans.push_back(recurrence_plan(build_fla_cp_context(context, static_cast<int>(b)), context.plan(), r));
    if (edit) edit(plans.back(), r, static_cast<int>(b));
  }
  auto plan = std::make_shared<FlatPlan>(plans);
  const Device device = Q.device();
  for (const Tensor* t : {&Kt, &Vt, &Bt, &G})
    CPSIM_ENFORCE(t->device() == device, "gated_delta_rule: inputs on ", device.str(), " and ", t->device().str());
  const std::int64_t block = H * K * (K + V);
  Tensor work({B * H * kernels::recurrence_workspace(L, K, V)}, DType::f64, device);
  Tensor mine({B * block}, DType::f64, device), S0({B, H, K, V}, DType::f64, device),
      M_first({B, H, K, K}, DType::f64, device), o({B, L, H, V}, DType::f64, device);
  kernels::RecurrenceArgs a{};
  a.B = B, a.L = L, a.H = H, a.K = K, a.V = V;
  a.q = f64(Q), a.k = f64(Kt), a.v = f64(Vt), a.beta = f64(Bt), a.g = f64(G);
  a.plan = plan->on(device);
  a.work = f64(work), a.mine = f64(mine), a.S0 = f64(S0), a.M_first = f64(M_first), a.o = f64(o);
  const auto& run = kernels::kernels_for(device);
  run.recurrence_pass(a, kernels::RecurrenceStep::publish, kernels::current_stream());  // (M, S_ext) of the published segment
  const Tensor all = exchange(comm, mine);
  a.all = f64(all);
  run.recurrence_pass(a, kernels::RecurrenceStep::forward, kernels::current_stream());  // fold, then every segment

  return record(o, "gated_delta_rule", {q, k, v, beta, g},
                [=, plan = plan, keep = std::vector<Tensor>{work, S0, M_first}](const Tensor& d_o) {  // a points into plan and keep
                  Tensor gq(Q.shape(), DType::f64, device), gk(Q.shape(), DType::f64, device),
                      gv(Vt.shape(), DType::f64, device), gb(Bt.shape(), DType::f64, device),
                      gg(Q.shape(), DType::f64, device), mine_b({B * block}, DType::f64, device);
                  kernels::RecurrenceArgs ab = a;
                  ab.mine = f64(mine_b);
                  ab.d_o = f64(d_o);
                  ab.gq = f64(gq), ab.gk = f64(gk), ab.gv = f64(gv), ab.gbeta = f64(gb), ab.gg = f64(gg);
                  const auto& k2 = kernels::kernels_for(device);
                  // Every segment with d_o alone; publish [M_first^T | dS] of first segments
                  // that began on earlier ranks.
                  k2.recurrence_pass(ab, kernels::RecurrenceStep::backward_local, kernels::current_stream());
                  const Tensor all_b = exchange(comm, mine_b);
                  // Fold the successors' state gradients into the published segment's end and
                  // add that segment's response to them (backward is linear in its gradients).
                  ab.all = f64(all_b);
                  ab.d_o = nullptr;
                  k2.recurrence_pass(ab, kernels::RecurrenceStep::backward_fold, kernels::current_stream());
                  return std::vector<Tensor>{gq, gk, gv, gb, gg};
                });
}

}  // namespace cpsim
