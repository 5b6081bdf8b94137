// RapidCheck generators for packed batches covering SPEC §5: documents crossing
// one or many shard edges, boundaries exactly on edges, length-1 documents,
// all-padding shards, shards shorter than W-1, EOS = PAD, left padding, S not
// divisible by c, rows with different document counts, c from 1 to max_cp.
// Generation draws a LayoutSpec (so shrinking works on plain numbers) and maps
// it through build_case.
#pragma once

#include <rapidcheck.h>

#include "verify/cases.hpp"

namespace cpsim::verify {

rc::Gen<LayoutSpec> gen_layout_spec(int max_cp = 16);
rc::Gen<LayoutCase> gen_layout_case(int max_cp = 16);

}  // namespace cpsim::verify

namespace rc {
template <>
struct Arbitrary<cpsim::verify::LayoutCase> {
  static Gen<cpsim::verify::LayoutCase> arbitrary() { return cpsim::verify::gen_layout_case(); }
};
}  // namespace rc
