// cpsim golden: the folder reads back through the safetensors reader and holds the
// references; the code under test agrees with it; and an independent numpy
// implementation (examples/golden_check.py) agrees with it too.
#include <gmock/gmock.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/shard.hpp"
#include "tests/subprocess.hpp"
#include "verify/batch_io.hpp"
#include "verify/golden.hpp"
#include "verify/random.hpp"
#include "verify/reference.hpp"
#include "verify/reference_layers.hpp"
#include "verify/rows/inputs.hpp"
#include "verify/safetensors.hpp"

using namespace cpsim;
using namespace cpsim::verify;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

namespace {
const std::string& kExamples = cpsim::testing::kExamplesDir;

SafetensorsFile read(const std::filesystem::path& p) {
  const MappedFile f(p.string());
  return parse_safetensors(f.bytes(), p.string(), true);
}

std::filesystem::path fresh_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}
}  // namespace

TEST(Golden, FolderReadsBackAndHoldsTheReferences) {
  const BatchFile f = read_batch_file(kExamples + "packed_two_rows.json");
  const LayoutCase c{f.batch, f.pad_token_id, 3, 5, std::nullopt, PlanChoice{}};
  CheckOptions o;
  o.conv_width = 6;
  const auto dir = fresh_dir("cpsim-golden");
  const auto files = write_golden(c, o, dir.string(), "packed_two_rows.json");
  EXPECT_EQ(files.size(), 6u);  // inputs, reference, 3 ranks, manifest
  const SafetensorsFile inputs = read(dir / "inputs.safetensors"), ref = read(dir / "reference.safetensors");
  const ReferenceShape shape = reference_shape(c.batch);
  const ReferenceGeometry g = reference_geometry(shape.seq_len, 3);
  const LayoutTruth truth = reference_layout(c.batch);
  const Tensor x = inputs::conv(truth, shape.rows, g.padded_len, o, c.seed).x;
  EXPECT_TRUE(inputs.tensors.at("x").bitwise_equal(x));
  EXPECT_TRUE(ref.tensors.at("doc_ids").bitwise_equal(reference_padded_doc_ids(truth, g.padded_len)));
  const ConvReference conv = reference_conv(x, reference_padded_doc_ids(truth, g.padded_len),
                                            inputs.tensors.at("conv_weight"), inputs.tensors.at("conv_bias"),
                                            inputs.tensors.at("conv_grad_y"));
  EXPECT_TRUE(ref.tensors.at("conv_y").bitwise_equal(conv.y));
  EXPECT_TRUE(ref.tensors.at("conv_dw").bitwise_equal(conv.dw));
  // The layers: the inputs the rows draw, and their references.
  const AttentionInputs at = inputs::attention(shape.rows, g.padded_len, o, c.seed);
  EXPECT_TRUE(inputs.tensors.at("attention_q").bitwise_equal(at.q));
  EXPECT_TRUE(inputs.tensors.at("index_k").bitwise_equal(at.index_k));
  const Batch padded = reference_padded_global(c, g.padded_len);
  const Tensor& pos = padded.at("position_ids");
  EXPECT_TRUE(ref.tensors.at("rope_k").bitwise_equal(reference_rope(at.k, pos)));
  const AttentionReference sparse =
      reference_attention(reference_rope(at.q, pos), reference_rope(at.k, pos), at.v,
                          reference_padded_doc_ids(truth, g.padded_len), padded.at("padding_mask"), at.grad_o,
                          1.0 / std::sqrt(static_cast<double>(o.rope_dim())), at.index_q, at.index_k, o.topk);
  EXPECT_TRUE(ref.tensors.at("sparse_attention_kept").bitwise_equal(sparse.kept));
  EXPECT_TRUE(ref.tensors.at("sparse_attention_o").bitwise_equal(sparse.o));
  EXPECT_EQ(ref.tensors.at("loss").get(0),
            reference_loss(inputs.tensors.at("logits"), inputs.tensors.at("loss_tokens"),
                           reference_padded_doc_ids(truth, g.padded_len), padded.at("padding_mask"))
                .loss);
  for (int r = 0; r < 3; ++r) {
    const SafetensorsFile rank = read(dir / ("rank_" + std::to_string(r) + ".safetensors"));
    EXPECT_TRUE(rank.tensors.at("halo").bitwise_equal(reference_history(x, g.start(r), g.size(r), 6))) << r;
    // The code under test agrees with the vectors: shard_batch and the packed context.
    const ShardedBatch sb = shard_batch_at(r, 3, c.batch, std::nullopt, c.pad_token_id, false);
    for (const auto& [key, t] : sb.local) {
      ASSERT_TRUE(rank.tensors.count("batch." + key)) << key;
      const Tensor& want = rank.tensors.at("batch." + key);
      EXPECT_EQ(count_wrong(want, t.dtype() == want.dtype() ? t : t.to(want.dtype())), 0) << "rank " << r << " " << key;
    }
    EXPECT_TRUE(rank.tensors.at("local_doc_ids").bitwise_equal(sb.context.local_doc_ids())) << r;
    for (int b = 0; b < 2; ++b) {
      const Tensor& cu = rank.tensors.at("row_cu_seqlens." + std::to_string(b));
      EXPECT_EQ(std::vector<std::int64_t>(cu.data<std::int64_t>(), cu.data<std::int64_t>() + cu.numel()),
                sb.context.row_cu_seqlens(b));
    }
  }
  std::ifstream manifest(dir / "manifest.json");
  std::string text((std::istreambuf_iterator<char>(manifest)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"halo\""));
  EXPECT_THAT(text, HasSubstr("\"meaning\""));
  std::filesystem::remove_all(dir);
}

// examples/golden_check.py, an implementation of sharding, halo and gather in numpy
// written apart from cpsim, agrees with the vectors of every example batch.
// Golden writes the inputs the rows draw: every drawn input of the folder is what
// verify/rows/inputs.hpp gives for the case's seed (a second seed too, so that a
// seed changed there moves both), and no row nor golden draws an input itself.
TEST(Golden, TheFolderHoldsTheInputsTheRowsDraw) {
  const BatchFile f = read_batch_file(kExamples + "packed_two_rows.json");
  for (std::uint64_t seed : {5ull, 77ull}) {
    const LayoutCase c{f.batch, f.pad_token_id, 3, seed, std::nullopt, PlanChoice{}};
    CheckOptions o;
    const auto dir = fresh_dir("cpsim-golden-inputs");
    write_golden(c, o, dir.string(), "packed_two_rows.json");
    const SafetensorsFile in = read(dir / "inputs.safetensors");
    const ReferenceShape shape = reference_shape(c.batch);
    const std::int64_t B = shape.rows, P = reference_geometry(shape.seq_len, 3).padded_len;
    const inputs::Conv conv = inputs::conv(reference_layout(c.batch), B, P, o, seed);
    const inputs::Recurrence rec = inputs::recurrence(B, P, o, seed);
    const AttentionInputs at = inputs::attention(B, P, o, seed);
    const LossInputs loss = inputs::loss(reference_padded_global(c, P).at("input_ids"), o, seed);
    const std::vector<std::pair<std::string, Tensor>> drawn = {
        {"x", conv.x}, {"conv_weight", conv.weight}, {"conv_bias", conv.bias}, {"conv_grad_y", conv.grad_y},
        {"q", rec.in.q}, {"k", rec.in.k}, {"v", rec.in.v}, {"beta", rec.in.beta}, {"g", rec.in.g},
        {"recurrence_grad_o", rec.grad_o}, {"attention_q", at.q}, {"attention_k", at.k}, {"attention_v", at.v},
        {"attention_grad_o", at.grad_o}, {"index_q", at.index_q}, {"index_k", at.index_k},
        {"loss_tokens", loss.tokens}, {"logits", loss.logits},
        {"gather_grad.0", inputs::gather_upstream({B, P, o.channels}, DType::f64, 0, seed)},
        {"gather_grad.2", inputs::gather_upstream({B, P, o.channels}, DType::f64, 2, seed)}};
    for (const auto& [name, t] : drawn) EXPECT_TRUE(in.tensors.at(name).bitwise_equal(t)) << name << " seed " << seed;
    std::filesystem::remove_all(dir);
  }
  // The seeds are written once: of the rows and the golden folders, only
  // verify/rows/inputs.cpp draws or mixes a case's seed (every file of
  // verify/rows/, so a new row is held to it too).
  std::vector<std::string> files{"verify/golden.cpp"};
  for (const auto& entry : std::filesystem::directory_iterator(std::string(CPSIM_SOURCE_DIR) + "/verify/rows"))
    if (entry.path().extension() == ".cpp" && entry.path().filename() != "inputs.cpp")
      files.push_back("verify/rows/" + entry.path().filename().string());
  EXPECT_GE(files.size(), 11u);  // golden.cpp and the ten files of rows
  for (const std::string& file : files) {
    std::ifstream src(std::string(CPSIM_SOURCE_DIR) + "/" + file);
    const std::string text((std::istreambuf_iterator<char>(src)), std::istreambuf_iterator<char>());
    ASSERT_FALSE(text.empty()) << file;
    for (const char* draw : {"random_tensor(", "masked_activation(", "random_recurrence_inputs(",
                             "random_attention_inputs(", "random_loss_inputs(", "mix_seed(", "SplitMix64 "})
      EXPECT_EQ(text.find(draw), std::string::npos) << file << " draws from the case's seed itself: " << draw;
  }
}

TEST(Golden, AnIndependentNumpyImplementationAgrees) {
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "needs numpy for /usr/bin/python3 (Debian's python3-numpy; make deps installs it)";
  for (const auto& example : {"spec_example.json", "packed_two_rows.json", "thd_cu_seqlens_padded_only.json",
                              "unpacked_left_padding.json", "token_type_ids.json"}) {
    for (const char* cp : {"1", "3", "8"}) {
      const auto dir = fresh_dir("cpsim-golden-py");
      const auto g = cpsim::testing::run_process(
          {CPSIM_BINARY, "golden", kExamples + example, "--cp", cp, "--out", dir.string(), "--conv-width", "6"}, 60s);
      ASSERT_EQ(g.status, 0) << g.err;
      const auto r = cpsim::testing::run_process(
          {"/usr/bin/python3", std::string(CPSIM_SOURCE_DIR) + "/examples/golden_check.py", dir.string()}, 60s);
      EXPECT_EQ(r.status, 0) << example << " cp=" << cp << "\n" << r.out << r.err;
      EXPECT_THAT(r.out, HasSubstr("comparisons hold"));
      std::filesystem::remove_all(dir);
    }
  }
  // In float32 and bfloat16, computing in float32, within the manifest's tolerances
  // (scripts/measure-golden-tolerances.py measures them over every example at CP 1-8).
  for (const char* dtype : {"f32", "bf16"})
    for (const char* cp : {"1", "4", "8"}) {
      const auto dir = fresh_dir("cpsim-golden-py-dtype");
      const auto g = cpsim::testing::run_process({CPSIM_BINARY, "golden", kExamples + "token_type_ids.json", "--cp",
                                                  cp, "--out", dir.string(), "--dtype", dtype},
                                                 60s);
      ASSERT_EQ(g.status, 0) << g.err;
      EXPECT_EQ(read(dir / "rank_0.safetensors").dtypes.at("o"), std::string(dtype) == "f32" ? "F32" : "BF16");
      const auto r = cpsim::testing::run_process(
          {"/usr/bin/python3", std::string(CPSIM_SOURCE_DIR) + "/examples/golden_check.py", dir.string()}, 60s);
      EXPECT_EQ(r.status, 0) << dtype << " cp=" << cp << "\n" << r.out << r.err;
      std::filesystem::remove_all(dir);
    }
  // The options: input_ids sharded, int32 row_cu_seqlens, a pad multiple.
  const auto dir = fresh_dir("cpsim-golden-py-options");
  const auto g = cpsim::testing::run_process({CPSIM_BINARY, "golden", kExamples + "packed_two_rows.json", "--cp", "3",
                                              "--out", dir.string(), "--shard-primary", "--index-dtype", "int32",
                                              "--pad-multiple", "4"},
                                             60s);
  ASSERT_EQ(g.status, 0) << g.err;
  const SafetensorsFile rank = read(dir / "rank_1.safetensors");
  EXPECT_EQ(rank.tensors.at("batch.input_ids").shape(), (Shape{2, 8}));  // P = roundup(13, 3 * 4) = 24, L = 8
  EXPECT_EQ(rank.dtypes.at("row_cu_seqlens.0"), "I32");
  const auto r = cpsim::testing::run_process(
      {"/usr/bin/python3", std::string(CPSIM_SOURCE_DIR) + "/examples/golden_check.py", dir.string()}, 60s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  std::filesystem::remove_all(dir);
  // Shard plans: the balanced one, and a plan file with an empty interval. The
  // manifest gives the cuts (L is null when the intervals differ).
  const auto plan_file = fresh_dir("cpsim-golden-py-plan") / "plan.json";
  std::filesystem::create_directories(plan_file.parent_path());
  std::ofstream(plan_file) << R"({"cuts": [0, 9, 9, 12, 16]})";
  for (const std::string& plan : {std::string("balanced"), plan_file.string()}) {
    const auto pdir = fresh_dir("cpsim-golden-py-plans");
    const auto pg = cpsim::testing::run_process({CPSIM_BINARY, "golden", kExamples + "packed_two_rows.json", "--cp", "4",
                                                 "--out", pdir.string(), "--plan", plan},
                                                60s);
    ASSERT_EQ(pg.status, 0) << pg.err;
    const SafetensorsFile empty = read(pdir / "rank_1.safetensors");
    if (plan != "balanced") {
      EXPECT_EQ(empty.tensors.at("batch.labels").shape(), (Shape{2, 0}));
    }
    const auto pr = cpsim::testing::run_process(
        {"/usr/bin/python3", std::string(CPSIM_SOURCE_DIR) + "/examples/golden_check.py", pdir.string()}, 60s);
    EXPECT_EQ(pr.status, 0) << plan << "\n" << pr.out << pr.err;
    std::filesystem::remove_all(pdir);
  }
  std::filesystem::remove_all(plan_file.parent_path());
}

// A sum over ranks in bfloat16 whose terms cancel: golden stores the rank-order
// sum rounded after every addition; an exact (float64) or float32 sum differs from
// it by far more than 3e-2 of its own size, but not of its terms' size, the
// scale the manifest names for gather_grad_x. Both pass; a gradient missing one
// rank's term still fails.
TEST(Golden, ASumOverRanksIsHeldToItsTermsInBfloat16) {
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "needs numpy for /usr/bin/python3 (Debian's python3-numpy; make deps installs it)";
  const char* script = R"(
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import golden_check as gc
g = gc.load_golden(sys.argv[2])
def summed(dtype, drop=None):
    def f(up, cuts):
        return [sum(u[:, cuts[r]:cuts[r + 1]].astype(dtype) for q, u in enumerate(up) if q != drop)
                for r in range(len(up))]
    return f
gc.check(g, gather_backward=summed(np.float64), log=lambda *_: None)
gc.check(g, gather_backward=summed(np.float32), log=lambda *_: None)
try:
    gc.check(g, gather_backward=summed(np.float64, drop=3), log=lambda *_: None)
except AssertionError as e:
    print("missing term caught:", e)
)";
  for (const auto& example : {"spec_example.json", "packed_two_rows.json", "thd_cu_seqlens.json"}) {
    const auto dir = fresh_dir("cpsim-golden-bf16-sum");
    const auto g = cpsim::testing::run_process({CPSIM_BINARY, "golden", kExamples + example, "--cp", "8", "--dtype",
                                                "bf16", "--channels", "1", "--seed", "41", "--out", dir.string()},
                                               60s);
    ASSERT_EQ(g.status, 0) << g.err;
    const auto r = cpsim::testing::run_process(
        {"/usr/bin/python3", "-c", script, std::string(CPSIM_SOURCE_DIR) + "/examples", dir.string()}, 60s);
    EXPECT_EQ(r.status, 0) << example << "\n" << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("missing term caught: rank")) << example << "\n" << r.out << r.err;
    std::filesystem::remove_all(dir);
  }
}

// Planted bugs in that numpy implementation, one per hook (tests/verify/golden_plants.py:
// interior padding taken as real, a segment reaching back one rank at most, a
// gather backward keeping only its own slice, conv taps across documents, q scaled
// by K^-0.5, RoPE by local index, attention without the gathered keys, top-k ties
// to the later key, targets aligned after sharding, a mean of rank means, a halo
// of zeros, a gather in reverse rank order, labels padded with 0) are each reported at the key they break, with its rank and first
// position.
TEST(Golden, PlantedBugsInTheNumpyImplementationAreReportedAtTheirKey) {
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "needs numpy for /usr/bin/python3 (Debian's python3-numpy; make deps installs it)";
  const auto dir = fresh_dir("cpsim-golden-plants");
  const auto g = cpsim::testing::run_process(
      {CPSIM_BINARY, "golden", kExamples + "thd_cu_seqlens.json", "--cp", "8", "--out", dir.string()}, 60s);
  ASSERT_EQ(g.status, 0) << g.err;
  const auto r = cpsim::testing::run_process(
      {"/usr/bin/python3", std::string(CPSIM_SOURCE_DIR) + "/tests/verify/golden_plants.py", dir.string()}, 60s);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  for (const char* key : {"layout padding", "cp_context.pre_num_ranks", "gather_grad_x", "conv_dx", "o", "rope_q",
                          "attention_dk", "sparse_attention_kept", "targets", "loss", "halo", "gathered", "batch.labels"})
    EXPECT_THAT(r.out, HasSubstr(std::string(key) + ": ")) << r.out;
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("MISSED"))) << r.out;
  std::filesystem::remove_all(dir);
}

namespace {
// Each tensor's absolute file offset is a multiple of its element size.
void expect_aligned(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  const std::map<std::string, int> width = {{"F64", 8}, {"I64", 8}, {"F32", 4}, {"I32", 4}, {"BF16", 2},
                                            {"I16", 2}, {"U8", 1},  {"I8", 1},  {"BOOL", 1}};
  for (const auto& [key, e] : header.items()) {
    if (key == "__metadata__") continue;
    const std::uint64_t at = 8 + n + e.at("data_offsets")[0].get<std::uint64_t>();
    EXPECT_EQ(at % width.at(e.at("dtype").get<std::string>()), 0u) << path << " " << key;
  }
}
}  // namespace

// The inputs are stored as the file gave them: a safetensors batch of int32 and
// uint8 1-D keys keeps dtype, shape and bytes; a lengths-only batch's input_ids
// are marked as cpsim's stand-ins. Every tensor of every file is aligned to its
// element size, and (with PyTorch) loads in place with torch.frombuffer.
TEST(Golden, InputsAreStoredAsGivenAndEveryTensorLoadsInPlace) {
  const auto dir = fresh_dir("cpsim-golden-given");
  std::filesystem::create_directories(dir);
  const std::vector<std::int64_t> ids = {7, 7, 7, 0, 8, 8, 8, 8, 0};
  std::map<std::string, RawTensor> file;
  file["input_ids"] = raw_tensor(Tensor::from<std::int64_t>({9}, ids), {"I32", {9}});
  file["cu_seqlens"] = raw_tensor(Tensor::from<std::int64_t>({3}, {0, 3, 8}), {"I32", {3}});
  file["cu_seqlens_padded"] = raw_tensor(Tensor::from<std::int64_t>({3}, {0, 4, 9}), {"I32", {3}});
  file["loss_mask"] = raw_tensor(Tensor::from<std::int64_t>({9}, {1, 1, 1, 0, 1, 1, 1, 1, 0}), {"U8", {9}});
  const auto batch = dir / "batch.safetensors";
  std::ofstream(batch, std::ios::binary) << write_safetensors(file, {{"pad_token_id", "0"}});
  const auto out = dir / "golden";
  auto g = cpsim::testing::run_process({CPSIM_BINARY, "golden", batch.string(), "--cp", "3", "--out", out.string()}, 60s);
  ASSERT_EQ(g.status, 0) << g.err;
  const MappedFile inputs_file((out / "inputs.safetensors").string());
  const SafetensorsFile inputs = parse_safetensors(inputs_file.bytes(), "inputs", true);
  EXPECT_EQ(inputs.dtypes.at("inputs.input_ids"), "I32");
  EXPECT_EQ(inputs.dtypes.at("inputs.loss_mask"), "U8");
  EXPECT_EQ(inputs.tensors.at("inputs.input_ids").shape(), (Shape{9}));
  EXPECT_EQ(inputs.tensors.at("inputs.input_ids").get_int(4), 8);
  EXPECT_EQ(inputs.tensors.at("inputs.cu_seqlens").shape(), (Shape{3}));
  for (const char* name : {"inputs.safetensors", "reference.safetensors", "rank_0.safetensors", "rank_2.safetensors"})
    expect_aligned(out / name);

  const auto lengths = dir / "lengths";
  g = cpsim::testing::run_process(
      {CPSIM_BINARY, "golden", kExamples + "lengths_only.json", "--cp", "2", "--out", lengths.string()}, 60s);
  ASSERT_EQ(g.status, 0) << g.err;
  const MappedFile stand_file((lengths / "inputs.safetensors").string());
  const SafetensorsFile stand = parse_safetensors(stand_file.bytes(), "inputs", true);
  EXPECT_TRUE(stand.tensors.count("stand_in.input_ids"));
  EXPECT_FALSE(stand.tensors.count("inputs.input_ids"));
  EXPECT_TRUE(stand.tensors.count("inputs.seq_lens"));
  std::ifstream manifest(lengths / "manifest.json");
  const auto m = nlohmann::json::parse(manifest);
  EXPECT_EQ(m["files"]["inputs.safetensors"]["stand_in.input_ids"]["origin"], "stand-in");
  EXPECT_EQ(m["conventions"]["q_scale"], 1.0);
  EXPECT_TRUE(m["files"]["rank_0.safetensors"]["conv_dw_partial"].contains("tolerance"));

  // With torch: the project's environment (make test sets CPSIM_PYTHON), else the system's.
  const std::string python = std::string(CPSIM_PYTHON).empty() ? "/usr/bin/python3" : CPSIM_PYTHON;
  if (std::system((python + " -c 'import torch, numpy' >/dev/null 2>&1").c_str()) == 0) {
    const auto r = cpsim::testing::run_process({python, std::string(CPSIM_SOURCE_DIR) +
                                                "/tests/verify/golden_frombuffer.py", out.string(), lengths.string()}, 120s);
    EXPECT_EQ(r.status, 0) << r.out << r.err;
    EXPECT_THAT(r.out, HasSubstr("load in place"));
  }
  std::filesystem::remove_all(dir);
}
