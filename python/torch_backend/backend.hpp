// torch.distributed's backend "cpsim" (torch 2.x): a c10d::Backend whose every
// call runs on one rank's cpsim Communicator, so the call check (SPEC §4) stands
// in front of it: a rank that skips a call, calls another one, other sizes,
// dtypes, reductions or roots, raises, or never comes ends every rank with one
// report naming each rank's call and where in the program it made it.
//
// One mechanism carries every torch call: the communicator moves the bytes (an
// all_gather, a broadcast or a barrier), and the backend does the rest on the
// caller's thread in rank order (the reduction, the root's share, the split of
// an all_to_all). The call's torch name and arguments travel in the record
// (CallLabel), so reports and the check speak of torch's all_reduce(MAX), not of
// the all_gather that carried it. Collectives complete before they return; a
// receive completes when its message comes, so receives and sends match in any
// order (NCCL's and Gloo's semantics): the comm layer's Mailbox.
//
// Its rooms: collectives.cpp (torch's collectives), exchange.cpp (the bytes
// every rank gives: reductions, gathers, all_to_all), calls.cpp (one call on
// the communicator, its reports, and point to point).
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/call_check.hpp"
#include "core/comm/communicator.hpp"
#include "core/comm/point_to_point.hpp"
#include "core/error.hpp"
#include "python/torch_backend/work.hpp"

namespace cpsim::torch_backend {

// One rank of one group: what its calls run on.
struct RankContext {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Mailbox> mailbox;      // the ranks' point to point (a spawn's, or one process's of a job)
  std::shared_ptr<ActivityBoard> board;  // what each rank does (the spawn's ranks, or this process's)
  std::shared_ptr<Ledger> ledger;
  std::string group;  // torch's group name
  RankNames names;    // its ranks in the spawn or job, and its label where it is a subgroup
};

class BackendCpsim : public c10d::Backend {
 public:
  explicit BackendCpsim(RankContext ctx) : c10d::Backend(ctx.comm->rank(), ctx.comm->size()), ctx_(std::move(ctx)) {}

  const std::string getBackendName() const override { return "cpsim"; }
  // Whether a call of this rank ended in cpsim's CollectiveError (the report of
  // what the ranks did), as opposed to an error of the rank's own.
  bool collective_failed() const { return collective_failed_; }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  bool supportsCoalescing() const override { return false; }

  // Collectives (collectives.cpp).
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions&) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool) override;

  // Point to point (calls.cpp).
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

 private:
  // One call (calls.cpp).
  c10::intrusive_ptr<c10d::Work> post_recv(std::vector<at::Tensor>& tensors, int src, int tag);
  int global(int group_rank) const;
  c10::intrusive_ptr<c10d::Work> work(c10d::OpType type, const std::string& what, std::vector<at::Tensor> outputs,
                                      const std::string& site = "");
  // One communicator call under torch's name for it; its CollectiveError is
  // remembered (and told what ranks wait in point to point).
  void run(const std::string& name, const std::string& args, const std::function<void(Communicator&, CallOptions)>& f);
  // A report of the communicator's, with what the peers wait for in point to
  // point (the communicator sees only collectives).
  std::string told(const Error& e);
  // A point-to-point call; its CollectiveError (a peer's end) is remembered.
  void point_to_point(const std::function<void()>& f);

  // The bytes every rank gives (exchange.cpp).

  // Every rank's bytes of `t` (the same size on every rank): [ranks, bytes].
  at::Tensor exchange(const at::Tensor& t, const std::string& name, const std::string& args);
  // The reduction of every rank's t, in rank order, into t (root -1: on every
  // rank; else only on the root).
  void reduce_into(at::Tensor& t, const c10d::ReduceOp& op, const std::string& name, int root);
  // Every rank's block of `input` reduced, this rank's share into `out`.
  void scatter_reduced(at::Tensor& out, const at::Tensor& input, const c10d::ReduceOp& op, const std::string& name);
  // What cpsim does not reduce, refused before a byte moves (at every group size).
  static void expect_reduction(const c10d::ReduceOp& op, const at::Tensor& like, const std::string& name);
  // rows [ranks, bytes] of `like`'s dtype reduced by `op` (one expect_reduction
  // accepts) in rank order: a flat tensor.
  at::Tensor reduced(const at::Tensor& all, const at::Tensor& like, const c10d::ReduceOp& op, const std::string& name);
  void gather_into_list(std::vector<at::Tensor>& outputs, const at::Tensor& in, const std::string& name);
  void gather_into_tensor(at::Tensor& output, const at::Tensor& input, const std::string& name);
  void expect_list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* op) const;
  static std::int64_t row_numel(const at::Tensor& t);
  static std::string row_text(const at::Tensor& t);
  // parts[q] goes to rank q; returns what each rank sent this one (as bytes of
  // the parts' dtype): two all_gathers, of the sizes and of the padded parts.
  std::vector<at::Tensor> all_to_all(const std::vector<at::Tensor>& parts, const std::string& name,
                                     const std::string& args);

  RankContext ctx_;
  bool collective_failed_ = false;
  std::uint64_t seq_ = 0;
  std::string last_site_;
};

}  // namespace cpsim::torch_backend
