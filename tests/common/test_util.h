// The gtest helpers every family's tests share (tests/<family>/ include this as "common/test_util.h"):
//   - fresh random inputs: test_rng(), seeded from the running test's name;
//   - error paths: call() catches the optimized::Error a call throws (Caught), EXPECT_ERROR /
//     EXPECT_MENTIONS / EXPECT_CONTAINS assert its status and wording, contains_all() and error_of()
//     for messages that must name several things;
//   - views exactly as given (raw(), no constructor in between), moved, retyped or shifted;
//   - poisoned storage with a guard zone: GuardedLayout, and the elements that changed outside a view;
//   - CUDA: SKIP_WITHOUT_CUDA() (skips with the reason), OwnStream (a non-blocking stream), and
//     run_on_cuda(), which runs a call on device copies of host storage on the default stream or
//     on an own stream held back by a 50 ms host callback with the device copies NaN until the
//     stream's uploads land (a kernel launched on any other stream reads NaN and fails the check).
#pragma once

#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "optimized/buffer.h"
#include "optimized/core.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized::testing {

// ---- random inputs ----------------------------------------------------------------------------

// A generator seeded from the running test's full name and a per-call counter: every test gets
// its own fresh inputs, and a failure reproduces exactly.
inline std::mt19937_64 test_rng() {
  static std::string last_test;
  static uint64_t counter = 0;
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  if (name != last_test) {
    last_test = name;
    counter = 0;
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  h ^= 0x9e3779b97f4a7c15ull * ++counter;
  return std::mt19937_64(h);
}

// ---- error paths ------------------------------------------------------------------------------

struct Caught {
  bool thrown = false;
  Status status = Status::kOk;
  std::string message;
};

// What f throws: an optimized::Error (anything else fails the test), or nothing.
template <typename F>
Caught call(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return {true, e.status(), e.what()};
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than optimized::Error: " << e.what();
    return {true, Status::kInternal, e.what()};
  }
  return {};
}

// The message of the Error fn throws ("" and a failure when it throws nothing).
template <typename F>
std::string error_of(F&& fn) {
  const Caught c = call(fn);
  if (!c.thrown) ADD_FAILURE() << "expected optimized::Error";
  return c.message;
}

inline bool is_ident(char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; }

// `word` appears in `msg` as a whole word (not inside an identifier): "a" in "a: expected ...".
inline bool mentions(const std::string& msg, const std::string& word) {
  for (size_t pos = msg.find(word); pos != std::string::npos; pos = msg.find(word, pos + 1)) {
    const bool left = pos == 0 || !is_ident(msg[pos - 1]);
    const bool right = pos + word.size() >= msg.size() || !is_ident(msg[pos + word.size()]);
    if (left && right) return true;
  }
  return false;
}
inline bool contains(const std::string& msg, const std::string& s) { return msg.find(s) != std::string::npos; }

// Whether `msg` contains every one of `parts`.
inline ::testing::AssertionResult contains_all(const std::string& msg, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts)
    if (!contains(msg, p))
      return ::testing::AssertionFailure() << "message \"" << msg << "\" does not mention \"" << p << "\"";
  return ::testing::AssertionSuccess();
}

#define EXPECT_ERROR(caught, expected_status)                                                                   \
  do {                                                                                                          \
    ASSERT_TRUE((caught).thrown) << "expected an Error (" << ::optimized::status_name(expected_status) << ")"; \
    EXPECT_EQ((caught).status, expected_status)                                                                 \
        << "got " << ::optimized::status_name((caught).status) << ": " << (caught).message;                    \
    EXPECT_FALSE((caught).message.empty());                                                                     \
  } while (0)

#define EXPECT_MENTIONS(caught, word)                                                                          \
  EXPECT_TRUE(::optimized::testing::mentions((caught).message, word)) << "message should name '" << (word) \
                                                                       << "': " << (caught).message
#define EXPECT_CONTAINS(caught, text)                                                                          \
  EXPECT_TRUE(::optimized::testing::contains((caught).message, text)) << "message should contain '" << (text) \
                                                                       << "': " << (caught).message

// ---- views --------------------------------------------------------------------------------------

// A view built field by field, so that shapes and strides reach the API exactly as given.
inline TensorView raw(void* data, DType dtype, Device device, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.rank = static_cast<int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}
inline TensorView on(TensorView t, Device d) {
  t.device = d;
  return t;
}
inline TensorView as(TensorView t, DType d) {
  t.dtype = d;
  return t;
}
inline TensorView shifted(TensorView t, int64_t elements) {
  t.data = static_cast<char*>(t.data) + elements * static_cast<int64_t>(dtype_size(t.dtype));
  return t;
}

// ---- poisoned storage with a guard zone -------------------------------------------------------

// Storage of one operand: `batches` matrices of rows x cols, stored row-major (rows `ld` apart) or
// column-major (col_major: columns `ld` apart), batches `batch_stride` apart, starting `offset`
// elements into a buffer that ends with a guard zone. Everything outside the view is poisoned
// (NaN) by the families' operand builders.
struct GuardedLayout {
  int64_t rows = 0, cols = 0, ld = 0;  // rows and cols of the matrix as the view shows it
  int64_t offset = 0;
  int64_t batches = 1;  // matrices stored (1 when broadcast)
  int64_t batch_stride = 0;
  bool col_major = false;
  static constexpr int64_t kGuard = 67;  // elements after the last one the view covers

  // The stored rows (ld apart) and their width.
  int64_t stored_rows() const { return col_major ? cols : rows; }
  int64_t stored_cols() const { return col_major ? rows : cols; }
  int64_t storage() const { return offset + (batches - 1) * batch_stride + stored_rows() * ld + kGuard; }
  int64_t count() const { return batches * rows * cols; }
  // Index in the buffer of element (i, j), and of element (i, j) of matrix z (z < batches).
  int64_t index(int64_t i, int64_t j) const { return at(0, i, j); }
  int64_t at(int64_t z, int64_t i, int64_t j) const {
    return offset + z * batch_stride + (col_major ? j * ld + i : i * ld + j);
  }
  // Marks the elements the view covers.
  std::vector<char> mask() const {
    std::vector<char> m(static_cast<size_t>(storage()), 0);
    for (int64_t z = 0; z < batches; ++z)
      for (int64_t r = 0; r < stored_rows(); ++r)
        if (stored_cols() > 0)
          std::memset(&m[static_cast<size_t>(offset + z * batch_stride + r * ld)], 1,
                      static_cast<size_t>(stored_cols()));
    return m;
  }
};

// Elements of storage `layout` whose bytes differ between `before` and `after`: outside the view
// only, or everywhere (an input's storage). *first: the first one's storage index.
inline int64_t changed_elements(const GuardedLayout& layout, size_t elem_size, const void* before, const void* after,
                                bool outside_only, int64_t* first) {
  const std::vector<char> inside = layout.mask();
  const auto* b = static_cast<const unsigned char*>(before);
  const auto* a = static_cast<const unsigned char*>(after);
  int64_t changed = 0;
  for (size_t i = 0; i < inside.size(); ++i)
    if ((!outside_only || !inside[i]) && std::memcmp(b + i * elem_size, a + i * elem_size, elem_size) != 0) {
      if (changed++ == 0 && first) *first = static_cast<int64_t>(i);
    }
  return changed;
}

// ---- CUDA ---------------------------------------------------------------------------------------

#define SKIP_WITHOUT_CUDA()                                                                                    \
  do {                                                                                                         \
    if (::optimized::cuda_device_count() == 0)                                                                \
      GTEST_SKIP() << "no CUDA device: " << ::optimized::cuda_unavailable_reason();                          \
  } while (0)

// Whether device 0 has compute capability 9.0, where the sm_90a rungs (wgmma, TMA, setmaxnreg) run.
inline bool hopper_device() {
#if OPTIMIZED_WITH_CUDA
  if (::optimized::cuda_device_count() == 0) return false;
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

// A CUDA stream of our own, non-blocking with respect to the legacy default stream, so that a
// launcher that ignores ctx.cuda_stream (and runs on stream 0) races with the synchronization
// the test does and is caught.
class OwnStream {
 public:
  OwnStream() {
#if OPTIMIZED_WITH_CUDA
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
#endif
  }
  ~OwnStream() {
#if OPTIMIZED_WITH_CUDA
    if (stream_) cudaStreamDestroy(stream_);
#endif
  }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  void* get() const { return stream_; }

 private:
#if OPTIMIZED_WITH_CUDA
  cudaStream_t stream_ = nullptr;
#else
  void* stream_ = nullptr;
#endif
};

// Runs call(device_bases) on device copies of the host buffers (null entries: no buffer) and
// returns the host copies of every buffer afterwards, or the CUDA error (empty on success).
// stream null: copies and call on the legacy default stream, then a device synchronization.
// stream set: everything on that stream behind a 50 ms host callback, the device copies NaN until
// the stream's uploads land. Throws what call throws.
inline std::string run_on_cuda(const std::vector<const Buffer*>& host, Device device, void* stream,
                               const std::function<void(const std::vector<void*>&)>& call,
                               std::vector<Buffer>& after) {
  after.clear();
  after.resize(host.size());
#if OPTIMIZED_WITH_CUDA
  std::vector<Buffer> dev(host.size());
  std::vector<void*> bases(host.size(), nullptr);
  for (size_t i = 0; i < host.size(); ++i) {
    if (!host[i]) continue;
    dev[i] = Buffer(host[i]->dtype(), host[i]->count(), device);
    after[i] = Buffer(host[i]->dtype(), host[i]->count(), Device::cpu());
    bases[i] = dev[i].data();
  }
  cudaError_t e = cudaSuccess;
  auto st = static_cast<cudaStream_t>(stream);
  if (!st) {
    for (size_t i = 0; i < host.size(); ++i)
      if (host[i]) dev[i].copy_from_host(host[i]->data());
    call(bases);
    e = cudaDeviceSynchronize();
    for (size_t i = 0; i < host.size() && e == cudaSuccess; ++i)
      if (host[i]) dev[i].copy_to_host(after[i].data());
  } else {
    for (size_t i = 0; i < host.size(); ++i)
      if (host[i]) dev[i].fill_bytes(0xFF);
    e = cudaLaunchHostFunc(st, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }, nullptr);
    for (size_t i = 0; i < host.size() && e == cudaSuccess; ++i)
      if (host[i]) e = cudaMemcpyAsync(dev[i].data(), host[i]->data(), host[i]->bytes(), cudaMemcpyHostToDevice, st);
    if (e == cudaSuccess) call(bases);
    for (size_t i = 0; i < host.size() && e == cudaSuccess; ++i)
      if (host[i]) e = cudaMemcpyAsync(after[i].data(), dev[i].data(), dev[i].bytes(), cudaMemcpyDeviceToHost, st);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
  }
  if (e != cudaSuccess) return std::string("CUDA error around the call: ") + cudaGetErrorString(e);
  return "";
#else
  (void)device, (void)stream, (void)call;
  return "CUDA case in a build without CUDA";
#endif
}

// Runs call(bases, device) on copies of the host buffers: host copies on the CPU, device copies on
// cuda:0 (the default stream, then a synchronization). Returns the buffers afterwards.
inline std::vector<Buffer> run_case(bool cuda, const std::vector<const Buffer*>& host,
                                    const std::function<void(const std::vector<void*>&, Device)>& call) {
  std::vector<Buffer> after;
  if (!cuda) {
    std::vector<void*> bases;
    for (const Buffer* h : host) {
      after.emplace_back(h->dtype(), h->count(), Device::cpu());
      std::memcpy(after.back().data(), h->data(), h->bytes());
      bases.push_back(after.back().data());
    }
    call(bases, Device::cpu());
    return after;
  }
  const std::string err =
      run_on_cuda(host, Device::cuda(0), nullptr, [&](const std::vector<void*>& b) { call(b, Device::cuda(0)); }, after);
  EXPECT_TRUE(err.empty()) << err;
  return after;
}

}  // namespace optimized::testing
