#include <Python.h>
#include <frameobject.h>
#include <pybind11/pybind11.h>

#include "python/torch_backend/call_site.hpp"

namespace cpsim::torch_backend {

std::vector<std::string>& internal_paths() {
  static std::vector<std::string> paths;
  return paths;
}

std::string& site_context() {
  thread_local std::string context;
  return context;
}
std::string& own_path() {
  static std::string path;
  return path;
}

std::string python_call_site() {
  if (!Py_IsInitialized()) return "";
  pybind11::gil_scoped_acquire gil;
  PyFrameObject* frame = PyEval_GetFrame();
  if (frame == nullptr) return "";
  Py_INCREF(frame);
  std::string site;
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    const std::string path = file ? file : "";
    bool inside = path.rfind("<", 0) == 0;
    for (const std::string& p : internal_paths()) inside = inside || path.rfind(p, 0) == 0;
    if (!site_context().empty() && !own_path().empty() && path.rfind(own_path(), 0) == 0) {
      Py_DECREF(code);
      Py_DECREF(frame);
      return site_context();
    }
    if (!inside) {
      const std::size_t slash = path.rfind('/');
      site = (slash == std::string::npos ? path : path.substr(slash + 1)) + ":" +
             std::to_string(PyFrame_GetLineNumber(frame));
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
    if (!site.empty()) break;
  }
  Py_XDECREF(frame);
  return site.empty() ? site_context() : site;
}

}  // namespace cpsim::torch_backend
