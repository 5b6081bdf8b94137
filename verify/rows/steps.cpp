// The two-step row: a training loop reuses its rank objects across steps (the
// packed context is reassigned from batch to batch, as a `step` variable is), so
// state kept from the last batch (a cache keyed by row, a plan, a buffer) must not
// leak into the next. Each rank runs the recurrence on the case's batch, then,
// with the same context object reassigned, on a second batch of the same shape
// with another layout, then on the first again; at each step the segments its
// context gives of each row of its shard (row_cu_seqlens, cached per row: what
// FLA's CP context hands a kernel as cu_seqlens) are those of that step's batch.
#include <cmath>

#include "core/recurrence.hpp"
#include "verify/rows/common.hpp"
#include "verify/rows/inputs.hpp"

namespace cpsim::verify {

using namespace rows;

namespace {

const RowHead kTwoSteps{.name = "two_steps",
    .claim = "rank objects reused across steps (the packed context reassigned) keep no state from the last batch",
    .comparison = Comparison::tolerance,
    .tolerance = kRecurrenceTolerance,
    .runs_ranks = true,
    .cost = {.bytes_per_token = recurrence_bytes, .us_per_token = 2.0, .us_per_token_per_rank = 0.1}};

// The second step's batch: the rows of the case, as documents of three tokens.
Batch second_step(const Prepared& s) {
  const std::int64_t B = s.shape.rows, S = s.shape.seq_len, D = (S + 2) / 3;
  Batch b;
  Tensor lens({B, D}, DType::i64), ids({B, S}, DType::i64);
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t d = 0; d < D; ++d) lens.set(r * D + d, static_cast<double>(std::min<std::int64_t>(3, S - 3 * d)));
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids.set(i, static_cast<double>(1 + i % 5));
  b["seq_lens"] = lens;
  b["input_ids"] = ids;
  return b;
}

}  // namespace

static PropertyResult two_steps_of(Prepared& s, const CheckOptions& o, const RecurrenceFn& fn) {
  const LayoutCase& c = s.c;
  ToleranceTally t;
  LayoutCase c2 = c;
  c2.batch = second_step(s);
  c2.truth.reset();
  const Prepared s2(c2);
  const Prepared* steps[] = {&s, &s2, &s};
  struct Step {
    RecurrenceInputs in;
    Tensor ids;
    Tensor ref;
    // Each rank's segments of its shard of each row, as the shard row holds
    // row_cu_seqlens to them: [rank][row].
    std::vector<std::vector<std::vector<std::int64_t>>> segments;
  };
  std::vector<Step> data;
  for (int k = 0; k < 2; ++k) {
    const Prepared& p = *steps[k];
    Step d{inputs::step_recurrence(p.shape.rows, p.g.padded_len, o, k, c.seed),
           reference_padded_doc_ids(p.truth, p.g.padded_len), Tensor(),
           std::vector<std::vector<std::vector<std::int64_t>>>(c.cp)};
    d.ref = reference_recurrence(d.in, d.ids, Tensor()).o;
    for (std::int64_t b = 0; b < p.shape.rows; ++b) {
      const auto ids = reference_padded_doc_ids_row(p.truth, static_cast<int>(b), p.g.padded_len);
      for (int r = 0; r < c.cp; ++r) d.segments[r].push_back(reference_cp_context(ids, p.g, r).cu_seqlens);
    }
    data.push_back(std::move(d));
  }
  std::vector<std::vector<Tensor>> outs(3, std::vector<Tensor>(c.cp));
  // Per step and rank, the first row whose cached segments are not its batch's
  // (-1: none), a tensor so that a job's ranks send it back.
  std::vector<std::vector<Tensor>> stale(3, std::vector<Tensor>(c.cp));
  std::vector<Input> inputs;
  for (const Step& d : data)
    for (const Tensor* t : {&d.in.q, &d.in.k, &d.in.v, &d.in.beta, &d.in.g}) inputs.push_back({"of the recurrence", t});
  run_reading(inputs, c.cp, [&](Communicator& comm) {
    const int r = comm.rank();
    PackedContext ctx;  // one object, reassigned every step
    for (int k = 0; k < 3; ++k) {
      ctx = steps[k]->context(r);
      const RecurrenceInputs& in = data[k % 2].in;
      auto mine = [&](const Tensor& x) { return Var(on(comm, local(x, ctx)), false); };
      const Var out = fn(mine(in.q), mine(in.k), mine(in.v), mine(in.beta), mine(in.g), ctx, &comm);
      outs[k][r] = host(out.value());
      const auto& want = data[k % 2].segments[r];
      Tensor first({1}, DType::f64);
      first.set(0, -1.0);
      for (int b = static_cast<int>(want.size()) - 1; b >= 0; --b)
        if (ctx.row_cu_seqlens(b) != want[b]) first.set(0, static_cast<double>(b));
      stale[k][r] = first;
    }
  }, run_options(o), {&outs[0], &outs[1], &outs[2], &stale[0], &stale[1], &stale[2]});
  const char* what[] = {"step 1 (the case)", "step 2 (documents of 3 tokens)", "step 3 (the case again)"};
  for (int k = 0; k < 3; ++k) {
    bool all = true;
    for (const Tensor& x : outs[k]) all = all && x.defined();
    t.expect_close(data[k % 2].ref, all ? cat(outs[k], 1) : Tensor(), kTwoSteps.tolerance,
                   std::string(what[k]) + ": recurrence o");
    for (int r = 0; r < c.cp && t.why.empty(); ++r)
      if (stale[k][r].defined() && stale[k][r].get(0) >= 0)
        t.why = std::string(what[k]) + ": rank " + std::to_string(r) + "'s context gives row " +
                std::to_string(static_cast<std::int64_t>(stale[k][r].get(0))) +
                " segments that are not this step's batch's (row_cu_seqlens kept from an earlier step?)";
  }
  return t.result(kTwoSteps.tolerance);
}


namespace rows {

std::vector<PropertyRow> step_rows() {
  return {kTwoSteps.with(
      [](const Prepared& p, const CheckOptions& o) {
        return 3 * recurrence_state_bytes(p.shape.rows, o.heads, o.key_dim, o.value_dim);
      },
      [](Prepared& p, const CheckOptions& o, const Impl& impl) {
        return two_steps_of(p, o, or_default(impl.recurrence, default_recurrence));
      })};
}

}  // namespace rows

}  // namespace cpsim::verify
