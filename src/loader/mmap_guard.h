// Reading a mapped shard (io=mmap) that was truncated after it was mapped (overwritten in place,
// cut by another process) touches pages past the end of the file, and the kernel answers with
// SIGBUS, which would end the process. The loader checks each shard's size (fstat) before it
// touches a batch's pages; this guard covers the window between that check and the reads.
//
// run_guarded(fn, ctx) calls fn(ctx) with a SIGBUS handler armed for the calling thread: a SIGBUS
// raised on this thread while fn runs jumps back (siglongjmp) and run_guarded returns false. fn is
// abandoned mid-way, so it must only read and write memory: no locks, no allocation, no I/O. A
// SIGBUS on any other thread, or outside fn, goes to the handler that was installed before ours
// (the default one ends the process, as it would have).
#pragma once

#include <type_traits>

namespace optimized::loader {

bool run_guarded(void (*fn)(void* ctx), void* ctx);

// Calls f() under run_guarded; f is a lambda or function object.
template <typename F>
bool guarded(F&& f) {
  using Fn = std::remove_reference_t<F>;
  return run_guarded([](void* p) { (*static_cast<Fn*>(p))(); }, const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace optimized::loader
