// The bytes every rank gives, and what each rank makes of them in rank order:
// reductions, gathers and all_to_all.
#include "python/torch_backend/backend.hpp"

#include "core/comm/call_check.hpp"
#include "python/torch_backend/call_site.hpp"
#include "python/torch_backend/reductions.hpp"
#include "python/torch_backend/tensors.hpp"

namespace cpsim::torch_backend {

at::Tensor BackendCpsim::exchange(const at::Tensor& t, const std::string& name, const std::string& args) {
  at::Tensor mine = as_bytes(t);
  at::Tensor all = at::empty({getSize(), mine.numel()}, at::kByte);
  run(name, args, [&](Communicator& c, CallOptions o) {
    c.all_gather(mine.data_ptr(), all.data_ptr(), mine.numel(), DType::b8, o);
  });
  return all;
}

void BackendCpsim::reduce_into(at::Tensor& t, const c10d::ReduceOp& op, const std::string& name, int root) {
  expect_cpu(t, name.c_str());
  expect_reduction(op, t, name);
  at::Tensor all =
      exchange(t, name, shape_text(t) + ", " + reduce_name(op) + (root >= 0 ? ", root " + std::to_string(root) : ""));
  if (root >= 0 && getRank() != root) return;
  t.copy_(reduced(all, t, op, name).view(t.sizes()));
}

void BackendCpsim::scatter_reduced(at::Tensor& out, const at::Tensor& input, const c10d::ReduceOp& op,
                                   const std::string& name) {
  expect_cpu(out, name.c_str());
  expect_cpu(input, name.c_str());
  expect_reduction(op, input, name);
  if (input.numel() != getSize() * out.numel())
    throw InvalidInput(name + ": the input holds " + std::to_string(input.numel()) + " elements, not " +
                       std::to_string(getSize()) + " x " + std::to_string(out.numel()));
  at::Tensor all = exchange(input, name, shape_text(input) + ", " + reduce_name(op));
  at::Tensor sum = reduced(all, input, op, name);
  out.copy_(sum.narrow(0, getRank() * out.numel(), out.numel()).view(out.sizes()));
}

void BackendCpsim::expect_reduction(const c10d::ReduceOp& op, const at::Tensor& like, const std::string& name) {
  const Reduction* r = reduction_of(op);
  if (!r || !r->join) throw Unsupported("cpsim does not support " + name + " with " + reduce_name(op));
  const bool floating = at::isFloatingType(like.scalar_type()) || at::isComplexType(like.scalar_type());
  if (r->takes == Reduction::Takes::floating && !floating)
    throw InvalidInput(name + " with " + r->name + " of " + dtype_text(like) + " (torch: floating types only)");
  if (r->takes == Reduction::Takes::integral && floating)
    throw InvalidInput(name + " with " + r->name + " of " + dtype_text(like) + " (torch: integer and bool types only)");
}

at::Tensor BackendCpsim::reduced(const at::Tensor& all, const at::Tensor& like, const c10d::ReduceOp& op,
                                 const std::string& name) {
  const Reduction& r = *reduction_of(op);  // expect_reduction took it
  const std::int64_t n = like.numel();
  auto part = [&](int q) { return all[q].view(like.scalar_type()).view({n}); };
  at::Tensor acc = part(0).clone();
  try {
    for (int q = 1; q < getSize(); ++q) r.join(acc, part(q));
    if (r.average) acc.div_(getSize());
  } catch (const c10::Error& e) {
    throw InvalidInput(name + " with " + r.name + " of " + dtype_text(like) + ": " + e.what_without_backtrace());
  }
  return acc;
}

void BackendCpsim::gather_into_list(std::vector<at::Tensor>& outputs, const at::Tensor& in, const std::string& name) {
  expect_cpu(in, name.c_str());
  expect_list(outputs, in, name.c_str());
  at::Tensor all = exchange(in, name, shape_text(in));
  for (int q = 0; q < getSize(); ++q) write_bytes(outputs[q], all[q]);
}

void BackendCpsim::gather_into_tensor(at::Tensor& output, const at::Tensor& input, const std::string& name) {
  expect_cpu(input, name.c_str());
  expect_cpu(output, name.c_str());
  if (output.numel() != getSize() * input.numel() || output.scalar_type() != input.scalar_type())
    throw InvalidInput(name + ": the output is " + shape_text(output) + ", not " + std::to_string(getSize()) +
                       " x the input (" + shape_text(input) + ")");
  at::Tensor all = exchange(input, name, shape_text(input));
  write_bytes(output, all.view({-1}));
}

void BackendCpsim::expect_list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* op) const {
  if (static_cast<int>(list.size()) != getSize())
    throw InvalidInput(std::string(op) + ": " + std::to_string(list.size()) + " tensors in the list for " +
                       std::to_string(getSize()) + " ranks");
  for (std::size_t q = 0; q < list.size(); ++q)
    if (list[q].numel() != like.numel() || list[q].scalar_type() != like.scalar_type())
      throw InvalidInput(std::string(op) + ": tensor " + std::to_string(q) + " of the list is " + shape_text(list[q]) +
                         ", not " + shape_text(like));
}

std::int64_t BackendCpsim::row_numel(const at::Tensor& t) {
  return t.dim() == 0 || t.size(0) == 0 ? 1 : t.numel() / t.size(0);
}

std::string BackendCpsim::row_text(const at::Tensor& t) {
  return dtype_text(t) + ", rows of " + std::to_string(row_numel(t));
}

std::vector<at::Tensor> BackendCpsim::all_to_all(const std::vector<at::Tensor>& parts, const std::string& name,
                                                 const std::string& args) {
  const int n = getSize();
  at::Tensor sizes = at::empty({n}, at::kLong);
  for (int q = 0; q < n; ++q) sizes[q] = static_cast<std::int64_t>(as_bytes(parts[q]).numel());
  at::Tensor all_sizes = exchange(sizes, name, args + " (sizes)").view(at::kLong).view({n, n});
  const std::int64_t longest = all_sizes.sum(1).max().item<std::int64_t>();
  at::Tensor mine = at::zeros({longest}, at::kByte);
  std::int64_t offset = 0;
  for (int q = 0; q < n; ++q) {
    at::Tensor b = as_bytes(parts[q]);
    mine.narrow(0, offset, b.numel()).copy_(b);
    offset += b.numel();
  }
  at::Tensor all = exchange(mine, name, args);
  std::vector<at::Tensor> out;
  const at::ScalarType type = parts.empty() ? at::kByte : parts[0].scalar_type();
  for (int q = 0; q < n; ++q) {
    std::int64_t start = 0;
    for (int k = 0; k < getRank(); ++k) start += all_sizes[q][k].item<std::int64_t>();
    const std::int64_t bytes = all_sizes[q][getRank()].item<std::int64_t>();
    out.push_back(all[q].narrow(0, start, bytes).clone().view(type));
  }
  return out;
}

}  // namespace cpsim::torch_backend
