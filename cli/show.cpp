// cpsim show: the layout of a batch at one CP size, in the terminal and as SVG.
#include <sys/ioctl.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>

#include "cli/commands.hpp"
#include "cli/common.hpp"
#include "verify/batch_io.hpp"
#include "verify/family.hpp"
#include "verify/show.hpp"

namespace cpsim::cli {

namespace {

int terminal_columns() {
  winsize ws{};
  if (isatty(STDOUT_FILENO) && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS")) {
    const int n = std::atoi(c);
    if (n > 0) return n;
  }
  return 100;
}

bool use_color(const std::string& mode) {
  if (mode == "always") return true;
  if (mode == "never") return false;
  const char* term = std::getenv("TERM");
  return isatty(STDOUT_FILENO) && !std::getenv("NO_COLOR") && term && std::string(term) != "dumb";
}

}  // namespace

// A few members of a layout family, each drawn at its CP size.
int show_family(const ShowArgs& a) {
  const verify::LayoutFamily family = verify::read_family(a.family);
  const std::optional<PlanChoice> plan = plan_choice_of(a.plan);
  if (!plan || plan->kind == PlanChoice::Kind::cuts)
    throw UsageError("--plan with --family: equal or balanced (members differ in length and CP size)");
  const auto gen = verify::gen_family_case(family, 16, plan);
  std::cout << "family " << family.name << (family.description.empty() ? "" : ": " + family.description) << "\n";
  for (int k = 0; k < a.samples; ++k) {
    const verify::LayoutCase c = gen(rc::Random(a.seed * 1000003 + k), 30).value();
    verify::ShowOptions o;
    o.cp = c.cp;
    o.plan = c.plan;
    o.conv_width = a.conv_width;
    o.columns = terminal_columns();
    o.color = use_color(a.color);
    o.title = "member " + std::to_string(k + 1) + " (cp=" + std::to_string(c.cp) + ")";
    std::cout << verify::show_text(c.batch, o) << "  " << verify::batch_to_json(c.batch, c.pad_token_id) << "\n";
    const std::string off = verify::family_violation(family, c);
    if (!off.empty()) throw Error("internal: a drawn member is outside its family: " + off);
  }
  return kExitOk;
}

int run_show(const ShowArgs& a) {
  if (!a.family.empty()) return show_family(a);
  if (a.batch.empty()) throw UsageError("cpsim show: give a BATCH file, or --family FILE");
  const verify::BatchFile f = verify::read_batch_file(a.batch);
  derive_layout(f.batch);  // invalid input is exit 2 before anything is drawn
  const std::optional<PlanChoice> plan = plan_choice_of(a.plan);
  if (!plan) throw UsageError("--plan random draws plans for fuzz; show takes equal, balanced or a plan file");
  expect_plan_fits(*plan, sequence_length(f.batch), a.cp, a.batch);
  verify::ShowOptions o;
  o.cp = a.cp;
  o.plan = *plan;
  o.conv_width = a.conv_width;
  o.columns = terminal_columns();
  o.color = use_color(a.color);
  o.title = a.batch;
  std::cout << verify::show_text(f.batch, o);
  if (!a.svg.empty()) {
    std::ofstream out(a.svg);
    if (!out) throw UsageError("--svg " + a.svg + ": cannot write");
    out << verify::show_svg(f.batch, o);
    std::cout << "wrote " << a.svg << "\n";
  }
  return kExitOk;
}

}  // namespace cpsim::cli
