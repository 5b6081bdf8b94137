#include "core/device.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/error.hpp"

namespace cpsim {

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

namespace {

class HostRuntime final : public DeviceRuntime {
 public:
  void* allocate(Device, std::size_t bytes) override {
    // calloc: zeroed pages come from the kernel lazily, as cheap as the memory itself.
    void* p = std::calloc(bytes ? bytes : 1, 1);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(Device, void* ptr, std::size_t) noexcept override { std::free(ptr); }
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
