// BackwardProgram, the backward launches of one call signature, and the recording of the training node that
// runs them (training_node.cpp). The forward's repeat call (repeat_call.cpp) records the node too.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "driver.h"
#include "tensor_maps.h"

namespace flash_attention_host {

// ---------------------------------------------------------------------------------------------------------
// BackwardProgram: one call signature's backward launches (made by flash_attention/ops/training.py).

// The pointer fields of BwdParams this file writes, in the order of the offsets list Python passes.
enum Slot : int {
  kQ, kK, kV, kO, kDout, kLse, kLseLog2, kDelta, kDqAccum, kDq, kDk, kDv, kKeyRange, kDropoutKey, kNumSlots
};

struct BackwardProgram : torch::CustomClassHolder {
  static constexpr uint64_t kMagic = 0x666173746e6f6465;  // record_training's check on the address it is given
  uint64_t magic = kMagic;
  std::vector<uint8_t> params;  // BwdParams (BwdTmaParams), every field but the pointers, the key and maps
  int64_t offsets[kNumSlots];   // byte offset of each slot in params (-1: not written)
  // The byte offsets of a variant's pointer fields (ALiBi's slopes, a packed batch's runs): each call binds
  // one tensor to each (record_training's `bound`), which the node keeps alive and writes there.
  std::vector<int64_t> bound_offsets;
  std::vector<Launch> launches;  // in queue order: preprocessing, dK/dV, then dQ's cast or kernel
  std::vector<std::string> names;  // the launches' kernel names, for error messages
  int64_t stats;                 // floats in each of the workspace's base-2 LSE and delta arrays
  int64_t accum;                 // floats of the atomic dQ accumulator after them (0: deterministic)
  void* context;                 // the device's primary context (the launches' kernels are loaded there)
  // With tma_loads (BwdTmaParams): q's and dO's tensor maps (tensor_maps.h), encoded per call on its
  // addresses (each backward's dO is a fresh tensor, so no cache: two encodes, about a microsecond each).
  std::vector<MapLayout> maps;  // none, or q's and dO's
  int encode_flags[5] = {0, 0, 0, 0, 0};

  // launches: seven integers per launch (driver.h's launches_from);
  // names: the kernel names joined by newlines; map_fields: 12 integers per map (tensor_maps.h's
  // maps_from), none or q's and dO's; flags: the five encode constants (with maps).
  BackwardProgram(const at::Tensor& params_bytes, std::vector<int64_t> slot_offsets,
                  std::vector<int64_t> launch_fields, const std::string& kernel_names, int64_t stats_,
                  int64_t accum_, int64_t context_, std::vector<int64_t> bound_offsets_,
                  std::vector<int64_t> map_fields, std::vector<int64_t> flags)
      : stats(stats_), accum(accum_), context(reinterpret_cast<void*>(context_)) {
    params = params_from(params_bytes, "BackwardProgram");
    // The dropout key is a 32-bit field; every other slot an address.
    offsets_from(slot_offsets, offsets, kNumSlots, params.size(), "BackwardProgram",
                 [](int slot) { return slot == kDropoutKey ? 4 : 8; });
    bound_offsets.resize(bound_offsets_.size());
    offsets_from(bound_offsets_, bound_offsets.data(), static_cast<int>(bound_offsets_.size()), params.size(),
                 "BackwardProgram (bound tensors)", [](int) { return 8; });
    launches = launches_from(launch_fields);
    names = names_from(kernel_names, launches.size());
    maps = maps_from(map_fields, params.size(), "BackwardProgram");
    check(maps.empty() || maps.size() == 2, "BackwardProgram: maps are none, or q's and dO's");
    check(maps.empty() || flags.size() == 5, "BackwardProgram: expected five encode flags");
    for (size_t i = 0; i < flags.size() && i < 5; ++i) encode_flags[i] = static_cast<int>(flags[i]);
  }

  // q's and dO's tensor maps at these addresses, into `into` (a program with maps).
  void put_maps(std::vector<uint8_t>& into, uint64_t q, uint64_t dout) const {
    if (maps.empty()) return;
    encode_map(maps[0], encode_flags, context, q, into.data() + maps[0].offset);
    encode_map(maps[1], encode_flags, context, dout, into.data() + maps[1].offset);
  }

  // The program at `address` (a BackwardProgram's `address()`, kept alive by the caller for the call), with a
  // reference of its own.
  static c10::intrusive_ptr<BackwardProgram> from_address(int64_t address) {
    auto* raw = reinterpret_cast<BackwardProgram*>(address);
    check(raw != nullptr && raw->magic == kMagic,
          "record_training: program is not the address of a BackwardProgram");
    return c10::intrusive_ptr<BackwardProgram>::reclaim_copy(raw);
  }

  // Write an address (8 bytes) or the dropout key (a 32-bit unsigned field) into a copy of the params;
  // absent slots are skipped.
  // The addresses of a call's bound tensors, at bound_offsets.
  void put_bound(std::vector<uint8_t>& into, const std::vector<at::Tensor>& bound) const {
    for (size_t i = 0; i < bound.size(); ++i) {
      const uint64_t value = reinterpret_cast<uint64_t>(bound[i].data_ptr());
      std::memcpy(into.data() + bound_offsets[i], &value, sizeof(value));
    }
  }

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

// Make `out` (the forward's fresh output) the output of a new training node over q, k and v whose backward
// runs `program` (nothing when none of them requires grad), with `bound` at the program's bound offsets;
// with `sinks` (the forward's, (heads_q,)), a node over them too, which gives their gradient (`sink_rows`:
// a packed batch's rows in the workspace, int64; none: row i is row i).
void record_node(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                 const at::Tensor& lse, const std::optional<at::Tensor>& key_range, int64_t dropout_key,
                 c10::intrusive_ptr<BackwardProgram> program, std::vector<at::Tensor> bound = {},
                 const std::optional<at::Tensor>& sinks = std::nullopt,
                 std::optional<at::Tensor> sink_rows = std::nullopt);

}  // namespace flash_attention_host
