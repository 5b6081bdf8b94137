// Layout families (SPEC §5): what one packer can emit, read from a JSON family
// file, drawn by a RapidCheck generator that shrinks within the family (every
// counterexample is still a batch that packer could emit), and checked for
// membership by a test of its own (family_violation).
//
// A family file (docs/files.md has the schema):
//   {"name": "te-thd-2cp", "description": "...", "form": "cu_seqlens",
//    "cp": [1, 16], "rows": [1, 1], "documents": [1, 6], "document_length": [1, 40],
//    "length_distribution": "uniform" | "short", "pad_documents_to": 1 | "cp" | "2*cp" | N,
//    "interior_padding": [0, 0], "zero_length_placeholders": [0, 0],
//    "tail_padding": [0, 0], "left_padding": [0, 0], "eos_is_pad": false,
//    "pad_token_id": 0, "one_dimensional": false,
//    "image_spans": {"token_id": 9, "per_document": [0, 2], "length": [1, 4]},
//    "mrope": false}
// Ranges are [min, max], inclusive.
#pragma once

#include <cstdint>
#include <optional>
#include <map>
#include <string>

#include <rapidcheck.h>

#include "verify/cases.hpp"
#include "verify/generators.hpp"

namespace cpsim::verify {

struct Range {
  int min = 0, max = 0;
};

struct LayoutFamily {
  std::string name, description;
  LayoutForm form = LayoutForm::seq_lens_padded;
  std::string form_name = "seq_lens_padded";
  Range cp{1, 16}, rows{1, 1}, documents{1, 4}, document_length{1, 16};
  bool short_lengths = false;            // lengths biased to the minimum
  int pad_documents_to = 1;              // a fixed multiple, or (with pad_to_cp) a multiple of cp
  int pad_to_cp = 0;                     // 1: "cp", 2: "2*cp"
  Range interior_padding{0, 0};          // extra padding inside each document
  Range zero_length_placeholders{0, 0};  // zero-length entries after a row's documents
  Range tail_padding{0, 0};              // after the longest row's documents
  Range left_padding{0, 0};              // unpacked rows only
  bool tail_in_last_document = false;    // a row's tail counted in its last document's occupied length
  bool position_ids = false;             // the packer gives position_ids (packed forms)
  bool mrope = false;                    // ... as mRoPE's [3, B, S] planes, image spans as grids
  bool eos_is_pad = false;
  int pad_token_id = 0;
  bool one_dimensional = false;
  struct ImageSpans {
    int token_id = 0;
    Range per_document{0, 0}, length{1, 1};
  };
  std::optional<ImageSpans> image_spans;

  // The multiple a document's occupied length is rounded up to at CP size cp.
  int document_multiple(int cp_size) const { return pad_to_cp ? pad_to_cp * cp_size : pad_documents_to; }
};

// The forms by the names family files (and cpsim harness --forms) give them.
const std::map<std::string, LayoutForm>& layout_forms();

// Reads a family file; InvalidInput with one line naming the file and the field.
LayoutFamily read_family(const std::string& path);
LayoutFamily parse_family(const std::string& text, const std::string& source);

// Members of the family, at CP sizes within both the family's range and max_cp.
rc::Gen<LayoutCase> gen_family_case(const LayoutFamily& family, int max_cp = 16, const PlanDraw& plan = std::nullopt);
// Members at the listed CP sizes within the family's range, each as often as any
// other (gen_cp_size); InvalidInput when none of them is in the range.
rc::Gen<LayoutCase> gen_family_case(const LayoutFamily& family, const std::vector<int>& cp_sizes,
                                    const PlanDraw& plan = std::nullopt);

// Why `c` is not a batch the family's packer could emit (empty: it is one). Read
// from the batch's own keys, not from how the generator built it.
std::string family_violation(const LayoutFamily& family, const LayoutCase& c);

}  // namespace cpsim::verify
