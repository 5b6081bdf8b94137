#include "sim/job/launch.hpp"

#include <gloo/rendezvous/prefix_store.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>

#include "core/error.hpp"
#include "sim/gloo/connect.hpp"
#include "sim/gloo/store.hpp"

namespace cpsim::sim {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

std::atomic<int> forwarded_signal{0};
void on_signal(int sig) { forwarded_signal = sig; }

std::string self_executable() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "cpsim";
  buf[n] = '\0';
  return buf;
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // exit code, or 128 + signal
  std::string how;
};

std::string describe_exit(int wstatus, int& code) {
  if (WIFSIGNALED(wstatus)) {
    const int sig = WTERMSIG(wstatus);
    code = 128 + sig;
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  code = WEXITSTATUS(wstatus);
  return "exited with status " + std::to_string(code);
}

}  // namespace

int launch_processes(const LaunchOptions& o, std::ostream& log) {
  CPSIM_ENFORCE(!o.command.empty(), "launch needs a command");
  if (o.processes < 1) CPSIM_INVALID("launch -n ", o.processes, ": needs at least one process");
  std::string store = o.store, temp_dir;
  if (store.empty()) {
    char tmpl[] = "/tmp/cpsim-launch-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) throw Aborted(std::string("cannot create a store directory: ") + strerror(errno));
    temp_dir = tmpl;
    store = "file:" + temp_dir;
  }
  std::random_device rd;
  const std::string job = "launch-" + std::to_string(getpid()) + "-" + std::to_string(rd() % 1000000);
  auto base = open_store(store);
  gloo::rendezvous::PrefixStore records(job, *base);

  std::vector<std::string> argv_s = o.command;
  if (argv_s[0] == "cpsim") argv_s[0] = self_executable();
  log << "cpsim launch: " << o.processes << " processes, store " << store << ", job " << job << "\n" << std::flush;

  struct sigaction sa {}, old_int{}, old_term{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  forwarded_signal = 0;

  std::vector<Child> children(o.processes);
  for (int r = 0; r < o.processes; ++r) {
    const pid_t pid = fork();
    if (pid < 0) throw Aborted(std::string("fork failed: ") + strerror(errno));
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(o.processes).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(o.processes).c_str(), 1);
      setenv("CPSIM_STORE", store.c_str(), 1);
      setenv("CPSIM_JOB_ID", job.c_str(), 1);
      if (!getenv("CPSIM_GLOO_HOST") && !getenv("CPSIM_GLOO_IFNAME")) setenv("CPSIM_GLOO_HOST", "127.0.0.1", 1);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      std::vector<char*> argv;
      for (auto& a : argv_s) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      const std::string msg = "cpsim launch: cannot run " + argv_s[0] + ": " + strerror(errno) + "\n";
      (void)!write(STDERR_FILENO, msg.data(), msg.size());
      _exit(127);
    }
    children[r] = {r, pid, true, 0, ""};
    log << "cpsim launch: rank " << r << " pid " << pid << "\n" << std::flush;
  }

  std::optional<Clock::time_point> deadline;
  int first_failed = -1;
  int running = o.processes;
  bool killed_rest = false;
  while (running > 0) {
    if (const int sig = forwarded_signal.exchange(0)) {
      for (auto& c : children)
        if (c.running) kill(c.pid, sig);
      if (!deadline) deadline = Clock::now() + o.grace;
    }
    int wstatus = 0;
    const pid_t pid = waitpid(-1, &wstatus, WNOHANG);
    if (pid > 0) {
      for (auto& c : children) {
        if (c.pid != pid) continue;
        c.running = false;
        --running;
        c.how = describe_exit(wstatus, c.status);
        if (c.status != 0 && running > 0) {
          // Peers that lose this process read why from the store.
          const std::string what = "rank " + std::to_string(c.rank) + " (pid " + std::to_string(pid) + ") " + c.how;
          const std::string why = what + " " + kLaunchRecordTag;
          try {
            records.set("failed/" + std::to_string(c.rank), std::vector<char>(why.begin(), why.end()));
          } catch (const std::exception&) {
          }
          if (first_failed < 0) {
            first_failed = c.rank;
            deadline = Clock::now() + o.grace;
            log << "cpsim launch: " << what << "; the others have " << o.grace.count() / 1000.0
                << " s to exit\n" << std::flush;
          }
        }
      }
      continue;
    }
    if (deadline && Clock::now() >= *deadline && !killed_rest) {
      killed_rest = true;
      for (auto& c : children)
        if (c.running) {
          log << "cpsim launch: rank " << c.rank << " (pid " << c.pid << ") did not exit in time; killing it\n"
              << std::flush;
          kill(c.pid, SIGKILL);
        }
    }
    std::this_thread::sleep_for(10ms);
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);

  int worst = 0;
  for (const auto& c : children) {
    worst = std::max(worst, c.status);
    if (c.status != 0) log << "cpsim launch: rank " << c.rank << " (pid " << c.pid << ") " << c.how << "\n";
  }
  log << "cpsim launch: exit status " << worst << "\n" << std::flush;
  if (!temp_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(temp_dir, ec);
  }
  return worst;
}

}  // namespace cpsim::sim
