// Programmatic dependent launch (sm_90 and later; both functions compile to nothing before): how a kernel
// may start while the kernel before it on the stream is still running.
//
// The launch layer (flash_attention/ops/plans.py, Launch.programmatic) queues the second and later kernels
// of a backward and every kernel of a decode call (the first one too, unless
// FLASH_ATTENTION_DECODE_PDL_FIRST=0: ops/decode.py), with the driver's programmatic-stream-serialization
// attribute. Such a kernel's blocks may
// be scheduled as soon as every block of the kernel before it has called allow_dependent_launch() (or
// exited), instead of when that kernel has finished: its launch latency and the previous kernel's last
// blocks overlap. In exchange it must call grid_dependency_wait() before it reads anything the previous
// kernel writes (or writes anything that kernel reads); the wait returns once that kernel has completed
// and its memory operations are visible. A kernel launched without the attribute passes the wait at once.
//
// Every kernel queued with the attribute calls the wait, in every block, before its first access to
// memory: a kernel that could finish before the one it follows would let the stream's next, ordinarily
// launched kernel start too early (that one waits only for its immediate predecessor to complete).
//
// Both are griddepcontrol (PTX ISA, "griddepcontrol", PTX 7.8, sm_90). The "memory" clobber keeps the
// compiler from moving loads or stores across the wait.
#pragma once

namespace fa {

// Blocks until the kernel this one follows programmatically has completed and its writes are visible.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel on the stream (if queued programmatically) be scheduled once every block of this
// grid has called it or exited. Called at a block's start: the dependent's blocks then wait in
// grid_dependency_wait, and take a multiprocessor only where this grid leaves room.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace fa
