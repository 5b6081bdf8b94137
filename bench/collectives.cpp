#include "bench/collectives.hpp"

#include "core/bytes.hpp"

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "core/comm/run_ranks.hpp"
#include "core/error.hpp"

namespace cpsim::bench {

using Clock = std::chrono::steady_clock;

Op op_from_name(const std::string& name) {
  for (Op op : kTimedOps)
    if (name == collective_name(op)) return op;
  CPSIM_INVALID("unknown collective '", name, "' (all_gather, reduce_scatter, send_recv)");
}

namespace {

// What rank q sends at element i: small integers, so every sum is exact in float.
float value(int q, std::size_t i) { return static_cast<float>((q * 131 + i * 7) % 1021); }

// Bytes one rank's call moves (what it writes, and for a reduction what it reads).
std::size_t moved_bytes(Op op, int ranks, std::size_t bytes) {
  return op == Op::send_recv ? bytes : static_cast<std::size_t>(ranks) * bytes;
}

// A decade's tick label: 0.001, 0.01, 0.1, 1, 10, 100 (never "0.0").
std::string tick_text(double v) {
  std::ostringstream os;
  os << std::setprecision(v < 1 ? 1 : 6) << (v < 1 ? v : std::round(v));
  return os.str();
}

double bus_factor(Op op, int ranks) { return op == Op::send_recv ? 1.0 : (ranks - 1.0) / ranks; }

}  // namespace

int iterations_for(Op op, int ranks, std::size_t bytes) {
  const double budget = 256.0 * (1 << 20);  // bytes moved per point, all ranks together
  const double per_call = static_cast<double>(moved_bytes(op, ranks, bytes)) * ranks + 4096.0 * ranks;
  return static_cast<int>(std::clamp(budget / per_call, 5.0, 2000.0));
}

Point measure(const std::string& backend, Op op, int n, std::size_t bytes, int iterations, std::shared_ptr<Job> job) {
  Point p;
  p.backend = backend;
  p.op = op;
  p.ranks = n;
  p.count = std::max<std::size_t>(1, bytes / sizeof(float));
  p.bytes = p.count * sizeof(float);
  p.size = op == Op::send_recv ? p.bytes : n * p.bytes;
  p.iterations = iterations;
  const std::size_t count = p.count;
  const std::size_t send_n = op == Op::reduce_scatter ? n * count : count;
  const std::size_t recv_n = op == Op::all_gather ? n * count : count;
  // Per-rank results as run outputs: in a multi-process job every process gets them.
  std::vector<Tensor> wrongs(n), times(n);
  std::int64_t wrong = 0;
  RunOptions o;
  o.backend = backend;
  o.timeout = std::chrono::milliseconds(120000);
  o.job = std::move(job);
  // One timed run of the call; rank 0's seconds.
  auto timed = [&] {
    run_ranks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      const Device device = comm.device();
      Tensor send_host({static_cast<std::int64_t>(send_n)}, DType::f32);
      float* s = send_host.data<float>();
      for (std::size_t i = 0; i < send_n; ++i) s[i] = value(r, i);
      const Tensor send = device.is_cpu() ? send_host : send_host.to(device);
      Tensor recv({static_cast<std::int64_t>(recv_n)}, DType::f32, device);
      const int to = (r + 1) % n, from = (r + n - 1) % n;
      auto call = [&] {
        switch (op) {
          case Op::all_gather: comm.all_gather(send.raw(), recv.raw(), count, DType::f32); break;
          case Op::reduce_scatter: comm.reduce_scatter(send.raw(), recv.raw(), count, DType::f32); break;
          case Op::send_recv:
            comm.send_recv(SendRecv{send.raw(), count, n > 1 ? to : -1, recv.raw(), count, n > 1 ? from : -1}, DType::f32);
            break;
          default: CPSIM_ENFORCE(false, "bench times ", collective_name(op), " only as one of kTimedOps");
        }
      };
      call();  // warm-up: connections, pages, caches
      comm.barrier();
      const auto t0 = Clock::now();
      for (int i = 0; i < iterations; ++i) call();
      comm.barrier();
      times[r] = Tensor::full({1}, DType::f64, std::chrono::duration<double>(Clock::now() - t0).count());
      // The last call's result, element by element.
      const Tensor got_t = device.is_cpu() ? recv : recv.to(Device::host());
      const float* got = got_t.data<float>();
      std::int64_t bad = 0;
      for (std::size_t i = 0; i < recv_n; ++i) {
        float want = 0;
        switch (op) {
          case Op::all_gather: want = value(static_cast<int>(i / count), i % count); break;
          case Op::reduce_scatter:
            for (int q = 0; q < n; ++q) want += value(q, r * count + i);
            break;
          case Op::send_recv: want = n > 1 ? value(from, i) : 0; break;
          default: break;
        }
        bad += got[i] != want;
      }
      wrongs[r] = Tensor::from<std::int64_t>({1}, {bad});
    }, o, {&wrongs, &times});
    for (const Tensor& w : wrongs) wrong += w.get_int(0);
    return times[0].get(0);
  };
  // On a shared machine one round is at the mercy of the neighbours. Large points
  // alternate the call and its reference three times and keep the best of each;
  // small ones, where a round is a few wake-ups, five times and keep the median.
  const bool large = moved_bytes(op, n, p.bytes) >= (1 << 20);
  std::vector<double> calls, refs;
  for (int round = 0; round < (large ? 3 : 5); ++round) {
    calls.push_back(timed());
    refs.push_back(ref_us(n, moved_bytes(op, n, p.bytes), iterations));
  }
  auto pick = [large](std::vector<double>& v) {
    std::sort(v.begin(), v.end());
    return large ? v.front() : v[v.size() / 2];
  };
  const double seconds = pick(calls), limit = pick(refs);
  p.time_us = seconds * 1e6 / iterations;
  p.algbw = static_cast<double>(p.size) / (p.time_us * 1e3);
  p.busbw = p.algbw * bus_factor(op, n);
  p.wrong = wrong;
  p.ref_us = limit;
  return p;
}

double ref_us(int threads, std::size_t bytes, int iterations) {
  std::barrier sync(threads);
  double seconds = 0;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      std::vector<std::byte> src(bytes, std::byte{1}), dst(bytes, std::byte{0});  // touched: no page faults in the loop
      std::memcpy(dst.data(), src.data(), bytes);
      sync.arrive_and_wait();
      const auto t0 = Clock::now();
      for (int i = 0; i < iterations; ++i) {
        std::memcpy(dst.data(), src.data(), bytes);
        sync.arrive_and_wait();
      }
      if (t == 0) seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  for (auto& t : pool) t.join();
  return seconds * 1e6 / iterations;
}

std::size_t parse_size(const std::string& text) { return static_cast<std::size_t>(parse_bytes(text)); }

std::string size_text(std::size_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return std::to_string(bytes >> 20) + "M";
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) return std::to_string(bytes >> 10) + "K";
  return std::to_string(bytes);
}

std::string table(const std::vector<Point>& points) {
  std::ostringstream os;
  std::string header;
  for (const Point& p : points) {
    const std::string h = std::string("# ") + collective_name(p.op) + " on " + p.backend + ", " + std::to_string(p.ranks) +
                          " ranks, float32; size = " + (p.op == Op::send_recv ? "bytes sent" : "ranks x bytes per rank") +
                          "\n# ref = a same-run memcpy of the bytes + std::barrier by as many threads; vs ref = ref / "
                          "time (above 1: faster than the reference)";
    if (h != header) {
      header = h;
      os << "\n" << h << "\n"
         << "#" << std::setw(12) << "size" << std::setw(12) << "count" << std::setw(7) << "type" << std::setw(12)
         << "time(us)" << std::setw(13) << "algbw(GB/s)" << std::setw(13) << "busbw(GB/s)" << std::setw(8) << "#wrong"
         << std::setw(12) << "ref(us)" << std::setw(10) << "vs ref" << "\n";
    }
    os << std::setw(13) << p.size << std::setw(12) << p.count << std::setw(7) << "float" << std::fixed
       << std::setprecision(2) << std::setw(12) << p.time_us << std::setw(13) << p.algbw << std::setw(13) << p.busbw
       << std::setw(8) << p.wrong << std::setw(12) << p.ref_us << std::setw(10) << p.vs_ref() << "\n";
    os.unsetf(std::ios::fixed);
  }
  return os.str();
}

std::string json(const std::vector<Point>& points) {
  nlohmann::json out = nlohmann::json::array();
  for (const Point& p : points)
    out.push_back({{"backend", p.backend}, {"op", collective_name(p.op)}, {"ranks", p.ranks}, {"bytes", p.bytes},
                   {"size", p.size}, {"count", p.count}, {"type", "float"}, {"iterations", p.iterations},
                   {"time_us", p.time_us}, {"algbw_gbps", p.algbw}, {"busbw_gbps", p.busbw}, {"wrong", p.wrong},
                   {"ref_us", p.ref_us}, {"vs_ref", p.vs_ref()}});
  return out.dump(1) + "\n";
}

std::string svg(const std::vector<Point>& points) {
  std::vector<Op> ops;
  std::vector<int> ranks;
  std::vector<std::string> backends;
  double lo_x = 1e30, hi_x = 0, lo_y = 1e30, hi_y = 0;
  for (const Point& p : points) {
    if (std::find(ops.begin(), ops.end(), p.op) == ops.end()) ops.push_back(p.op);
    if (std::find(ranks.begin(), ranks.end(), p.ranks) == ranks.end()) ranks.push_back(p.ranks);
    if (std::find(backends.begin(), backends.end(), p.backend) == backends.end()) backends.push_back(p.backend);
    const double limit_bw = p.size / (p.ref_us * 1e3) * bus_factor(p.op, p.ranks);
    lo_x = std::min(lo_x, static_cast<double>(p.bytes));
    hi_x = std::max(hi_x, static_cast<double>(p.bytes));
    for (double y : {p.busbw, limit_bw})
      if (y > 0) lo_y = std::min(lo_y, y), hi_y = std::max(hi_y, y);
  }
  std::sort(ranks.begin(), ranks.end());
  if (points.empty()) lo_x = 1, hi_x = 2, lo_y = 1e-3, hi_y = 1;
  if (hi_x <= lo_x) hi_x = lo_x * 2;
  lo_y = std::pow(10, std::floor(std::log10(lo_y)));
  hi_y = std::pow(10, std::ceil(std::log10(hi_y)));
  if (hi_y <= lo_y) hi_y = lo_y * 10;
  const double W = 360, H = 240, ml = 60, mt = 30, pad = 30;
  const double total_w = ranks.size() * (W + ml + pad) + 160, total_h = ops.size() * (H + mt + 50) + 20;
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  std::ostringstream os;
  os << std::fixed << std::setprecision(1);
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << total_w << "\" height=\"" << total_h
     << "\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  for (std::size_t oi = 0; oi < ops.size(); ++oi)
    for (std::size_t ri = 0; ri < ranks.size(); ++ri) {
      const double x0 = ri * (W + ml + pad) + ml, y0 = oi * (H + mt + 50) + mt;
      auto X = [&](double b) { return x0 + (std::log2(b) - std::log2(lo_x)) / (std::log2(hi_x) - std::log2(lo_x)) * W; };
      auto Y = [&](double v) {
        return y0 + H - (std::log10(std::max(v, lo_y)) - std::log10(lo_y)) / (std::log10(hi_y) - std::log10(lo_y)) * H;
      };
      os << "<rect x=\"" << x0 << "\" y=\"" << y0 << "\" width=\"" << W << "\" height=\"" << H
         << "\" fill=\"none\" stroke=\"#888\"/>\n";
      os << "<text x=\"" << x0 << "\" y=\"" << y0 - 8 << "\" font-weight=\"bold\">" << collective_name(ops[oi]) << ", "
         << ranks[ri] << " ranks: bus bandwidth (GB/s) against bytes per rank</text>\n";
      for (double v = lo_y; v <= hi_y * 1.001; v *= 10)
        os << "<line x1=\"" << x0 << "\" x2=\"" << x0 + W << "\" y1=\"" << Y(v) << "\" y2=\"" << Y(v)
           << "\" stroke=\"#eee\"/><text x=\"" << x0 - 4 << "\" y=\"" << Y(v) + 4 << "\" text-anchor=\"end\">"
           << tick_text(v) << "</text>\n";
      for (double b = lo_x; b <= hi_x * 1.001; b *= 8)
        os << "<text x=\"" << X(b) << "\" y=\"" << y0 + H + 14 << "\" text-anchor=\"middle\">"
           << size_text(static_cast<std::size_t>(b)) << "</text>\n";
      for (std::size_t bi = 0; bi < backends.size(); ++bi) {
        std::string line, limit;
        for (const Point& p : points) {
          if (p.op != ops[oi] || p.ranks != ranks[ri] || p.backend != backends[bi]) continue;
          std::ostringstream a, b;
          a << std::fixed << std::setprecision(1) << X(p.bytes) << "," << Y(p.busbw) << " ";
          b << std::fixed << std::setprecision(1) << X(p.bytes) << ","
            << Y(p.size / (p.ref_us * 1e3) * bus_factor(p.op, p.ranks)) << " ";
          line += a.str();
          limit += b.str();
        }
        const char* color = colors[bi % 6];
        if (!line.empty())
          os << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\" points=\"" << line << "\"/>\n"
             << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-dasharray=\"4 3\" points=\"" << limit
             << "\"/>\n";
      }
    }
  const double lx = ranks.size() * (W + ml + pad) + 10;
  for (std::size_t bi = 0; bi < backends.size(); ++bi) {
    const double ly = 40 + bi * 36;
    os << "<line x1=\"" << lx << "\" x2=\"" << lx + 24 << "\" y1=\"" << ly << "\" y2=\"" << ly << "\" stroke=\""
       << colors[bi % 6] << "\" stroke-width=\"2\"/><text x=\"" << lx + 30 << "\" y=\"" << ly + 4 << "\">"
       << backends[bi] << "</text>\n"
       << "<line x1=\"" << lx << "\" x2=\"" << lx + 24 << "\" y1=\"" << ly + 14 << "\" y2=\"" << ly + 14
       << "\" stroke=\"" << colors[bi % 6] << "\" stroke-dasharray=\"4 3\"/><text x=\"" << lx + 30 << "\" y=\""
       << ly + 18 << "\">its reference (memcpy + barrier)</text>\n";
  }
  os << "</svg>\n";
  return os.str();
}

}  // namespace cpsim::bench
