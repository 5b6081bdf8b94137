// The module cpsim._C: cpsim's torch.distributed backend (backend.hpp), its
// requests (work.hpp) and groups (groups.hpp), and cpsim's errors as Python
// exceptions.
//
// Built by python/CMakeLists.txt (make test; pip install . through
// scikit-build-core), against the torch that is installed.
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

#include "core/comm/registry.hpp"
#include "core/error.hpp"
#include "python/torch_backend/backend.hpp"
#include "python/torch_backend/call_site.hpp"
#include "python/torch_backend/groups.hpp"
#include "python/torch_backend/work.hpp"

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using namespace cpsim::torch_backend;
  m.doc() = "cpsim's torch.distributed backend (a c10d Backend) and its spawned groups";
  py::module::import("torch.distributed");  // c10d::Backend's Python type first
  // cpsim's error classes as Python exceptions (RuntimeError's when torch's own
  // bindings carry them: the spawn then reads collective_failed()).
  py::register_exception<cpsim::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  py::register_exception<cpsim::Aborted>(m, "Aborted", PyExc_RuntimeError);
  py::register_exception<cpsim::Unsupported>(m, "Unsupported", PyExc_NotImplementedError);
  py::register_exception<cpsim::InvalidInput>(m, "InvalidInput", PyExc_ValueError);
  py::class_<BackendCpsim, c10d::Backend, c10::intrusive_ptr<BackendCpsim>>(m, "BackendCpsim")
      .def("backend_name", &BackendCpsim::getBackendName)
      .def("collective_failed", &BackendCpsim::collective_failed);
  py::class_<Ledger, std::shared_ptr<Ledger>>(m, "Ledger")
      .def("outstanding", &Ledger::outstanding)
      .def("size", &Ledger::size)
      .def("unwaited", &Ledger::unwaited);
  bind_groups(m);
  m.def("backends", [] { return cpsim::backend_names(); });
  m.def("set_site_context", [](std::string context) { site_context() = std::move(context); });
  m.def("set_own_path", [](std::string path) { own_path() = std::move(path); });
  m.def(
      "set_internal_paths", [](std::vector<std::string> paths) { internal_paths() = std::move(paths); },
      "folders whose frames are not a call's site (torch's and cpsim's own)");
}
