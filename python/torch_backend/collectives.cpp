// torch's collectives, each on the communicator under its torch name.
#include "python/torch_backend/backend.hpp"

#include "core/comm/call_check.hpp"
#include "python/torch_backend/call_site.hpp"
#include "python/torch_backend/tensors.hpp"

namespace cpsim::torch_backend {

c10::intrusive_ptr<c10d::Work> BackendCpsim::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  expect_one(tensors.size(), "broadcast");
  at::Tensor& t = tensors[0];
  expect_cpu(t, "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor bytes = as_bytes(t).clone();
  run("broadcast", shape_text(t) + ", root " + std::to_string(root),
      [&](Communicator& c, CallOptions o) { c.broadcast(bytes.data_ptr(), bytes.numel(), DType::b8, root, o); });
  if (getRank() != root) write_bytes(t, bytes);
  return work(c10d::OpType::BROADCAST, "broadcast", {t});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  expect_one(tensors.size(), "all_reduce");
  reduce_into(tensors[0], opts.reduceOp, "all_reduce", -1);
  return work(c10d::OpType::ALLREDUCE, "all_reduce", {tensors[0]});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                 const c10d::AllreduceCoalescedOptions& opts) {
  for (at::Tensor& t : tensors) reduce_into(t, opts.reduceOp, "all_reduce_coalesced", -1);
  return work(c10d::OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", tensors);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  expect_one(tensors.size(), "reduce");
  reduce_into(tensors[0], opts.reduceOp, "reduce", static_cast<int>(opts.rootRank));
  return work(c10d::OpType::REDUCE, "reduce", {tensors[0]});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) {
  expect_one(inputs.size(), "all_gather");
  expect_one(outputs.size(), "all_gather");
  gather_into_list(outputs[0], inputs[0], "all_gather");
  return work(c10d::OpType::ALLGATHER, "all_gather", outputs[0]);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::AllgatherOptions&) {
  gather_into_tensor(output, input, "all_gather_into_tensor");
  return work(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", {output});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions&) {
  if (outputs.size() != inputs.size())
    throw InvalidInput("all_gather_coalesced: " + std::to_string(outputs.size()) + " output lists for " +
                       std::to_string(inputs.size()) + " inputs");
  std::vector<at::Tensor> all;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    gather_into_list(outputs[i], inputs[i], "all_gather_coalesced");
    all.insert(all.end(), outputs[i].begin(), outputs[i].end());
  }
  return work(c10d::OpType::ALLGATHER_COALESCED, "all_gather_coalesced", all);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::AllgatherOptions&) {
  if (outputs.size() != inputs.size())
    throw InvalidInput("all_gather_into_tensor_coalesced: " + std::to_string(outputs.size()) + " outputs for " +
                       std::to_string(inputs.size()) + " inputs");
  for (std::size_t i = 0; i < inputs.size(); ++i)
    gather_into_tensor(outputs[i], inputs[i], "all_gather_into_tensor_coalesced");
  return work(c10d::OpType::COALESCED, "all_gather_into_tensor_coalesced", outputs);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                    std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  expect_one(inputs.size(), "gather");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor& in = inputs[0];
  expect_cpu(in, "gather");
  at::Tensor all = exchange(in, "gather", shape_text(in) + ", root " + std::to_string(root));
  if (getRank() == root) {
    expect_one(outputs.size(), "gather");
    expect_list(outputs[0], in, "gather");
    for (int q = 0; q < getSize(); ++q) write_bytes(outputs[0][q], all[q]);
    return work(c10d::OpType::GATHER, "gather", outputs[0]);
  }
  if (!outputs.empty() && !outputs[0].empty())
    throw InvalidInput("gather: rank " + std::to_string(getRank()) + " is not the root (" + std::to_string(root) +
                       ") and passes a gather_list");
  return work(c10d::OpType::GATHER, "gather", {});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::scatter(std::vector<at::Tensor>& outputs,
                                                     std::vector<std::vector<at::Tensor>>& inputs,
                                                     const c10d::ScatterOptions& opts) {
  expect_one(outputs.size(), "scatter");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor& out = outputs[0];
  expect_cpu(out, "scatter");
  const std::int64_t n = as_bytes(out).numel();
  at::Tensor all = at::empty({getSize() * n}, at::kByte);
  if (getRank() == root) {
    expect_one(inputs.size(), "scatter");
    expect_list(inputs[0], out, "scatter");
    for (int q = 0; q < getSize(); ++q) all.narrow(0, q * n, n).copy_(as_bytes(inputs[0][q]));
  } else if (!inputs.empty() && !inputs[0].empty()) {
    throw InvalidInput("scatter: rank " + std::to_string(getRank()) + " is not the root (" + std::to_string(root) +
                       ") and passes a scatter_list");
  }
  run("scatter", shape_text(out) + ", root " + std::to_string(root),
      [&](Communicator& c, CallOptions o) { c.broadcast(all.data_ptr(), all.numel(), DType::b8, root, o); });
  write_bytes(out, all.narrow(0, getRank() * n, n));
  return work(c10d::OpType::SCATTER, "scatter", {out});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ReduceScatterOptions& opts) {
  expect_one(outputs.size(), "reduce_scatter");
  expect_one(inputs.size(), "reduce_scatter");
  at::Tensor& out = outputs[0];
  expect_list(inputs[0], out, "reduce_scatter");
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : inputs[0]) flat.push_back(t.reshape({-1}));
  scatter_reduced(out, at::cat(flat), opts.reduceOp, "reduce_scatter");
  return work(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", {out});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                  const c10d::ReduceScatterOptions& opts) {
  scatter_reduced(output, input, opts.reduceOp, "reduce_scatter_tensor");
  return work(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", {output});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                             std::vector<at::Tensor>& inputs,
                                                                             const c10d::ReduceScatterOptions& opts) {
  if (outputs.size() != inputs.size())
    throw InvalidInput("reduce_scatter_tensor_coalesced: " + std::to_string(outputs.size()) + " outputs for " +
                       std::to_string(inputs.size()) + " inputs");
  for (std::size_t i = 0; i < inputs.size(); ++i)
    scatter_reduced(outputs[i], inputs[i], opts.reduceOp, "reduce_scatter_tensor_coalesced");
  return work(c10d::OpType::COALESCED, "reduce_scatter_tensor_coalesced", outputs);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                           std::vector<int64_t>& output_splits,
                                                           std::vector<int64_t>& input_splits,
                                                           const c10d::AllToAllOptions&) {
  expect_cpu(input, "all_to_all_single");
  expect_cpu(output, "all_to_all_single");
  const int n = getSize();
  auto splits = [&](const at::Tensor& t, std::vector<int64_t> s, const char* side) {
    if (s.empty()) {
      if (t.size(0) % n != 0)
        throw InvalidInput(std::string("all_to_all_single: the ") + side + " has " + std::to_string(t.size(0)) +
                           " rows, not a multiple of " + std::to_string(n) + " ranks (give split sizes)");
      s.assign(n, t.size(0) / n);
    }
    if (static_cast<int>(s.size()) != n)
      throw InvalidInput(std::string("all_to_all_single: ") + std::to_string(s.size()) + " " + side +
                         " split sizes for " + std::to_string(n) + " ranks");
    return s;
  };
  const std::vector<int64_t> in_rows = splits(input, input_splits, "input");
  const std::vector<int64_t> out_rows = splits(output, output_splits, "output");
  std::vector<at::Tensor> parts;
  std::int64_t offset = 0;
  for (int q = 0; q < n; ++q) {
    parts.push_back(input.narrow(0, offset, in_rows[q]));
    offset += in_rows[q];
  }
  std::vector<at::Tensor> received = all_to_all(parts, "all_to_all_single", row_text(input));
  offset = 0;
  for (int q = 0; q < n; ++q) {
    at::Tensor slot = output.narrow(0, offset, out_rows[q]);
    offset += out_rows[q];
    if (received[q].numel() != slot.numel())
      throw InvalidInput("all_to_all_single: rank " + std::to_string(getRank()) + " expects " +
                         std::to_string(out_rows[q]) + " rows from rank " + std::to_string(q) + ", which sends " +
                         std::to_string(received[q].numel() / std::max<std::int64_t>(1, row_numel(input))));
    write_bytes(slot, as_bytes(received[q]));
  }
  return work(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", {output});
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions&) {
  const int n = getSize();
  if (static_cast<int>(inputs.size()) != n || static_cast<int>(outputs.size()) != n)
    throw InvalidInput("all_to_all: " + std::to_string(inputs.size()) + " inputs and " +
                       std::to_string(outputs.size()) + " outputs for " + std::to_string(n) + " ranks");
  std::vector<at::Tensor> received = all_to_all(inputs, "all_to_all", inputs.empty() ? "" : dtype_text(inputs[0]));
  for (int q = 0; q < n; ++q) {
    if (received[q].numel() != outputs[q].numel())
      throw InvalidInput("all_to_all: rank " + std::to_string(getRank()) + "'s output " + std::to_string(q) +
                         " holds " + std::to_string(outputs[q].numel()) + " elements; rank " + std::to_string(q) +
                         " sends " + std::to_string(received[q].numel()));
    write_bytes(outputs[q], as_bytes(received[q]));
  }
  return work(c10d::OpType::ALLTOALL, "all_to_all", outputs);
}

c10::intrusive_ptr<c10d::Work> BackendCpsim::barrier(const c10d::BarrierOptions&) {
  run("barrier", "", [&](Communicator& c, CallOptions o) { c.barrier(o); });
  return work(c10d::OpType::BARRIER, "barrier", {});
}

void BackendCpsim::monitoredBarrier(const c10d::BarrierOptions& opts, bool) {
  run("monitored_barrier", "", [&](Communicator& c, CallOptions o) {
    if (opts.timeout.count() > 0) o.timeout = opts.timeout;
    c.barrier(o);
  });
}

}  // namespace cpsim::torch_backend
