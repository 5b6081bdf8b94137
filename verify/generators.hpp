// RapidCheck generators for packed batches covering SPEC §5: documents crossing
// one or many shard edges, boundaries exactly on edges, length-1 documents,
// all-padding shards, shards shorter than W-1, EOS = PAD, left padding, S not
// divisible by c, rows with different document counts, c from 1 to max_cp.
// Generation draws a LayoutSpec (so shrinking works on plain numbers) and maps
// it through build_case.
#pragma once

#include <optional>
#include <rapidcheck.h>
#include <vector>

#include "verify/cases.hpp"

namespace cpsim::verify {

// Which shard plans a generator gives its cases: one choice for all (a plan file's
// fixed cuts cannot fit drawn lengths), or (nullopt) a drawn one: equal intervals,
// the balanced plan of a drawn cost, or drawn cuts with empty intervals.
using PlanDraw = std::optional<PlanChoice>;
rc::Gen<PlanSpec> gen_plan_spec(int cp);
// A fixed equal or balanced choice as the spec that gives it.
PlanSpec plan_spec_of(const PlanChoice& choice);
// What a library's contract limits a random draw to: the forms its batches come
// in (empty: every form; given, their row forms come as [B, S] rows only, THD
// forms as [S] or [1, S]), and the shortest shard (every row at least
// cp * (min_shard - 1) + 1 tokens long, so every rank of the equal plan holds at
// least min_shard positions: FLA's CP convolution takes ranks of W - 1 tokens).
struct DrawLimits {
  std::vector<LayoutForm> forms;
  int min_shard = 1;
  // 1 in `long_every` draws (0: none) is a long sequence, long_min to long_max
  // tokens (fuzz: 512 to 2048; its tensors pass 64 KiB, so the host memory cache
  // keeps the blocks one property row frees and hands them to the next rows, of
  // other shapes, and a balanced plan's cuts part from the equal ones over its
  // padding gaps). The harness draws them for torch steps too: long documents,
  // shards that span several kernel chunks.
  int long_every = 0;
  int long_min = 512, long_max = 2048;
  // The long lengths are a rank's: a long draw is cp x long_min to cp x long_max
  // tokens, so that every rank's shard spans the same kernel chunks at every CP
  // size (a kernel's chunk carried inside a rank).
  bool long_per_rank = false;
  // 1 in `mrope_every` draws (0: none; not position resets) gives mRoPE's [3, B, S]
  // position_ids with image-token spans as grids (docs/layout.md): cpsim's own
  // operators take them; a torch step opts in through an mRoPE family.
  int mrope_every = 0;
  // Every layout a multiple of this many rows (> 1: [B, S] row forms only, B =
  // rows_multiple x 1..3): the global batch of check(dp=D), each replica its own
  // B / D rows.
  int rows_multiple = 1;
  // Unpacked rows draw, 2 in 3, a padding gap inside their document (an
  // attention mask's zeros between its real tokens), where positions are not
  // given: a balanced plan's cost must run on across it.
  bool interior_gaps = false;
};
// cpsim fuzz's draw: every form, 1 in 8 layouts long (what one property row
// leaves in the host memory cache is handed to the next, as in a long step), 1
// in 6 with mRoPE position_ids, interior padding gaps in unpacked rows.
DrawLimits fuzz_draw_limits();
// cpsim fuzz's inputs: 1 in 4 cases draws the recurrence's gates live
// (CheckOptions::live_gates_every).
inline constexpr int kFuzzLiveGatesEvery = 4;
rc::Gen<LayoutSpec> gen_layout_spec(int max_cp = 16, const PlanDraw& plan = std::nullopt, const DrawLimits& limits = {});
rc::Gen<LayoutCase> gen_layout_case(int max_cp = 16, const PlanDraw& plan = std::nullopt, const DrawLimits& limits = {});
// CP sizes from a list, each as often as any other at every generator size (the
// max_cp forms draw 1..max_cp as RapidCheck's inRange does: small sizes first);
// a failure shrinks towards the list's first size.
rc::Gen<int> gen_cp_size(const std::vector<int>& sizes);
rc::Gen<LayoutSpec> gen_layout_spec(const std::vector<int>& cp_sizes, const PlanDraw& plan = std::nullopt,
                                    const DrawLimits& limits = {});
rc::Gen<LayoutCase> gen_layout_case(const std::vector<int>& cp_sizes, const PlanDraw& plan = std::nullopt,
                                    const DrawLimits& limits = {});

}  // namespace cpsim::verify

namespace rc {
template <>
struct Arbitrary<cpsim::verify::LayoutCase> {
  static Gen<cpsim::verify::LayoutCase> arbitrary() { return cpsim::verify::gen_layout_case(); }
};
}  // namespace rc
