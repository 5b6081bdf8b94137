#include "cli/options.hpp"

#include <CLI/CLI.hpp>
#include <algorithm>

#include "core/comm/registry.hpp"

namespace cpsim::cli {

namespace {

// Options every rank-running command takes.
void add_job_options(CLI::App* cmd, JobArgs& job) {
  std::string names;
  for (const auto& name : backend_names()) names += (names.empty() ? "" : " | ") + name;
  cmd->add_option("--backend", job.backend, names + " (default: threads; gloo in a multi-process job)")
      ->check(CLI::IsMember(backend_names()))
      ->each([&job](const std::string&) { job.backend_given = true; });
  cmd->add_option("--store", job.store, "the store the processes of a multi-process job meet in: file:DIR or redis://HOST:PORT "
                                        "(default: $CPSIM_STORE, which cpsim launch sets)");
  cmd->add_option("--timeout", job.timeout, "seconds a rank waits for its peers before it reports them")
      ->check(CLI::Range(0.05, 86400.0));
}

// Shapes and seed of the seeded inputs.
// A BATCH argument, or --family FILE (one of them) with the members' count and seed.
void add_batch_or_family(CLI::App* cmd, std::string& batch, std::string& family, int& samples, std::uint64_t& seed,
                         const std::string& family_help) {
  auto* batch_arg = cmd->add_option("batch", batch, "BATCH file (JSON or safetensors)")->check(CLI::ExistingFile);
  auto* family_arg = cmd->add_option("--family", family, family_help)->check(CLI::ExistingFile)->excludes(batch_arg);
  batch_arg->excludes(family_arg);
  cmd->add_option("--samples", samples, "members drawn with --family")->check(CLI::Range(1, 100000));
  cmd->add_option("--seed", seed, "seed of the members drawn with --family");
}

void add_plan_options(CLI::App* cmd, PlanOption& plan, bool random) {
  cmd->add_option("--plan", plan.plan,
                  std::string("how the ranks cut the padded rows: equal (intervals of P/c), balanced (by --cost), ") +
                      (random ? "random (each case draws equal, balanced or random cuts, empty intervals included)"
                              : "or a plan file {\"cuts\": [0, a_1, ..., P]}"));
  cmd->add_option("--cost", plan.cost,
                  "the per-token cost --plan balanced balances: attention (t - doc_start + 1 per real token), "
                  "linear (1), or attention=A,linear=B");
}

void add_model_options(CLI::App* cmd, ModelArgs& m, const std::string& seed_help) {
  cmd->add_option("--conv-width", m.conv_width, "convolution taps W")->check(CLI::Range(1, 64));
  cmd->add_option("--channels", m.channels, "activation channels")->check(CLI::Range(1, 4096));
  cmd->add_option("--heads", m.heads, "heads H of the recurrence and attention")->check(CLI::Range(1, 64));
  cmd->add_option("--key-dim", m.key_dim, "key size K of the recurrence and attention (RoPE: rounded up to even)")->check(CLI::Range(1, 256));
  cmd->add_option("--value-dim", m.value_dim, "value size V of the recurrence and attention")->check(CLI::Range(1, 256));
  cmd->add_option("--topk", m.topk, "keys each query keeps in the sparse attention")->check(CLI::Range(0, 4096));
  cmd->add_option("--index-dim", m.index_dim, "size Di of the sparse attention's indexer")->check(CLI::Range(1, 256));
  cmd->add_option("--vocab", m.vocab, "vocabulary of the loss's logits (token ids are taken mod vocab)")
      ->check(CLI::Range(1, 1 << 20));
  if (!seed_help.empty()) cmd->add_option("--seed", m.seed, seed_help);  // empty: the command has its own
}

}  // namespace

Parsed parse_options(int argc, char** argv) {
  Options o;
  CLI::App app{"cpsim: verify contiguous context parallelism over packed sequences"};
  app.require_subcommand(1);
  // The version, and what each backend can do here (gpu-check reads the GPU count
  // from the nccl line: CUDA's device count, which honours CUDA_VISIBLE_DEVICES).
  app.set_version_flag("--version", [] {
    std::string out = kVersion;
    out += "\nbackends:";
    for (const std::string& name : backend_names()) {
      const Backend& b = find_backend(name);
      out += "\n  " + name + ": ";
      if (const auto why = b.unavailable()) {
        out += "unavailable: " + *why;
        continue;
      }
      const auto [most, why] = b.max_ranks();
      out += most > 0 ? "up to " + std::to_string(most) + " ranks in one process (" + why + ")" : "available";
    }
    return out;
  });
  app.footer("Run 'cpsim COMMAND --help' for a command's options and an example.");
  // Every option's help shows its default ([20] after --timeout, say).
  app.option_defaults()->always_capture_default();
  CheckArgs& check = o.check;
  auto* c = app.add_subcommand("check", "verify every property on batch files at each CP size");
  // Files are opened by check itself: one that cannot be read is reported and the others still run.
  c->add_option("batch", check.batches, "BATCH files (JSON, or safetensors as safetensors.torch.save_file writes them)")->required();
  c->add_option("--cp", check.cp_sizes, "CP sizes (default 1,2,3,4,8; in a multi-process job, its size)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024))
      ->each([&check](const std::string&) { check.cp_given = true; });
  add_job_options(c, check.job);
  add_model_options(c, check.model, "seed of the activations");
  add_plan_options(c, check.plan, false);
  c->add_flag("--json", check.json, "one JSON object instead of a table");
  c->add_flag("--row-memory", check.row_memory,
              "measure each row's peak resident memory (peak_bytes in --json; Linux), resetting the process's "
              "high-water mark before each row");
  c->add_option("--max-memory", check.max_memory,
                "refuse a batch whose estimated peak memory is larger: 512M, 8G, ... (binary: 8G = 8 GiB; default: 80% "
                "of this machine's memory)");
  c->add_option("--max-time", check.max_time,
                "refuse a batch whose estimated CPU time (every CP size, every row) is longer, in seconds")
      ->check(CLI::PositiveNumber);
  c->add_option("--rows", check.rows, "only these property rows (names as in the table), comma-separated")
      ->delimiter(',');
  c->add_option("--skip", check.skip, "every property row but these, comma-separated")->delimiter(',');
  c->add_flag("--quiet", check.quiet, "no progress lines on standard error");
  c->footer(
      "Example:\n  cpsim check examples/spec_example.json --cp 1,2,3,4,8\n"
      "  cpsim check batch.safetensors --backend gloo --json\n"
      "Exit status: 0 every property holds, 1 a property failed, 2 bad usage or invalid input (each invalid file\n"
      "is reported, the others still run), 3 the run could not complete (a rank died or timed out, a resource failed).");
  FuzzArgs& fuzz = o.fuzz;
  auto* f = app.add_subcommand("fuzz", "random layouts, shrunk to the smallest failing one");
  f->add_option("--cases", fuzz.cases, "random layouts")->check(CLI::Range(1, 10000000));
  f->add_option("--seed", fuzz.seed, "generator seed");
  f->add_option("--max-cp", fuzz.max_cp, "largest CP size drawn")->check(CLI::Range(1, 64));
  add_job_options(f, fuzz.job);
  add_model_options(f, fuzz.model, "");
  f->add_option("--out", fuzz.out, "where the smallest failing batch is saved (and its plan's cuts, beside it)");
  add_plan_options(f, fuzz.plan, true);
  f->add_option("--family", fuzz.family,
                "a layout family file: draw only what that packer can emit, and shrink within it "
                "(examples/families/)")
      ->check(CLI::ExistingFile);
  f->footer("Example:\n  cpsim fuzz --cases 300 --seed 7 --max-cp 8\n"
            "  cpsim fuzz --family examples/families/te_thd_2cp.json --cases 500 --plan balanced\n"
            "  then replay a failure: cpsim check cpsim-counterexample.json --cp N --seed S");
  HarnessArgs& harness = o.harness;
  auto* h = app.add_subcommand("harness", "the generator side of the Python property harness (cpsim.torch.check)");
  h->add_option("--cases", harness.cases, "layouts to draw")->check(CLI::Range(1, 10000000));
  std::uint64_t harness_seed = 0;
  auto* hs = h->add_option("--seed", harness_seed, "generator seed (default: RapidCheck's)");
  h->add_option("--max-cp", harness.max_cp, "largest CP size drawn")->check(CLI::Range(1, 64));
  h->add_option("--cp", harness.cp, "every case at this CP size (a drawn plan's cuts become equal intervals)")
      ->check(CLI::Range(1, 64));
  h->add_option("--cps", harness.cp_sizes, "draw CP sizes from this list, each as often as any other")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  auto* hf = h->add_option("--family", harness.family, "draw only members of this layout family")->check(CLI::ExistingFile);
  h->add_option("--batch", harness.batch, "replay this batch file (one case at --cp, with --plan and --seed)")
      ->check(CLI::ExistingFile)
      ->excludes(hf);
  h->add_option("--plan", harness.plan.plan, "equal, balanced, random (drawn cuts), or with --batch a plan file");
  h->add_option("--cost", harness.plan.cost, "the balanced plan's token cost");
  h->add_option("--conv-width", harness.conv_width, "convolution taps W")->check(CLI::Range(1, 64));
  h->add_flag("--shard-primary", harness.shard_primary, "input_ids sharded like the other keys");
  h->add_option("--dtype", harness.dtype, "dtype of every floating input and expected value (tolerances in the manifest)")
      ->check(CLI::IsMember({"f64", "f32", "bf16"}));
  h->add_option("--pad-multiple", harness.pad_multiple, "pad the sequence to a multiple of cp * M (equal or balanced plan)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  h->add_option("--min-shard", harness.min_shard,
                "draw only layouts whose equal shards hold at least N positions (a library's contract)")
      ->check(CLI::Range(1, 1 << 20));
  h->add_option("--forms", harness.forms,
                "draw random layouts only in these forms (seq_lens_padded, seq_lens, cu_seqlens, cu_seqlens_only, "
                "cu_seqlens_padded_only, unpacked, position_ids)")
      ->delimiter(',');
  h->add_option("--long-every", harness.long_every, "1 in N random layouts is long (--long-lengths; 0: none)")
      ->check(CLI::Range(0, 1 << 20));
  h->add_option("--long-lengths", harness.long_lengths, "the long layouts' lengths: MIN,MAX tokens")
      ->delimiter(',')->expected(2)->check(CLI::Range(1, 1 << 20));
  h->add_flag("--long-per-rank", harness.long_per_rank,
              "the long lengths are each rank's shard (the sequence cp times as long): shards that span kernel "
              "chunks at every CP size");
  h->add_option("--live-gates-every", harness.live_gates_every,
                "1 in N cases draws the recurrence's gates live: per head a decay factor 1, 0.01, 0.1 or 0 (a state "
                "that outlives a chunk, heads that differ; 0: none)")
      ->check(CLI::Range(0, 1 << 20));
  h->add_option("--rows-multiple", harness.rows_multiple,
                "every layout a multiple of N rows, [B, S] row forms only (N data-parallel replicas, each its own "
                "rows of one batch)")
      ->check(CLI::Range(1, 64));
  h->add_option("--probes", harness.probes,
                "once the property held, this many layouts just outside each contract (--min-shard, --forms): the "
                "step must refuse them or handle them right")
      ->check(CLI::Range(0, 1000));
  h->add_option("--workdir", harness.workdir, "where each case's golden folder is written")->required();
  h->footer("Speaks a line protocol on stdin/stdout (cli/harness.cpp); run it through cpsim.torch.check.");
  ShowArgs& show = o.show;
  auto* s = app.add_subcommand("show", "draw a batch's layout: documents, padding, shard cuts, halos");
  add_batch_or_family(s, show.batch, show.family, show.samples, show.seed,
                      "draw members of a layout family instead of a batch");
  s->add_option("--cp", show.cp, "CP size")->check(CLI::Range(1, 4096));
  s->add_option("--conv-width", show.conv_width, "convolution taps W (halo of W-1 positions)")->check(CLI::Range(1, 64));
  s->add_option("--svg", show.svg, "also write the picture as an SVG file");
  add_plan_options(s, show.plan, false);
  s->add_option("--color", show.color, "auto | always | never")->check(CLI::IsMember({"auto", "always", "never"}));
  s->footer("Example:\n  cpsim show examples/spec_example.json --cp 3 --svg layout.svg");
  GoldenArgs& golden = o.golden;
  auto* gd = app.add_subcommand("golden", "conformance vectors for another implementation, as safetensors");
  gd->add_option("batch", golden.batch, "BATCH file (JSON or safetensors)")->required()->check(CLI::ExistingFile);
  gd->add_option("--cp", golden.cp, "CP size")->required()->check(CLI::Range(1, 1024));
  gd->add_option("--out", golden.out, "folder to write")->required();
  gd->add_flag("--shard-primary", golden.shard_primary,
               "input_ids sharded like the other keys (a language-only model; default: global, as a "
               "vision-language model keeps them)");
  gd->add_option("--index-dtype", golden.index_dtype, "dtype of row_cu_seqlens: int32 (as FLA takes) or int64")
      ->check(CLI::IsMember({"int32", "int64"}));
  gd->add_option("--dtype", golden.dtype,
                 "dtype of every floating input and expected value: f64, f32 or bf16 (tolerances in the manifest)")
      ->check(CLI::IsMember({"f64", "f32", "bf16"}));
  gd->add_option("--pad-multiple", golden.pad_multiple, "pad the sequence to a multiple of cp * M")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  add_model_options(gd, golden.model, "seed of the inputs (the same inputs cpsim check --seed draws)");
  add_plan_options(gd, golden.plan, false);
  gd->footer("Example:\n  cpsim golden examples/spec_example.json --cp 3 --out golden/\n"
             "  python3 examples/golden_check.py golden/   (compares a PyTorch or numpy implementation)");
  LaunchArgs& launch = o.launch;
  PlanArgs& plan = o.plan;
  auto* pl = app.add_subcommand("plan", "each shard plan's per-rank cost, imbalance and bytes moved, side by side");
  add_batch_or_family(pl, plan.batch, plan.family, plan.samples, plan.seed,
                      "the imbalance over members of a layout family instead");
  pl->add_option("--cp", plan.cp, "CP size")->required()->check(CLI::Range(1, 1024));
  pl->add_option("--cost", plan.cost,
                 "the per-token cost balanced: attention (t - doc_start + 1 per real token), linear (1), or "
                 "attention=A,linear=B");
  pl->add_flag("--json", plan.json, "JSON instead of the table");
  pl->add_option("--svg", plan.svg, "also draw per-rank cost bars under the layout picture");
  pl->add_option("--conv-width", plan.model.conv_width, "convolution taps W (the halo's reach)")->check(CLI::Range(1, 64));
  pl->add_option("--channels", plan.model.channels, "channels of the float32 activation whose bytes are counted")
      ->check(CLI::Range(1, 1 << 20));
  pl->add_option("--heads", plan.model.heads, "heads of the recurrent state")->check(CLI::Range(1, 1024));
  pl->add_option("--key-dim", plan.model.key_dim, "key size K of the recurrent state")->check(CLI::Range(1, 4096));
  pl->add_option("--value-dim", plan.model.value_dim, "value size V of the recurrent state")->check(CLI::Range(1, 4096));
  pl->footer("Example:\n  cpsim plan examples/packed_two_rows.json --cp 4\n"
             "  cpsim plan --family examples/families/nemo_automodel_seq_lens.json --cp 8 --cost attention=1,linear=64");
  auto* l = app.add_subcommand("launch", "start N processes of one Gloo job on this host: launch -n N -- cpsim ...");
  l->add_option("-n,--nproc", launch.launch.processes, "processes (ranks)")->required()->check(CLI::Range(1, 1024));
  l->add_option("--store", launch.launch.store,
                "the store the processes meet in: file:DIR or redis://HOST:PORT (default: a fresh temporary directory)");
  l->add_option("--grace", launch.grace, "seconds the others get to exit after one process fails, before they are killed")
      ->check(CLI::Range(0.0, 86400.0));
  l->add_option("command", launch.launch.command, "the command each process runs, after --")->required();
  l->footer("Example:\n  cpsim launch -n 4 -- cpsim check examples/spec_example.json");
  BenchArgs& bench = o.bench;
  auto* b = app.add_subcommand("bench", "time collectives against the memory limit (nccl-tests table), check every result");
  b->add_option("--backend", bench.backends, "backends to time (default: every one that can run here)")
      ->delimiter(',')
      ->check(CLI::IsMember(backend_names()));
  b->add_option("--store", bench.job.store, "the store of a multi-process job (default: $CPSIM_STORE)");
  b->add_option("--timeout", bench.job.timeout, "seconds a rank waits for its peers")->check(CLI::Range(0.05, 86400.0));
  b->add_option("--ranks", bench.ranks, "rank counts")->delimiter(',')->check(CLI::Range(1, 64));
  b->add_option("--sizes", bench.sizes, "bytes per rank: 8,64K,16M,...")->delimiter(',');
  b->add_option("--ops", bench.ops, "all_gather,reduce_scatter,send_recv")
      ->delimiter(',')
      ->check(CLI::IsMember({"all_gather", "reduce_scatter", "send_recv"}));
  b->add_option("--iterations", bench.iterations, "timed calls a point (default: about 256 MiB of traffic)")
      ->check(CLI::Range(1, 1000000));
  b->add_option("--properties", bench.properties, "also time the property table, this many seconds a row (cases/s)")
      ->check(CLI::Range(0.0, 3600.0));
  b->add_flag("--json", bench.json, "JSON instead of the table");
  b->add_flag("--quick", bench.quick,
              "a first look in under a minute: --backend threads (unless given) --ranks 2,4 --sizes 8,64K,1M "
              "--properties 0.5");
  b->add_option("--svg", bench.svg, "write bus bandwidth against size as an SVG file");
  b->footer("Example:\n  cpsim bench --quick\n  cpsim bench --backend threads,gloo --ranks 4 --sizes 8,64K,16M --svg bench.svg\n"
            "Every backend, 2/4/8 ranks and 8 sizes (the defaults) take about 5 minutes on two cores.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return {std::nullopt, code == 0 ? kExitOk : kExitUsage};
  }
  // The same CP size twice is one column.
  std::vector<int> sizes;
  for (int cp : check.cp_sizes)
    if (std::find(sizes.begin(), sizes.end(), cp) == sizes.end()) sizes.push_back(cp);
  check.cp_sizes = sizes;
  o.command = c->parsed()    ? Command::check
              : f->parsed()  ? Command::fuzz
              : s->parsed()  ? Command::show
              : gd->parsed() ? Command::golden
              : pl->parsed() ? Command::plan
              : b->parsed()  ? Command::bench
              : h->parsed()  ? Command::harness
                             : Command::launch;
  if (h->parsed() && hs->count() > 0) harness.seed = harness_seed;
  return {o, kExitOk};
}

}  // namespace cpsim::cli
