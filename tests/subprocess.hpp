// Runs a command as a child process for the command-line tests: captures stdout
// and stderr, calls `on_stderr` with each stderr line as it arrives (so a test can
// act mid-run, e.g. kill a rank), and kills the whole child process group at the
// deadline so a broken build fails the test instead of hanging it.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace cpsim::testing {

#ifdef CPSIM_SOURCE_DIR
// The shipped examples the tests read (batches, families, golden_check.py).
inline const std::string kExamplesDir = std::string(CPSIM_SOURCE_DIR) + "/examples/";
inline const std::string kSpecExample = kExamplesDir + "spec_example.json";
#endif

struct ProcessResult {
  int status = -1;  // exit code, 128+signal if killed, -1 if it hit the deadline
  std::string out, err;
  std::chrono::milliseconds elapsed{0};
  std::int64_t max_rss_bytes = 0;  // the process's peak resident memory (wait4's ru_maxrss)
};

inline ProcessResult run_process(const std::vector<std::string>& args, std::chrono::milliseconds deadline,
                                 const std::function<void(const std::string&)>& on_stderr = {},
                                 const std::vector<std::pair<std::string, std::string>>& env = {}) {
  int out_pipe[2], err_pipe[2];
  if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0) return {};
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    dup2(out_pipe[1], STDOUT_FILENO);
    dup2(err_pipe[1], STDERR_FILENO);
    close(out_pipe[0]), close(err_pipe[0]), close(out_pipe[1]), close(err_pipe[1]);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  close(out_pipe[1]), close(err_pipe[1]);
  ProcessResult r;
  std::string line;
  bool out_open = true, err_open = true, timed_out = false;
  while (out_open || err_open) {
    const auto left = deadline - (std::chrono::steady_clock::now() - start);
    if (left <= std::chrono::milliseconds(0)) {
      timed_out = true;
      kill(-pid, SIGKILL);
      break;
    }
    pollfd fds[2] = {{out_open ? out_pipe[0] : -1, POLLIN, 0}, {err_open ? err_pipe[0] : -1, POLLIN, 0}};
    poll(fds, 2, 50);
    char buf[4096];
    for (int i = 0; i < 2; ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP))) continue;
      const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n <= 0) {
        (i == 0 ? out_open : err_open) = false;
        continue;
      }
      if (i == 0) {
        r.out.append(buf, n);
        continue;
      }
      r.err.append(buf, n);
      for (ssize_t k = 0; k < n; ++k) {
        if (buf[k] != '\n') {
          line += buf[k];
          continue;
        }
        if (on_stderr) on_stderr(line);
        line.clear();
      }
    }
  }
  close(out_pipe[0]), close(err_pipe[0]);
  int wstatus = 0;
  rusage usage{};
  wait4(pid, &wstatus, 0, &usage);
  r.max_rss_bytes = static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
  r.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  if (timed_out) r.status = -1;
  else r.status = WIFSIGNALED(wstatus) ? 128 + WTERMSIG(wstatus) : WEXITSTATUS(wstatus);
  return r;
}

}  // namespace cpsim::testing
