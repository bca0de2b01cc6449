// How the loader reads: an engine takes read requests (file, offset, length, destination) and calls
// back when each has finished, from its own thread.
//
//   pread     a pool of threads, one blocking pread per request: works everywhere
//   io_uring  one thread keeps up to queue_depth reads in flight through one ring (liburing): fewer
//             threads and system calls for the same depth; containers often forbid it, so it is
//             tried at run time and the pread pool is the fallback. The staging buffers may be
//             registered with the ring (io_uring_register_buffers): reads into them are then
//             IORING_OP_READ_FIXED, which skips pinning the destination pages on every read; where
//             registration is refused (RLIMIT_MEMLOCK, memory that is not anonymous, an old kernel)
//             the reads stay plain and register_buffers says why
//   cufile    GPUDirect Storage: cuFileRead from the pool's threads into GPU memory (cufile_shim.h)
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loader/fd_cache.h"
#include "loader/worker_pool.h"

namespace optimized::loader {

struct IoRequest {
  uint32_t file = 0;          // index into the engine's files (its FdCache)
  uint64_t offset = 0;        // file offset
  uint64_t bytes = 0;
  uint8_t* base = nullptr;    // destination buffer (host, or device for cufile)
  uint64_t base_offset = 0;   // destination = base + base_offset
  void* tag = nullptr;        // the caller's
};

// result: bytes read (fewer than requested only at end of file), or -errno (also when the file
// cannot be opened: -ENOENT, -EMFILE).
using IoDone = std::function<void(const IoRequest&, int64_t result)>;

class IoEngine {
 public:
  virtual ~IoEngine() = default;  // waits for the requests in flight
  virtual void submit(const IoRequest* requests, size_t count) = 0;
  virtual const char* name() const = 0;
  // In the child of a fork, where the engine's threads do not exist: releases what the kernel
  // holds for it (io_uring: the ring) without joining or locking anything. The engine is then
  // leaked, never used or destroyed.
  virtual void abandon_after_fork() {}

  // Registers `buffers` (address, bytes) as the engine's fixed buffers, buffer i at index i; reads whose
  // destination lies inside one of them then use it. False with `why_not` where this engine has none
  // (pread, cufile) or the kernel refuses; reads then go on unregistered. Call before the first read.
  // The environment variable OPTIMIZED_LOADER_FIXED_BUFFERS=off skips registration and =fail makes it
  // fail as if the kernel had refused (for tests of the fallback).
  virtual bool register_buffers(const std::vector<std::pair<void*, uint64_t>>& buffers, std::string& why_not) {
    (void)buffers;
    why_not = std::string("the ") + name() + " engine has no fixed buffers";
    return false;
  }
  // Replaces registered buffer `index` (a staging slot given a new buffer); no read may be in flight
  // into the old or the new one. False when the kernel refuses: reads into that buffer go unregistered.
  virtual bool update_buffer(unsigned index, void* address, uint64_t bytes) {
    (void)index, (void)address, (void)bytes;
    return false;
  }
  // Reads issued so far as fixed (registered) reads and as plain ones.
  virtual uint64_t fixed_reads() const { return 0; }
};

// OPTIMIZED_LOADER_FIXED_BUFFERS: "" or "on" (register where the kernel allows), "off" (never), "fail"
// (registration fails with a note, to test the fallback). Anything else reads as "on".
std::string fixed_buffers_env();

// Reads with pread on `pool`'s threads; each read takes its file's descriptor from `files` for
// the time of the read.
std::unique_ptr<IoEngine> make_pread_engine(WorkerPool& pool, FdCache& files, IoDone done);

// io_uring with `queue_depth` reads in flight, each holding its file's descriptor from `files` from
// submission to completion; nullptr and `why_not` when this build or this system cannot (not built
// with liburing, the kernel or a seccomp policy refuses io_uring_setup, ...).
std::unique_ptr<IoEngine> make_uring_engine(FdCache& files, int queue_depth, IoDone done, std::string& why_not);

}  // namespace optimized::loader
