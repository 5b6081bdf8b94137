// The recurrence rows: the CP gated delta rule forward and backward.
#include "core/recurrence.hpp"

#include "verify/golden_build.hpp"
#include "verify/rows/common.hpp"
#include "verify/rows/inputs.hpp"

namespace cpsim::verify {

using namespace rows;

struct RecurrenceRun {
  RecurrenceReference ref;
  Tensor o, dq, dk, dv, dbeta, dg;  // gathered, in global order
  bool grads_defined = true;
};

namespace {

const RowHead kRecurrenceForward{.name = "recurrence_forward",
    .claim = "the CP gated delta rule matches the unsharded recurrence (o)",
    .comparison = Comparison::tolerance,
    .tolerance = kRecurrenceTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = recurrence_bytes, .us_per_token = 2.7, .us_per_token_per_rank = 0.15}};
const RowHead kRecurrenceBackward{.name = "recurrence_backward",
    .claim = "gradients of q, k, v, beta, g match the unsharded recurrence",
    .comparison = Comparison::tolerance,
    .tolerance = kRecurrenceTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = recurrence_bytes, .us_per_token = 0.12, .us_per_token_per_rank = 0}};

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
  const inputs::Recurrence drawn = inputs::recurrence(B, P, opt, c.seed);
  const RecurrenceInputs& in = drawn.in;
  const Tensor& d_o = drawn.grad_o;
  RecurrenceRun run;
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
  const std::vector<Input> inputs = {{"q", &q}, {"k", &k}, {"v", &v}, {"beta", &beta}, {"g", &gg}, {"up", &up}};
  run_reading(inputs, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    const PackedContext ctx =
        sharding == Sharding::contiguous ? s.context(r) : PackedContext(ids_p, ShardPlan{g.cuts}, r, S);
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
  o = dq = dk = dv = db = dg = {};
  // After the ranks' run (run_reading checked that their inputs are unchanged):
  // the reference's results are not held through the ranks' peak.
  run.ref = reference_recurrence(in, ids, d_o);
  return run;
}

std::shared_ptr<const RecurrenceRun> recurrence_run(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn,
                                                    Sharding sharding) {
  if (fn || sharding != Sharding::contiguous)
    return std::make_shared<RecurrenceRun>(run_recurrence(s, o, or_default(fn, default_recurrence), sharding));
  if (!s.runs->recurrence) s.runs->recurrence = std::make_shared<RecurrenceRun>(run_recurrence(s, o, default_recurrence(), sharding));
  return s.runs->recurrence;
}

}  // namespace

static PropertyResult recurrence_forward_of(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn, Sharding sharding) {
  ToleranceTally t;
  const auto held = recurrence_run(s, o, fn, sharding);  // keeps a fresh run alive
  const RecurrenceRun& run = *held;
  t.expect_close(run.ref.o, run.o, kRecurrenceForward.tolerance, "recurrence output o");
  return t.result(kRecurrenceForward.tolerance);
}

static PropertyResult recurrence_backward_of(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn, Sharding sharding) {
  ToleranceTally t;
  const auto held = recurrence_run(s, o, fn, sharding);  // keeps a fresh run alive
  const RecurrenceRun& run = *held;
  t.expect_close(run.ref.dq, run.dq, kRecurrenceBackward.tolerance, "dq");
  t.expect_close(run.ref.dk, run.dk, kRecurrenceBackward.tolerance, "dk");
  t.expect_close(run.ref.dv, run.dv, kRecurrenceBackward.tolerance, "dv");
  t.expect_close(run.ref.dbeta, run.dbeta, kRecurrenceBackward.tolerance, "dbeta");
  t.expect_close(run.ref.dg, run.dg, kRecurrenceBackward.tolerance, "dg");
  s.runs->recurrence.reset();  // the last row of the pair: its memory goes before the next row's
  return t.result(kRecurrenceBackward.tolerance);
}



namespace rows {

namespace {

// The recurrence's inputs, its unsharded output and gradients, and each rank's
// slices and states.
void recurrence_golden(GoldenBuild& build) {
  inputs::Recurrence drawn = inputs::recurrence(build.B, build.P, build.o, build.c.seed);
  RecurrenceInputs& in = drawn.in;
  for (Tensor* t : {&in.q, &in.k, &in.v, &in.beta, &in.g}) *t = build.low(*t);
  const Tensor d_o = build.low(drawn.grad_o);
  build.inputs.add("q", in.q, "recurrence queries [B, P, H, K]", "§3");
  build.inputs.add("k", in.k, "recurrence keys [B, P, H, K], normalised", "§3");
  build.inputs.add("v", in.v, "recurrence values [B, P, H, V]", "§3");
  build.inputs.add("beta", in.beta, "recurrence beta [B, P, H], in (0, 1)", "§3");
  build.inputs.add("g", in.g, "recurrence log-decay [B, P, H, K], <= 0", "§3");
  build.inputs.add("recurrence_grad_o", d_o, "upstream gradient of o [B, P, H, V]", "§3");
  const RecurrenceReference rec = reference_recurrence(in, build.ids, d_o);
  const std::vector<std::pair<std::string, Tensor>> grads = {
      {"dq", rec.dq}, {"dk", rec.dk}, {"dv", rec.dv}, {"dbeta", rec.dbeta}, {"dg", rec.dg}};
  build.ref.add("o", rec.o, "recurrence output [B, P, H, V]", "§3");
  for (const auto& [name, t] : grads) build.ref.add(name, t, "recurrence gradient " + name, "§3");
  for (int r = 0; r < build.c.cp; ++r) {
    GoldenFile& rank = build.ranks[r];
    rank.add("o", build.slice(rec.o, r), "this rank's recurrence output [B, L, H, V]", "§3");
    for (const auto& [name, t] : grads) rank.add(name, build.slice(t, r), "this rank's recurrence gradient " + name, "§3");
    const RecurrenceStates states = reference_recurrence_states(in, build.ids, build.g.start(r), build.g.size(r));
    rank.add("recurrence_initial_state", states.initial,
             "the state [B, H, K, V] this rank's first token starts from: the fold of the earlier ranks' transitions "
             "over pre_num_ranks (0 where a segment starts at the shard; every recurrence_* key is 0 on a rank "
             "with an empty interval)",
             "§3");
    rank.add("recurrence_final_state", states.final_state, "the state [B, H, K, V] after this rank's last token", "§3");
    rank.add("recurrence_transition_m", states.m,
             "M [B, H, K, K] of this rank's last local segment (from its first local token, from a zero state): "
             "S_out = M S_in + S_ext, what the rank publishes in the all-gather",
             "§3");
    rank.add("recurrence_transition_s_ext", states.s_ext, "S_ext [B, H, K, V] of this rank's last local segment", "§3");
  }
}

}  // namespace

// Every token's state (for backward) and the inputs' gradients (a rank reads its
// inputs in place; the reference, with its states of one head, runs after the
// ranks): one run serves both rows. Two steps (two batches' inputs, three steps'
// outputs and two forward references, with no backward) fit within it.
double recurrence_bytes(const RowShapes& s) {
  return s.states() + 0.5 * (s.in() + s.out()) + 8 * s.K * s.V + 600 + 40 * s.cp;
}

std::vector<PropertyRow> recurrence_rows() {
  const auto states = [](const Prepared& p, const CheckOptions& o) {
    return recurrence_state_bytes(p.shape.rows, o.heads, o.key_dim, o.value_dim);
  };
  return {kRecurrenceForward.with(states,
                                  [](Prepared& p, const CheckOptions& o, const Impl& impl) {
                                    return recurrence_forward_of(p, o, impl.recurrence, impl.sharding);
                                  },
                                  recurrence_golden),
          kRecurrenceBackward.with([=](const Prepared& p, const CheckOptions& o) { return 2 * states(p, o); },
                                   [](Prepared& p, const CheckOptions& o, const Impl& impl) {
                                     return recurrence_backward_of(p, o, impl.recurrence, impl.sharding);
                                   })};
}

}  // namespace rows

}  // namespace cpsim::verify
