// One C entry for Python's ctypes: wait for the loader's next batch without holding the GIL.
// ctypes releases the GIL around foreign calls, a torch custom-class method does not, and a
// training loop with other Python threads (or the benchmark's compute thread) must not stall
// while the loader waits on storage. The loader's address comes from the torch glue
// (torch.classes.optimized.StreamingLoader.handle()).
#include "optimized/loader.h"

extern "C" int optimized_loader_wait(void* loader) {
  try {
    static_cast<optimized::Loader*>(loader)->wait();
    return 0;
  } catch (...) {
    return -1;  // next() reports the error itself
  }
}
