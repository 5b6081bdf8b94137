// Where a tensor's bytes live: the host (cpu) or a GPU (cuda:N), and the runtime
// that allocates, zeroes and copies them. The CPU runtime is built in; gpu/
// registers CUDA's when a device is usable. core/ names no CUDA type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace cpsim {

enum class DeviceKind : std::uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  static constexpr Device host() { return {}; }
  static constexpr Device cuda(int index) { return {DeviceKind::cuda, index}; }
  bool is_cpu() const { return kind == DeviceKind::cpu; }
  std::string str() const;  // "cpu", "cuda:0"
  friend bool operator==(const Device& a, const Device& b) {
    return a.kind == b.kind && (a.kind == DeviceKind::cpu || a.index == b.index);
  }
};

// Memory of one kind of device. Copies name both sides; the runtime of the
// non-host side does them (and host-to-host copies are the CPU runtime's).
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual void* allocate(Device device, std::size_t bytes) = 0;
  virtual void deallocate(Device device, void* ptr, std::size_t bytes) noexcept = 0;
  virtual void zero(Device device, void* ptr, std::size_t bytes) = 0;
  virtual void copy(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes) = 0;
};

// The runtime for `kind`; throws Unavailable when none is registered (a build
// without CUDA, or no usable device).
DeviceRuntime& device_runtime(DeviceKind kind);
// Registers (or, with nullptr, removes) the runtime of a non-host kind.
void register_device_runtime(DeviceKind kind, DeviceRuntime* runtime);

// Host memory, through a cache: blocks of 64 KiB and more whose every page is
// resident are kept when freed (in size classes at most 1/8 apart, up to
// host_cache_limit() bytes in all) and handed out again, whole or cut down to a
// smaller class, so a step that makes the same tensors every call neither maps
// nor faults in fresh pages. Before a fresh block is mapped, cached blocks of at
// least its size are given back: the cache never raises what the process holds
// above what it would hold without one. `zeroed`: the block reads as zeros (a
// fresh block comes zeroed from the kernel, its pages resident only once touched;
// a reused one is cleared). `resident` (may be null) says whether every page of
// the block is resident once the caller has written what it promised: true for a
// block not zeroed (its caller writes it in full) and a reused one, false for a
// fresh zeroed one. host_deallocate keeps only resident blocks.
void* host_allocate(std::size_t bytes, bool zeroed, bool* resident);
void host_deallocate(void* ptr, std::size_t bytes, bool resident) noexcept;
// Returns every cached block to the system (between the CP sizes of a check, say).
void release_host_cache() noexcept;
std::size_t host_cache_limit();
// Sets the limit (0: no cache) unless CPSIM_HOST_CACHE fixed it; frees what is over.
void set_host_cache_limit(std::size_t bytes);
std::size_t host_cache_bytes();

// Copies `bytes` between any two devices through the right runtime.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, std::size_t bytes);

}  // namespace cpsim
