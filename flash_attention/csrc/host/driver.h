// The CUDA driver as the host library reaches it: entry points handed over by Python, errors, and the
// launch of a program's kernels in its device's primary context. Shared by training_node.cpp (the autograd
// node's backward launches) and repeat_call.cpp (a repeated forward call's launch).
//
// Nothing here links against CUDA: the entry points' addresses come from flash_attention/jit/driver.py's
// libcuda (set_driver), so the library compiles with the headers of any PyTorch build, CPU-only ones
// included, and the CPU tests drive it with stand-in functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace flash_attention_host {

using LaunchFn = int (*)(void* kernel, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned smem, void* stream, void** params, void** extra);
// cuLaunchKernelEx's configuration and one launch attribute, laid out as cuda.h lays out CUlaunchConfig and
// CUlaunchAttribute (the attribute's id, padding to 8 bytes, a 64-byte value union whose first int is the
// programmatic-serialization flag); this library includes no CUDA header.
struct LaunchAttribute {
  int id;
  char pad[4];
  int value;
  char rest[60];
};
struct LaunchConfig {
  unsigned grid[3];
  unsigned block[3];
  unsigned smem;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(LaunchAttribute) == 72 && sizeof(LaunchConfig) == 56, "cuda.h's launch structures");
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the launch may start before the kernel ahead of it
// on the stream has finished (the kernel waits for it itself: fa/grid_dependency.cuh).
constexpr int kProgrammaticSerialization = 6;
using LaunchExFn = int (*)(const LaunchConfig* config, void* kernel, void** params, void** extra);
using CtxGetFn = int (*)(void** ctx);
using CtxSetFn = int (*)(void* ctx);
using ErrorStringFn = int (*)(int status, const char** text);
// cuTensorMapEncodeTiled (CUDA 12.0+): the map, data type, rank, address, dims, byte strides, box, element
// strides, interleave, swizzle, L2 promotion, out-of-bounds fill.
using EncodeTiledFn = int (*)(void* map, int dtype, unsigned rank, void* address, const uint64_t* dims,
                              const uint64_t* strides, const uint32_t* box, const uint32_t* element_strides,
                              int interleave, int swizzle, int l2_promotion, int oob_fill);

struct Driver {
  LaunchFn launch = nullptr;
  CtxGetFn ctx_get = nullptr;
  CtxSetFn ctx_set = nullptr;
  ErrorStringFn error_string = nullptr;
  EncodeTiledFn encode_tiled = nullptr;  // absent on drivers before CUDA 12.0: then no program has maps
  LaunchExFn launch_ex = nullptr;        // cuLaunchKernelEx; absent: programmatic launches are ordinary ones
};

// Set once at load (and by the CPU tests' stand-ins) before any launch; read by every launch.
inline Driver g_driver;

// Every error this library raises is a std::runtime_error, never TORCH_CHECK's c10::Error: on torch 2.11 (an
// H100 machine's image) a TORCH_CHECK with a composed message, raised from this library, crashed the process
// with a segmentation fault (in a custom class's constructor and inside the autograd engine alike), while
// the same errors as std::runtime_error are reported normally. PyTorch turns either into a Python
// RuntimeError.
[[noreturn]] inline void fail(const std::string& message) { throw std::runtime_error(message); }

inline void check(bool ok, const std::string& message) {
  if (!ok) fail(message);
}

[[noreturn]] inline void driver_failed(int status, const std::string& what) {
  const char* text = nullptr;
  if (g_driver.error_string != nullptr) g_driver.error_string(status, &text);
  fail("flash_attention: " + what + " failed: " + (text != nullptr ? text : "unknown error") + " (" +
       std::to_string(status) + ")");
}

// One kernel launch of a program: the kernel handle, its grid, threads and dynamic shared memory, and
// whether it is queued programmatically (flash_attention/ops/plans.py, Launch).
struct Launch {
  void* kernel;
  unsigned grid[3];
  unsigned threads;
  unsigned smem;
  bool programmatic;
};

// Seven integers per launch (kernel handle, grid x, y, z, threads, dynamic shared memory, programmatic), as
// Python hands a program's launches over (ops/plans.py, launch_fields).
inline std::vector<Launch> launches_from(const std::vector<int64_t>& fields) {
  check(!fields.empty() && fields.size() % 7 == 0, "launches must be seven integers each");
  std::vector<Launch> out;
  for (size_t i = 0; i < fields.size(); i += 7) {
    out.push_back({reinterpret_cast<void*>(fields[i]),
                   {static_cast<unsigned>(fields[i + 1]), static_cast<unsigned>(fields[i + 2]),
                    static_cast<unsigned>(fields[i + 3])},
                   static_cast<unsigned>(fields[i + 4]),
                   static_cast<unsigned>(fields[i + 5]),
                   fields[i + 6] != 0});
  }
  return out;
}

// The launches' kernel names, joined by newlines in Python, one per launch (for error messages).
inline std::vector<std::string> names_from(const std::string& joined, size_t count) {
  std::vector<std::string> names;
  size_t start = 0;
  while (names.size() < count) {
    const size_t end = joined.find('\n', start);
    names.push_back(joined.substr(start, end == std::string::npos ? std::string::npos : end - start));
    start = end == std::string::npos ? joined.size() : end + 1;
  }
  return names;
}

// PyTorch's current stream on `device` (null for a CPU device: only the tests' stand-in driver runs those).
inline void* current_stream(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;
  c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  return guard.getStream(device).native_handle();
}

// The device's primary context `context` made current on this thread for the guard's lifetime, and the
// caller's put back after, as flash_attention/jit/driver.py's make_primary_current does for the Python
// launches: a launch, and a tensor-map encode, go to whatever context is current, and the autograd engine's
// device thread (or any thread whose CUDA work so far was served from PyTorch's caches) may have none.
class ContextGuard {
 public:
  explicit ContextGuard(void* context) {
    int status = g_driver.ctx_get(&previous_);
    if (status != 0) driver_failed(status, "cuCtxGetCurrent");
    switched_ = previous_ != context;
    if (switched_ && (status = g_driver.ctx_set(context)) != 0) driver_failed(status, "cuCtxSetCurrent");
  }
  ~ContextGuard() {
    if (switched_ && previous_ != nullptr) g_driver.ctx_set(previous_);
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  void* previous_ = nullptr;
  bool switched_ = false;
};

// Queue `launches` in order, each with `params` as its one by-value argument, on `stream`, in `context` (the
// device's primary context, where the kernels are loaded).
inline void launch_all(const std::vector<Launch>& launches, const std::vector<std::string>& names, void* context,
                       void* params, void* stream) {
  if (g_driver.launch == nullptr) fail("flash_attention_host: set_driver was not called");
  int failed = 0;
  size_t which = 0;
  {
    ContextGuard current(context);
    void* args[1] = {params};  // the kernels take the params struct as their one by-value argument
    for (; which < launches.size(); ++which) {
      const Launch& l = launches[which];
      if (l.programmatic && g_driver.launch_ex != nullptr) {
        LaunchAttribute attr{};
        attr.id = kProgrammaticSerialization;
        attr.value = 1;
        const LaunchConfig config{{l.grid[0], l.grid[1], l.grid[2]}, {l.threads, 1, 1}, l.smem, stream, &attr, 1};
        failed = g_driver.launch_ex(&config, l.kernel, args, nullptr);
      } else {
        failed = g_driver.launch(l.kernel, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.smem, stream,
                                 args, nullptr);
      }
      if (failed != 0) break;
    }
  }
  if (failed != 0) driver_failed(failed, "launching " + names[which]);
}

// A program's params struct as Python hands it over (every field but the pointers): uint8 CPU bytes.
inline std::vector<uint8_t> params_from(const at::Tensor& bytes, const std::string& what) {
  check(bytes.device().is_cpu() && bytes.scalar_type() == at::kByte && bytes.is_contiguous(),
        what + ": params must be a contiguous uint8 CPU tensor");
  const auto* data = bytes.data_ptr<uint8_t>();
  return std::vector<uint8_t>(data, data + bytes.numel());
}

// The byte offsets of a program's `count` pointer slots in its params (-1: not written), each checked to
// leave room for the slot's width (`width_of(slot)` bytes) inside the params.
template <class WidthOf>
void offsets_from(const std::vector<int64_t>& given, int64_t* into, int count, size_t params_size,
                  const std::string& what, WidthOf width_of) {
  check(static_cast<int64_t>(given.size()) == count,
        what + ": expected " + std::to_string(count) + " offsets, got " + std::to_string(given.size()));
  for (int i = 0; i < count; ++i) {
    check(given[i] == -1 || (given[i] >= 0 && given[i] + width_of(i) <= static_cast<int64_t>(params_size)),
          what + ": offset of slot " + std::to_string(i) + " outside the params");
    into[i] = given[i];
  }
}

inline uint64_t address_of(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// The kernels read and write 16-byte vectors: a 16-byte aligned base (strides are the program's, checked
// when it was made).
inline bool kernel_readable(const at::Tensor& t) { return address_of(t) % 16 == 0; }

}  // namespace flash_attention_host
