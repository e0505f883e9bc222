// Tensor maps (CUtensorMap) as the host library encodes them for each call's addresses: the layout a plan
// fixes (flash_attention/ops/tma.py's MapLayout), the encode through the driver entry point Python handed
// over, and a small cache of maps by address. Shared by repeat_call.cpp (a TMA forward's q, k, v, o) and
// training_node.cpp (the backward's q and dO with tma_loads).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "driver.h"

namespace flash_attention_host {

// Bytes of a CUtensorMap, which the driver writes to a 64-byte aligned address.
constexpr size_t kTensorMapBytes = 128;

// One operand's map: where it sits in a params struct and what it describes (every field but the address).
struct MapLayout {
  int64_t offset;
  uint64_t dims[4];
  uint64_t strides[3];
  uint32_t box[4];
};

// The layouts of `fields`: 12 integers per map (offset, 4 dims, 3 byte strides, 4 box sizes), each map inside
// params of `params_size` bytes.
inline std::vector<MapLayout> maps_from(const std::vector<int64_t>& fields, size_t params_size,
                                        const std::string& who) {
  check(fields.size() % 12 == 0, who + ": maps must be 12 integers each");
  std::vector<MapLayout> maps;
  for (size_t m = 0; m < fields.size(); m += 12) {
    MapLayout layout{fields[m], {}, {}, {}};
    check(layout.offset >= 0 && static_cast<size_t>(layout.offset) + kTensorMapBytes <= params_size,
          who + ": a tensor map outside the params");
    for (int i = 0; i < 4; ++i) layout.dims[i] = static_cast<uint64_t>(fields[m + 1 + i]);
    for (int i = 0; i < 3; ++i) layout.strides[i] = static_cast<uint64_t>(fields[m + 5 + i]);
    for (int i = 0; i < 4; ++i) layout.box[i] = static_cast<uint32_t>(fields[m + 8 + i]);
    maps.push_back(layout);
  }
  return maps;
}

// Encode map `m` of the tensor at `address` into `dst` (kTensorMapBytes), in `context`, with the five encode
// constants `flags` (data type, interleave, swizzle, L2 promotion, out-of-bounds fill).
inline void encode_map(const MapLayout& m, const int (&flags)[5], void* context, uint64_t address, uint8_t* dst) {
  if (g_driver.encode_tiled == nullptr) fail("flash_attention_host: the driver has no cuTensorMapEncodeTiled");
  alignas(64) uint8_t scratch[kTensorMapBytes];  // the driver writes a map to a 64-byte aligned address
  static const uint32_t kOnes[4] = {1, 1, 1, 1};  // element strides: every element of a box
  ContextGuard current(context);  // the encode fails (invalid context) on a thread with none current
  const int status = g_driver.encode_tiled(scratch, flags[0], 4, reinterpret_cast<void*>(address), m.dims, m.strides,
                                           m.box, kOnes, flags[1], flags[2], flags[3], flags[4]);
  // The plan encoded this layout once when it was made; only an address could differ, and the caller
  // checked those are 16-byte aligned.
  if (status != 0) driver_failed(status, "cuTensorMapEncodeTiled");
  std::memcpy(dst, scratch, kTensorMapBytes);
}

// Tensor maps encoded for the last few addresses of the tensors they describe: a training loop or a decoder
// hands the same few addresses back (PyTorch's caching allocator), and an encode costs about as much as the
// rest of the call. kMaps maps per entry, keyed by their kMaps addresses; the oldest entry goes first.
template <size_t kMaps>
struct EncodedMaps {
  static constexpr size_t kKept = 16;
  struct Entry {
    std::array<uint64_t, kMaps> addresses;
    std::array<uint8_t, kMaps * kTensorMapBytes> maps;
  };
  std::vector<Entry> entries;
  size_t next = 0;

  const Entry* find(const std::array<uint64_t, kMaps>& addresses) const {
    for (const Entry& e : entries)
      if (e.addresses == addresses) return &e;
    return nullptr;
  }
  const Entry* add(const Entry& e) {
    if (entries.size() < kKept) {
      entries.push_back(e);
      return &entries.back();
    }
    entries[next] = e;
    const Entry* added = &entries[next];
    next = (next + 1) % kKept;
    return added;
  }
};

}  // namespace flash_attention_host
