// NCCL loaded at run time (gpu/nccl_loader.cpp): nothing links libnccl.so.2.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace cpsim::gpu {

struct NcclLibrary {
  void* handle = nullptr;
  std::string path;   // the file loaded
  std::string error;  // why none was, naming every place it looked
};
// The first of `candidates` (paths, or names the dynamic loader resolves) that loads.
NcclLibrary load_nccl(const std::vector<std::string>& candidates);

// Why the nccl backend cannot find NCCL (looked for once), or nothing.
std::optional<std::string> nccl_unavailable();
// The NCCL in use ("" when none could be loaded).
std::string nccl_library_path();
// A symbol of the loaded NCCL library (nullptr when none is loaded or it has no
// such symbol): how the nccl backend finds a host device the library brings
// (gpu/nccl_host_device.h), and tests the NCCL test double's controls.
void* nccl_library_symbol(const char* name);

}  // namespace cpsim::gpu
