// The autograd node of an eager training call on our kernels, in compiled host code.
//
// Why this file exists: a Python torch.autograd.Function costs more host time per training step than
// cuDNN's whole forward+backward of a small problem (docs/kernel-log.md, steps 23 and 25): its forward
// builds a Python context, and its backward runs Python on the autograd engine's device thread, which must
// take the GIL back from the thread that called backward(). A node written in C++ pays neither. The forward
// launch stays in Python (the same code inference runs, flash_attention/ops/forward.py); this file holds
// what comes after it:
//
//   flash_attention_host::record_training(q, k, v, out, lse, key_range?, dropout_key, program address)
//       makes `out` the output of an AttentionBackward node whose inputs are q, k and v;
//   AttentionBackward::apply
//       allocates dq, dk, dv and the fp32 workspace and queues the backward's launches, all in C++.
//
// What the launches are is decided in Python, once per call signature (flash_attention/ops/backward.py
// makes the plan; flash_attention/ops/training.py hands it over as a BackwardProgram): the params struct
// with every field but the pointers, the byte offsets of the pointer fields, and the kernels with their
// grids. This file never needs the struct's layout, so the kernels' params headers stay the one definition.
//
// The CUDA driver is reached through function pointers handed over by flash_attention/jit/driver.py's
// libcuda (set_driver): nothing here links against CUDA, so the file compiles with the headers of any
// PyTorch build, CPU-only ones included, and the CPU tests drive it with stand-in launch functions.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace flash_attention_host {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// ---------------------------------------------------------------------------------------------------------
// The driver entry points (addresses from Python; see the file comment).

using LaunchFn = int (*)(void* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned smem, void* stream, void** params, void** extra);
using CtxGetFn = int (*)(void** ctx);
using CtxSetFn = int (*)(void* ctx);
using ErrorStringFn = int (*)(int status, const char** text);

struct Driver {
  LaunchFn launch = nullptr;
  CtxGetFn ctx_get = nullptr;
  CtxSetFn ctx_set = nullptr;
  ErrorStringFn error_string = nullptr;
};

// Set once at load (and by the CPU tests' stand-ins) before any node exists; read by every backward.
Driver g_driver;

// Every error this file raises is a std::runtime_error, never TORCH_CHECK's c10::Error: on torch 2.11 (an
// H100 machine's image) a TORCH_CHECK with a composed message, raised from this library, crashed the process
// with a segmentation fault (in the custom class's constructor and inside the autograd engine alike), while
// the same errors as std::runtime_error are reported normally. PyTorch turns either into a Python
// RuntimeError.
[[noreturn]] void fail(const std::string& message) { throw std::runtime_error(message); }

void check(bool ok, const std::string& message) {
  if (!ok) fail(message);
}

void set_driver(int64_t launch, int64_t ctx_get, int64_t ctx_set, int64_t error_string) {
  check(launch && ctx_get && ctx_set, "flash_attention_host.set_driver: null entry point");
  g_driver.launch = reinterpret_cast<LaunchFn>(launch);
  g_driver.ctx_get = reinterpret_cast<CtxGetFn>(ctx_get);
  g_driver.ctx_set = reinterpret_cast<CtxSetFn>(ctx_set);
  g_driver.error_string = reinterpret_cast<ErrorStringFn>(error_string);
}


[[noreturn]] void driver_failed(int status, const std::string& what) {
  const char* text = nullptr;
  if (g_driver.error_string != nullptr) g_driver.error_string(status, &text);
  fail("flash_attention: " + what + " failed: " + (text != nullptr ? text : "unknown error") + " (" +
                  std::to_string(status) + ")");
}

// ---------------------------------------------------------------------------------------------------------
// BackwardProgram: one call signature's backward launches (made by flash_attention/ops/training.py).

// The pointer fields of BwdParams this file writes, in the order of the offsets list Python passes.
enum Slot : int {
  kQ, kK, kV, kO, kDout, kLse, kLseLog2, kDelta, kDqAccum, kDq, kDk, kDv, kKeyRange, kDropoutKey, kNumSlots
};

struct Launch {
  void* kernel;
  unsigned grid[3];
  unsigned threads;
  unsigned smem;
};

struct BackwardProgram : torch::CustomClassHolder {
  static constexpr uint64_t kMagic = 0x666173746e6f6465;  // record_training's check on the address it is given
  uint64_t magic = kMagic;
  std::vector<uint8_t> params;  // BwdParams, every field but the pointers and the dropout key
  int64_t offsets[kNumSlots];   // byte offset of each slot in params (-1: not written)
  std::vector<Launch> launches;  // in queue order: preprocessing, dK/dV, then dQ's cast or kernel
  std::vector<std::string> names;  // the launches' kernel names, for error messages
  int64_t stats;                 // floats in each of the workspace's base-2 LSE and delta arrays
  int64_t accum;                 // floats of the atomic dQ accumulator after them (0: deterministic)
  void* context;                 // the device's primary context (the launches' kernels are loaded there)

  // launches: six integers per launch (kernel handle, grid x, y, z, threads, dynamic shared memory);
  // names: the kernel names joined by newlines.
  BackwardProgram(const at::Tensor& params_bytes, std::vector<int64_t> slot_offsets,
                  std::vector<int64_t> launch_fields, const std::string& kernel_names, int64_t stats_,
                  int64_t accum_, int64_t context_)
      : stats(stats_), accum(accum_), context(reinterpret_cast<void*>(context_)) {
    check(params_bytes.device().is_cpu() && params_bytes.scalar_type() == at::kByte &&
              params_bytes.is_contiguous(),
          "BackwardProgram: params must be a contiguous uint8 CPU tensor");
    check(static_cast<int64_t>(slot_offsets.size()) == kNumSlots,
          "BackwardProgram: expected " + std::to_string(kNumSlots) + " offsets, got " +
              std::to_string(slot_offsets.size()));
    check(!launch_fields.empty() && launch_fields.size() % 6 == 0,
          "BackwardProgram: launches must be six integers each");
    const auto* bytes = params_bytes.data_ptr<uint8_t>();
    params.assign(bytes, bytes + params_bytes.numel());
    for (int i = 0; i < kNumSlots; ++i) {
      const int64_t width = i == kDropoutKey ? 4 : 8;
      check(slot_offsets[i] == -1 || (slot_offsets[i] >= 0 && slot_offsets[i] + width <= params_bytes.numel()),
            "BackwardProgram: offset of slot " + std::to_string(i) + " outside the params");
      offsets[i] = slot_offsets[i];
    }
    for (size_t i = 0; i < launch_fields.size(); i += 6) {
      launches.push_back({reinterpret_cast<void*>(launch_fields[i]),
                          {static_cast<unsigned>(launch_fields[i + 1]), static_cast<unsigned>(launch_fields[i + 2]),
                           static_cast<unsigned>(launch_fields[i + 3])},
                          static_cast<unsigned>(launch_fields[i + 4]),
                          static_cast<unsigned>(launch_fields[i + 5])});
    }
    size_t start = 0;
    while (names.size() < launches.size()) {
      const size_t end = kernel_names.find('\n', start);
      names.push_back(kernel_names.substr(start, end == std::string::npos ? std::string::npos : end - start));
      start = end == std::string::npos ? kernel_names.size() : end + 1;
    }
  }

  // Write an address (8 bytes) or the dropout key (a 32-bit unsigned field) into a copy of the params;
  // absent slots are skipped.
  void put(std::vector<uint8_t>& into, Slot slot, uint64_t value) const {
    if (offsets[slot] < 0) return;
    if (slot == kDropoutKey) {
      const uint32_t key = static_cast<uint32_t>(value);
      std::memcpy(into.data() + offsets[slot], &key, sizeof(key));
    } else {
      std::memcpy(into.data() + offsets[slot], &value, sizeof(value));
    }
  }
};

// Queue every launch of `program` on `stream` with `params`, in the device's primary context (made current
// for the launches and the caller's context put back after, as flash_attention/jit/driver.py's
// make_primary_current does for the Python launches: the engine's device thread may have none current).
void launch_all(const BackwardProgram& program, std::vector<uint8_t>& params, void* stream) {
  if (g_driver.launch == nullptr) fail("flash_attention_host: set_driver was not called");
  void* previous = nullptr;
  int status = g_driver.ctx_get(&previous);
  if (status != 0) driver_failed(status, "cuCtxGetCurrent");
  const bool switched = previous != program.context;
  if (switched && (status = g_driver.ctx_set(program.context)) != 0) driver_failed(status, "cuCtxSetCurrent");
  void* args[1] = {params.data()};  // the kernels take the params struct as their one by-value argument
  int failed = 0;
  size_t which = 0;
  for (; which < program.launches.size(); ++which) {
    const Launch& l = program.launches[which];
    failed = g_driver.launch(l.kernel, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.smem, stream, args,
                             nullptr);
    if (failed != 0) break;
  }
  if (switched && previous != nullptr) g_driver.ctx_set(previous);
  if (failed != 0) driver_failed(failed, "launching " + program.names[which]);
}

// ---------------------------------------------------------------------------------------------------------
// The node

// Nodes are reference counted by c10::intrusive_ptr in newer PyTorch releases and by std::shared_ptr in
// older ones; the type says which, so one source builds against both.
template <class N, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, N>) {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  } else {
    return std::shared_ptr<N>(new N(std::forward<Args>(args)...));
  }
}

// A node's owning pointer to itself, of the type SavedVariable::unpack takes for a node's own output.
template <class N>
auto self_pointer(N* node) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, N>) {
    return c10::intrusive_ptr<torch::autograd::Node>::unsafe_reclaim_from_nonowning(node);
  } else {
    return node->shared_from_this();
  }
}

bool kernel_readable(const at::Tensor& t) {
  // The kernels read 16-byte vectors: a 16-byte aligned base (the strides are the plan's, checked by caller).
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

struct AttentionBackward : public torch::autograd::Node {
  AttentionBackward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                    std::optional<at::Tensor> key_range, int64_t dropout_key,
                    c10::intrusive_ptr<BackwardProgram> program)
      : q_(q, false),
        k_(k, false),
        v_(v, false),
        lse_(lse),
        key_range_(std::move(key_range)),
        dropout_key_(dropout_key),
        program_(std::move(program)) {}

  std::string name() const override { return "FlashAttentionBackward"; }

  void release_variables() override {
    q_.reset_data();
    k_.reset_data();
    v_.reset_data();
    out_.reset_data();
    lse_.reset();
    key_range_.reset();
  }

  variable_list apply(variable_list&& grads) override {
    // (After a backward without retain_graph, unpack raises PyTorch's "backward through the graph a second
    // time" error: release_variables freed what was saved.)
    // (out, this node's own output, is saved without its history to avoid a reference cycle: unpacking it
    // takes the node. Each unpack checks that no in-place operation changed the tensor since.)
    const at::Tensor q = q_.unpack(), k = k_.unpack(), v = v_.unpack(), out = out_.unpack(self_pointer(this));
    at::Tensor dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};  // out took no part in the loss
    // The program's dO strides are out's (contiguous): autograd hands over whatever layout the next op
    // produced (a stride-0 expand for out.sum(), a transpose's view), so anything else is copied first.
    if (!dout.is_contiguous() || !kernel_readable(dout)) dout = dout.contiguous();
    if (!kernel_readable(dout)) dout = dout.clone();

    const BackwardProgram& program = *program_;
    const auto contiguous = at::MemoryFormat::Contiguous;
    at::Tensor dq = at::empty_like(q, q.options(), contiguous);
    at::Tensor dk = at::empty_like(k, k.options(), contiguous);
    at::Tensor dv = at::empty_like(v, v.options(), contiguous);
    // One fp32 workspace: base-2 LSE rows, delta rows, then the atomic dQ accumulator (all written before
    // they are read by the preprocessing kernel, which also zeroes the accumulator).
    at::Tensor ws = at::empty({2 * program.stats + program.accum}, q.options().dtype(at::kFloat));

    std::vector<uint8_t> params = program.params;
    const auto addr = [](const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); };
    const uint64_t w = addr(ws);
    program.put(params, kQ, addr(q));
    program.put(params, kK, addr(k));
    program.put(params, kV, addr(v));
    program.put(params, kO, addr(out));
    program.put(params, kDout, addr(dout));
    program.put(params, kLse, addr(lse_));
    program.put(params, kLseLog2, w);
    program.put(params, kDelta, w + 4 * program.stats);
    program.put(params, kDqAccum, program.accum ? w + 8 * program.stats : 0);
    program.put(params, kDq, addr(dq));
    program.put(params, kDk, addr(dk));
    program.put(params, kDv, addr(dv));
    program.put(params, kKeyRange, key_range_ ? addr(*key_range_) : 0);
    program.put(params, kDropoutKey, static_cast<uint64_t>(dropout_key_));

    void* stream = nullptr;  // CPU tensors: only the tests' stand-in driver runs them
    if (q.is_cuda()) {
      // PyTorch's current stream on q's device: the engine made it the forward's stream for this node.
      c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
      stream = guard.getStream(q.device()).native_handle();
    }
    launch_all(program, params, stream);

    variable_list result{should_compute_output(0) ? dq : at::Tensor(),
                         should_compute_output(1) ? dk : at::Tensor(),
                         should_compute_output(2) ? dv : at::Tensor()};
    if (torch::autograd::GradMode::is_enabled()) {
      // backward(create_graph=True): these gradients were computed outside autograd, so differentiating
      // them again must fail loudly rather than give zero.
      auto error = make_node<torch::autograd::NotImplemented>(
          "FlashAttentionBackward", torch::autograd::collect_next_edges(q, k, v, dout));
      for (auto& g : result) {
        if (g.defined()) torch::autograd::set_history(g, error);
      }
    }
    return result;
  }

  SavedVariable q_, k_, v_, out_;
  at::Tensor lse_;
  std::optional<at::Tensor> key_range_;
  int64_t dropout_key_;
  c10::intrusive_ptr<BackwardProgram> program_;
};

// Make `out` (the forward's fresh output) the output of a new AttentionBackward node over q, k and v.
//
// `program` is the address of a live BackwardProgram (its `address()`; the caller keeps that object alive
// for the call, and the node takes its own reference). An address, not the object: a custom-class argument
// costs about 12 us more per call in PyTorch's Python op dispatch than an integer (measured on the CPU).
void record_training(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                     const at::Tensor& lse, const std::optional<at::Tensor>& key_range, int64_t dropout_key,
                     int64_t program_address) {
  auto* raw = reinterpret_cast<BackwardProgram*>(program_address);
  check(raw != nullptr && raw->magic == BackwardProgram::kMagic,
        "record_training: program is not the address of a BackwardProgram");
  auto program = c10::intrusive_ptr<BackwardProgram>::reclaim_copy(raw);
  check(!out.requires_grad(), "record_training: out already has an autograd history");
  check(out.is_contiguous() && kernel_readable(out), "record_training: out must be contiguous and aligned");
  if (!torch::autograd::compute_requires_grad(q, k, v)) return;
  auto node = make_node<AttentionBackward>(q, k, v, lse, key_range, dropout_key, program);
  node->set_next_edges(torch::autograd::collect_next_edges(q, k, v));
  torch::autograd::set_history(out, node);
  node->out_ = SavedVariable(out, /*is_output=*/true);
}

TORCH_LIBRARY(flash_attention_host, m) {
  m.class_<BackwardProgram>("BackwardProgram")
      .def(torch::init<at::Tensor, std::vector<int64_t>, std::vector<int64_t>, std::string, int64_t, int64_t,
                       int64_t>())
      .def("address", [](const c10::intrusive_ptr<BackwardProgram>& self) {
        return static_cast<int64_t>(reinterpret_cast<intptr_t>(self.get()));
      });
  m.def("set_driver", &set_driver);
  m.def("record_training", &record_training);
}

}  // namespace flash_attention_host
