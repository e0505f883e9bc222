// A planned attention_with_kvcache call in one dispatch: allocate the output, the LSE and the split
// partials' workspace, fill the decode params' pointers, and queue the plan's launches (append, decode,
// combine), without Python between them.
//
// Why: a one-token decode call's time at small batches and short caches is the host's (docs/kernel-log.md,
// steps 41 and 42), and of its Python the launches through ctypes (two or three, each with eleven converted
// arguments, after a context query) are the largest part on a GPU host.
//
//   flash_attention_host::decode_call(q, k_cache, v_cache, k?, v?, cache_seqlens?, cache_seqlen, block_table?,
//                                     program, cache_starts?) -> [out, lse] | [out] | []
//
// cache_seqlens None: every row's length is the int cache_seqlen, passed to the kernels by value. A
// contiguous cache's plan serves every cache length of its bucket (ops/decode.py), so its geometry (the
// capacity and the K/V strides) is written per call from k_cache and v_cache. cache_starts: each row's
// first cache row (int32, batch), for a program made with row starts (attention_varlen's decoding steps,
// whose rows all read one packed buffer: a batch stride of 0).
//
// The program (DecodeProgram) is made in Python once per plan (flash_attention/ops/decode.py) from the
// plan's params bytes, the byte offsets of the pointer fields and its launches. It covers the plans whose
// every operand the kernels read in place; a call whose tensors would need a copy (a misaligned address)
// gets an empty result and takes Python's path, which makes the copies.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "driver.h"

namespace flash_attention_host {

// The fields of DecodeParams this file writes, in the order of the offsets list Python passes: the
// pointers (the row starts -1 for a plan without them), then the contiguous cache's geometry (64-bit
// strides, then the 32-bit capacity; -1 for a paged plan, whose geometry is its signature's), then the
// 32-bit one length of every row.
enum DecodeSlot : int {
  kDecQ, kDecK, kDecV, kDecKNew, kDecVNew, kDecO, kDecLse, kDecOPartial, kDecLsePartial, kDecCacheSeqlens,
  kDecBlockTable, kDecCacheStarts, kDecKBatchStride, kDecKRowStride, kDecKHeadStride, kDecVBatchStride, kDecVRowStride,
  kDecVHeadStride, kDecCapacity, kDecCacheSeqlen, kNumDecodeSlots
};

struct DecodeProgram : torch::CustomClassHolder {
  static constexpr uint64_t kMagic = 0x6661737464656364;  // decode_call's check on the address it is given
  uint64_t magic = kMagic;
  std::vector<uint8_t> params;        // DecodeParams but the pointers
  int64_t offsets[kNumDecodeSlots];   // byte offset of each slot in params (-1: not written)
  std::vector<Launch> launches;       // append (with new tokens), decode, combine (with splits)
  std::vector<std::string> names;
  void* context;                      // the device's primary context
  std::vector<int64_t> lse_shape;     // (batch, heads_q, seqlen_q); empty: the call has no LSE
  int64_t partial_o;                  // floats of the split partials' O in the workspace (0: one split)
  int64_t partial_rows;               // floats of their LSEs after them

  // slot_offsets: one per DecodeSlot; launch_fields: seven integers per launch (driver.h's launches_from);
  // names: the kernel names joined by newlines.
  DecodeProgram(const at::Tensor& params_bytes, std::vector<int64_t> slot_offsets, std::vector<int64_t> launch_fields,
                const std::string& kernel_names, int64_t context_, std::vector<int64_t> lse_shape_,
                int64_t partial_o_, int64_t partial_rows_)
      : context(reinterpret_cast<void*>(context_)),
        lse_shape(std::move(lse_shape_)),
        partial_o(partial_o_),
        partial_rows(partial_rows_) {
    params = params_from(params_bytes, "DecodeProgram");
    offsets_from(slot_offsets, offsets, kNumDecodeSlots, params.size(), "DecodeProgram",
                 [](int slot) { return slot < kDecCapacity ? 8 : 4; });
    launches = launches_from(launch_fields);
    check(launches.size() <= 3, "DecodeProgram: at most three launches (append, decode, combine)");
    names = names_from(kernel_names, launches.size());
    check(lse_shape.empty() || lse_shape.size() == 3, "DecodeProgram: the LSE shape has three sizes or none");
    check(partial_o >= 0 && partial_rows >= 0 && (partial_o == 0) == (partial_rows == 0),
          "DecodeProgram: the partials' sizes are both zero or both positive");
  }

  void put(std::vector<uint8_t>& into, DecodeSlot slot, uint64_t value) const {
    if (offsets[slot] >= 0) std::memcpy(into.data() + offsets[slot], &value, sizeof(value));
  }
  void put32(std::vector<uint8_t>& into, DecodeSlot slot, int32_t value) const {
    if (offsets[slot] >= 0) std::memcpy(into.data() + offsets[slot], &value, sizeof(value));
  }
  bool fills_geometry() const { return offsets[kDecCapacity] >= 0; }
  bool has_starts() const { return offsets[kDecCacheStarts] >= 0; }

  static DecodeProgram& at_address(int64_t address) {
    auto* raw = reinterpret_cast<DecodeProgram*>(address);
    check(raw != nullptr && raw->magic == kMagic, "decode_call: program is not the address of a DecodeProgram");
    return *raw;
  }
};

// `program` is the address of a live DecodeProgram (the caller keeps it alive for the call).
std::vector<at::Tensor> decode_call(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                                    const std::optional<at::Tensor>& cache_seqlens, int64_t cache_seqlen,
                                    const std::optional<at::Tensor>& block_table, int64_t program_address,
                                    const std::optional<at::Tensor>& cache_starts) {
  const DecodeProgram& program = DecodeProgram::at_address(program_address);
  check(cache_starts.has_value() == program.has_starts(),
        "decode_call: row starts are given exactly to a program made with them");
  // The kernels read q and the new tokens and write the caches 16 bytes at a time; the lengths and the page
  // table are int32 read element by element (their layouts are the plan's).
  if (!kernel_readable(q) || !kernel_readable(k_cache) || !kernel_readable(v_cache)) return {};
  if ((k && !kernel_readable(*k)) || (v && !kernel_readable(*v))) return {};
  // A contiguous cache's strides are this call's: the kernels read rows 16 bytes at a time, so each stride
  // must be a multiple of 8 elements with the last 1 (Python's signature admitted only such caches to the
  // plan; checked again here because a wrong stride would read outside the cache). A zero stride is a
  // broadcast the kernels would read as one row over and over, except the batch stride of a program with
  // row starts and no append: there every batch row is one view of the same buffer, placed by its start
  // (an append would write every row's tokens into that one buffer).
  if (program.fills_geometry()) {
    for (const at::Tensor* t : {&k_cache, &v_cache}) {
      if (t->dim() != 4 || t->stride(3) != 1) return {};
      for (int d = 0; d < 3; ++d) {
        const bool shared = d == 0 && program.has_starts() && !k;
        if (t->stride(d) % 8 != 0 || (t->stride(d) == 0 && t->size(d) > 1 && !shared)) return {};
      }
    }
  }
  // The starts as the kernels read them: int32, adjacent, one per batch row (varlen_rows makes them so;
  // anything else takes Python's path).
  if (cache_starts && (cache_starts->scalar_type() != at::kInt || !cache_starts->is_contiguous() ||
                       cache_starts->numel() != q.size(0) || cache_starts->device() != q.device()))
    return {};
  at::Tensor out = at::empty_like(q, q.options(), at::MemoryFormat::Contiguous);
  at::Tensor lse;
  if (!program.lse_shape.empty()) lse = at::empty(program.lse_shape, q.options().dtype(at::kFloat));
  // One fp32 workspace for the split partials: O (splits, batch, heads_q, seqlen_q, head_dim) then the LSEs.
  // Held until the launches are queued (under CUDA-graph capture it comes from the graph's pool).
  at::Tensor partials;
  if (program.partial_o) partials = at::empty({program.partial_o + program.partial_rows}, q.options().dtype(at::kFloat));

  std::vector<uint8_t> params = program.params;
  program.put(params, kDecQ, address_of(q));
  program.put(params, kDecK, address_of(k_cache));
  program.put(params, kDecV, address_of(v_cache));
  program.put(params, kDecKNew, k ? address_of(*k) : 0);
  program.put(params, kDecVNew, v ? address_of(*v) : 0);
  program.put(params, kDecO, address_of(out));
  program.put(params, kDecLse, lse.defined() ? address_of(lse) : 0);
  program.put(params, kDecOPartial, partials.defined() ? address_of(partials) : 0);
  program.put(params, kDecLsePartial, partials.defined() ? address_of(partials) + 4 * program.partial_o : 0);
  program.put(params, kDecCacheSeqlens, cache_seqlens ? address_of(*cache_seqlens) : 0);
  program.put32(params, kDecCacheSeqlen, static_cast<int32_t>(cache_seqlen));
  if (program.fills_geometry()) {
    program.put(params, kDecKBatchStride, k_cache.stride(0));
    program.put(params, kDecKRowStride, k_cache.stride(1));
    program.put(params, kDecKHeadStride, k_cache.stride(2));
    program.put(params, kDecVBatchStride, v_cache.stride(0));
    program.put(params, kDecVRowStride, v_cache.stride(1));
    program.put(params, kDecVHeadStride, v_cache.stride(2));
    program.put32(params, kDecCapacity, static_cast<int32_t>(k_cache.size(1)));
  }
  program.put(params, kDecBlockTable, block_table ? address_of(*block_table) : 0);
  program.put(params, kDecCacheStarts, cache_starts ? address_of(*cache_starts) : 0);
  launch_all(program.launches, program.names, program.context, params.data(), current_stream(q.device()));
  if (lse.defined()) return {out, lse};
  return {out};
}

TORCH_LIBRARY_FRAGMENT(flash_attention_host, m) {
  m.class_<DecodeProgram>("DecodeProgram")
      .def(torch::init<at::Tensor, std::vector<int64_t>, std::vector<int64_t>, std::string, int64_t,
                       std::vector<int64_t>, int64_t, int64_t>())
      .def("address", [](const c10::intrusive_ptr<DecodeProgram>& self) {
        return static_cast<int64_t>(reinterpret_cast<intptr_t>(self.get()));
      });
  // (The schema spelled out for its default: calls without row starts pass nine arguments.)
  m.def(
      "decode_call(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
      "int cache_seqlen, Tensor? block_table, int program_address, Tensor? cache_starts=None) -> Tensor[]",
      &decode_call);
}

}  // namespace flash_attention_host
