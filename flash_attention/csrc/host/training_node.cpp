// The autograd node of an eager training call on our kernels, in compiled host code.
//
// Why this file exists: a Python torch.autograd.Function costs more host time per training step than
// cuDNN's whole forward+backward of a small problem (docs/kernel-log.md, steps 23 and 25): its forward
// builds a Python context, and its backward runs Python on the autograd engine's device thread, which must
// take the GIL back from the thread that called backward(). A node written in C++ pays neither. This file
// holds what comes after the forward launch (flash_attention/ops/forward.py, or repeat_call.cpp for a
// repeated call):
//
//   flash_attention_host::record_training(q, k, v, out, lse, key_range?, dropout_key, program address,
//                                          bound tensors, sinks?, sink_rows?)
//       makes `out` the output of an AttentionBackward node whose inputs are q, k and v (and the attention
//       sinks, where the call has them);
//   AttentionBackward::apply
//       allocates dq, dk, dv and the fp32 workspace and queues the backward's launches, all in C++; with
//       sinks, their gradient from the preprocessing kernel's D rows (flash_attention/sinks.py's formula,
//       a few ATen operations: the sinks were the one variant whose training took the Python function, at
//       about twice the node's host time per step, measured with the CPU tests' stand-in GPU).
//
// What the launches are is decided in Python, once per call signature (flash_attention/ops/backward.py
// makes the plan; flash_attention/ops/training.py hands it over as a BackwardProgram, training_node.h): the
// params struct with every field but the pointers, the byte offsets of the pointer fields, and the kernels
// with their grids. This file never needs the struct's layout, so the kernels' params headers stay the one
// definition. The driver is reached as driver.h says.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/neg.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/sum.h>
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
#include <string>
#include <type_traits>
#include <vector>

#include "driver.h"
#include "training_node.h"

namespace flash_attention_host {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

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

struct AttentionBackward : public torch::autograd::Node {
  AttentionBackward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                    std::optional<at::Tensor> key_range, int64_t dropout_key,
                    c10::intrusive_ptr<BackwardProgram> program, std::vector<at::Tensor> bound,
                    const std::optional<at::Tensor>& sinks, std::optional<at::Tensor> sink_rows)
      : q_(q, false),
        k_(k, false),
        v_(v, false),
        lse_(lse),
        key_range_(std::move(key_range)),
        dropout_key_(dropout_key),
        program_(std::move(program)),
        bound_(std::move(bound)),
        has_sinks_(sinks.has_value()),
        sink_rows_(std::move(sink_rows)) {
    if (sinks) sinks_ = SavedVariable(*sinks, false);
  }

  std::string name() const override { return "FlashAttentionBackward"; }

  void release_variables() override {
    q_.reset_data();
    k_.reset_data();
    v_.reset_data();
    out_.reset_data();
    lse_.reset();
    key_range_.reset();
    bound_.clear();
    sinks_.reset_data();
    sink_rows_.reset();
  }

  variable_list apply(variable_list&& grads) override {
    // (After a backward without retain_graph, unpack raises PyTorch's "backward through the graph a second
    // time" error: release_variables freed what was saved.)
    // (out, this node's own output, is saved without its history to avoid a reference cycle: unpacking it
    // takes the node. Each unpack checks that no in-place operation changed the tensor since.)
    const at::Tensor q = q_.unpack(), k = k_.unpack(), v = v_.unpack(), out = out_.unpack(self_pointer(this));
    at::Tensor dout = grads[0];
    if (!dout.defined()) return variable_list(num_outputs());  // out took no part in the loss
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
    const auto addr = address_of;
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
    program.put_bound(params, bound_);
    program.put_maps(params, addr(q), addr(dout));

    // PyTorch's current stream on q's device: the engine made it the forward's stream for this node.
    launch_all(program.launches, program.names, program.context, params.data(), current_stream(q.device()));

    variable_list result{should_compute_output(0) ? dq : at::Tensor(),
                         should_compute_output(1) ? dk : at::Tensor(),
                         should_compute_output(2) ? dv : at::Tensor()};
    if (has_sinks_) {
      // (task_should_compute_output, not should_compute_output: the sinks require a gradient in training,
      // but a backward asked only for q, k and v's -- autograd.grad(out, (q, k, v)) -- must not pay for
      // theirs; the edge alone says only that it could be asked.)
      result.push_back(task_should_compute_output(3) ? sinks_gradient(ws) : at::Tensor());
    }
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

  // d loss / d sinks = -sum over batch and rows of exp(sink - lse'_i) D_i (flash_attention/sinks.py), with
  // D the preprocessing kernel's rows in the workspace: (batch, heads, padded rows), read back by row (a
  // packed batch's through sink_rows, each row's place in the workspace's per-sequence layout). Queued on
  // the current stream after the launches that write D; the same operations, in the same order, as the
  // Python function's (sinks_gradient_from_delta), so both paths give the same bits.
  at::Tensor sinks_gradient(const at::Tensor& ws) const {
    const at::Tensor sinks = sinks_.unpack();
    const BackwardProgram& program = *program_;
    at::Tensor delta = ws.narrow(0, program.stats, program.stats).view({lse_.size(0), lse_.size(1), -1});
    delta = sink_rows_ ? at::index_select(delta, 2, *sink_rows_) : delta.narrow(2, 0, lse_.size(2));
    const at::Tensor p_sink = at::exp(at::sub(sinks.to(at::kFloat).view({1, -1, 1}), lse_));
    // (The dims as an IntArrayRef, not a braced list: some PyTorch versions' headers find that ambiguous
    // between sum's int and Dimname overloads, and the library then fails to build there.)
    const int64_t batch_and_rows[] = {0, 2};
    return at::neg(at::sum(at::mul(p_sink, delta), at::IntArrayRef(batch_and_rows))).to(sinks.scalar_type());
  }

  SavedVariable q_, k_, v_, out_;
  at::Tensor lse_;
  std::optional<at::Tensor> key_range_;
  int64_t dropout_key_;
  c10::intrusive_ptr<BackwardProgram> program_;
  std::vector<at::Tensor> bound_;  // (read-only inputs of the backward: no autograd history to save)
  bool has_sinks_;                   // the node's fourth input: the sinks (heads_q,)
  SavedVariable sinks_;
  std::optional<at::Tensor> sink_rows_;  // int64 (rows,): a packed batch's rows in the workspace
};

void record_node(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                 const at::Tensor& lse, const std::optional<at::Tensor>& key_range, int64_t dropout_key,
                 c10::intrusive_ptr<BackwardProgram> program, std::vector<at::Tensor> bound,
                 const std::optional<at::Tensor>& sinks, std::optional<at::Tensor> sink_rows) {
  check(!out.requires_grad(), "record_training: out already has an autograd history");
  check(out.is_contiguous() && kernel_readable(out), "record_training: out must be contiguous and aligned");
  check(bound.size() == program->bound_offsets.size(),
        "record_training: " + std::to_string(bound.size()) + " bound tensors for a program that takes " +
            std::to_string(program->bound_offsets.size()));
  for (const auto& t : bound) {
    check(t.defined() && t.is_contiguous(), "record_training: a bound tensor must be contiguous");
  }
  if (sinks) {
    check(sinks->dim() == 1 && sinks->size(0) == lse.size(1),
          "record_training: sinks must be (heads_q,), one per the LSE's heads");
    check(!sink_rows || (sink_rows->dim() == 1 && sink_rows->size(0) == lse.size(2)),
          "record_training: sink_rows must give each row of the LSE its workspace row");
  }
  const at::Tensor none;
  const at::Tensor& s = sinks ? *sinks : none;  // (undefined: no edge)
  if (!torch::autograd::compute_requires_grad(q, k, v, s)) return;
  auto node = make_node<AttentionBackward>(q, k, v, lse, key_range, dropout_key, std::move(program),
                                           std::move(bound), sinks, std::move(sink_rows));
  node->set_next_edges(sinks ? torch::autograd::collect_next_edges(q, k, v, s)
                             : torch::autograd::collect_next_edges(q, k, v));
  torch::autograd::set_history(out, node);
  node->out_ = SavedVariable(out, /*is_output=*/true);
}

// The op: record_node for the BackwardProgram at `program_address`.
//
// `program` is the address of a live BackwardProgram (its `address()`; the caller keeps that object alive
// for the call, and the node takes its own reference). An address, not the object: a custom-class argument
// costs about 12 us more per call in PyTorch's Python op dispatch than an integer (measured on the CPU).
void record_training(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                     const at::Tensor& lse, const std::optional<at::Tensor>& key_range, int64_t dropout_key,
                     int64_t program_address, std::vector<at::Tensor> bound,
                     const std::optional<at::Tensor>& sinks, std::optional<at::Tensor> sink_rows) {
  record_node(q, k, v, out, lse, key_range, dropout_key, BackwardProgram::from_address(program_address),
              std::move(bound), sinks, std::move(sink_rows));
}

void set_driver(int64_t launch, int64_t ctx_get, int64_t ctx_set, int64_t error_string, int64_t encode_tiled,
                int64_t launch_ex) {
  check(launch && ctx_get && ctx_set, "flash_attention_host.set_driver: null entry point");
  g_driver.launch = reinterpret_cast<LaunchFn>(launch);
  g_driver.ctx_get = reinterpret_cast<CtxGetFn>(ctx_get);
  g_driver.ctx_set = reinterpret_cast<CtxSetFn>(ctx_set);
  g_driver.error_string = reinterpret_cast<ErrorStringFn>(error_string);
  g_driver.encode_tiled = reinterpret_cast<EncodeTiledFn>(encode_tiled);
  g_driver.launch_ex = reinterpret_cast<LaunchExFn>(launch_ex);
}

TORCH_LIBRARY(flash_attention_host, m) {
  m.class_<BackwardProgram>("BackwardProgram")
      .def(torch::init<at::Tensor, std::vector<int64_t>, std::vector<int64_t>, std::string, int64_t, int64_t,
                       int64_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>())
      .def("address", [](const c10::intrusive_ptr<BackwardProgram>& self) {
        return static_cast<int64_t>(reinterpret_cast<intptr_t>(self.get()));
      });
  m.def("set_driver", &set_driver);
  // (The schema spelled out for its defaults: calls without sinks pass nine arguments.)
  m.def(
      "record_training(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_range, int dropout_key, "
      "int program_address, Tensor[] bound, Tensor? sinks=None, Tensor? sink_rows=None) -> ()",
      &record_training);
}

}  // namespace flash_attention_host
