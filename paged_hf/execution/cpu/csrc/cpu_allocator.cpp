// paged_hf::keep_large_blocks — torch's CPU allocator, with the large blocks a step frees kept for the
// next step instead of going back to the kernel.
//
// A CPU step allocates and frees the same large temporaries every time (a layer's activations at
// the step's token count: megabytes each), between small allocations that live on. glibc's heap
// then fragments: a freed block sits under a small live one, the next large request does not fit
// the hole, the heap grows, and every new page is a fault (zeroed by the kernel; ~13 us a page on a
// virtual machine here: a W-mixed run with a 4,096-token budget spent 4.7 s of 12 s in the kernel).
// Blocks of 256 KiB and more are handed out here in size classes (powers of two in quarter steps,
// 64-byte aligned), and a freed block waits in its class for the next request of that class (or of
// the two classes below it), up to a cap on the bytes kept: past it the blocks kept longest go back
// to the system first (the step's token count moves, and with it the classes it asks for). Smaller
// requests go to the allocator that was installed before. Data pointers stay "simple" (context == pointer), as torch's
// own CPU allocator's are. Results do not change; memory kept free is at most the cap.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t LARGE = 256 << 10;

// the size class of n bytes: the smallest of 2^k, 1.25, 1.5, 1.75 x 2^k that holds it
size_t size_class(size_t n) {
  size_t p = 1;
  while (p * 2 <= n) p *= 2;
  if (p == n) return n;
  for (size_t q = 1; q <= 4; ++q) {
    const size_t c = p + q * (p / 4);
    if (c >= n) return c;
  }
  return 2 * p;
}

class KeptBlocks final : public c10::Allocator {
 public:
  explicit KeptBlocks(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < LARGE) return base_->allocate(n);
    size_t size = size_class(n);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> g(mu_);
      // its own class, else one or two classes up (at most 1.5x the bytes)
      for (size_t c = size, k = 0; k < 3 && p == nullptr; ++k, c = size_class(c + 1)) {
        auto it = free_.find(c);
        if (it != free_.end() && !it->second.empty()) {
          auto node = it->second.back();
          it->second.pop_back();
          p = node->second;
          size = c;
          lru_.erase(node);
          kept_ -= c;
        }
      }
    }
    if (p == nullptr) p = c10::alloc_cpu(size);
    {
      std::lock_guard<std::mutex> g(mu_);
      live_[p] = size;
    }
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* p) { instance()->put_back(p); }

  void put_back(void* p) {
    std::vector<void*> out;  // blocks given back to the system, outside the lock
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = live_.find(p);
      if (it == live_.end()) {  // not one of ours: cannot happen, but never leak or double-free
        out.push_back(p);
      } else {
        const size_t size = it->second;
        live_.erase(it);
        if (size > cap_) {
          out.push_back(p);
        } else {
          while (kept_ + size > cap_ && !lru_.empty()) {  // the longest kept first
            const auto [old_size, old_p] = lru_.front();
            auto& list = free_[old_size];
            list.erase(std::find(list.begin(), list.end(), lru_.begin()));
            lru_.pop_front();
            kept_ -= old_size;
            out.push_back(old_p);
          }
          lru_.emplace_back(size, p);
          free_[size].push_back(std::prev(lru_.end()));
          kept_ += size;
        }
      }
    }
    for (void* b : out) c10::free_cpu(b);
  }

  // Give every kept block back to the system; returns the bytes given back.
  int64_t trim() {
    std::vector<void*> blocks;
    int64_t bytes = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& [size, p] : lru_) {
        bytes += static_cast<int64_t>(size);
        blocks.push_back(p);
      }
      lru_.clear();
      free_.clear();
      kept_ = 0;
    }
    for (void* b : blocks) c10::free_cpu(b);
    return bytes;
  }

  void set_cap(size_t cap) {
    std::lock_guard<std::mutex> g(mu_);
    cap_ = cap;
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    int64_t live_bytes = 0;
    for (auto& [p, size] : live_) live_bytes += static_cast<int64_t>(size);
    return {static_cast<int64_t>(kept_), live_bytes, static_cast<int64_t>(cap_)};
  }

  static KeptBlocks* instance() {
    static KeptBlocks* one = new KeptBlocks(c10::GetCPUAllocator());  // never destroyed: tensors outlive anything
    return one;
  }

 private:
  c10::Allocator* base_;
  std::mutex mu_;
  using Kept = std::list<std::pair<size_t, void*>>;  // (size class, block), the longest kept first
  std::unordered_map<void*, size_t> live_;
  Kept lru_;
  std::unordered_map<size_t, std::vector<Kept::iterator>> free_;  // each class's kept blocks, newest last
  size_t kept_ = 0;
  size_t cap_ = size_t(1) << 30;
};

// Install it as torch's CPU allocator (once per process; later calls only set the cap).
bool keep_large_blocks(int64_t cap_bytes) {
  static std::once_flag once;
  KeptBlocks* k = KeptBlocks::instance();
  k->set_cap(static_cast<size_t>(std::max<int64_t>(cap_bytes, 0)));
  std::call_once(once, [&] { c10::SetCPUAllocator(k, /*priority=*/1); });
  return c10::GetCPUAllocator() == k;
}

int64_t trim_kept_blocks() { return KeptBlocks::instance()->trim(); }

std::vector<int64_t> kept_blocks_stats() { return KeptBlocks::instance()->stats(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(paged_hf, m) {
  m.def("keep_large_blocks(int cap_bytes) -> bool", &keep_large_blocks);
  m.def("trim_kept_blocks() -> int", &trim_kept_blocks);
  m.def("kept_blocks_stats() -> int[]", &kept_blocks_stats);
}
