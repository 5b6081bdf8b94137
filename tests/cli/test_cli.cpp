// The command line on the shipped examples: every valid batch holds at every CP
// size, every invalid one is exit 2 with one line naming the key.
#include <gmock/gmock.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/layout.hpp"
#include "tests/subprocess.hpp"
#include "verify/memory.hpp"
#include "verify/properties.hpp"

using cpsim::testing::run_process;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

namespace {
const std::string kCpsim = CPSIM_BINARY;
const std::filesystem::path kExamples = std::filesystem::path(CPSIM_SOURCE_DIR) / "examples";

std::vector<std::filesystem::path> json_files(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".json") out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

TEST(Cli, EveryExampleHoldsAtEveryCpSize) {
  const auto files = json_files(kExamples);
  ASSERT_GE(files.size(), 5u);
  for (const auto& f : files) {
    const auto r = run_process({kCpsim, "check", f.string(), "--cp", "1,2,3,4,8"}, 120s);
    EXPECT_EQ(r.status, 0) << f << "\n" << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("all properties hold")) << f;
  }
}

// Shapes whose halo and gather messages pass the threads backend's 64 KiB staging
// threshold (they hung on the default backend once): wide channels, and many rows.
TEST(Cli, PropertiesHoldWithMessagesAboveTheStagingThreshold) {
  const std::string example = (kExamples / "spec_example.json").string();
  for (const char* channels : {"2730", "2731", "4096"}) {
    const auto r = run_process({kCpsim, "check", example, "--cp", "2,3", "--channels", channels, "--timeout", "10"}, 120s);
    EXPECT_EQ(r.status, 0) << "--channels " << channels << "\n" << r.out << r.err;
  }
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-rows-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (int rows : {512, 513, 2000}) {
    const auto path = dir / ("rows" + std::to_string(rows) + ".json");
    std::ofstream out(path);
    out << "{\"input_ids\": [";
    for (int r = 0; r < rows; ++r) out << (r ? ", " : "") << "[1, 2, 3, 4]";
    out << "], \"seq_lens\": [";
    for (int r = 0; r < rows; ++r) out << (r ? ", " : "") << "[3, 1]";
    out << "]}\n";
    out.close();
    const auto r = run_process({kCpsim, "check", path.string(), "--cp", "2,4", "--timeout", "10"}, 120s);
    EXPECT_EQ(r.status, 0) << rows << " rows\n" << r.out << r.err;
  }
  std::filesystem::remove_all(dir);
}

// Runs cpsim check on every JSON file of `dir`: each must be exit 2 with one line
// containing its expected text (`expected`: file name -> text).
void expect_each_invalid(const std::filesystem::path& dir, const std::map<std::string, std::string>& expected) {
  const auto files = json_files(dir);
  ASSERT_EQ(files.size(), expected.size()) << "each file of " << dir << " needs its expected message here";
  for (const auto& f : files) {
    const auto r = run_process({kCpsim, "check", f.string()}, 60s);
    EXPECT_EQ(r.status, 2) << f << "\n" << r.out << r.err;
    ASSERT_TRUE(expected.count(f.filename().string())) << f;
    EXPECT_THAT(r.err, HasSubstr(expected.at(f.filename().string()))) << f;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << f << ": " << r.err;
  }
}

// Expected key in each invalid example's one-line message.
TEST(Cli, EveryInvalidExampleIsExitTwoNamingTheKey) {
  expect_each_invalid(kExamples / "invalid",
                      {{"bad_positions.json", "position_ids"},
                       {"lengths_overflow.json", "seq_lens_padded"},
                       {"malformed.json", "malformed JSON"},
                       {"sentinel_in_middle.json", "seq_lens"},
                       {"wrong_shape.json", "input_ids"},
                       {"seq_lens_padded_alone.json", "seq_lens_padded"},
                       {"other_key_wrong_shape.json", "token_type_ids"},
                       {"empty_sequence.json", "input_ids"},
                       {"duplicate_key.json", "input_ids: key appears twice"},
                       {"deep_nesting.json", "nested deeper than 8 levels"},
                       {"int64_overflow.json", "input_ids row 0 index 1"},
                       {"seq_len_too_large.json", "seq_len: 9000000000000"},
                       {"conflicting_forms.json", "cu_seqlens row 0: the documents it describes disagree with seq_lens"}});
}

// The hostile batches a new user's tries turned up: each is exit 2 with one line
// naming the key, row and index (or the byte), never a guess or a property failure.
TEST(Cli, EveryHostileBatchIsExitTwoNamingWhatIsWrong) {
  expect_each_invalid(std::filesystem::path(CPSIM_SOURCE_DIR) / "tests" / "data" / "hostile",
                      {{"attention_mask_contradicts_seq_lens.json", "attention_mask row 0 index 5: 1 says a real token, but seq_lens makes it padding"},
                       {"attention_mask_of_document_indices.json", "attention_mask row 0 index 2: value 2; a mask holds 0 or 1"},
                       {"cu_seqlens_past_the_row.json", "cu_seqlens row 0 index 2: document 2 ends at 7"},
                       {"lengths_without_tokens.json", "gives the sequence length"},
                       {"long_key.json", "... (2000 characters)\" is no batch key name"},
                       {"masks_contradict_each_other.json", "attention_mask row 0 index 2: 1 says a real token, but padding_mask"},
                       {"misspelled_mask_key.json", "did you mean attention_mask?"},
                       {"nul_after_value.json", "a NUL byte at byte 26"},
                       {"nul_in_key.json", "a key \"labels\\x00x\" is no batch key name"},
                       {"padding_mask_not_boolean.json", "padding_mask row 0 index 4: value 2"},
                       {"positions_never_reset.json", "position_ids row 0 index 2: position 2, but the token is the start of document 2"},
                       {"positions_overflow_the_fill.json", "position_ids row 0 index 0: position 9223372036854775805 is beyond 2^52"},
                       {"positions_beyond_float64.json", "position_ids row 0 index 0: position 9007199254740992 is beyond 2^52"},
                       {"positions_reset_inside_a_document.json", "position_ids row 0 index 3: position 0"},
                       {"second_value.json", "more after the JSON value, at byte 28"}});
}

// Every key cpsim reads, at every rank from 0-D to 5-D and in every JSON type:
// cpsim check takes it (exit 0) or names the key (exit 2); no input reaches an
// internal check (exit 3). (A 4-D seq_lens once did: element 1 of [1, 1, 1].)
TEST(Cli, EveryKnownKeyOfAnyRankAndTypeIsTakenOrNamedNeverInternal) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-key-ranks-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::map<std::string, std::string> rows = {
      {"input_ids", "[5, 6, 7, 2, 8, 9, 2, 4]"},     {"labels", "[6, 7, -100, -100, 9, -100, -100, -100]"},
      {"position_ids", "[0, 1, 2, 3, 0, 1, 2, 3]"},  {"seq_lens", "[4, 4, -1000]"},
      {"seq_lens_padded", "[4, 4, -1000]"},          {"cu_seqlens", "[0, 4, 8]"},
      {"cu_seqlens_padded", "[0, 4, 8]"},            {"padding_mask", "[0, 0, 0, 0, 0, 0, 0, 1]"},
      {"attention_mask", "[1, 1, 1, 1, 1, 1, 1, 0]"}, {"loss_mask", "[1, 1, 1, 1, 1, 1, 1, 0]"},
      {"token_type_ids", "[0, 0, 0, 0, 1, 1, 1, 1]"}};
  ASSERT_EQ(rows.size(), cpsim::known_batch_keys().size());
  const std::vector<std::string> types = {"", "1.5", "true", "\"a\"", "null", "{}"};
  int n = 0;
  for (const std::string& key : cpsim::known_batch_keys()) {
    ASSERT_TRUE(rows.count(key)) << key;
    for (int depth = 0; depth <= 5; ++depth)
      for (const std::string& type : types) {
        std::string value = depth == 0 ? (type.empty() ? "3" : type) : rows.at(key);
        if (depth > 0 && !type.empty()) value = "[" + type + ", " + value.substr(1);
        for (int d = 1; d < depth; ++d) value = "[" + value + "]";
        std::string batch = "{\"" + key + "\": " + value;
        if (key != "input_ids") batch += ", \"input_ids\": [[5, 6, 7, 2, 8, 9, 2, 4]]";
        batch += ", \"pad_token_id\": 2}";
        const auto path = dir / ("b" + std::to_string(n++) + ".json");
        std::ofstream(path) << batch;
        const auto r = run_process({kCpsim, "check", path.string(), "--cp", "2"}, 60s);
        EXPECT_TRUE(r.status == 0 || r.status == 2) << batch << ": exit " << r.status << "\n" << r.err;
        EXPECT_THAT(r.err, Not(HasSubstr("internal error"))) << batch;
        if (r.status == 2) {
          EXPECT_THAT(r.err, HasSubstr(key)) << batch;
        }
      }
  }
  std::filesystem::remove_all(dir);
}

// Batches that look odd but are valid: no input_ids (stand-ins, said in the report),
// documents from position_ids resets, nested one-row cu_seqlens, JSON named .safetensors.
TEST(Cli, ValidOddBatchesHoldAtEveryCpSize) {
  const auto dir = std::filesystem::path(CPSIM_SOURCE_DIR) / "tests" / "data" / "valid";
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    ++n;
    const auto r = run_process({kCpsim, "check", e.path().string(), "--cp", "1,2,3,4"}, 120s);
    EXPECT_EQ(r.status, 0) << e.path() << "\n" << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("all properties hold")) << e.path();
    if (e.path().filename() != "nested_cu_seqlens.json" && e.path().filename() != "json_named.safetensors") {
      EXPECT_THAT(r.out, HasSubstr("no input_ids in the file: stand-in token ids")) << e.path();
    }
    if (e.path().filename() == "nested_cu_seqlens.json") {  // what was assumed is said
      EXPECT_THAT(r.out, HasSubstr("cu_seqlens given as [1, 3]: read as one packed row's boundaries [3]")) << r.out;
    }
  }
  EXPECT_EQ(n, 5u);
}

// Several files: an invalid one (or one that cannot be read) is reported on its own
// line naming it, the others still run, and the status is 2.
TEST(Cli, SeveralFilesAreEachCheckedAndEachInvalidOneIsNamed) {
  const std::string good = (kExamples / "spec_example.json").string();
  const std::string bad = (kExamples / "invalid" / "bad_positions.json").string();
  const auto r = run_process({kCpsim, "check", good, bad, "/nonexistent/batch.json", good, "--cp", "2,2"}, 60s);
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("invalid input: " + bad + ": position_ids row 0 index 4"));
  EXPECT_THAT(r.err, HasSubstr("invalid input: /nonexistent/batch.json: cannot open the batch file"));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 2) << r.err;
  // Both valid files ran, and --cp 2,2 is one column.
  const auto rows = static_cast<std::ptrdiff_t>(cpsim::verify::property_table().size());
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 2 * (rows + 2) + 1) << r.out;  // two tables of every row
  EXPECT_THAT(r.out, HasSubstr("every property holds on the valid batches; 2 invalid"));
  const auto header = r.out.substr(r.out.find("property"), r.out.find('\n', r.out.find("property")) - r.out.find("property"));
  EXPECT_EQ(header.find("cp=2"), header.rfind("cp=2")) << "one column per CP size: " << header;
}

// A FIFO (or any file that is not regular) is refused before it is opened: no hang.
TEST(Cli, AFileThatIsNotRegularIsRefusedWithoutBlocking) {
  const auto fifo = std::filesystem::temp_directory_path() / ("cpsim-fifo-" + std::to_string(::getpid()));
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const auto r = run_process({kCpsim, "check", fifo.string()}, 20s);
  std::filesystem::remove(fifo);
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("not a regular file"));
}

// --help shows every default; golden needs its CP size.
TEST(Cli, HelpShowsDefaultsAndGoldenNeedsItsCpSize) {
  const auto help = run_process({kCpsim, "check", "--help"}, 20s);
  EXPECT_EQ(help.status, 0);
  for (const char* d : {"=20", "=[1,2,3,4,8]", "=threads", "=4", "=8"}) EXPECT_THAT(help.out, HasSubstr(d)) << help.out;
  const auto fuzz = run_process({kCpsim, "fuzz", "--help"}, 20s);
  for (const char* d : {"=200", "=1", "=16"}) EXPECT_THAT(fuzz.out, HasSubstr(d)) << fuzz.out;
  // fuzz takes the model's shapes as check does (every row on the drawn layouts).
  for (const char* d : {"--channels", "--heads", "--key-dim", "--topk", "--vocab"}) EXPECT_THAT(fuzz.out, HasSubstr(d));
  const auto shaped = run_process({kCpsim, "fuzz", "--cases", "5", "--max-cp", "3", "--channels", "3", "--heads", "1",
                                   "--key-dim", "3", "--value-dim", "2", "--topk", "1", "--vocab", "5"},
                                  120s);
  EXPECT_EQ(shaped.status, 0) << shaped.out << shaped.err;
  const auto golden = run_process({kCpsim, "golden", (kExamples / "spec_example.json").string(), "--out", "/tmp/x"}, 20s);
  EXPECT_EQ(golden.status, 2);
  EXPECT_THAT(golden.err, HasSubstr("--cp is required"));
}

// Inputs the fuzzers found (make fuzz): each is exit 2 with one line naming what is wrong.
TEST(Cli, FuzzerFindingsAreInvalidInputWithOneLine) {
  expect_each_invalid(std::filesystem::path(CPSIM_SOURCE_DIR) / "tests" / "data" / "invalid",
                      {{"json_number_overflow.json",
                        "json_number_overflow.json: a number in the JSON is too large to represent"}});
}

// cpsim bench: every point timed and checked (#wrong 0), the nccl-tests columns,
// JSON with the counters, and the SVG plot.
TEST(Cli, BenchTimesChecksAndPlotsEveryPoint) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-bench-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string svg = (dir / "bench.svg").string();
  const auto r = run_process({kCpsim, "bench", "--backend", "threads,gloo", "--ranks", "2,3", "--sizes", "8,4K",
                              "--iterations", "3", "--svg", svg},
                             120s);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("algbw(GB/s)"));
  EXPECT_THAT(r.out, HasSubstr("busbw(GB/s)"));
  EXPECT_THAT(r.out, HasSubstr("#wrong"));
  EXPECT_THAT(r.out, HasSubstr("reduce_scatter on gloo, 3 ranks"));
  std::ifstream in(svg);
  const std::string picture((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(picture, HasSubstr("<svg"));
  EXPECT_THAT(picture, HasSubstr("send_recv, 3 ranks"));
  EXPECT_THAT(picture, HasSubstr("its reference"));
  const auto j = run_process({kCpsim, "bench", "--backend", "threads", "--ranks", "2", "--sizes", "8", "--ops",
                              "all_gather", "--iterations", "3", "--json"},
                             60s);
  ASSERT_EQ(j.status, 0) << j.err;
  for (const char* key : {"\"algbw_gbps\"", "\"busbw_gbps\"", "\"wrong\": 0", "\"ref_us\"", "\"vs_ref\""})
    EXPECT_THAT(j.out, HasSubstr(key));
  std::filesystem::remove_all(dir);
}

// A run that cannot complete is exit 3 with one line saying "aborted:", never a
// property failure (1): a peer that never comes (a timeout), a store that cannot
// be reached or made (a resource).
TEST(Cli, ARunThatCannotCompleteIsExitThree) {
  const std::string example = (kExamples / "spec_example.json").string();
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-exit3-" + std::to_string(::getpid()));
  struct Case {
    std::string name;
    std::vector<std::string> args;
    std::vector<std::pair<std::string, std::string>> env;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"a peer that never comes", {kCpsim, "check", example, "--timeout", "1"},
       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"CPSIM_STORE", "file:" + (dir / "store").string()}, {"CPSIM_JOB_ID", "x"}},
       "rank 1 never came"},
      {"a Redis store that is down", {kCpsim, "check", example, "--cp", "1", "--store", "redis://127.0.0.1:1"},
       {{"RANK", "0"}, {"WORLD_SIZE", "1"}}, "cannot reach the Redis store"},
      {"a file store that cannot be made", {kCpsim, "check", example, "--cp", "1", "--store", "file:/proc/cpsim-no"},
       {{"RANK", "0"}, {"WORLD_SIZE", "1"}}, "cannot create the directory"},
  };
  for (const auto& c : cases) {
    const auto r = run_process(c.args, 60s, {}, c.env);
    EXPECT_EQ(r.status, 3) << c.name << "\n" << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("aborted: ")) << c.name;
    EXPECT_THAT(r.err, HasSubstr(c.says)) << c.name;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.name << ": " << r.err;
    // A wait keeps its deadline: the peer that never comes is given up after its
    // 1 s, not a second per look at a file store (Gloo's waits count whole seconds).
    if (const auto at = r.err.find(" waited "); at != std::string::npos) {
      EXPECT_LT(std::stoi(r.err.substr(at + 8)), 1500) << r.err;
    }
  }
  std::filesystem::remove_all(dir);
}

// Memory: a batch over the limit is refused before anything is allocated (exit 2,
// naming the estimate); one that runs out anyway (the limit raised past what the
// address space allows) aborts (exit 3, ABORTED cells), never FAIL.
TEST(Cli, MemoryIsEstimatedFirstAndRunningOutAborts) {
  const auto path = std::filesystem::temp_directory_path() / ("cpsim-oom-" + std::to_string(::getpid()) + ".json");
  // Large enough that running out comes in the first rows, whatever the binary
  // itself maps of the address space (it no longer maps NCCL at start).
  std::ofstream(path) << "{\"seq_len\": 2000000, \"seq_lens\": [[1500000, 500000]]}\n";
  const auto refused = run_process({kCpsim, "check", path.string(), "--cp", "2", "--max-memory", "64M"}, 60s);
  EXPECT_EQ(refused.status, 2) << refused.out << refused.err;
  EXPECT_THAT(refused.err, AllOf(HasSubstr("needs about"), HasSubstr("at cp 2"), HasSubstr("over the limit of 64.0 MiB (--max-memory)")));
  EXPECT_EQ(std::count(refused.err.begin(), refused.err.end(), '\n'), 1) << refused.err;
  EXPECT_EQ(refused.out, "");
  // 64 rows of a million tokens: refused from the shape the file gives, before
  // anything is built (the stand-in token ids alone are 512 MB, more than the
  // address space allowed here, and deriving the layout took seconds).
  const auto huge = std::filesystem::temp_directory_path() / ("cpsim-huge-" + std::to_string(::getpid()) + ".json");
  {
    std::ofstream out(huge);
    out << "{\"seq_len\": 1000000, \"seq_lens\": [";
    for (int r = 0; r < 64; ++r) out << (r ? ", " : "") << "[1000000]";
    out << "]}\n";
  }
  const auto at_once = run_process({kCpsim, "check", huge.string(), "--max-memory", "8G"}, 60s);
  EXPECT_EQ(at_once.status, 2) << at_once.out << at_once.err;
  EXPECT_THAT(at_once.err, AllOf(HasSubstr("needs about"), HasSubstr("64 x 1000000 tokens")));
#if !defined(CPSIM_SANITIZED)
  const auto small_space = run_process({"/bin/bash", "-c", "ulimit -v 400000 && exec \"$0\" check \"$1\" --max-memory 8G",
                                        kCpsim, huge.string()}, 60s);
  EXPECT_EQ(small_space.status, 2) << small_space.out << small_space.err;
  EXPECT_THAT(small_space.err, AllOf(HasSubstr("needs about"), HasSubstr("64 x 1000000 tokens")));
#endif
  std::filesystem::remove(huge);
#if !defined(CPSIM_SANITIZED)  // sanitizers need the address space themselves
  const auto by_default = run_process({"/bin/bash", "-c", "ulimit -v 400000 && exec \"$0\" check \"$1\" --cp 2", kCpsim,
                                       path.string()}, 60s);
  EXPECT_EQ(by_default.status, 2) << by_default.err;
  EXPECT_THAT(by_default.err, HasSubstr("half of the address-space limit (ulimit -v)"));
  const auto oom = run_process({"/bin/bash", "-c", "ulimit -v 400000 && exec \"$0\" check \"$1\" --cp 2 --max-memory 100G",
                                kCpsim, path.string()}, 120s);
  EXPECT_EQ(oom.status, 3) << oom.out << oom.err;
  EXPECT_THAT(oom.out, AllOf(HasSubstr("ABORTED"), HasSubstr("out of memory"), Not(HasSubstr("FAIL"))));
#endif
  std::filesystem::remove(path);
}

// A check of a few seconds says its time estimate first, then shows its progress:
// on a terminal (a pseudo-terminal, through script(1)) one line rewritten in place
// with the row, rows done, elapsed and about how long is left; not on a terminal,
// the estimate; with --quiet, nothing. --rows and --skip choose rows; an unknown
// name is exit 2 listing the names; --max-time refuses a batch over its estimate.
TEST(Cli, ALongCheckShowsItsEstimateAndProgress) {
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-progress-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string batch = (dir / "long.json").string();
  {
    std::ofstream out(batch);
    out << "{\"seq_len\": 100000, \"seq_lens\": [[";
    for (int d = 0; d < 100; ++d) out << (d ? ", " : "") << 1000;
    out << "]]}\n";
  }
  if (std::system("command -v script >/dev/null 2>&1") == 0) {
    const auto tty = run_process({"/usr/bin/script", "-qfec", std::string(kCpsim) + " check " + batch + " --cp 2,8",
                                  "/dev/null"},
                                 300s);
    EXPECT_EQ(tty.status, 0) << tty.out << tty.err;
    EXPECT_THAT(tty.out, AllOf(HasSubstr("of CPU (cp 2 "), HasSubstr("\r\033[K"), HasSubstr(" cp=8: "),
                               HasSubstr(" of " + std::to_string(cpsim::verify::property_table().size()) + "), "), HasSubstr(" s elapsed, about "), HasSubstr(" s left")))
        << tty.out;
    EXPECT_THAT(tty.out, HasSubstr("all properties hold"));
  }
  const auto piped = run_process({kCpsim, "check", batch, "--cp", "2"}, 300s);
  EXPECT_EQ(piped.status, 0) << piped.err;
  EXPECT_THAT(piped.err, HasSubstr("cpsim check: " + batch + ": about "));
  EXPECT_THAT(piped.err, Not(HasSubstr("\r")));
  const auto quiet = run_process({kCpsim, "check", batch, "--cp", "2", "--quiet", "--rows", "layout,rope"}, 300s);
  EXPECT_EQ(quiet.status, 0) << quiet.err;
  EXPECT_EQ(quiet.err, "");
  EXPECT_THAT(quiet.out, AllOf(HasSubstr("rope"), Not(HasSubstr("shard")), Not(HasSubstr("attention"))));
  const auto skipped = run_process({kCpsim, "check", batch, "--cp", "2", "--quiet", "--skip",
                                    "attention_forward,attention_backward,sparse_attention_forward,"
                                    "sparse_attention_backward,recurrence_forward,recurrence_backward,two_steps"},
                                   300s);
  EXPECT_EQ(skipped.status, 0) << skipped.err;
  EXPECT_THAT(skipped.out, AllOf(HasSubstr("loss_backward"), Not(HasSubstr("attention")), Not(HasSubstr("two_steps"))));
  const auto unknown = run_process({kCpsim, "check", batch, "--rows", "layout,attenton_forward"}, 60s);
  EXPECT_EQ(unknown.status, 2);
  EXPECT_THAT(unknown.err, AllOf(HasSubstr("no property row named 'attenton_forward'"),
                                 HasSubstr("the rows are layout, shard, gather_forward")));
  const auto too_long = run_process({kCpsim, "check", batch, "--cp", "8", "--max-time", "0.5"}, 60s);
  EXPECT_EQ(too_long.status, 2);
  EXPECT_THAT(too_long.err, AllOf(HasSubstr("of CPU at cp 8, over --max-time"), HasSubstr("--rows, --skip")));
  EXPECT_EQ(too_long.out, "");
  std::filesystem::remove_all(dir);
}

// An in-process gloo group large enough to take seconds to connect says so first.
TEST(Cli, ALargeInProcessGlooGroupSaysHowLongConnectingTakes) {
  const auto r = run_process({kCpsim, "check", (kExamples / "spec_example.json").string(), "--backend", "gloo", "--cp",
                              "24", "--timeout", "60"},
                             120s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("cpsim: gloo: connecting an in-process group of 24 ranks (276 loopback connections, about"));
}

// Too few descriptors for an in-process gloo group: a resource error naming the
// limit (exit 2, one line), never a hang or a property failure.
TEST(Cli, TooFewDescriptorsForAGlooGroupIsAResourceErrorNamingTheLimit) {
  const std::string example = (kExamples / "spec_example.json").string();
  const auto r = run_process({"/bin/bash", "-c",
                              "ulimit -Sn 256 && ulimit -Hn 256 && exec \"$0\" check \"$1\" --backend gloo --cp 40",
                              kCpsim, example},
                             60s);
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_THAT(r.err, HasSubstr("may open 256 descriptors (RLIMIT_NOFILE"));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// The memory estimate check refuses batches by is an upper bound of the peak it
// measures, and not a loose one: cpsim check's peak resident memory on batches of
// tens of thousands of tokens, at several CP sizes and model shapes, lies within
// [estimate / 1.6, estimate]. (Sanitizer builds hold far more memory: skipped.)
TEST(Cli, TheMemoryEstimateBoundsTheMeasuredPeak) {
#if defined(CPSIM_SANITIZED)
  GTEST_SKIP() << "sanitizer builds hold shadow memory";
#endif
  const auto dir = std::filesystem::temp_directory_path() / ("cpsim-memory-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto batch = [&](std::int64_t tokens) {
    const auto path = dir / ("tokens" + std::to_string(tokens) + ".json");
    std::ofstream out(path);
    out << "{\"seq_len\": " << tokens << ", \"seq_lens\": [[";
    std::int64_t left = tokens;
    for (int i = 0; left > 0; ++i) {
      // Documents of 1 to 300 tokens: the attention rows cost the sum of squared
      // document lengths, and memory is per token whatever the lengths.
      const std::int64_t len = std::min<std::int64_t>(left, 1 + (i * 7919) % 300);
      out << (i ? ", " : "") << len;
      left -= len;
    }
    out << "]]}\n";
    return path.string();
  };
  struct Point {
    std::int64_t tokens;
    int cp;
    std::vector<std::string> model;
  };
  const std::vector<Point> points = {{65536, 1, {}},
                                     {65536, 8, {}},
                                     {32768, 4, {"--channels", "64"}},
                                     {16384, 2, {"--heads", "8", "--key-dim", "16", "--value-dim", "16"}}};
  for (const Point& p : points) {
    std::vector<std::string> args{kCpsim, "check", batch(p.tokens), "--cp", std::to_string(p.cp)};
    args.insert(args.end(), p.model.begin(), p.model.end());
    const auto r = run_process(args, 300s);
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    cpsim::verify::CheckOptions o;
    for (std::size_t i = 0; i + 1 < p.model.size(); i += 2) {
      const int v = std::stoi(p.model[i + 1]);
      if (p.model[i] == "--channels") o.channels = v;
      if (p.model[i] == "--heads") o.heads = v;
      if (p.model[i] == "--key-dim") o.key_dim = v;
      if (p.model[i] == "--value-dim") o.value_dim = v;
    }
    const auto e = cpsim::verify::estimate_check_memory(1, p.tokens, 1, p.cp, o);
    const double ratio = static_cast<double>(e.bytes) / static_cast<double>(r.max_rss_bytes);
    std::cout << "[ measured ] " << p.tokens << " tokens, cp " << p.cp << ": peak " << r.max_rss_bytes / 1000000
              << " MB, estimate " << e.bytes / 1000000 << " MB (" << e.largest_row << "), ratio " << ratio << "\n";
    EXPECT_GE(ratio, 1.0) << "the estimate is below the measured peak";
    EXPECT_LE(ratio, 1.6) << "the estimate is loose";
  }
  std::filesystem::remove_all(dir);
}
