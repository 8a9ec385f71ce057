// ulysses._C: the pybind11 module behind the Python package. Thin: it converts arguments and
// calls the core's pure planners (head and sequence splits, mask shapes, layouts); the
// `ulysses` command is its own module (cli_module.cpp);
// tensors reach the core through torch.ops.ulysses (each floor's src/<floor>/ops.cpp),
// registered when libulysses loads. Every rule Python applies is read from here, never copied:
// the even split, tile counts, the label rule, the kernel names and module-option rules, the
// default timeout and the ignore index.
#include <c10/util/Exception.h>
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "attention/orchestration.h"
#include "dispatch/autograd.h"
#include "plan/fnv1a.h"
#include "training/offloaded_bytes.h"
#include "transport/op_options.h"
#include "ulysses/collective_recorder.h"
#include "ulysses/distributed_attention.h"
#include "ulysses/flash_attention.h"
#include "ulysses/group.h"
#include "ulysses/mask.h"
#include "ulysses/mask_decision.h"
#include "ulysses/mesh_plan.h"
#include "ulysses/partition.h"
#include "ulysses/ring_attention.h"
#include "ulysses/sharding.h"
#include "ulysses/tiled.h"

namespace py = pybind11;

namespace ulysses {
namespace {

py::list ranges(const std::vector<Range>& rs) {
  py::list out;
  for (const Range& r : rs) out.append(py::make_tuple(r.begin, r.end));
  return out;
}

// The head partition (and sequence split) of every rank, as plain Python values.
py::dict plan(int64_t q_heads, int64_t kv_heads, int64_t sp, c10::optional<int64_t> seq_len) {
  const auto p = HeadPartition::make(q_heads, kv_heads, sp);
  py::dict d;
  std::vector<int64_t> nq, nkv;
  std::vector<std::vector<int64_t>> maps;
  for (int64_t r = 0; r < sp; ++r) {
    nq.push_back(p.q_range(r).size());
    nkv.push_back(p.kv_range(r).size());
    maps.push_back(p.kv_map(r));
  }
  d["q_heads"] = nq;
  d["kv_heads"] = nkv;
  d["q_ranges"] = ranges(p.q_ranges());
  d["kv_ranges"] = ranges(p.kv_ranges());
  d["kv_map"] = maps;
  if (seq_len) d["seq_lens"] = SequencePartition::even(*seq_len, sp).lengths();
  d["total_q_heads"] = q_heads;
  d["total_kv_heads"] = kv_heads;
  d["sp"] = sp;
  return d;
}

// c10 errors keep their Python types (ValueError, TypeError, ...), as torch's own bindings do.
void translate_c10_errors() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
}

// The pure planners: head and sequence splits, the ring layout, the Ulysses x ring mesh.
void bind_plans(py::module_& m) {
  m.def("plan", &plan, py::arg("q_heads"), py::arg("kv_heads"), py::arg("sp"),
        py::arg("seq_len") = py::none());
  m.def("free_if_unshared", &detail::free_if_unshared, py::arg("tensor"),
        "Frees the tensor's bytes, keeping its shape, where nothing else holds its storage; "
        "returns whether it did (a recomputed output whose graph is all that is wanted).");
  m.def("auto_head_chunks", &auto_head_chunks, py::arg("q_heads"), py::arg("kv_heads"),
        py::arg("sp"), py::arg("recompute") = false,
        "The chunk count head_chunks='auto' takes (partition.h).");
  m.def(
      "head_chunks",
      [](int64_t q_heads, int64_t kv_heads, int64_t sp, int64_t count) {
        py::list out;
        for (const HeadChunk& c : head_chunks(q_heads, kv_heads, sp, count))
          out.append(py::make_tuple(py::make_tuple(c.q.begin, c.q.end),
                                    py::make_tuple(c.kv.begin, c.kv.end)));
        return out;
      },
      py::arg("q_heads"), py::arg("kv_heads"), py::arg("sp"), py::arg("count"),
      "Attention in `count` chunks of heads (Note [Head chunks]): each chunk's query and kv "
      "heads, as ((begin, end), (begin, end)).");
  m.def(
      "sequence_split",
      [](int64_t seq_len, int64_t sp) { return SequencePartition::even(seq_len, sp).lengths(); },
      py::arg("seq_len"), py::arg("sp"),
      "Every rank's token count when `seq_len` tokens are split evenly over `sp` ranks (the "
      "first `seq_len % sp` ranks hold one more).");
  m.def(
      "ring_shard_index",
      [](int64_t seq_len, int64_t ulysses, int64_t ring, int64_t sp_rank) {
        at::Tensor index = RingLayout::make(seq_len, ulysses, ring).shard_index(sp_rank);
        return std::vector<int64_t>(index.data_ptr<int64_t>(),
                                    index.data_ptr<int64_t>() + index.numel());
      },
      py::arg("seq_len"), py::arg("ulysses"), py::arg("ring"), py::arg("sp_rank"),
      "Global token indices (increasing) held by SP rank `sp_rank` (= ring rank * ulysses + "
      "Ulysses rank) in the zigzag hybrid layout of `seq_len` tokens.");
  m.def(
      "ring_lengths",
      [](int64_t seq_len, int64_t ulysses, int64_t ring) {
        return RingLayout::make(seq_len, ulysses, ring).ring_lengths();
      },
      py::arg("seq_len"), py::arg("ulysses"), py::arg("ring"),
      "Tokens of every ring rank (all its Ulysses ranks together) in the zigzag layout.");
  m.def("check_mesh_sizes", &check_mesh_sizes, py::arg("world_size"), py::arg("sp_size"),
        py::arg("ring_size"), py::arg("who"),
        "The mesh size rule: the SP size divides the world, the ring size the SP size (raises "
        "ValueError naming the sizes, prefixed by `who`).");
  m.def(
      "plan_sp_mesh",
      [](int64_t sp, int64_t q_heads, int64_t kv_heads, int64_t seq_len, int64_t head_dim,
         int64_t batch, int64_t elem_bytes) {
        LayerShape s;
        s.q_heads = q_heads, s.kv_heads = kv_heads, s.seq_len = seq_len, s.head_dim = head_dim;
        s.batch = batch, s.elem_bytes = elem_bytes;
        std::vector<py::dict> out;
        for (const MeshCost& c : plan_sp_mesh(sp, s)) {
          py::dict d;
          d["ulysses"] = c.ulysses, d["ring"] = c.ring, d["a2a_bytes"] = c.a2a_bytes;
          d["ring_bytes"] = c.ring_bytes, d["ring_messages"] = c.ring_messages;
          d["peak_bytes"] = c.peak_bytes, d["kv_replicas"] = c.kv_replicas;
          out.push_back(d);
        }
        return out;
      },
      py::arg("sp"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("seq_len"),
      py::arg("head_dim") = 128, py::arg("batch") = 1, py::arg("elem_bytes") = 2,
      "Every Ulysses x ring split of `sp` ranks with its per-rank cost per layer, recommended "
      "first (see ulysses plan).");
}

// The shape rules Python checks with: masks and layouts.
void bind_shape_rules(py::module_& m) {
  m.def(
      "rebuilt_mask_shape",
      [](const std::vector<int64_t>& sizes, int64_t q_heads, int64_t kv_heads,
         const std::vector<int64_t>& seq_lens, int64_t rank, int64_t key_len) {
        return rebuilt_mask_shape(
            sizes, HeadPartition::make(q_heads, kv_heads, static_cast<int64_t>(seq_lens.size())),
            SequencePartition::from_lengths(seq_lens), rank, key_len);
      },
      py::arg("sizes"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("seq_lens"),
      py::arg("rank"), py::arg("key_len") = -1);
  m.def("check_window", &check_window, py::arg("window"), py::arg("causal"),
        "The sliding-window rule (raises ValueError unless 0, or > 0 with causal).");
  m.def("flash_attention_isa", &flash_attention_isa,
        "The instruction set the fused kernel runs in (\"AVX512\", \"AVX2\" or \"DEFAULT\").");
  m.def("check_softcap", &check_softcap, py::arg("softcap"),
        "The logit-softcap rule (raises ValueError unless 0, or finite and > 0).");
  m.def("mask_shared_across_heads", &mask_shared_across_heads, py::arg("sizes"),
        "True when a mask of these sizes is one mask for every head (see mask_decision.h).");
  m.def(
      "layout_dims",
      [](const std::string& layout) {
        const Layout l = parse_layout(layout);
        return std::make_pair(seq_dim(l), head_dim(l));
      },
      py::arg("layout"), "(sequence dim, head dim) of a layout name such as 'BSHD'.");
  m.def(
      "bhsd_permutations",
      [](const std::string& layout) {
        const Layout l = parse_layout(layout);
        return std::make_pair(to_bhsd(l), from_bhsd(l));
      },
      py::arg("layout"), "(layout -> BHSD, BHSD -> layout) permutations of a layout name.");
}

// Group helpers and the C++-API test hook.
void bind_groups_and_hooks(py::module_& m) {
  m.def(
      "collective_count",
      [](const std::string& group) { return Group::resolve(group).recorder().collectives(); },
      py::arg("group"));
  m.def(
      "fail_together",
      [](const std::string& message, const std::string& group, int64_t timeout_ms,
         bool before_attention) {
        const GroupOptions options = options_from_ints({timeout_ms});
        const Group g = Group::resolve(group, options);
        py::gil_scoped_release release;
        try {
          TORCH_CHECK_VALUE(false, message);
        } catch (const c10::Error&) {
          if (before_attention) fail_attention_together(g, std::current_exception());
          g.fail_together(std::current_exception());
        }
      },
      py::arg("message"), py::arg("group"), py::arg("timeout_ms"),
      py::arg("before_attention") = false,
      "Raises `message` on every rank of `group` through the agreement round that the other "
      "ranks' ops run (every agreement round has one shape), so a local mistake found in Python "
      "fails all ranks alike instead of hanging them. `before_attention`: the other ranks start "
      "an attention call (through the group's armed exchange first, Note [Reused agreement]).");
  m.def(
      "gradients_of",
      [](const std::vector<at::Tensor>& params, const std::string& group, int64_t timeout_ms) {
        const GroupOptions options = options_from_ints({timeout_ms});
        const Group g = Group::resolve(group, options);
        py::gil_scoped_release release;
        return gradients_of(params, g);
      },
      py::arg("params"), py::arg("group"), py::arg("timeout_ms"),
      "The gradients of `params` to sum over `group`, alike on every rank (sharding.h): those "
      "some ranks lack are set to zeros there.");
  m.def(
      "check_together",
      [](const std::string& error, const std::string& group, int64_t timeout_ms,
         const std::string& purpose) {
        const GroupOptions options = options_from_ints({timeout_ms});
        const Group g = Group::resolve(group, options);
        py::gil_scoped_release release;
        g.agree(
            [&] {
              TORCH_CHECK_VALUE(error.empty(), error);
              return std::vector<int64_t>{};
            },
            purpose);
      },
      py::arg("error"), py::arg("group"), py::arg("timeout_ms"), py::arg("purpose"),
      "One agreement round over `group` on a check made in Python: `error` is this rank's "
      "problem, empty when none. If any rank has one, every rank raises the lowest such rank's "
      "(ValueError, naming it).");
  m.def(
      "agree_values",
      [](const std::vector<int64_t>& values, const std::vector<std::string>& names,
         const std::string& group, int64_t timeout_ms, const std::string& who) {
        TORCH_CHECK_VALUE(names.size() == values.size(), who, ": one name per value");
        const GroupOptions options = options_from_ints({timeout_ms});
        const Group g = Group::resolve(group, options);
        std::vector<std::vector<int64_t>> all;
        {
          py::gil_scoped_release release;
          all = g.agree([&] { return values; }, who);
        }
        for (size_t r = 1; r < all.size(); ++r) {
          const size_t n = std::min(all[r].size(), all[0].size());
          size_t i = 0;
          while (i < n && all[r][i] == all[0][i]) ++i;
          if (i == n && all[r].size() == all[0].size()) continue;
          const auto value = [](const std::vector<int64_t>& v, size_t j) {
            return j < v.size() ? std::to_string(v[j]) : std::string("none");
          };
          TORCH_CHECK_VALUE(false, who, ": ranks disagree on ",
                            i < names.size() ? names[i] : std::string("the number of values"),
                            ": rank 0 has ", value(all[0], i), ", rank ", r, " has ",
                            value(all[r], i));
        }
      },
      py::arg("values"), py::arg("names"), py::arg("group"), py::arg("timeout_ms"), py::arg("who"),
      "One agreement round over `group` on values every rank must hold alike (at most 96): "
      "where any differ, every rank raises the same ValueError naming the first (`names`) with "
      "rank 0's value and the differing rank's.");
  m.def(
      "text_digest", [](const std::string& text) { return Fnv1a().add(text).non_negative(); },
      py::arg("text"),
      "A non-negative 63-bit FNV-1a digest of `text` (src/plan/fnv1a.h): what an agreement round "
      "compares in place of a text.");
  m.def(
      "cpp_distributed_attention",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& positions,
         const std::string& group, int64_t timeout_ms, int64_t q_heads, int64_t kv_heads,
         const std::string& layout, bool causal, double scale, const std::string& local,
         int64_t window, double softcap) {
        py::gil_scoped_release release;  // Rank threads run collectives meanwhile.
        const GroupOptions options = options_from_ints({timeout_ms});
        AttentionOptions a;
        a.q_heads = q_heads;
        a.kv_heads = kv_heads;
        a.layout = parse_layout(layout);
        a.causal = causal;
        a.scale = scale;
        a.window = window;
        a.softcap = softcap;
        a.kernel = parse_local_kernel(local);
        DistributedAttention attention(Group::resolve(group, options), a);
        return attention(q, k, v, {mask, positions});
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("positions"),
      py::arg("group"), py::arg("timeout_ms"), py::arg("q_heads"), py::arg("kv_heads"),
      py::arg("layout"), py::arg("causal"), py::arg("scale"), py::arg("local"),
      py::arg("window") = 0, py::arg("softcap") = 0.0,
      "One call of the C++ API's DistributedAttention (q_heads/kv_heads 0: from the tensors), "
      "for tests that hold the Python module to it.");
}

// The rules Python applies, each with its one home in C++.
void bind_rules(py::module_& m) {
  m.def(
      "even_split", [](int64_t n, int64_t parts) { return ranges(even_split(n, parts)); },
      py::arg("n"), py::arg("parts"),
      "The even split of range(n) into `parts` (start, end) blocks, the first n % parts one "
      "larger (the rule of every head, token and tile split).");
  m.def("tile_count", &tile_count, py::arg("rows"), py::arg("tile_rows"),
        "Tiles of at most tile_rows rows covering rows rows (at least 1).");
  m.def("loss_tile_count", &loss_tile_count, py::arg("rows"), py::arg("vocab"),
        py::arg("tile_bytes"),
        "Tiles of a tiled loss over rows rows of vocab classes, each holding at most tile_bytes "
        "of fp32 logits.");
  m.def(
      "checkpoint_modes",
      [] {
        std::vector<std::string> names;
        for (Checkpoint c : {Checkpoint::kNone, Checkpoint::kRecompute, Checkpoint::kOffload})
          names.push_back(to_string(c));
        return names;
      },
      "How a checkpointed layer keeps its input: \"none\", \"recompute\", \"offload\".");
  m.def("offloaded_bytes", &offloaded_bytes,
        "Bytes of host memory that offloaded checkpoints (C++ and Python) hold now.");
  m.def("count_offloaded_bytes", &count_offloaded_bytes, py::arg("delta"),
        "Adds `delta` bytes (negative: released) to offloaded_bytes.");
  m.def("target_problem", &target_problem, py::arg("targets"), py::arg("vocab"),
        py::arg("ignore_index"), py::arg("who"), py::arg("name"),
        "What is wrong with the labels of a loss over vocab classes, or \"\".");
  m.def(
      "local_kernels",
      [] {
        std::vector<std::string> names;
        for (LocalKernel k : local_kernels()) names.push_back(to_string(k));
        return names;
      },
      "The names of the local-attention kernels (\"auto\" first).");
  m.def(
      "chosen_local_kernel",
      [](const std::string& device, at::ScalarType dtype, bool mask, bool documents, int64_t window,
         double softcap, bool sinks, const std::string& kernel, bool by_cpp) {
        KernelCase c;
        c.device = c10::Device(device).type();
        c.dtype = dtype;
        c.mask = mask, c.documents = documents, c.window = window, c.softcap = softcap;
        c.sinks = sinks;
        const LocalKernel chosen = choose_local_kernel(c, parse_local_kernel(kernel));
        return to_string(by_cpp ? kernel_run_by_cpp(chosen, c) : chosen);
      },
      py::arg("device"), py::arg("dtype"), py::arg("mask"), py::arg("documents"), py::arg("window"),
      py::arg("softcap"), py::arg("sinks"), py::arg("kernel") = "auto", py::arg("by_cpp") = false,
      "The kernel local attention runs for a case with these facts (Note [Local attention by "
      "case], choose_local_kernel; `device` a device type name such as \"cuda\", `documents`: "
      "position ids given): the rule's choice for \"auto\", else the kernel named (raises "
      "where it cannot run). \"flex\" is Python's to run; `by_cpp`: the kernel the C++ API runs "
      "in its place (kernel_run_by_cpp).");
  m.def("splits_documents", &splits_documents, py::arg("positions"),
        "Whether position ids [B, S] or [S] put tokens of one row in different documents (a 0 "
        "after the row's first token); ids that do not add no rule to attention.");
  m.def(
      "check_attention_options",
      [](int64_t q_heads, int64_t kv_heads, bool causal, double scale, int64_t window,
         double softcap) {
        AttentionRules rules;
        rules.causal = causal, rules.scale = scale, rules.window = window, rules.softcap = softcap;
        check_attention_options(q_heads, kv_heads, rules);
      },
      py::arg("q_heads"), py::arg("kv_heads"), py::arg("causal"), py::arg("scale"),
      py::arg("window"), py::arg("softcap"),
      "The rules of a DistributedAttention's options (raises ValueError).");
  m.def(
      "check_ring_kernel",
      [](const std::string& local) {
        check_ring_kernel(local.empty() ? c10::nullopt
                                        : c10::optional<LocalKernel>(parse_local_kernel(local)));
      },
      py::arg("local"),
      "Hybrid ring attention runs the fused kernel (local \"\": a callable; raises ValueError).");
  m.attr("DEFAULT_TIMEOUT_MS") = kDefaultTimeout.count();
  m.attr("IGNORE_INDEX") = kIgnoreIndex;
  m.attr("LOSS_TILE_BYTES") = kLossTileBytes;
}

}  // namespace
}  // namespace ulysses

PYBIND11_MODULE(_C, m) {
  m.doc() = "ulysses C++ core (torch.ops.ulysses is registered when this module loads)";
  ulysses::translate_c10_errors();
  ulysses::bind_plans(m);
  ulysses::bind_shape_rules(m);
  ulysses::bind_groups_and_hooks(m);
  ulysses::bind_rules(m);
}
