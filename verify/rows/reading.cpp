// run_reading: the inputs a run's ranks read in place, and the check that they
// did not write into them.
#include <algorithm>
#include <cstring>
#include <mutex>

#include "verify/rows/common.hpp"

namespace cpsim::verify::rows {

namespace {

// The storages being read in place now: (first byte, bytes), one entry per
// input of each run in progress (rows may run side by side).
std::mutex reading_mutex;
std::vector<std::pair<const void*, std::size_t>> reading;

// A run's inputs that live on the host: read in place while it lasts (the
// registry holds them), and compared with their fingerprints after it.
struct Reading {
  std::vector<std::pair<const Input*, std::uint64_t>> guarded;  // an input, its fingerprint before the run
  std::vector<std::pair<const void*, std::size_t>> keys;
  explicit Reading(const std::vector<Input>& inputs) {
    for (const Input& in : inputs)
      if (in.tensor->defined() && in.tensor->is_cpu()) {
        guarded.emplace_back(&in, fingerprint(*in.tensor));
        keys.emplace_back(in.tensor->raw(), in.tensor->nbytes());
      }
    std::lock_guard<std::mutex> lock(reading_mutex);
    reading.insert(reading.end(), keys.begin(), keys.end());
  }
  ~Reading() {
    std::lock_guard<std::mutex> lock(reading_mutex);
    for (const auto& k : keys) reading.erase(std::find(reading.begin(), reading.end(), k));
  }
};

}  // namespace

std::uint64_t fingerprint(const Tensor& t) {
  // Eight independent lanes of xor-multiply over 8-byte words (a bijection of the
  // lane for each word, so a changed word changes its lane for good), mixed at the
  // end with the tail: memory speed.
  const auto* p = static_cast<const unsigned char*>(t.raw());
  const std::size_t n = t.nbytes(), words = n / 8;
  constexpr std::uint64_t k = 0x9E3779B97F4A7C15ull;
  std::uint64_t lane[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  std::size_t i = 0;
  for (; i + 8 <= words; i += 8)
    for (int l = 0; l < 8; ++l) {
      std::uint64_t w;
      std::memcpy(&w, p + 8 * (i + l), 8);
      lane[l] = (lane[l] ^ w) * k;
    }
  auto mix = [](std::uint64_t h, std::uint64_t w) {
    h = (h ^ w) * k;
    return h ^ (h >> 29);
  };
  std::uint64_t h = n;
  for (; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);
    h = mix(h, w);
  }
  for (std::size_t b = 8 * words; b < n; ++b) h = mix(h, p[b]);
  for (std::uint64_t l : lane) h = mix(h, l);
  return h;
}

bool read_in_place(const Tensor& global) {
  if (!global.defined() || !global.is_cpu()) return false;
  const std::pair<const void*, std::size_t> key{global.raw(), global.nbytes()};
  std::lock_guard<std::mutex> lock(reading_mutex);
  return std::find(reading.begin(), reading.end(), key) != reading.end();
}

void run_reading(const std::vector<Input>& inputs, int n, const RankFn& fn, const RunOptions& options,
                 const RankOutputs& outputs) {
  // A process of a multi-process job runs one rank: it copies its slices (nothing
  // to share), and every process reaches the same verdict.
  if (options.job) return run_ranks(n, fn, options, outputs);
  const Reading inputs_read(inputs);
  run_ranks(n, fn, options, outputs);
  for (const auto& [in, before] : inputs_read.guarded)
    if (fingerprint(*in->tensor) != before)
      throw Error(std::string("a rank wrote into its input ") + in->name +
                  " (the slice it was given of the global tensor, which the row compares against)");
}

}  // namespace cpsim::verify::rows
