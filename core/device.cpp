#include "core/device.hpp"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <new>

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

class HostCache {
 public:
  void* take(std::size_t cls) {
    std::lock_guard<std::mutex> lock(m_);
    auto it = free_.find(cls);
    if (it == free_.end()) return nullptr;
    void* p = it->second;
    free_.erase(it);
    cached_ -= cls;
    return p;
  }
  bool keep(void* p, std::size_t cls) {
    std::lock_guard<std::mutex> lock(m_);
    if (cached_ + cls > host_cache_limit()) return false;
    free_.emplace(cls, p);
    cached_ += cls;
    return true;
  }
  void release() noexcept {
    std::lock_guard<std::mutex> lock(m_);
    for (auto& [cls, p] : free_) std::free(p);
    free_.clear();
    cached_ = 0;
  }
  std::size_t bytes() {
    std::lock_guard<std::mutex> lock(m_);
    return cached_;
  }

 private:
  std::mutex m_;
  std::multimap<std::size_t, void*> free_;
  std::size_t cached_ = 0;
};

HostCache& host_cache() {
  static HostCache* c = new HostCache;  // never destroyed: tensors may outlive static destruction
  return *c;
}

class HostRuntime final : public DeviceRuntime {
 public:
  void* allocate(Device, std::size_t bytes) override { return host_allocate(bytes, true); }
  void deallocate(Device, void* ptr, std::size_t bytes) noexcept override { host_deallocate(ptr, bytes); }
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

void* host_allocate(std::size_t bytes, bool zeroed) {
  if (bytes >= kCachedFrom) {
    const std::size_t cls = size_class(bytes);
    if (void* p = host_cache().take(cls)) {
      if (zeroed) std::memset(p, 0, bytes);
      return p;
    }
    // calloc: fresh pages come zeroed from the kernel, lazily.
    void* p = zeroed ? std::calloc(cls, 1) : std::malloc(cls);
    if (!p) {
      release_host_cache();  // what the cache holds may be what is missing
      p = zeroed ? std::calloc(cls, 1) : std::malloc(cls);
    }
    if (!p) throw std::bad_alloc();
    return p;
  }
  void* p = zeroed ? std::calloc(bytes ? bytes : 1, 1) : std::malloc(bytes ? bytes : 1);
  if (!p) throw std::bad_alloc();
  return p;
}

void host_deallocate(void* ptr, std::size_t bytes) noexcept {
  if (!ptr) return;
  if (bytes >= kCachedFrom && host_cache().keep(ptr, size_class(bytes))) return;
  std::free(ptr);
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
