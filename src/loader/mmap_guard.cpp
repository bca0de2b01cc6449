// The SIGBUS guard of mapped reads (see mmap_guard.h).
//
// The handler must find the jump target of the faulting thread without thread-local storage (a
// lazily allocated TLS block is not safe to touch from a signal handler in a dlopen'ed library), so
// guarded threads register in a fixed table by kernel thread id; the handler, async-signal-safe,
// looks itself up with gettid(). A thread that finds the table full runs unguarded (the loader's
// fstat check still stands in front of it).
#include "loader/mmap_guard.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <csetjmp>
#include <csignal>
#include <mutex>

namespace optimized::loader {

namespace {

constexpr int kGuardSlots = 256;

struct GuardSlot {
  std::atomic<long> tid{0};
  sigjmp_buf* jump = nullptr;
};
GuardSlot g_slots[kGuardSlots];
struct sigaction g_previous{};
std::once_flag g_install_once;

long current_tid() { return static_cast<long>(::syscall(SYS_gettid)); }

void on_sigbus(int sig, siginfo_t* info, void* context) {
  const long tid = current_tid();
  for (GuardSlot& s : g_slots) {
    if (s.tid.load(std::memory_order_acquire) == tid && s.jump) siglongjmp(*s.jump, 1);
  }
  // Not a guarded read: what would have happened without us.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  // The default action: restore it; the faulting access runs again and ends the process.
  struct sigaction dfl{};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
}

void install() {
  struct sigaction sa{};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, &g_previous);
}

}  // namespace

bool run_guarded(void (*fn)(void* ctx), void* ctx) {
  std::call_once(g_install_once, install);
  const long tid = current_tid();
  GuardSlot* slot = nullptr;
  for (GuardSlot& s : g_slots) {
    long free_tid = 0;
    if (s.tid.load(std::memory_order_relaxed) == 0 &&
        s.tid.compare_exchange_strong(free_tid, -1, std::memory_order_acq_rel)) {
      slot = &s;
      break;
    }
  }
  if (!slot) {  // every slot taken: run unguarded
    fn(ctx);
    return true;
  }
  sigjmp_buf jump;
  bool ok = true;
  slot->jump = &jump;
  slot->tid.store(tid, std::memory_order_release);
  if (sigsetjmp(jump, 1) == 0) {  // 1: the signal mask is restored by the jump (SIGBUS unblocked)
    fn(ctx);
  } else {
    ok = false;
  }
  slot->tid.store(-1, std::memory_order_release);
  slot->jump = nullptr;
  slot->tid.store(0, std::memory_order_release);
  return ok;
}

}  // namespace optimized::loader
