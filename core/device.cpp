#include "core/device.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include <sys/mman.h>

#include "core/error.hpp"

namespace cpsim {

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

namespace {

constexpr std::size_t kCachedFrom = 64 * 1024;

// A block's size class: the size rounded up to a multiple of an eighth of its
// power of two (at most 1/8 more than asked).
std::size_t size_class(std::size_t bytes) {
  std::size_t top = 1;
  while (top * 2 <= bytes) top *= 2;
  const std::size_t step = std::max<std::size_t>(top / 8, 4096);
  return (bytes + step - 1) / step * step;
}

// Blocks (64 KiB and more) are mapped on their own and unmapped when freed (or
// kept by the cache below): their memory goes back to the system at once (an
// allocator's per-thread arenas would keep it resident after every rank's thread
// let go). Fresh pages come zeroed from the kernel. They are not marked for
// transparent huge pages: where the kernel compacts memory to find a huge page
// for a marked region (defrag "madvise", a common default), a first touch cost
// 1.2 to 15 s a GiB here against 0.45 s for 4 KiB pages, and a check of 1M
// tokens at CP 8 twice the CPU.
constexpr std::size_t kPage = 4096;

std::size_t mapped_size(std::size_t cls) { return (cls + kPage - 1) / kPage * kPage; }

void* block_allocate(std::size_t cls) {
  void* p = mmap(nullptr, mapped_size(cls), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void block_free(void* p, std::size_t cls) noexcept { munmap(p, mapped_size(cls)); }

// Freed blocks whose every page is resident, oldest first. A request takes a
// block of its own size class, else the smallest larger one cut down to its size
// (the tail unmapped), else, before mapping a fresh block, first unmaps cached
// blocks (oldest first) of at least its size. So the cache never makes the
// process hold more than it would without it: what a fresh block may make
// resident, the cache gave back first.
class HostCache {
 public:
  void* take(std::size_t cls) {
    std::lock_guard<std::mutex> lock(m_);
    auto found = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->first >= cls && (found == free_.end() || it->first < found->first ||
                               (it->first == found->first && it > found)))  // the newest of a class
        found = it;
    if (found == free_.end()) return nullptr;
    void* p = found->second;
    const std::size_t have = mapped_size(found->first), need = mapped_size(cls);
    if (have > need) munmap(static_cast<std::byte*>(p) + need, have - need);
    cached_ -= found->first;
    free_.erase(found);
    return p;
  }
  bool keep(void* p, std::size_t cls) {
    std::lock_guard<std::mutex> lock(m_);
    if (cached_ + cls > host_cache_limit()) return false;
    free_.emplace_back(cls, p);
    cached_ += cls;
    return true;
  }
  void release_at_least(std::size_t bytes) noexcept {
    std::lock_guard<std::mutex> lock(m_);
    std::size_t freed = 0, n = 0;
    for (; n < free_.size() && freed < bytes; ++n) {
      block_free(free_[n].second, free_[n].first);
      freed += free_[n].first;
      cached_ -= free_[n].first;
    }
    free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(n));
  }
  void release() noexcept {
    std::lock_guard<std::mutex> lock(m_);
    for (auto& [cls, p] : free_) block_free(p, cls);
    free_.clear();
    cached_ = 0;
  }
  std::size_t bytes() {
    std::lock_guard<std::mutex> lock(m_);
    return cached_;
  }

 private:
  std::mutex m_;
  std::vector<std::pair<std::size_t, void*>> free_;  // (size class, block), oldest first
  std::size_t cached_ = 0;
};

HostCache& host_cache() {
  static HostCache* c = new HostCache;  // never destroyed: tensors may outlive static destruction
  return *c;
}

class HostRuntime final : public DeviceRuntime {
 public:
  void* allocate(Device, std::size_t bytes) override { return host_allocate(bytes, true, nullptr); }
  void deallocate(Device, void* ptr, std::size_t bytes) noexcept override { host_deallocate(ptr, bytes, false); }
  void zero(Device, void* ptr, std::size_t bytes) override {
    if (bytes) std::memset(ptr, 0, bytes);
  }
  void copy(void* dst, Device, const void* src, Device, std::size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
};

HostRuntime host_runtime;
std::atomic<DeviceRuntime*> cuda_runtime{nullptr};

}  // namespace

void* host_allocate(std::size_t bytes, bool zeroed, bool* resident) {
  if (resident) *resident = !zeroed;
  if (bytes >= kCachedFrom) {
    const std::size_t cls = size_class(bytes);
    if (void* p = host_cache().take(cls)) {
      if (zeroed) std::memset(p, 0, bytes);
      if (resident) *resident = true;
      return p;
    }
    host_cache().release_at_least(cls);
    // Fresh pages come zeroed from the kernel, lazily.
    void* p = block_allocate(cls);
    if (!p) {
      release_host_cache();  // what the cache holds may be what is missing
      p = block_allocate(cls);
    }
    if (!p) throw std::bad_alloc();
    return p;
  }
  void* p = zeroed ? std::calloc(bytes ? bytes : 1, 1) : std::malloc(bytes ? bytes : 1);
  if (!p) throw std::bad_alloc();
  return p;
}

void host_deallocate(void* ptr, std::size_t bytes, bool resident) noexcept {
  if (!ptr) return;
  if (bytes < kCachedFrom) return std::free(ptr);
  const std::size_t cls = size_class(bytes);
  if (!resident || !host_cache().keep(ptr, cls)) block_free(ptr, cls);
}

void release_host_cache() noexcept { host_cache().release(); }

namespace {
// CPSIM_HOST_CACHE (bytes) fixes the limit; 0 turns the cache off.
const char* cache_env() { return std::getenv("CPSIM_HOST_CACHE"); }
std::atomic<std::size_t> cache_limit{cache_env() && *cache_env()
                                         ? static_cast<std::size_t>(std::strtoull(cache_env(), nullptr, 10))
                                         : std::size_t{256} << 20};
}  // namespace

std::size_t host_cache_limit() { return cache_limit.load(); }

void set_host_cache_limit(std::size_t bytes) {
  if (cache_env() && *cache_env()) return;
  cache_limit.store(bytes);
  if (host_cache_bytes() > bytes) release_host_cache();
}

std::size_t host_cache_bytes() { return host_cache().bytes(); }

DeviceRuntime& device_runtime(DeviceKind kind) {
  if (kind == DeviceKind::cpu) return host_runtime;
  DeviceRuntime* r = cuda_runtime.load();
  if (!r) throw Unavailable("no CUDA runtime in this process (a build without CUDA, or no usable device)");
  return *r;
}

void register_device_runtime(DeviceKind kind, DeviceRuntime* runtime) {
  CPSIM_ENFORCE(kind != DeviceKind::cpu, "the host runtime is built in");
  cuda_runtime.store(runtime);
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {  // the host path: no dispatch
    std::memmove(dst, src, bytes);
    return;
  }
  const DeviceKind kind = !dst_device.is_cpu() ? dst_device.kind : src_device.kind;
  device_runtime(kind).copy(dst, dst_device, src, src_device, bytes);
}

}  // namespace cpsim
