// The host block cache (core/device.hpp): which freed blocks it keeps (only those
// whose every page is resident), how it hands them out again (whole, or cut down
// to a smaller size class, cleared when asked for zeros), and that a fresh block
// is mapped only after the cache gave back as much: with the cache, the process
// never holds more than it would without one.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/device.hpp"
#include "core/tensor.hpp"

using namespace cpsim;

namespace {

constexpr std::int64_t kMiB = 1 << 20;

// This process's resident bytes now.
std::int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * 4096;
}

// A block of `bytes` bytes the caller writes in full (so, once freed, every page
// of it is resident).
Tensor written(std::int64_t bytes, std::uint8_t value) {
  Tensor t = Tensor::empty({bytes}, DType::b8);
  std::memset(t.raw(), value, static_cast<std::size_t>(bytes));
  return t;
}

bool all_zero(const Tensor& t) {
  const auto* p = static_cast<const std::uint8_t*>(t.raw());
  for (std::int64_t i = 0; i < t.numel(); ++i)
    if (p[i] != 0) return false;
  return true;
}

struct CacheOn {
  CacheOn() {
    set_host_cache_limit(std::size_t{1} << 40);
    release_host_cache();
  }
  ~CacheOn() {
    release_host_cache();
    set_host_cache_limit(std::size_t{256} << 20);
  }
};

}  // namespace

TEST(HostCache, AResidentBlockIsReusedWholeOrCutDownAndClearedWhenZerosAreAsked) {
  if (std::getenv("CPSIM_HOST_CACHE")) GTEST_SKIP() << "CPSIM_HOST_CACHE fixes the cache's limit";
  CacheOn on;
  const void* first = nullptr;
  {
    Tensor a = written(8 * kMiB, 0xAB);
    first = a.raw();
  }
  EXPECT_EQ(host_cache_bytes(), static_cast<std::size_t>(8 * kMiB));
  {
    Tensor b({8 * kMiB}, DType::b8);  // zero-filled: the cached block, cleared
    EXPECT_EQ(b.raw(), first);
    EXPECT_TRUE(all_zero(b));
    EXPECT_EQ(host_cache_bytes(), 0u);
    std::memset(b.raw(), 0xCD, 8 * kMiB);
  }
  EXPECT_EQ(host_cache_bytes(), static_cast<std::size_t>(8 * kMiB));  // a reused block is resident
  {
    Tensor c({3 * kMiB}, DType::b8);  // a smaller class: the cached block cut down to it
    EXPECT_EQ(c.raw(), first);
    EXPECT_TRUE(all_zero(c));
    EXPECT_EQ(host_cache_bytes(), 0u);
    std::memset(c.raw(), 0x11, 3 * kMiB);  // the whole of it is still mapped
  }
  EXPECT_EQ(host_cache_bytes(), static_cast<std::size_t>(3 * kMiB));
}

TEST(HostCache, AFreshZeroFilledBlockIsNotKept) {
  if (std::getenv("CPSIM_HOST_CACHE")) GTEST_SKIP() << "CPSIM_HOST_CACHE fixes the cache's limit";
  CacheOn on;
  {
    Tensor z({16 * kMiB}, DType::b8);  // its pages are resident only where touched
    static_cast<std::uint8_t*>(z.raw())[0] = 1;
  }
  EXPECT_EQ(host_cache_bytes(), 0u);
}

TEST(HostCache, AFreshBlockIsMappedOnlyAfterTheCacheGaveBackAsMuch) {
  if (std::getenv("CPSIM_HOST_CACHE")) GTEST_SKIP() << "CPSIM_HOST_CACHE fixes the cache's limit";
  CacheOn on;
  {
    Tensor a = written(2 * kMiB, 1), b = written(2 * kMiB, 2), c = written(2 * kMiB, 3);
  }
  EXPECT_EQ(host_cache_bytes(), static_cast<std::size_t>(6 * kMiB));
  {
    // No cached block is 3 MiB or more: the oldest are given back until 3 MiB are.
    Tensor d = written(3 * kMiB, 4);
    EXPECT_EQ(host_cache_bytes(), static_cast<std::size_t>(2 * kMiB));
  }
  release_host_cache();
  // What the process holds: 96 MiB written, freed into the cache, then 160 MiB
  // asked for and written. Without a cache it would hold 160 MiB at the end; with
  // one, it must not hold the 96 MiB beside them.
  const std::int64_t before = resident_bytes();
  { Tensor a = written(96 * kMiB, 5); }
  EXPECT_EQ(host_cache_bytes(), static_cast<std::size_t>(96 * kMiB));
  Tensor big({160 * kMiB}, DType::b8);
  std::memset(big.raw(), 6, 160 * kMiB);
  const std::int64_t grown = resident_bytes() - before;
  EXPECT_EQ(host_cache_bytes(), 0u);
  EXPECT_LT(grown, 160 * kMiB + 48 * kMiB) << "resident grew by " << grown / kMiB << " MiB";
}
