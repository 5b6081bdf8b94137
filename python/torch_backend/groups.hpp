// The groups a program's torch ranks belong to, and their Python classes:
// SpawnedGroup (the ranks of one spawn, as threads of this process), JobSession
// and JobGroup (this process's rank of a multi-process job).
#pragma once
#include <torch/csrc/utils/pybind.h>

namespace cpsim::torch_backend {

// Binds SpawnedGroup, JobSession and JobGroup in the module.
void bind_groups(pybind11::module_& m);

}  // namespace cpsim::torch_backend
