// GPUDirect Storage through cuFile, loaded at run time (dlopen "libcufile.so.0") so that the build
// and the library never depend on it. Compiled with the real API only when cufile.h was found at
// build time (OPTIMIZED_WITH_CUFILE); otherwise open_cufile() says why not.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loader/io_engine.h"

namespace optimized::loader {

class CuFile {
 public:
  // The process-wide cuFile driver, opened once; nullptr with `why_not` when unavailable. With
  // require_nvfs (gds="auto"), also nullptr when the nvidia-fs kernel module is absent: cuFile then
  // runs in compatibility mode (POSIX reads into its own bounce buffers), no faster than the pinned path.
  static CuFile* open(bool require_nvfs, std::string& why_not);

  // A cuFile handle for an open descriptor; nullptr with `error` on failure.
  void* register_file(int fd, std::string& error);
  void deregister_file(void* handle);
  // Registering device buffers lets cuFile DMA into them without its own bounce buffers; optional.
  bool register_buffer(void* device_ptr, uint64_t bytes);
  void deregister_buffer(void* device_ptr);
  // Bytes read, or -errno (-EIO for cuFile's own errors).
  int64_t read(void* handle, void* device_base, uint64_t bytes, uint64_t file_offset, uint64_t base_offset);

  struct Api;

 private:
  explicit CuFile(std::unique_ptr<Api> api);
  std::unique_ptr<Api> api_;
};

// cuFileRead on `pool`'s threads into device memory (IoRequest::base is a device pointer).
std::unique_ptr<IoEngine> make_cufile_engine(CuFile& cufile, WorkerPool& pool, std::vector<void*> handles, IoDone done);

}  // namespace optimized::loader
