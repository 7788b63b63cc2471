#include "device/wait_ledger.h"

namespace mltuner {

namespace {
std::atomic<uint64_t> next_ledger_id{1};
}  // namespace

WaitLedger::WaitLedger(int slots)
    : id_(next_ledger_id.fetch_add(1, std::memory_order_relaxed)),
      slots_(slots), recorders_(new Slot[slots]), waited_(new std::atomic<uint64_t>[slots * slots]) {
  for (int i = 0; i < slots * slots; ++i) waited_[i].store(0, std::memory_order_relaxed);
}

bool WaitLedger::Covers(int waiter, int recorder, uint64_t number) const {
  if (number == 0 || !Tracked(waiter) || !Tracked(recorder)) return false;
  return Waited(waiter, recorder).load(std::memory_order_acquire) >= number;
}

void WaitLedger::Note(int waiter, int recorder, uint64_t number) {
  if (number == 0 || !Tracked(waiter) || !Tracked(recorder)) return;
  std::atomic<uint64_t>& waited = Waited(waiter, recorder);
  uint64_t seen = waited.load(std::memory_order_relaxed);
  while (seen < number && !waited.compare_exchange_weak(seen, number, std::memory_order_release,
                                                        std::memory_order_relaxed)) {
  }
}

}  // namespace mltuner
