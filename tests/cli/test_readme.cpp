// The README and the guide (docs/) are for users: every command the README shows in
// a `sh` block runs as written from the project's root after `make`, every table
// renders as one table, every page it links exists, and nothing cites a document
// that does not ship.
#include <gmock/gmock.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>

#include "tests/subprocess.hpp"

using cpsim::testing::run_process;
using namespace std::chrono_literals;

namespace {
const std::filesystem::path kSource = CPSIM_SOURCE_DIR;

std::string read(const std::filesystem::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The commands of a page's ```sh blocks (other blocks are output or other machines).
std::vector<std::string> sh_commands(const std::string& text) {
  std::vector<std::string> out;
  bool in_sh = false;
  for (const auto& line : lines_of(text)) {
    const auto start = line.find_first_not_of(' ');
    const std::string trimmed = start == std::string::npos ? "" : line.substr(start);
    if (trimmed.rfind("```", 0) == 0) {
      in_sh = !in_sh && trimmed == "```sh";
      continue;
    }
    if (in_sh && !trimmed.empty() && trimmed[0] != '#') out.push_back(trimmed);
  }
  return out;
}

std::vector<std::filesystem::path> pages() {
  std::vector<std::filesystem::path> out{kSource / "README.md"};
  for (const auto& e : std::filesystem::directory_iterator(kSource / "docs"))
    if (e.path().extension() == ".md") out.push_back(e.path());
  return out;
}
}  // namespace

TEST(Readme, EveryCommandItShowsRunsAsWritten) {
  const auto commands = sh_commands(read(kSource / "README.md"));
  ASSERT_GE(commands.size(), 6u);
  // A fresh root: the build and the examples, nothing else, so that what the
  // commands write (golden/) goes nowhere near the source tree.
  const auto root = std::filesystem::temp_directory_path() / ("cpsim-readme-" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  std::filesystem::create_directory_symlink(std::filesystem::path(CPSIM_BINARY).parent_path(), root / "build");
  std::filesystem::create_directory_symlink(kSource / "examples", root / "examples");
  for (const auto& command : commands) {
    const auto r = run_process({"/bin/bash", "-c", "cd \"$0\" && " + command, root.string()}, 300s);
    EXPECT_EQ(r.status, 0) << command << "\n" << r.out.substr(0, 2000) << r.err.substr(0, 2000);
  }
  std::filesystem::remove_all(root);
}

TEST(Readme, EveryTableRendersAsOneTable) {
  for (const auto& page : pages()) {
    const auto lines = lines_of(read(page));
    bool in_code = false;
    for (std::size_t i = 0; i < lines.size(); ++i) {
      const auto start = lines[i].find_first_not_of(' ');
      if (start != std::string::npos && lines[i].compare(start, 3, "```") == 0) in_code = !in_code;
      if (in_code || lines[i].rfind("| ", 0) != 0) continue;
      // A table: a header, a separator, then rows with as many cells, with no line between.
      ASSERT_LT(i + 1, lines.size()) << page;
      EXPECT_EQ(lines[i + 1].rfind("| ---", 0), 0u) << page.filename() << " line " << i + 2 << ": a table without its separator";
      const auto cells = [](const std::string& l) {
        std::size_t n = 0, at = 0;
        bool code = false;
        for (; at < l.size(); ++at) {
          if (l[at] == '`') code = !code;
          if (l[at] == '|' && !code) ++n;
        }
        return n;
      };
      const std::size_t width = cells(lines[i]);
      std::size_t j = i + 1;
      for (; j < lines.size() && lines[j].rfind("|", 0) == 0; ++j)
        EXPECT_EQ(cells(lines[j]), width) << page.filename() << " line " << j + 1 << ": " << lines[j];
      i = j;
    }
  }
}

TEST(Readme, ItsLinksExistAndNothingCitesADocumentThatDoesNotShip) {
  const std::regex link(R"(\]\(([^)#]+\.md)\))");
  for (const auto& page : pages()) {
    const std::string text = read(page);
    EXPECT_EQ(text.find("SPEC"), std::string::npos) << page.filename() << " cites SPEC, which does not ship";
    for (std::sregex_iterator it(text.begin(), text.end(), link), end; it != end; ++it) {
      const auto target = page.parent_path() / (*it)[1].str();
      EXPECT_TRUE(std::filesystem::exists(target)) << page.filename() << " links " << (*it)[1].str();
    }
  }
}

// docs/design.md names every source file over 20,000 bytes with why it is one
// file, and its size as it is (a row's "N KB", or "A-B KB" for a row of several).
TEST(Readme, EverySourceFileOver20KBHasItsReason) {
  std::ifstream in(kSource / "docs" / "design.md");
  const std::string design((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(design.empty());
  const std::vector<std::string> kinds = {".cpp", ".hpp", ".h", ".cu", ".cuh", ".py", ".sh"};
  for (const char* folder : {"core", "sim", "gpu", "verify", "cli", "bench", "python", "tests", "examples", "scripts"})
    for (const auto& e : std::filesystem::recursive_directory_iterator(kSource / folder)) {
      if (!e.is_regular_file() || e.file_size() <= 20000) continue;
      if (std::find(kinds.begin(), kinds.end(), e.path().extension().string()) == kinds.end()) continue;
      const std::string rel = std::filesystem::relative(e.path(), kSource).string();
      // Its row of the table: a line that starts with "|" and names it.
      std::string line;
      for (std::size_t at = design.find(rel); at != std::string::npos && line.empty(); at = design.find(rel, at + 1)) {
        const std::size_t start = design.rfind('\n', at) + 1;
        if (design.compare(start, 2, "| ") == 0) line = design.substr(start, design.find('\n', at) - start);
      }
      EXPECT_FALSE(line.empty()) << rel << " is " << e.file_size() << " bytes and docs/design.md does not say why";
      if (line.empty()) continue;
      std::smatch m;
      static const std::regex size(R"(\| (\d+)(?:-(\d+))? KB \|)");
      ASSERT_TRUE(std::regex_search(line, m, size)) << rel << ": its row gives no size: " << line;
      const long kb = std::lround(static_cast<double>(e.file_size()) / 1000.0);
      const long lo = std::stol(m[1].str()), hi = m[2].matched ? std::stol(m[2].str()) : lo;
      EXPECT_TRUE(lo <= kb && kb <= hi) << rel << " is " << kb << " KB; docs/design.md says " << m[0].str();
    }
}
