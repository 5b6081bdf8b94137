#include "core/comm/registry.hpp"

#include <algorithm>
#include <mutex>

namespace cpsim {

namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::unique_ptr<Backend>>& registry() {
  static std::vector<std::unique_ptr<Backend>> r;
  return r;
}

}  // namespace

void register_backend(Backend backend) {
  CPSIM_ENFORCE(!backend.name.empty() && backend.make_group, "a backend needs a name and a group factory");
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (const auto& b : registry()) CPSIM_ENFORCE(b->name != backend.name, "backend '", backend.name, "' registered twice");
  registry().push_back(std::make_unique<Backend>(std::move(backend)));
  // threads first: the default, and the baseline other backends are compared with.
  std::stable_sort(registry().begin(), registry().end(),
                   [](const auto& a, const auto& b) { return a->name == "threads" && b->name != "threads"; });
}

const Backend& find_backend(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::string have;
  for (const auto& b : registry()) {
    if (b->name == name) return *b;
    have += (have.empty() ? "" : ", ") + b->name;
  }
  throw Unavailable("backend '" + name + "' is not registered in this build (have: " + have + ")");
}

std::vector<std::string> backend_names() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (const auto& b : registry()) names.push_back(b->name);
  return names;
}

std::vector<std::string> available_backends() {
  std::vector<std::string> out;
  for (const auto& name : backend_names())
    if (!find_backend(name).unavailable()) out.push_back(name);
  return out;
}

}  // namespace cpsim
