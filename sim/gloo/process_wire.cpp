#include "sim/gloo/process_wire.hpp"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "sim/gloo/protocol.hpp"

namespace cpsim::sim {

namespace {

struct WireHeader {
  std::int64_t tag = 0, numel = 0, nbytes = 0, seq = 0;
  char dtype[24] = {};
  char site[96] = {};
};

}  // namespace

ProcessWire::ProcessWire(const GlooRank& rank, std::vector<int> ranks, std::shared_ptr<Mailbox> mailbox,
                         std::chrono::milliseconds timeout)
    : context_(rank.context_ptr()), ranks_(std::move(ranks)), me_(rank.rank()), mailbox_(std::move(mailbox)),
      timeout_(timeout) {
  if (context_ && ranks_.size() > 1) thread_ = std::thread([this] { take(); });
}

ProcessWire::~ProcessWire() {
  stopping_ = true;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (header_) header_->abortWaitRecv();
  }
  if (thread_.joinable()) thread_.join();
}

void ProcessWire::send(int dst, int tag, const Mailbox::Message& m) {
  const auto it = std::find(ranks_.begin(), ranks_.end(), dst);
  if (it == ranks_.end() || !context_) throw InvalidInput("send to rank " + std::to_string(dst) + ": not in this group");
  const int peer = static_cast<int>(it - ranks_.begin());
  WireHeader h;
  h.tag = tag, h.numel = m.payload.numel, h.nbytes = static_cast<std::int64_t>(m.payload.bytes.size()), h.seq = m.seq;
  std::strncpy(h.dtype, m.payload.dtype.c_str(), sizeof h.dtype - 1);
  std::strncpy(h.site, m.site.c_str(), sizeof h.site - 1);
  try {
    auto header = context_->createUnboundBuffer(&h, sizeof h);
    std::unique_ptr<gloo::transport::UnboundBuffer> payload;
    header->send(peer, kWireHeaderSlot);
    if (h.nbytes) {
      payload = context_->createUnboundBuffer(const_cast<std::uint8_t*>(m.payload.bytes.data()),
                                              static_cast<std::size_t>(h.nbytes));
      payload->send(peer, kWirePayloadSlot);
    }
    header->waitSend(timeout_);
    if (payload) payload->waitSend(timeout_);
  } catch (const std::exception& e) {
    throw CollectiveError("rank " + std::to_string(ranks_[me_]) + "'s send to rank " + std::to_string(dst) + " (tag " +
                          std::to_string(tag) + ", " + m.payload.shape() + ") did not leave within " +
                          std::to_string(timeout_.count()) + " ms: " + e.what());
  }
}

void ProcessWire::take() {
  std::vector<int> peers;
  for (int q = 0; q < static_cast<int>(ranks_.size()); ++q)
    if (q != me_) peers.push_back(q);
  while (!stopping_) {
    WireHeader h;
    int src = -1;
    try {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) return;
        header_ = context_->createUnboundBuffer(&h, sizeof h);
        header_->recv(peers, kWireHeaderSlot);
      }
      if (!header_->waitRecv(&src, std::chrono::hours(24 * 365)) || stopping_) return;
      std::vector<std::uint8_t> bytes(static_cast<std::size_t>(h.nbytes));
      if (h.nbytes) {
        auto payload = context_->createUnboundBuffer(bytes.data(), static_cast<std::size_t>(h.nbytes));
        payload->recv(src, kWirePayloadSlot);
        payload->waitRecv(timeout_);
      }
      h.dtype[sizeof h.dtype - 1] = h.site[sizeof h.site - 1] = 0;
      mailbox_->arrive("", ranks_[src], ranks_[me_], static_cast<int>(h.tag),
                       Mailbox::Message{Payload{std::move(bytes), h.dtype, h.numel}, static_cast<int>(h.seq), h.site});
    } catch (const std::exception&) {
      return;  // the group's connections closed (a peer ended or failed): its calls report that
    }
  }
}

}  // namespace cpsim::sim
