// cpsim show: a packed batch's layout as a picture. Text: one line per row with
// documents, padding, shard cuts, then which documents cross which shard edges and
// the convolution halo spans. SVG: rows of document rectangles (one per document),
// padding, shard boundaries, halo spans, and each document's ranks as its title;
// runs too narrow to draw are aggregated.
#pragma once

#include <cstdint>
#include <string>

#include "core/conv.hpp"
#include "core/layout.hpp"
#include "core/shard_plan.hpp"

namespace cpsim::verify {

struct ShowOptions {
  int cp = 1;
  PlanChoice plan;  // where the shard cuts fall (equal intervals by default)
  int conv_width = kDefaultConvWidth;
  int columns = 100;   // terminal width for the text form
  bool color = false;  // ANSI colours in the text form
  std::string title;   // the batch's name
};

// Letters: document i+1 is 'A' + i % 26, upper case where real, lower case on its
// own padding; '.' row padding; ':' positions added to reach P; '|' a shard cut
// (two together: an empty interval between them).
// Rows wider than the terminal show one character per bucket of positions ('#' a
// bucket holding several documents).
std::string show_text(const Batch& batch, const ShowOptions& options);
std::string show_svg(const Batch& batch, const ShowOptions& options);

}  // namespace cpsim::verify
