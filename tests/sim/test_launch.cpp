// Multi-process jobs through cpsim launch: with the file store and with a real
// Redis server, and what happens when a rank is killed or stops answering.
// Joining a job (rank variables, claims) is tests/sim/test_jobs.cpp.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "core/error.hpp"
#include "tests/subprocess.hpp"

using namespace cpsim;
using namespace std::chrono_literals;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using cpsim::testing::run_process;

namespace {

const std::string kCpsim = CPSIM_BINARY;
const std::string& kExample = cpsim::testing::kSpecExample;

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// "cpsim launch: rank R pid P" lines, as launch prints them.
struct Pids {
  std::mutex mutex;
  std::map<int, pid_t> by_rank;
  void see(const std::string& line) {
    static const std::regex re("cpsim launch: rank ([0-9]+) pid ([0-9]+)");
    std::smatch m;
    if (!std::regex_search(line, m, re)) return;
    std::lock_guard<std::mutex> lock(mutex);
    by_rank[std::stoi(m[1])] = std::stoi(m[2]);
  }
  pid_t wait_for(int rank, std::chrono::milliseconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (by_rank.count(rank)) return by_rank[rank];
      }
      std::this_thread::sleep_for(10ms);
    }
    return -1;
  }
};

// The TCP connections a process holds open (ESTABLISHED), from its file
// descriptors and the kernel's socket tables: a rank connected to its groups.
int established_connections(pid_t pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  int n = 0;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string f[10];
      for (auto& x : f) fields >> x;  // sl local remote state tx:rx tr:when retrnsmt uid timeout inode
      if (f[3] == "01" && inodes.count(f[9])) ++n;
    }
  }
  return n;
}

// Rank `rank`'s pid once it holds `connections` TCP connections (its groups are
// connected, so it is inside the run), or -1 after `limit`. A fixed sleep after
// the pid is printed is not enough: starting can take seconds on a loaded
// machine or under a sanitizer, and a rank lost while it connects is a
// different fault (Gloo waits 5x the timeout for a first connection).
pid_t wait_connected(Pids& pids, int rank, int connections, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  const pid_t pid = pids.wait_for(rank, limit);
  if (pid <= 0) return -1;
  while (std::chrono::steady_clock::now() < end) {
    if (established_connections(pid) >= connections) return pid;
    std::this_thread::sleep_for(20ms);
  }
  return -1;
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

bool port_answers(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

}  // namespace

TEST(Launch, FourProcessesCheckABatchAndOnlyRankZeroReports) {
  const auto r = run_process({kCpsim, "launch", "-n", "4", "--", "cpsim", "check", kExample, "--backend", "gloo"}, 120s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(count_of(r.out, "all properties hold"), 1) << r.out;
  EXPECT_THAT(r.out, AllOf(HasSubstr("cp=4"), Not(HasSubstr("cp=1")), Not(HasSubstr("FAIL"))));
  EXPECT_THAT(r.err, AllOf(HasSubstr("rank 3 pid"), HasSubstr("exit status 0")));
}

TEST(Launch, AFileStoreInAGivenDirectoryServesSeveralGroupSizes) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-test-store-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  const auto r = run_process({kCpsim, "launch", "-n", "3", "--store", "file:" + dir.string(), "--", "cpsim", "check",
                              kExample, "--cp", "1,2,3", "--json"},
                             120s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("\"ok\": true"), HasSubstr("\"cp\": 3"), HasSubstr("\"cp\": 2")));
  EXPECT_FALSE(std::filesystem::is_empty(dir)) << "the rendezvous never used the directory";
  std::filesystem::remove_all(dir);
}

TEST(Launch, FuzzAcrossProcessesAgreesWithItself) {
  const auto r = run_process({kCpsim, "launch", "-n", "3", "--", "cpsim", "fuzz", "--cases", "25", "--seed", "7"}, 180s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("cp 1-3"), HasSubstr("3 processes"), HasSubstr("every property holds")));
}

// run_ranks across processes: outputs reach every process, a rank's own failure is
// rethrown everywhere, a mismatch is reported everywhere and the job goes on
// (tests/doubles/world_probe.cpp, one process per rank).
TEST(Launch, RunRanksAcrossProcessesKeepsEveryProcessInStep) {
  const auto r = run_process({kCpsim, "launch", "-n", "3", "--", CPSIM_WORLD_PROBE}, 120s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  for (int q = 0; q < 3; ++q) EXPECT_THAT(r.out, HasSubstr("probe ok rank " + std::to_string(q))) << r.err;
}

// Processes started by hand with different batches (a file that changed on one
// host) must not compare unrelated results: every rank refuses.
TEST(Launch, ProcessesWithDifferentBatchesRefuseToRun) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-test-differ-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::vector<std::pair<std::string, std::string>> env = {
      {"WORLD_SIZE", "2"}, {"CPSIM_STORE", "file:" + dir.string()}, {"CPSIM_JOB_ID", "differ"},
      {"CPSIM_GLOO_HOST", "127.0.0.1"}};
  cpsim::testing::ProcessResult other;
  auto env1 = env;  // copied before the thread starts: the main thread appends to env
  env1.push_back({"RANK", "1"});
  std::thread rank1([&] {
    other = run_process({kCpsim, "check", std::string(CPSIM_SOURCE_DIR) + "/examples/packed_two_rows.json"}, 60s, {}, env1);
  });
  env.push_back({"RANK", "0"});
  const auto r = run_process({kCpsim, "check", kExample}, 60s, {}, env);
  rank1.join();
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_EQ(other.status, 2) << other.err;
  EXPECT_THAT(r.err, HasSubstr("cpsim: rank 0: invalid input: rank 1 runs a different job than rank 0"));
  EXPECT_THAT(other.err, HasSubstr("cpsim: rank 1: invalid input: rank 1 runs a different job"));
  std::filesystem::remove_all(dir);
}

// The same batch reached by two paths (a copy elsewhere, as another host would
// mount it) is one job: the processes agree on its bytes, not its path.
TEST(Launch, TheSameBatchByDifferentPathsIsOneJob) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-test-paths-" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "elsewhere");
  const auto copy = dir / "elsewhere" / "batch.json";
  std::filesystem::copy_file(kExample, copy);
  const std::vector<std::pair<std::string, std::string>> env = {
      {"WORLD_SIZE", "2"}, {"CPSIM_STORE", "file:" + (dir / "store").string()}, {"CPSIM_JOB_ID", "paths"},
      {"CPSIM_GLOO_HOST", "127.0.0.1"}};
  auto env0 = env, env1 = env;
  env0.push_back({"RANK", "0"});
  env1.push_back({"RANK", "1"});
  cpsim::testing::ProcessResult other;
  std::thread rank1([&] { other = run_process({kCpsim, "check", copy.string(), "--cp", "2"}, 60s, {}, env1); });
  const auto r = run_process({kCpsim, "check", kExample, "--cp", "2"}, 60s, {}, env0);
  rank1.join();
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(other.status, 0) << other.err;
  EXPECT_THAT(r.out, HasSubstr("all properties hold"));
  std::filesystem::remove_all(dir);
}

TEST(Launch, CpLargerThanTheJobIsAUsageError) {
  const auto r = run_process({kCpsim, "launch", "-n", "2", "--", "cpsim", "check", kExample, "--cp", "4"}, 60s);
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("--cp 4 needs 4 processes; this job has 2"));
}

TEST(Launch, AMultiProcessJobRefusesTheThreadsBackend) {
  const auto r = run_process({kCpsim, "check", kExample, "--backend", "threads"}, 30s, {},
                             {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"CPSIM_STORE", "file:/tmp/unused"}});
  EXPECT_EQ(r.status, 2);
  EXPECT_THAT(r.err, AllOf(HasSubstr("rank 0 of 2"), HasSubstr("--backend gloo")));
}

// A real redis-server on loopback: the one .ci/run starts (CPSIM_TEST_REDIS=HOST:PORT),
// else one this test starts on a free port.
TEST(Launch, RedisRendezvous) {
  std::string address;
  pid_t server = -1;
  if (const char* env = std::getenv("CPSIM_TEST_REDIS"); env && *env) {
    address = env;
  } else {
    if (std::system("command -v redis-server >/dev/null 2>&1") != 0)
      GTEST_SKIP() << "no redis-server here and CPSIM_TEST_REDIS is not set (.ci/run sets it)";
    const int port = free_port();
    server = fork();
    if (server == 0) {
      execlp("redis-server", "redis-server", "--port", std::to_string(port).c_str(), "--bind", "127.0.0.1", "--save",
             "", "--appendonly", "no", static_cast<char*>(nullptr));
      _exit(127);
    }
    for (int i = 0; i < 200 && !port_answers(port); ++i) std::this_thread::sleep_for(25ms);
    address = "127.0.0.1:" + std::to_string(port);
  }
  const auto r = run_process({kCpsim, "launch", "-n", "3", "--store", "redis://" + address, "--", "cpsim", "check",
                              kExample, "--cp", "2,3"},
                             120s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("all properties hold"));
  EXPECT_THAT(r.err, HasSubstr("store redis://" + address));
  // The job's keys are in that server: the rendezvous really went through Redis.
  const auto colon = address.rfind(':');
  const auto keys = run_process({"redis-cli", "-h", address.substr(0, colon), "-p", address.substr(colon + 1), "--scan",
                                 "--pattern", "launch-*"},
                                30s);
  EXPECT_THAT(keys.out, HasSubstr("launch-")) << keys.err;
  if (server > 0) {
    kill(server, SIGTERM);
    waitpid(server, nullptr, 0);
  }
}

// Kill one rank mid-job: the others fail within their timeout with an error that
// names it, and launch reports it and exits with the worst status. Never a hang.
TEST(Launch, AKilledRankFailsTheOthersWithinTheTimeout) {
  Pids pids;
  std::atomic<pid_t> victim{-1};
  std::chrono::steady_clock::time_point killed_at;
  std::thread killer([&] {
    // Rank 1 is connected to the world and to the group of 2 (3 connections),
    // and well inside the run: 10^6 cases take hours.
    victim = wait_connected(pids, 1, 3, 60s);
    if (victim <= 0) return;
    std::this_thread::sleep_for(500ms);
    killed_at = std::chrono::steady_clock::now();
    kill(victim, SIGKILL);
  });
  const auto r = run_process(
      {kCpsim, "launch", "-n", "3", "--", "cpsim", "fuzz", "--cases", "1000000", "--timeout", "5"}, 120s,
      [&](const std::string& line) { pids.see(line); });
  killer.join();
  ASSERT_GT(victim, 0) << r.err;
  const auto after_kill = std::chrono::steady_clock::now() - killed_at;
  EXPECT_LT(after_kill, 5s + 3s) << "the others did not fail within the timeout";
  std::cout << "[ measured ] SIGKILL mid-run, timeout 5 s: the job ended "
            << std::chrono::duration_cast<std::chrono::milliseconds>(after_kill).count() << " ms after the kill\n";
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.err;
  // The survivors could not complete the run: exit 3, not a property failure.
  EXPECT_THAT(r.err, AllOf(HasSubstr("cpsim launch: rank 0 (pid"), HasSubstr(") exited with status 3")));
  const std::string named = "rank 1 (pid " + std::to_string(victim) + ") was killed by signal 9";
  EXPECT_THAT(r.err, AllOf(HasSubstr("cpsim: rank 0: aborted:"), HasSubstr("cpsim: rank 2: aborted:"), HasSubstr(named),
                           Not(HasSubstr("did not exit in time"))));
  // Each survivor's own error names the dead rank (launch's record, read from the store).
  for (const char* survivor : {"cpsim: rank 0: aborted:", "cpsim: rank 2: aborted:"}) {
    const auto at = r.err.find(survivor);
    ASSERT_NE(at, std::string::npos);
    const auto end = r.err.find("cpsim", at + 10);
    EXPECT_THAT(r.err.substr(at, end - at), HasSubstr(named)) << r.err;
  }
}

// A rank that stops answering (SIGSTOP): the others time out and name it; launch
// kills it after the grace period.
TEST(Launch, AStuckRankTimesOutTheOthersAndLaunchKillsIt) {
  Pids pids;
  std::atomic<pid_t> victim{-1};
  std::thread stopper([&] {
    // Every group connected (rank 1 is in the world and the group of 2), then rank 2 stops.
    if (wait_connected(pids, 1, 3, 60s) <= 0) return;
    victim = wait_connected(pids, 2, 2, 60s);
    if (victim <= 0) return;
    std::this_thread::sleep_for(500ms);
    kill(victim, SIGSTOP);
  });
  const auto r = run_process({kCpsim, "launch", "-n", "3", "--grace", "1", "--", "cpsim", "fuzz", "--cases", "1000000",
                              "--timeout", "1"},
                             120s, [&](const std::string& line) { pids.see(line); });
  stopper.join();
  ASSERT_GT(victim, 0) << r.err;
  EXPECT_LT(r.elapsed, 30s);
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.err;
  EXPECT_THAT(r.err, AllOf(HasSubstr("timeout: rank"), HasSubstr("cpsim: rank 0: aborted:"),
                           HasSubstr("rank 2 (pid " + std::to_string(victim) + ") did not exit in time; killing it")));
}

// A rank of a smaller group stops answering (SIGSTOP, not dead) while another rank
// sits that group out: every live rank ends within the timeout + 2 s and names it.
TEST(Launch, AStoppedRankEndsTheRanksSittingOutWithinTheTimeout) {
  Pids pids;
  std::atomic<pid_t> victim{-1};
  std::chrono::steady_clock::time_point stopped_at;
  std::thread stopper([&] {
    // Rank 1 is connected to the world and to the group of 2: inside the run.
    victim = wait_connected(pids, 1, 3, 60s);
    if (victim <= 0) return;
    std::this_thread::sleep_for(500ms);
    stopped_at = std::chrono::steady_clock::now();
    kill(victim, SIGSTOP);
  });
  std::chrono::steady_clock::time_point rank2_at;
  std::string rank2_line;
  const auto r = run_process({kCpsim, "launch", "-n", "3", "--grace", "6", "--", "cpsim", "fuzz", "--cases", "1000000",
                              "--max-cp", "2", "--timeout", "2"},
                             120s, [&](const std::string& line) {
                               pids.see(line);
                               if (line.find("cpsim: rank 2: aborted:") != std::string::npos) {
                                 rank2_at = std::chrono::steady_clock::now();
                                 rank2_line = line;
                               }
                             });
  stopper.join();
  ASSERT_GT(victim, 0) << r.err;
  kill(victim, SIGCONT);
  ASSERT_NE(rank2_at, std::chrono::steady_clock::time_point{}) << r.err;
  // The bound counts from when rank 2 could first notice: the stop, or its own
  // wait's start when it was still computing at the stop (a slow machine, a
  // sanitizer build). Its error says how long it waited.
  std::smatch waited_match;
  ASSERT_TRUE(std::regex_search(rank2_line, waited_match, std::regex("waited ([0-9]+) ms"))) << rank2_line;
  const std::chrono::milliseconds waited{std::stoll(waited_match[1])};
  const auto noticed_from = std::max(stopped_at, rank2_at - waited);
  EXPECT_LT(rank2_at - noticed_from, 2s + 2s) << "the rank sitting out waited too long\n" << r.err;
  std::cout << "[ measured ] SIGSTOP of a group rank, timeout 2 s: the rank sitting out reported "
            << std::chrono::duration_cast<std::chrono::milliseconds>(rank2_at - stopped_at).count()
            << " ms after the stop, after waiting " << waited.count() << " ms\n";
  // Each live rank's error (its line and the records under it) names the stopped rank.
  for (const char* live : {"cpsim: rank 0: aborted:", "cpsim: rank 2: aborted:"}) {
    const auto at = r.err.find(live);
    ASSERT_NE(at, std::string::npos) << r.err;
    EXPECT_THAT(r.err.substr(at, r.err.find("cpsim", at + 10) - at), HasSubstr("no failure record from rank 1: its process (pid " + std::to_string(victim) + ") is stopped")) << r.err;
  }
}

// docs/errors.md's table of process faults says what the tests above see: each
// phrase they assert appears in it.
TEST(Launch, TheErrorsPageSaysWhatTheseTestsSee) {
  std::ifstream in(std::string(CPSIM_SOURCE_DIR) + "/docs/errors.md");
  const std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* phrase : {"was killed by signal 9", "is stopped (SIGSTOP or a debugger)",
                             "did not exit in time; killing it", "is already in use on store", "is claimed by",
                             "runs a different job than rank 0", "needs 4 processes; this job has 2", "never came",
                             "cannot reach the Redis store", "cannot create the directory", "cpsim: rank R: aborted:"})
    EXPECT_NE(page.find(phrase), std::string::npos) << "docs/errors.md does not say: " << phrase;
}
