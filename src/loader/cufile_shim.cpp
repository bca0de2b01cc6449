// cuFile loaded with dlopen (see cufile_shim.h).
#include "loader/cufile_shim.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cerrno>
#include <condition_variable>
#include <mutex>

#if OPTIMIZED_WITH_CUFILE
#include <cufile.h>
#endif

namespace optimized::loader {

#if OPTIMIZED_WITH_CUFILE

struct CuFile::Api {
  CUfileError_t (*driver_open)();
  CUfileError_t (*handle_register)(CUfileHandle_t*, CUfileDescr_t*);
  void (*handle_deregister)(CUfileHandle_t);
  CUfileError_t (*buf_register)(const void*, size_t, int);
  CUfileError_t (*buf_deregister)(const void*);
  ssize_t (*read)(CUfileHandle_t, void*, size_t, off_t, off_t);
};

namespace {

std::string cufile_error(CUfileError_t e) {
  std::string s = cufileop_status_error(e.err);
  if (e.err == CU_FILE_CUDA_DRIVER_ERROR) s += " (CUDA driver error " + std::to_string(static_cast<int>(e.cu_err)) + ")";
  return s;
}

constexpr const char* kNoNvfs =
    "the nvidia-fs kernel module is not loaded, so cuFile would run in compatibility mode (POSIX reads "
    "through its own bounce buffers, no faster than the pinned path); gds=\"on\" forces it";

bool path_exists(const char* p) {
  struct stat st;
  return ::stat(p, &st) == 0;
}

}  // namespace

CuFile::CuFile(std::unique_ptr<Api> api) : api_(std::move(api)) {}

CuFile* CuFile::open(bool require_nvfs, std::string& why_not) {
  // Opened once per process; the outcome (and its reason) is remembered.
  static std::mutex mutex;
  static bool tried = false;
  static CuFile* instance = nullptr;
  static std::string reason;
  std::lock_guard<std::mutex> lock(mutex);
  // Without nvidia-fs, gds="auto" need not open the driver at all (it allocates its own buffers).
  if (require_nvfs && !path_exists("/proc/driver/nvidia-fs") && !path_exists("/sys/module/nvidia_fs")) {
    why_not = kNoNvfs;
    return nullptr;
  }
  if (!tried) {
    tried = true;
    void* lib = nullptr;
    for (const char* name : {"libcufile.so.0", "libcufile.so", "/usr/local/cuda/lib64/libcufile.so.0",
                             "/usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.0"})
      if (!lib) lib = ::dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      const char* e = ::dlerror();
      reason = std::string("libcufile.so.0 not found (") + (e ? e : "dlopen failed") + ")";
    } else {
      auto api = std::make_unique<Api>();
      bool ok = true;
      auto sym = [&](auto& fn, const char* name) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
        if (!fn) {
          ok = false;
          reason = std::string("libcufile lacks ") + name;
        }
      };
      sym(api->driver_open, "cuFileDriverOpen");
      sym(api->handle_register, "cuFileHandleRegister");
      sym(api->handle_deregister, "cuFileHandleDeregister");
      sym(api->buf_register, "cuFileBufRegister");
      sym(api->buf_deregister, "cuFileBufDeregister");
      sym(api->read, "cuFileRead");
      if (ok) {
        const CUfileError_t e = api->driver_open();
        if (e.err != CU_FILE_SUCCESS) {
          reason = "cuFileDriverOpen failed: " + cufile_error(e);
        } else {
          instance = new CuFile(std::move(api));  // lives for the process, as the driver does
        }
      }
    }
  }
  if (!instance) why_not = reason;
  return instance;
}

void* CuFile::register_file(int fd, std::string& error) {
  CUfileDescr_t descr{};
  descr.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
  descr.handle.fd = fd;
  CUfileHandle_t handle = nullptr;
  const CUfileError_t e = api_->handle_register(&handle, &descr);
  if (e.err != CU_FILE_SUCCESS) {
    error = "cuFileHandleRegister failed: " + cufile_error(e);
    return nullptr;
  }
  return handle;
}

void CuFile::deregister_file(void* handle) { api_->handle_deregister(static_cast<CUfileHandle_t>(handle)); }

bool CuFile::register_buffer(void* p, uint64_t bytes) { return api_->buf_register(p, bytes, 0).err == CU_FILE_SUCCESS; }

void CuFile::deregister_buffer(void* p) { api_->buf_deregister(p); }

int64_t CuFile::read(void* handle, void* base, uint64_t bytes, uint64_t file_offset, uint64_t base_offset) {
  const ssize_t n = api_->read(static_cast<CUfileHandle_t>(handle), base, bytes, static_cast<off_t>(file_offset),
                               static_cast<off_t>(base_offset));
  if (n >= 0) return n;
  if (n == -1) return -errno;
  return -EIO;
}

#else  // built without cufile.h

struct CuFile::Api {};
CuFile::CuFile(std::unique_ptr<Api> api) : api_(std::move(api)) {}
CuFile* CuFile::open(bool, std::string& why_not) {
  why_not = "built without cufile.h (the CUDA toolkit or the nvidia-cufile wheel provides it at build time)";
  return nullptr;
}
void* CuFile::register_file(int, std::string& error) {
  error = "built without cuFile";
  return nullptr;
}
void CuFile::deregister_file(void*) {}
bool CuFile::register_buffer(void*, uint64_t) { return false; }
void CuFile::deregister_buffer(void*) {}
int64_t CuFile::read(void*, void*, uint64_t, uint64_t, uint64_t) { return -ENOSYS; }

#endif

namespace {

// Like the pread engine, with cuFileRead into device memory.
class CuFileEngine final : public IoEngine {
 public:
  CuFileEngine(CuFile& cufile, WorkerPool& pool, std::vector<void*> handles, IoDone done)
      : cufile_(cufile), pool_(pool), handles_(std::move(handles)), done_(std::move(done)) {}

  ~CuFileEngine() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return in_flight_ == 0; });
  }

  void submit(const IoRequest* requests, size_t count) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_flight_ += count;
    }
    for (size_t i = 0; i < count; ++i) {
      pool_.post([this, req = requests[i]] {
        uint64_t got = 0;
        int64_t result = 0;
        while (got < req.bytes) {
          const int64_t n = cufile_.read(handles_[req.file], req.base, req.bytes - got, req.offset + got,
                                         req.base_offset + got);
          if (n < 0) {
            if (n == -EINTR) continue;
            result = n;
            break;
          }
          if (n == 0) break;
          got += static_cast<uint64_t>(n);
        }
        done_(req, result < 0 ? result : static_cast<int64_t>(got));
        std::lock_guard<std::mutex> lock(mutex_);
        if (--in_flight_ == 0) cv_.notify_all();
      });
    }
  }

  const char* name() const override { return "cufile"; }

 private:
  CuFile& cufile_;
  WorkerPool& pool_;
  std::vector<void*> handles_;
  IoDone done_;
  std::mutex mutex_;
  std::condition_variable cv_;
  size_t in_flight_ = 0;
};

}  // namespace

std::unique_ptr<IoEngine> make_cufile_engine(CuFile& cufile, WorkerPool& pool, std::vector<void*> handles,
                                             IoDone done) {
  return std::make_unique<CuFileEngine>(cufile, pool, std::move(handles), std::move(done));
}

}  // namespace optimized::loader
