// A repeated attention() call in one dispatch: allocate the output (and the LSE), fill the forward params'
// pointers (and tensor maps), launch, and in training record the node (training_node.cpp).
//
// Why: flash_attention/ops/repeat.py already skips every decision a repeated call signature would make again,
// but what remains of a small call in Python (two allocations, the params struct's pointer fields through
// ctypes, the launch through ctypes with its context check, the record op's own dispatch) is a few
// microseconds each, and at small sizes the host's time is the call's time (docs/kernel-log.md, step 53).
//
//   flash_attention_host::repeat_call(q, k, v, key_range?, program address) -> [out, lse] | [out] | []
//   flash_attention_host::repeat_call_bound(q, k, v, key_range?, bound, node_bound, program address)
//
// The program (ForwardProgram) is made in Python once per signature from the forward plan
// (flash_attention/ops/repeat.py): the params bytes with every field but the pointers, the byte offsets of
// the pointer fields, the launch, and for a TMA kernel each operand's tensor-map layout. A variant's
// tensors (ALiBi's slopes, the sinks) are `bound`: one per bound offset of the program, written there; in
// training `node_bound` are the node's (record_training's `bound`); a plain call's program binds none, and
// calls the first form (two empty list arguments through the dispatcher cost a plain call about 0.8 us of
// its 8.6 on tools/host_time_cpu.py's harness). An empty result means this call must take Python's path: an address that is not 16-byte
// aligned (the whole path copies such a tensor).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "driver.h"
#include "tensor_maps.h"
#include "training_node.h"

namespace flash_attention_host {

// The pointer fields of FwdParams this file writes, in the order of the offsets list Python passes.
enum ForwardSlot : int { kFwdQ, kFwdK, kFwdV, kFwdO, kFwdLse, kFwdKeyRange, kNumForwardSlots };

struct ForwardProgram : torch::CustomClassHolder {
  static constexpr uint64_t kMagic = 0x6661737466777264;  // repeat_call's check on the address it is given
  uint64_t magic = kMagic;
  std::vector<uint8_t> params;        // FwdParams (FwdTmaParams for a TMA kernel) but the pointers
  int64_t offsets[kNumForwardSlots];  // byte offset of each slot in params (-1: not written)
  std::vector<int64_t> bound_offsets;  // the variant's pointer fields: each call binds one tensor to each
  std::vector<Launch> launches;       // the one forward launch
  std::vector<std::string> names;
  void* context;                       // the device's primary context (the kernel is loaded there)
  std::vector<int64_t> lse_shape;      // (batch, heads_q, seqlen_q); empty: the call has no LSE
  c10::intrusive_ptr<BackwardProgram> backward;  // training: the node's program; null for inference

  // A TMA kernel's tensor maps (tensor_maps.h): none, q's, k's and v's, or those and o's.
  std::vector<MapLayout> maps;
  int encode_flags[5];          // data type, interleave, swizzle, L2 promotion, out-of-bounds fill

  // The maps encoded so far: q's, k's and v's by their address triple, o's apart by its own address (a
  // fresh output each call: with o in the key, a new output address would cost all four encodes).
  std::mutex encoded_mutex;  // calls from several threads may share a program
  EncodedMaps<3> encoded_qkv;
  EncodedMaps<1> encoded_o;

  // slot_offsets: one per ForwardSlot; launch_fields: seven integers (driver.h's launches_from); map_fields:
  // 12 integers per map (offset, 4 dims, 3 byte strides, 4 box sizes), none, three or four maps; flags: the five
  // encode constants; backward_address: a BackwardProgram's address, or 0 for inference; bound_offsets_:
  // the byte offsets of the pointers each call binds a tensor to (none for a plain call).
  ForwardProgram(const at::Tensor& params_bytes, std::vector<int64_t> slot_offsets, std::vector<int64_t> launch_fields,
                 const std::string& kernel_name, int64_t context_, std::vector<int64_t> lse_shape_,
                 std::vector<int64_t> map_fields, std::vector<int64_t> flags, int64_t backward_address,
                 std::vector<int64_t> bound_offsets_)
      : context(reinterpret_cast<void*>(context_)), lse_shape(std::move(lse_shape_)) {
    params = params_from(params_bytes, "ForwardProgram");
    offsets_from(slot_offsets, offsets, kNumForwardSlots, params.size(), "ForwardProgram",
                 [](int) { return 8; });  // every slot an address
    bound_offsets.resize(bound_offsets_.size());
    offsets_from(bound_offsets_, bound_offsets.data(), static_cast<int>(bound_offsets_.size()), params.size(),
                 "ForwardProgram (bound tensors)", [](int) { return 8; });
    launches = launches_from(launch_fields);
    check(launches.size() == 1, "ForwardProgram: expected one launch");
    names = names_from(kernel_name, 1);
    check(lse_shape.empty() || lse_shape.size() == 3, "ForwardProgram: the LSE shape has three sizes or none");
    check(map_fields.empty() || map_fields.size() == 36 || map_fields.size() == 48,
          "ForwardProgram: maps must be 12 integers each, three or four");
    check(flags.size() == 5, "ForwardProgram: expected five encode flags");
    maps = maps_from(map_fields, params.size(), "ForwardProgram");
    for (int i = 0; i < 5; ++i) encode_flags[i] = static_cast<int>(flags[i]);
    if (backward_address != 0) {
      check(!lse_shape.empty(), "ForwardProgram: a training program needs the LSE");
      backward = BackwardProgram::from_address(backward_address);
    }
  }

  void put(std::vector<uint8_t>& into, ForwardSlot slot, uint64_t value) const {
    if (offsets[slot] >= 0) std::memcpy(into.data() + offsets[slot], &value, sizeof(value));
  }

  void encode(const MapLayout& m, uint64_t address, uint8_t* dst) const {
    encode_map(m, encode_flags, context, address, dst);
  }

  // Write the tensor maps of q, k, v (and o) at these addresses into `into`, each encoded once per address.
  void put_maps(std::vector<uint8_t>& into, uint64_t q, uint64_t k, uint64_t v, uint64_t o) {
    std::lock_guard<std::mutex> lock(encoded_mutex);
    const std::array<uint64_t, 3> qkv{q, k, v};
    const EncodedMaps<3>::Entry* found = encoded_qkv.find(qkv);
    if (found == nullptr) {
      EncodedMaps<3>::Entry e{qkv, {}};
      for (size_t i = 0; i < 3; ++i) encode(maps[i], qkv[i], e.maps.data() + i * kTensorMapBytes);
      found = encoded_qkv.add(e);
    }
    for (size_t i = 0; i < 3; ++i) {
      std::memcpy(into.data() + maps[i].offset, found->maps.data() + i * kTensorMapBytes, kTensorMapBytes);
    }
    if (maps.size() == 4) {
      const EncodedMaps<1>::Entry* found_o = encoded_o.find({o});
      if (found_o == nullptr) {
        EncodedMaps<1>::Entry e{{o}, {}};
        encode(maps[3], o, e.maps.data());
        found_o = encoded_o.add(e);
      }
      std::memcpy(into.data() + maps[3].offset, found_o->maps.data(), kTensorMapBytes);
    }
  }

  static ForwardProgram& at_address(int64_t address) {
    auto* raw = reinterpret_cast<ForwardProgram*>(address);
    check(raw != nullptr && raw->magic == kMagic, "repeat_call: program is not the address of a ForwardProgram");
    return *raw;
  }
};

// `program` is the address of a live ForwardProgram (the caller keeps it alive for the call; a node recorded
// here takes its own reference to the backward program). An address, not the object, for the reason
// record_training (training_node.cpp) gives. In training, `sinks` and `sink_rows` go to the node as
// record_training's do.
std::vector<at::Tensor> repeat_call_bound(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const std::optional<at::Tensor>& key_range,
                                          const std::vector<at::Tensor>& bound, std::vector<at::Tensor> node_bound,
                                          int64_t program_address, const std::optional<at::Tensor>& sinks,
                                          std::optional<at::Tensor> sink_rows) {
  ForwardProgram& program = ForwardProgram::at_address(program_address);
  check(bound.size() == program.bound_offsets.size(),
        "repeat_call: " + std::to_string(bound.size()) + " bound tensors for a program that takes " +
            std::to_string(program.bound_offsets.size()));
  for (const auto& t : bound) check(t.defined() && t.is_contiguous(), "repeat_call: a bound tensor must be contiguous");
  if (!kernel_readable(q) || !kernel_readable(k) || !kernel_readable(v)) return {};
  // The output has v's head_dim, which may be its own (an inference call's, DeepSeek's q/k 192, v 128: the
  // program's plan was made for that contiguous shape; prepare in ops/repeat.py declines training with it);
  // empty_like, the cheaper form, when it is q's.
  at::Tensor out;
  if (v.size(3) == q.size(3)) {
    out = at::empty_like(q, q.options(), at::MemoryFormat::Contiguous);
  } else {
    out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  }
  at::Tensor lse;
  if (!program.lse_shape.empty()) lse = at::empty(program.lse_shape, q.options().dtype(at::kFloat));

  std::vector<uint8_t> params = program.params;
  program.put(params, kFwdQ, address_of(q));
  program.put(params, kFwdK, address_of(k));
  program.put(params, kFwdV, address_of(v));
  program.put(params, kFwdO, address_of(out));
  program.put(params, kFwdLse, lse.defined() ? address_of(lse) : 0);
  program.put(params, kFwdKeyRange, key_range ? address_of(*key_range) : 0);
  for (size_t i = 0; i < bound.size(); ++i) {
    const uint64_t address = address_of(bound[i]);
    std::memcpy(params.data() + program.bound_offsets[i], &address, sizeof(address));
  }
  if (!program.maps.empty()) program.put_maps(params, address_of(q), address_of(k), address_of(v), address_of(out));
  launch_all(program.launches, program.names, program.context, params.data(), current_stream(q.device()));

  if (program.backward) {
    record_node(q, k, v, out, lse, key_range, 0, program.backward, std::move(node_bound), sinks,
                std::move(sink_rows));
  }
  if (lse.defined()) return {out, lse};
  return {out};
}

std::vector<at::Tensor> repeat_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& key_range, int64_t program_address) {
  return repeat_call_bound(q, k, v, key_range, {}, {}, program_address, std::nullopt, std::nullopt);
}

TORCH_LIBRARY_FRAGMENT(flash_attention_host, m) {
  m.class_<ForwardProgram>("ForwardProgram")
      .def(torch::init<at::Tensor, std::vector<int64_t>, std::vector<int64_t>, std::string, int64_t,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                       std::vector<int64_t>>())
      .def("address", [](const c10::intrusive_ptr<ForwardProgram>& self) {
        return static_cast<int64_t>(reinterpret_cast<intptr_t>(self.get()));
      });
  m.def("repeat_call", &repeat_call);
  // (The schema spelled out for its defaults: calls without sinks in training pass seven arguments.)
  m.def(
      "repeat_call_bound(Tensor q, Tensor k, Tensor v, Tensor? key_range, Tensor[] bound, Tensor[] node_bound, "
      "int program_address, Tensor? sinks=None, Tensor? sink_rows=None) -> Tensor[]",
      &repeat_call_bound);
}

}  // namespace flash_attention_host
