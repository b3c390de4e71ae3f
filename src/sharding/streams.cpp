#include "streams.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <array>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/debug/gpu_stats.h"

#ifdef FSDP_HAS_CUDA
#include <ATen/cuda/Sleep.h>
#endif

namespace fsdp::detail {

// See [Note: FSDP streams] in the header. Only CUDA builds of LibTorch (FSDP_HAS_CUDA) make
// streams; a CPU build compiles none of it, and CPU devices never get here.
int64_t stream_race_microseconds() {
  static const int64_t us = [] {
    const char* v = std::getenv("FSDP_STREAM_RACE_US");
    if (v == nullptr || *v == '\0') return int64_t{0};
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || n < 0) {
      throw std::invalid_argument(std::string("fsdp: FSDP_STREAM_RACE_US='") + v +
                                  "' is not a number of microseconds (0 or more; 0 or unset: off)");
    }
    return static_cast<int64_t>(n);
  }();
  return us;
}

#ifdef FSDP_HAS_CUDA

DeviceStreams* DeviceStreams::get(c10::Device device) {
  if (!device.is_cuda()) return nullptr;
  static std::mutex mu;
  static std::array<std::unique_ptr<DeviceStreams>, 64> per_device;  // CUDA device indices
  const c10::DeviceIndex index =
      device.has_index() ? device.index() : c10::impl::VirtualGuardImpl(device.type()).getDevice().index();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = per_device.at(static_cast<size_t>(index));
  if (!slot) {
    const c10::Device d(device.type(), index);
    c10::impl::VirtualGuardImpl impl(d.type());
    slot.reset(new DeviceStreams(impl.getStreamFromGlobalPool(d, /*isHighPriority=*/true),
                                 impl.getStreamFromGlobalPool(d, /*isHighPriority=*/true),
                                 impl.getStreamFromGlobalPool(d, /*isHighPriority=*/true),
                                 impl.getStreamFromGlobalPool(d, /*isHighPriority=*/false)));
  }
  return slot.get();
}

c10::Stream DeviceStreams::current() const { return c10::impl::VirtualGuardImpl(device().type()).getStream(device()); }

namespace {

// One event per producing stream, recorded again for every wait: cudaStreamWaitEvent takes the
// event's state when it is called, so a later record does not move an earlier wait. Never
// destroyed: at exit the CUDA runtime may be gone before static destructors run.
c10::Event& producer_event(const c10::Stream& producer) {
  static auto* events = new std::map<std::pair<int, c10::StreamId>, std::unique_ptr<c10::Event>>;
  auto& slot = (*events)[{static_cast<int>(producer.device_index()), producer.id()}];
  if (!slot) slot = std::make_unique<c10::Event>(producer.device_type());
  return *slot;
}
std::mutex& producer_events_mu() {
  static std::mutex mu;
  return mu;
}

// Stream-race mode: a side stream spins before the copy or collective it was told to wait for.
void spin_if_racing(const c10::Stream& waiter) {
  const int64_t us = stream_race_microseconds();
  if (us == 0) return;
  DeviceStreams* ds = DeviceStreams::get(waiter.device());
  if (ds == nullptr || !(waiter == ds->copy_in || waiter == ds->all_gather || waiter == ds->reduce_scatter ||
                         waiter == ds->all_reduce)) {
    return;
  }
  c10::StreamGuard guard(waiter);
  at::cuda::sleep(us * 2000);  // cycles: about 2 GHz (an H100/H200 runs at 1.6 to 2 GHz)
}

}  // namespace

void DeviceStreams::wait_stream(const c10::Stream& waiter, const c10::Stream& producer) {
  if (waiter == producer) return;
  {
    std::lock_guard<std::mutex> lock(producer_events_mu());
    c10::Event& event = producer_event(producer);
    event.record(producer);
    event.block(waiter);
  }
  spin_if_racing(waiter);
}

void DeviceStreams::wait_event(const c10::Stream& waiter, const c10::Event& event) {
  event.block(waiter);
  spin_if_racing(waiter);
}

void DeviceStreams::synchronize(const c10::Stream& stream) { stream.synchronize(); }

namespace {
using EventPair = std::pair<c10::Event, c10::Event>;
struct WaitTiming {
  std::mutex mu;
  bool on = false;
  std::vector<EventPair> pending;  // (before the wait, after it) on the compute stream
  std::vector<EventPair> spare;    // pairs already read, recorded again by later waits
  double done_ms = 0;              // pairs already passed, folded in so that `pending` stays short
  // A pair to record on the stream `on`: a spare one of its device, else a new one.
  EventPair take(const c10::Stream& on) {
    for (size_t i = spare.size(); i-- > 0;) {
      if (spare[i].first.device_index() == on.device_index()) {
        EventPair p = std::move(spare[i]);
        spare.erase(spare.begin() + static_cast<std::ptrdiff_t>(i));
        return p;
      }
    }
    return EventPair(c10::Event(on.device_type(), c10::EventFlag::BACKEND_DEFAULT),
                     c10::Event(on.device_type(), c10::EventFlag::BACKEND_DEFAULT));
  }
};
WaitTiming& wait_timing() {
  static auto* t = new WaitTiming;  // never destroyed: its events outlive the CUDA runtime at exit
  return *t;
}
}  // namespace

void DeviceStreams::current_waits_for_all_gather() const {
  const c10::Stream cur = current();
  WaitTiming& t = wait_timing();
  std::lock_guard<std::mutex> lock(t.mu);
  if (!t.on) {
    wait_stream(cur, all_gather);
    return;
  }
  // Nothing runs on the compute stream between the two events but the wait itself. The timing
  // events are reused once read (a pair per wait in flight, not per wait).
  EventPair timed = t.take(cur);
  timed.first.record(cur);
  wait_stream(cur, all_gather);
  timed.second.record(cur);
  t.pending.push_back(std::move(timed));
  // Nobody may ever ask (all_gather_wait_seconds): fold the pairs the GPU has passed, without a
  // host wait, so the list does not grow step after step.
  if (t.pending.size() >= 256) {
    size_t kept = 0;
    for (auto& pair : t.pending) {
      if (pair.second.query()) {
        t.done_ms += pair.first.elapsedTime(pair.second);
        t.spare.push_back(std::move(pair));
      } else {
        if (&t.pending[kept] != &pair) t.pending[kept] = std::move(pair);
        ++kept;
      }
    }
    t.pending.erase(t.pending.begin() + static_cast<std::ptrdiff_t>(kept), t.pending.end());
  }
}

}  // namespace fsdp::detail

namespace fsdp {

void set_all_gather_wait_timing(bool on) {
  auto& t = detail::wait_timing();
  std::lock_guard<std::mutex> lock(t.mu);
  t.on = on;
}

double all_gather_wait_seconds() {
  auto& t = detail::wait_timing();
  std::lock_guard<std::mutex> lock(t.mu);
  double ms = std::exchange(t.done_ms, 0.0);
  for (auto& pair : t.pending) {
    pair.second.synchronize();
    ms += pair.first.elapsedTime(pair.second);
    t.spare.push_back(std::move(pair));
  }
  t.pending.clear();
  return ms / 1000.0;
}

}  // namespace fsdp

namespace fsdp::detail {

#else

DeviceStreams* DeviceStreams::get(c10::Device) { return nullptr; }
c10::Stream DeviceStreams::current() const { return copy_in; }
void DeviceStreams::wait_stream(const c10::Stream&, const c10::Stream&) {}
void DeviceStreams::wait_event(const c10::Stream&, const c10::Event&) {}
void DeviceStreams::synchronize(const c10::Stream&) {}
void DeviceStreams::current_waits_for_all_gather() const {}

}  // namespace fsdp::detail

namespace fsdp {
void set_all_gather_wait_timing(bool) {}
double all_gather_wait_seconds() { return 0; }
}  // namespace fsdp

namespace fsdp::detail {

#endif

}  // namespace fsdp::detail
