// NCCL, loaded at run time: cpsim's binaries do not need libnccl.so.2 to start
// (a GPU machine keeps NCCL where PyTorch's pip packages put it, or nowhere), and
// only the nccl backend's first use looks for it. The NCCL entry points gpu/nccl.cpp
// calls are defined here, each forwarding to the loaded library's (the real NCCL,
// or any library with its entry points: a test double).
//
// Where it looks, in order: CPSIM_NCCL_LIBRARY (a path), then libnccl.so.2 as the
// dynamic loader finds it (LD_LIBRARY_PATH, the binary's RUNPATH, the system),
// then the CUDA toolkit's lib64/ and lib/.
#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "gpu/nccl_loader.hpp"

namespace cpsim::gpu {

namespace {

const NcclLibrary& loaded() {
  static const NcclLibrary l = [] {
    std::vector<std::string> candidates;
    if (const char* v = std::getenv("CPSIM_NCCL_LIBRARY"); v && *v) candidates.push_back(v);
    for (const char* c : {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2"})
      candidates.push_back(c);
    return load_nccl(candidates);
  }();
  return l;
}

template <class F>
F entry(const char* name) {
  const NcclLibrary& l = loaded();
  if (!l.handle) throw Unavailable(l.error);
  void* f = dlsym(l.handle, name);
  if (!f) throw Unavailable("the NCCL at " + l.path + " has no " + name);
  return reinterpret_cast<F>(f);
}

}  // namespace

NcclLibrary load_nccl(const std::vector<std::string>& candidates) {
  NcclLibrary out;
  std::string tried;
  for (const std::string& c : candidates) {
    if (void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      out.handle = h;
      char where[4096] = {0};
      // The file the loader picked (a bare name resolves through the search path).
      out.path = dlinfo(h, RTLD_DI_ORIGIN, where) == 0 ? std::string(where) + "/" + c.substr(c.rfind('/') + 1) : c;
      return out;
    }
    const char* why = dlerror();
    tried += (tried.empty() ? "" : "; ") + c + (why ? std::string(" (") + why + ")" : std::string());
  }
  out.error = "the nccl backend needs NCCL (libnccl.so.2) and found none: tried " + tried +
              ". Set CPSIM_NCCL_LIBRARY to its path, or add its folder to LD_LIBRARY_PATH (PyTorch's pip "
              "packages keep it in site-packages/nvidia/nccl/lib)";
  return out;
}

std::optional<std::string> nccl_unavailable() {
  const NcclLibrary& l = loaded();
  if (l.handle) return std::nullopt;
  return l.error;
}

std::string nccl_library_path() { return loaded().path; }

void* nccl_library_symbol(const char* name) {
  const NcclLibrary& l = loaded();
  return l.handle ? dlsym(l.handle, name) : nullptr;
}

}  // namespace cpsim::gpu

// The entry points gpu/nccl.cpp uses, forwarding to the loaded library.
using cpsim::gpu::entry;
#define CPSIM_NCCL_FORWARD(name, params, args) \
  extern "C" ncclResult_t name params { return entry<decltype(&name)>(#name) args; }

CPSIM_NCCL_FORWARD(ncclGetUniqueId, (ncclUniqueId * id), (id))
CPSIM_NCCL_FORWARD(ncclCommInitRank, (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank), (comm, nranks, id, rank))
CPSIM_NCCL_FORWARD(ncclCommInitAll, (ncclComm_t * comm, int ndev, const int* devlist), (comm, ndev, devlist))
CPSIM_NCCL_FORWARD(ncclCommAbort, (ncclComm_t comm), (comm))
CPSIM_NCCL_FORWARD(ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t * error), (comm, error))
CPSIM_NCCL_FORWARD(ncclGroupStart, (), ())
CPSIM_NCCL_FORWARD(ncclGroupEnd, (), ())
CPSIM_NCCL_FORWARD(ncclAllGather,
                   (const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm, cudaStream_t s),
                   (send, recv, count, type, comm, s))
CPSIM_NCCL_FORWARD(ncclReduceScatter,
                   (const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                    cudaStream_t s),
                   (send, recv, count, type, op, comm, s))
CPSIM_NCCL_FORWARD(ncclAllReduce,
                   (const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                    cudaStream_t s),
                   (send, recv, count, type, op, comm, s))
CPSIM_NCCL_FORWARD(ncclBroadcast,
                   (const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                    cudaStream_t s),
                   (send, recv, count, type, root, comm, s))
CPSIM_NCCL_FORWARD(ncclSend, (const void* send, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t s),
                   (send, count, type, peer, comm, s))
CPSIM_NCCL_FORWARD(ncclRecv, (void* recv, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t s),
                   (recv, count, type, peer, comm, s))

extern "C" const char* ncclGetErrorString(ncclResult_t result) {
  if (void* h = cpsim::gpu::loaded().handle)
    if (void* f = dlsym(h, "ncclGetErrorString")) return reinterpret_cast<const char* (*)(ncclResult_t)>(f)(result);
  return "NCCL error (no NCCL library loaded)";
}
