#include "verify/generators.hpp"

namespace cpsim::verify {

rc::Gen<PlanSpec> gen_plan_spec(int cp) {
  using namespace rc;
  // Weights 0 (an empty interval) as often as not; shrinking goes to equal.
  auto weight = gen::weightedOneOf<int>({{2, gen::just(0)}, {3, gen::inRange(1, 5)}});
  return gen::mapcat(gen::weightedOneOf<int>({{2, gen::just(0)}, {1, gen::just(1)}, {2, gen::just(2)}}), [=](int kind) {
    return gen::build<PlanSpec>(gen::set(&PlanSpec::kind, gen::just(static_cast<PlanChoice::Kind>(kind))),
                                gen::set(&PlanSpec::attention, gen::inRange(0, 3)),
                                gen::set(&PlanSpec::linear, gen::inRange(0, 3)),
                                gen::set(&PlanSpec::weights, gen::container<std::vector<int>>(cp, weight)));
  });
}

PlanSpec plan_spec_of(const PlanChoice& c) {
  CPSIM_ENFORCE(c.kind != PlanChoice::Kind::cuts, "a generator draws lengths: fixed cuts cannot fit them");
  PlanSpec s;
  s.kind = c.kind;
  s.attention = static_cast<int>(c.cost.attention);
  s.linear = static_cast<int>(c.cost.linear);
  return s;
}

namespace {

// One of `values`, each as often as any other whatever the generator size
// (gen::inRange scales with it), shrinking towards the first (gen::elementOf
// does not shrink).
rc::Gen<int> uniform_element(const std::vector<int>& values) {
  const std::size_t n = values.size();
  const rc::Gen<std::size_t> index = [n](const rc::Random& random, int /*size*/) {
    const auto i = static_cast<std::size_t>(rc::Random(random).next() % n);
    return rc::shrinkable::shrinkRecur(i, [](std::size_t x) { return rc::shrink::towards<std::size_t>(x, 0); });
  };
  return rc::gen::map(index, [values](std::size_t i) { return values[i]; });
}

rc::Gen<LayoutSpec> layout_spec_at(const rc::Gen<int>& cp_size, const PlanDraw& draw, const DrawLimits& limits = {}) {
  using namespace rc;
  const int min_shard = limits.min_shard;
  // A form index, or one of the allowed forms (each as often as any other).
  // Replicas that each take rows of one batch want [B, S] rows: no THD form (one row).
  const int rows_multiple = std::max(1, limits.rows_multiple);
  const auto thd_form = [](LayoutForm f) {
    return f == LayoutForm::cu_seqlens || f == LayoutForm::cu_seqlens_only || f == LayoutForm::cu_seqlens_padded_only;
  };
  std::vector<int> allowed;
  for (LayoutForm f : limits.forms)
    if (rows_multiple == 1 || !thd_form(f)) allowed.push_back(static_cast<int>(f));
  if (rows_multiple > 1 && limits.forms.empty())
    for (int f = 0; f < kLayoutForms; ++f)
      if (!thd_form(static_cast<LayoutForm>(f))) allowed.push_back(f);
  CPSIM_ENFORCE(!allowed.empty() || limits.forms.empty(),
                "rows in multiples of " + std::to_string(rows_multiple) + " need a row form; the forms given are THD "
                "forms (one row)");
  const Gen<int> form_index = allowed.empty() ? gen::inRange(0, kLayoutForms) : uniform_element(allowed);
  const int long_every = limits.long_every, mrope_every = limits.mrope_every;
  const int per_rank = limits.long_per_rank ? 1 : 0;
  const int long_min = limits.long_min, long_max = limits.long_max;
  const bool interior_gaps = limits.interior_gaps;
  // A forms filter is obeyed to the letter: its row forms come as [B, S] rows;
  // only THD forms (a collator's [S] stream) draw 1-D rows then.
  const bool filtered = !limits.forms.empty() || rows_multiple > 1;
  return gen::mapcat(gen::pair(cp_size, form_index), [draw, min_shard, long_every, long_min, long_max, per_rank,
                                                       mrope_every, filtered, rows_multiple,
                                                       interior_gaps](std::pair<int, int> cp_form) {
    const int cp = cp_form.first;
    const auto form = static_cast<LayoutForm>(cp_form.second);
    // Short rows relative to c give shards shorter than a conv window and all-padding shards.
    // (At least min_shard tokens a rank: S > cp * (min_shard - 1), the same spread above.)
    const int shortest = cp * (min_shard - 1) + 1;
    const Gen<int> short_length = gen::inRange(shortest, shortest + cp * 6 + 9);
    // A failure in a long draw shrinks towards the short ones (the first choice).
    const int scale = per_rank ? cp : 1;
    const Gen<int> length = long_every > 0 ? gen::weightedOneOf<int>({{long_every - 1, short_length},
                                                                      {1, gen::inRange(std::max(shortest, scale * long_min),
                                                                                      std::max(shortest, scale * long_max) + 1)}})
                                           : short_length;
    return gen::mapcat(length, [cp, form, draw, mrope_every, filtered, rows_multiple, interior_gaps](int S) {
      const int L = (S + cp - 1) / cp;
      // Lengths biased to the shard length (edges hit exactly), to 1, and to long spans.
      auto len = gen::weightedOneOf<int>({{5, gen::inRange(0, 2 * L + 2)},
                                          {2, gen::just(L)},
                                          {2, gen::just(1)},
                                          {1, gen::inRange(0, S + 1)}});
      auto extra = gen::weightedOneOf<int>({{3, gen::just(0)}, {1, gen::inRange(1, 4)}});
      auto doc = gen::build<DocSpec>(gen::set(&DocSpec::real, len), gen::set(&DocSpec::extra, extra));
      const bool thd = form == LayoutForm::cu_seqlens || form == LayoutForm::cu_seqlens_only ||
                       form == LayoutForm::cu_seqlens_padded_only;
      auto rows = thd ? gen::just(1)
                 : rows_multiple > 1 ? gen::map(gen::inRange(1, 4), [rows_multiple](int k) { return k * rows_multiple; })
                                     : gen::inRange(1, 4);
      return gen::mapcat(rows, [=](int B) {
        return gen::build<LayoutSpec>(
            gen::set(&LayoutSpec::cp, gen::just(cp)), gen::set(&LayoutSpec::form, gen::just(form)),
            gen::set(&LayoutSpec::plan, draw ? gen::just(plan_spec_of(*draw)) : gen_plan_spec(cp)),
            gen::set(&LayoutSpec::seq_len, gen::just(S)),
            gen::set(&LayoutSpec::rows, gen::container<std::vector<std::vector<DocSpec>>>(
                                            B, gen::resize(12, gen::container<std::vector<DocSpec>>(doc)))),
            gen::set(&LayoutSpec::row_pads,
                     gen::container<std::vector<std::pair<int, int>>>(
                         B, gen::pair(gen::weightedOneOf<int>({{2, gen::just(0)}, {1, gen::inRange(0, S + 1)}}),
                                      gen::weightedOneOf<int>({{2, gen::just(0)}, {1, gen::inRange(0, S + 1)}})))),
            // A category, drawn uniformly at every size (inRange favours its low end at small sizes).
            gen::set(&LayoutSpec::mask_kind,
                     gen::element(MaskKind::padding_mask, MaskKind::attention_mask, MaskKind::none)), gen::set(&LayoutSpec::absorb_tail, gen::arbitrary<bool>()),
            gen::set(&LayoutSpec::give_positions, gen::arbitrary<bool>()),
            gen::set(&LayoutSpec::give_loss_mask, gen::arbitrary<bool>()),
            gen::set(&LayoutSpec::pad_token_id, gen::inRange(0, 6)), gen::set(&LayoutSpec::cu_sentinels, gen::inRange(0, 3)),
            gen::set(&LayoutSpec::token_type_ids, gen::arbitrary<bool>()),
            gen::set(&LayoutSpec::one_dimensional, filtered && !thd ? gen::just(false) : gen::arbitrary<bool>()),
            gen::set(&LayoutSpec::eos_is_pad, gen::arbitrary<bool>()),
            gen::set(&LayoutSpec::mrope, mrope_every > 0 ? gen::weightedOneOf<bool>({{static_cast<std::size_t>(mrope_every - 1), gen::just(false)},
                                                                                     {1, gen::just(true)}})
                                                         : gen::just(false)),
            gen::set(&LayoutSpec::image_spans, mrope_every > 0 ? gen::just(std::optional<ImageSpans>(ImageSpans{}))
                                                               : gen::just(std::optional<ImageSpans>())),
            gen::set(&LayoutSpec::seed, gen::arbitrary<std::uint64_t>()),
            // Last: without interior gaps the draws before it are those of every earlier release.
            gen::set(&LayoutSpec::row_gaps,
                     interior_gaps ? gen::container<std::vector<std::pair<int, int>>>(
                                         B, gen::pair(gen::inRange(1, std::max(2, S / 2 + 1)),
                                                      gen::weightedOneOf<int>({{1, gen::just(0)}, {2, gen::inRange(1, 5)}})))
                                   : gen::just(std::vector<std::pair<int, int>>{})));
      });
    });
  });
}

}  // namespace

DrawLimits fuzz_draw_limits() {
  DrawLimits limits;
  limits.long_every = 8;
  limits.mrope_every = 6;
  limits.interior_gaps = true;
  return limits;
}

rc::Gen<int> gen_cp_size(const std::vector<int>& sizes) {
  CPSIM_ENFORCE(!sizes.empty(), "a list of CP sizes to draw from is empty");
  return uniform_element(sizes);
}

rc::Gen<LayoutSpec> gen_layout_spec(int max_cp, const PlanDraw& draw, const DrawLimits& limits) {
  return layout_spec_at(rc::gen::inRange(1, max_cp + 1), draw, limits);
}

rc::Gen<LayoutSpec> gen_layout_spec(const std::vector<int>& cp_sizes, const PlanDraw& draw, const DrawLimits& limits) {
  CPSIM_ENFORCE(limits.min_shard >= 1, "the shortest shard a generator draws is at least 1 token");
  return layout_spec_at(gen_cp_size(cp_sizes), draw, limits);
}

rc::Gen<LayoutCase> gen_layout_case(int max_cp, const PlanDraw& plan, const DrawLimits& limits) {
  return rc::gen::map(gen_layout_spec(max_cp, plan, limits), build_case);
}

rc::Gen<LayoutCase> gen_layout_case(const std::vector<int>& cp_sizes, const PlanDraw& plan, const DrawLimits& limits) {
  return rc::gen::map(gen_layout_spec(cp_sizes, plan, limits), build_case);
}

}  // namespace cpsim::verify
