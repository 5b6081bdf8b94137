// libFuzzer targets for the batch readers and layout validation (make fuzz).
// Whatever the bytes, a reader either returns a batch or throws InvalidInput (exit 2
// in the command line); any other exception, a crash, a read out of bounds or an
// allocation the input does not justify is a bug the fuzzer reports.
//   CPSIM_FUZZ_TARGET=1  JSON batch -> derive_layout -> shard_batch at cp 3
//   CPSIM_FUZZ_TARGET=2  safetensors batch -> the same
//   CPSIM_FUZZ_TARGET=3  lengths from the bytes -> derive_layout, compared with reference_layout
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "core/shard.hpp"
#include "verify/batch_io.hpp"
#include "verify/reference.hpp"
#include "verify/safetensors.hpp"

using namespace cpsim;
using namespace cpsim::verify;

namespace {

[[noreturn]] void bug(const char* what) {
  std::fprintf(stderr, "fuzz: not an InvalidInput: %s\n", what);
  std::abort();
}

void use(const BatchFile& f) {
  const Layout l = derive_layout(f.batch);
  if (l.doc_ids.numel() <= (1 << 20)) shard_batch_at(1, 3, f.batch, std::nullopt, f.pad_token_id, false);
}

// Bytes as lengths: [S, then seq_lens entries]; derive_layout must agree with the reference.
void layout_from_bytes(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return;
  const std::int64_t S = 1 + data[0] % 64;
  std::vector<std::int64_t> lens, padded;
  for (std::size_t i = 1; i + 1 < size && lens.size() < 16; i += 2) {
    const std::int64_t real = static_cast<std::int8_t>(data[i]) % 20, extra = data[i + 1] % 4;
    lens.push_back(real < -10 ? kSeqLensSentinel : real);
    padded.push_back(real < -10 ? kSeqLensSentinel : real + extra);
  }
  if (lens.empty()) return;
  const auto D = static_cast<std::int64_t>(lens.size());
  Batch b{{"input_ids", Tensor({1, S}, DType::i64)},
          {"seq_lens", Tensor::from<std::int64_t>({1, D}, lens)},
          {"seq_lens_padded", Tensor::from<std::int64_t>({1, D}, padded)}};
  Layout l;
  try {
    l = derive_layout(b);
  } catch (const InvalidInput&) {
    return;
  }
  const LayoutTruth want = reference_layout(b);
  if (count_wrong(want.doc_ids, l.doc_ids) || count_wrong(want.padding, l.padding) ||
      count_wrong(want.positions, l.positions))
    bug("derive_layout disagrees with reference_layout on a valid batch");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
#if CPSIM_FUZZ_TARGET == 1
    use(parse_batch_json(bytes, "fuzz.json"));
#elif CPSIM_FUZZ_TARGET == 2
    use(parse_batch_safetensors(bytes, "fuzz.safetensors"));
#else
    layout_from_bytes(data, size);
#endif
  } catch (const InvalidInput&) {
  } catch (const std::exception& e) {
    bug(e.what());
  }
  return 0;
}
