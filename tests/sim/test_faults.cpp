// The fault matrix on every backend that runs ranks in this process (threads,
// the test-only delayed, gloo): each fault ends on every surviving rank with the
// documented error, naming the ranks and their calls, within the timeout + 2 s,
// and leaves no thread behind. With CPSIM_FAULT_TABLE=FILE the measured times are
// appended to FILE as the rows of docs/errors.md.
#include <gmock/gmock.h>

#include <dirent.h>

#include <atomic>
#include <cctype>
#include <map>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <regex>
#include <thread>

#include "core/comm/registry.hpp"
#include "core/comm/run_ranks.hpp"

using namespace cpsim;
using namespace std::chrono_literals;
using ::testing::HasSubstr;

namespace {

constexpr auto kTimeout = 1000ms;  // the timeout the faults run under

struct Fault {
  std::string name;
  int ranks;
  // Rank r's part; `faulty` is the rank that misbehaves.
  std::function<void(Communicator& comm)> body;
  // Text every surviving rank's error must contain (the rank and its call).
  std::vector<std::string> survivors_see;
  // The faulty rank's own error ("" when it does not fail itself).
  std::string faulty_sees;
};

// Every fault at `scale` times its base message size: the sizes straddle each
// backend's thresholds (threads stages messages up to 64 KiB, gloo gathers up to
// 1 MiB per rank directly), so both paths of every backend meet every fault.
std::vector<Fault> faults(std::size_t scale) {
  auto ag = [scale](Communicator& comm, std::size_t count = 2, DType dt = DType::f64) {
    std::vector<double> in(count * scale), out(count * scale * comm.size());
    comm.all_gather(in.data(), out.data(), count * scale, dt);
  };
  const std::string two = std::to_string(2 * scale), three = std::to_string(3 * scale);
  return {
      {"a rank skips a collective (returns early)", 3,
       [=](Communicator& comm) {
         ag(comm);
         if (comm.rank() != 1) ag(comm);
       },
       {"rank 1 returned without joining all_gather #2"}, ""},
      {"two ranks call different collectives", 3,
       [=](Communicator& comm) {
         if (comm.rank() == 1) comm.barrier();
         else ag(comm);
       },
       {"different collectives at #1", "rank 1: in barrier #1", "rank 0: in all_gather #1"}, "different collectives"},
      {"one collective, different sizes", 3,
       [=](Communicator& comm) { ag(comm, comm.rank() == 1 ? 3 : 2); },
       {"all_gather #1 with different sizes", "rank 1: in all_gather #1 (count " + three}, "different sizes"},
      {"one collective, different dtypes", 3,
       [=](Communicator& comm) { ag(comm, 2, comm.rank() == 1 ? DType::i64 : DType::f64); },
       {"different dtypes", "rank 1: in all_gather #1 (count " + two + ", int64)"}, "different dtypes"},
      {"one collective, different roots", 3,
       [=](Communicator& comm) {
         std::vector<double> x(scale, 1.0);
         comm.broadcast(x.data(), scale, DType::f64, comm.rank() == 1 ? 1 : 0);
       },
       {"broadcast #1 with different roots", "root 1", "root 0"}, "different roots"},
      {"send_recv peers that do not pair up", 3,
       [=](Communicator& comm) {
         std::vector<float> out(scale, 1.0f), in(scale);
         const int dst = comm.rank() == 0 ? 1 : -1, src = comm.rank() == 1 ? 2 : -1;
         comm.send_recv({out.data(), scale, dst, in.data(), scale, src}, DType::f32);
       },
       {"send_recv #1: rank 0 sends to rank 1, which does not receive from it",
        "rank 1: in send_recv #1 (send 0 to nobody, recv " + std::to_string(scale) + " from rank 2"},
       "send_recv #1"},
      {"a rank throws before any collective", 3,
       [=](Communicator& comm) {
         if (comm.rank() == 1) throw InvalidInput("injected before");
         ag(comm);
       },
       {"rank 1 threw: injected before"}, "injected before"},
      {"a rank throws between the collectives of an operator", 3,
       [=](Communicator& comm) {
         ag(comm);
         if (comm.rank() == 1) throw Error("injected inside");
         ag(comm);
       },
       {"rank 1 threw: injected inside"}, "injected inside"},
      {"a rank throws after its last collective", 3,
       [=](Communicator& comm) {
         ag(comm);
         if (comm.rank() == 1) throw Error("injected after");
       },
       {}, "injected after"},
      {"a rank sleeps past the timeout", 3,
       [=](Communicator& comm) {
         if (comm.rank() == 1) std::this_thread::sleep_for(kTimeout + 500ms);
         ag(comm);
       },
       {"timeout: rank ", "(limit 1000 ms) in all_gather #1", "for rank 1, which never arrived", "rank 1: not in a collective"}, ""},
      {"a call after a failure", 3,
       [=](Communicator& comm) {
         try {
           ag(comm, comm.rank() == 1 ? 3 : 2);
         } catch (const CollectiveError&) {
         }
         ag(comm);  // the group is stopped: this fails at once, with the first failure
       },
       {"all_gather #1 with different sizes"}, "different sizes"},
      {"a rank sends a small message and receives a large one", 2,
       [=](Communicator& comm) {
         // The halo's pattern: rank 0 sends to rank 1, which sends nothing. Then
         // rank 1 skips the next call: the first must have completed on both.
         std::vector<double> out(8193, 1.0), in(out.size());  // just over 64 KiB
         const bool first = comm.rank() == 0;
         comm.send_recv({out.data(), first ? out.size() : 0, first ? 1 : -1, in.data(), first ? 0 : in.size(),
                         first ? -1 : 0},
                        DType::f64);
         if (comm.rank() != 1) ag(comm);
       },
       {"rank 1 returned without joining all_gather #2"}, ""},
  };
}

// Runs `f` on `backend` under the matrix's timeout; `seen(rank, what)` (on the
// rank's thread) for every rank that threw. Returns what run_ranks rethrew.
std::string run_fault(const Fault& f, const std::string& backend,
                      const std::function<void(int, const std::string&)>& seen) {
  try {
    run_ranks(f.ranks, [&](Communicator& comm) {
      try {
        f.body(comm);
      } catch (const std::exception& e) {
        seen(comm.rank(), e.what());
        throw;
      }
    }, {backend, kTimeout});
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A first line with its numbers made N: times, ports and which surviving rank
// timed out first vary from run to run; the words do not.
std::string shape_of(const std::string& line) {
  std::string out;
  for (std::size_t i = 0; i < line.size(); ++i) {
    if (std::isdigit(static_cast<unsigned char>(line[i]))) {
      out += 'N';
      while (i + 1 < line.size() && std::isdigit(static_cast<unsigned char>(line[i + 1]))) ++i;
    } else {
      out += line[i];
    }
  }
  return out;
}

// The rows of docs/errors.md's in-process table for `backend`: fault -> first line.
std::map<std::string, std::string> documented_errors(const std::string& backend) {
  std::ifstream in(std::string(CPSIM_SOURCE_DIR) + "/docs/errors.md");
  std::map<std::string, std::string> rows;
  std::string line;
  const std::string prefix = "| " + backend + " | ";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    const auto fault_end = line.find(" | `", prefix.size());
    const auto error_end = line.find("` | ", fault_end);
    if (fault_end == std::string::npos || error_end == std::string::npos) continue;
    rows[line.substr(prefix.size(), fault_end - prefix.size())] = line.substr(fault_end + 4, error_end - fault_end - 4);
  }
  return rows;
}

int threads_of_this_process() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

// Message sizes of the matrix, as a multiple of each fault's base count of a few
// elements: the base all_gather (2 float64) moves 16 bytes, then just over 64 KiB,
// then just over 1 MiB per rank.
constexpr std::size_t kScales[] = {1, 4097, 65537};

class FaultMatrix : public ::testing::TestWithParam<std::tuple<std::string, std::size_t>> {};
INSTANTIATE_TEST_SUITE_P(BackendsAndSizes, FaultMatrix,
                         ::testing::Combine(::testing::ValuesIn(backend_names()), ::testing::ValuesIn(kScales)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_x" + std::to_string(std::get<1>(info.param));
                         });

}  // namespace

TEST_P(FaultMatrix, EveryFaultEndsOnEveryRankWithItsErrorWithinTheTimeout) {
  const auto [backend, scale] = GetParam();
  std::ofstream table;
  if (const char* path = std::getenv("CPSIM_FAULT_TABLE"); path && scale == 1) table.open(path, std::ios::app);
  int threads_after_first = -1;
  std::map<std::string, std::string> first_lines;  // fault -> what the docs must say
  for (int round = 0; round < 2; ++round) {
    for (const Fault& f : faults(scale)) {
      std::mutex mutex;
      std::vector<std::string> seen(f.ranks);
      std::vector<double> at(f.ranks, 0);
      const auto start = std::chrono::steady_clock::now();
      const std::string rethrown = run_fault(f, backend, [&](int rank, const std::string& what) {
        std::lock_guard<std::mutex> lock(mutex);
        seen[rank] = what;
        at[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      });
      const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      SCOPED_TRACE(f.name + " at " + std::to_string(scale) + "x");
      EXPECT_LT(total, std::chrono::duration<double>(kTimeout).count() + 2.0) << "took " << total << " s";
      EXPECT_FALSE(rethrown.empty()) << "run_ranks returned as if nothing happened";
      for (int r = 0; r < f.ranks; ++r) {
        if (r == 1) {
          if (!f.faulty_sees.empty()) {
            EXPECT_THAT(seen[r], HasSubstr(f.faulty_sees));
          }
          continue;
        }
        if (f.survivors_see.empty()) {
          EXPECT_EQ(seen[r], "") << "rank " << r << " should have finished";
          continue;
        }
        for (const auto& text : f.survivors_see) EXPECT_THAT(seen[r], HasSubstr(text)) << "rank " << r;
      }
      // What a surviving rank sees (rank 0), else what run_ranks rethrew.
      const std::string& what = seen[0].empty() ? rethrown : seen[0];
      const std::string first_line = what.substr(0, what.find('\n')).substr(0, 160);
      if (round == 0) first_lines[f.name] = first_line;
      if (round == 0 && table.is_open()) {
        double slowest = 0;
        for (double t : at) slowest = std::max(slowest, t);
        table << "| " << backend << " | " << f.name << " | `" << first_line << "` | "
              << static_cast<int>(slowest * 1000 + 0.5) << " ms |\n";
      }
    }
    // docs/errors.md says what each fault gives, on this backend: the table's rows
    // are checked here (numbers aside), so the page cannot drift from the code.
    if (round == 0 && scale == 1) {
      const auto documented = documented_errors(backend);
      for (const auto& [fault, line] : first_lines) {
        SCOPED_TRACE(fault);
        ASSERT_TRUE(documented.count(fault)) << "docs/errors.md has no row for " << backend << " | " << fault
                                             << " (CPSIM_FAULT_TABLE=FILE writes the rows)";
        EXPECT_EQ(shape_of(documented.at(fault)), shape_of(line)) << "docs/errors.md is out of date";
      }
      EXPECT_EQ(documented.size(), first_lines.size()) << "docs/errors.md documents faults the matrix does not run";
      // One fault reads the same on every backend: the documented first lines (each
      // checked against its backend above) agree with the threads backend's.
      const auto on_threads = documented_errors("threads");
      for (const auto& [fault, line] : documented) {
        if (on_threads.count(fault)) {
          EXPECT_EQ(shape_of(line), shape_of(on_threads.at(fault))) << fault << " reads differently on " << backend;
        }
      }
    }
    // A second round of every fault starts no new threads: none were left behind.
    if (round == 0) {
      threads_after_first = threads_of_this_process();
    } else {
      EXPECT_LE(threads_of_this_process(), threads_after_first) << "threads were left behind";
    }
  }
}

// One fault reads the same on every in-process backend: not only the first line
// (the matrix above checks it against docs/errors.md) but the report of the rank
// at fault, the line that says what it did ("returned (last completed: ...)",
// "threw: ...", "not in a collective ..."). Numbers (times, ports) aside.
TEST(FaultReports, TheRankAtFaultReadsTheSameOnEveryInProcessBackend) {
  std::map<std::string, std::map<std::string, std::string>> reports;  // fault -> backend -> report
  for (const std::string& backend : backend_names()) {
    if (find_backend(backend).unavailable()) continue;
    for (const Fault& f : faults(1)) {
      std::string what;  // rank 0's, else what run_ranks rethrew
      const std::string rethrown = run_fault(f, backend, [&](int rank, const std::string& e) {
        if (rank == 0) what = e;
      });
      reports[f.name][backend] = what.empty() ? rethrown : what;
    }
  }
  for (const auto& [fault, by_backend] : reports) {
    SCOPED_TRACE(fault);
    auto at_fault = [](const std::string& report) {
      std::string first = report.substr(0, report.find('\n')), faulty;
      const auto at = report.find("\n  rank 1: ");
      if (at != std::string::npos) faulty = report.substr(at + 1, report.find('\n', at + 1) - at - 1);
      return shape_of(first) + "\n" + shape_of(faulty);
    };
    const std::string& on_threads = by_backend.at("threads");
    for (const auto& [backend, report] : by_backend)
      EXPECT_EQ(at_fault(report), at_fault(on_threads)) << "on " << backend << ":\n" << report << "\non threads:\n"
                                                        << on_threads;
  }
}

// A subgroup (new_group, a DeviceMesh dimension) reports in the numbers its user
// reads: every fault of the matrix on a group of global ranks 1, 3, 4 (of 6)
// names only those ranks, and every report of a call names the group.
TEST(FaultReports, ASubgroupNamesGlobalRanksAndTheGroup) {
  const RankNames names = RankNames::of({1, 3, 4}, 6);
  ASSERT_EQ(names.group, "the group of ranks 1, 3, 4");
  EXPECT_TRUE(RankNames::of({0, 1, 2}, 3).world()) << "every rank in order is the world";
  const std::regex rank_numbers(R"(\branks? (\d+(, \d+)*))");
  for (const std::string& backend : backend_names()) {
    if (find_backend(backend).unavailable()) continue;
    for (const Fault& f : faults(1)) {
      if (f.ranks != 3) continue;
      SCOPED_TRACE(backend + ": " + f.name);
      const auto group = find_backend(backend).make_group(f.ranks, kTimeout, names);
      std::vector<std::string> reports(f.ranks);
      std::vector<std::thread> threads;
      for (int r = 0; r < f.ranks; ++r)
        threads.emplace_back([&, r] {
          try {
            const auto comm = group->communicator(r);
            f.body(*comm);
            group->finish(r);
          } catch (const std::exception& e) {
            reports[r] = e.what();
            group->fail(r, e.what());
          }
        });
      for (auto& t : threads) t.join();
      group->done();
      for (const std::string& report : reports) {
        if (report.empty() || report.find("injected") == 0) continue;  // the rank's own exception
        for (std::sregex_iterator it(report.begin(), report.end(), rank_numbers), end; it != end; ++it) {
          std::string list = (*it)[1];
          for (std::size_t at = 0; at != std::string::npos;) {
            const int number = std::stoi(list.substr(at));
            EXPECT_TRUE(number == 1 || number == 3 || number == 4) << "rank " << number << " in:\n" << report;
            at = list.find(", ", at);
            if (at != std::string::npos) at += 2;
          }
        }
        const std::string first = report.substr(0, report.find('\n'));
        if (first.find(" threw: ") == std::string::npos)
          EXPECT_THAT(first, HasSubstr("on the group of ranks 1, 3, 4")) << report;
        EXPECT_THAT(report, ::testing::Not(HasSubstr("not in a collective"))) << "a subgroup's rank may be in another's";
      }
    }
  }
}
