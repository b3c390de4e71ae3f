#include "streams.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <array>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "fsdp/debug/gpu_stats.h"

namespace fsdp::detail {

// See [Note: FSDP streams] in the header. Only CUDA builds of LibTorch (FSDP_HAS_CUDA) make
// streams; a CPU build compiles none of it, and CPU devices never get here.
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

void DeviceStreams::wait_stream(const c10::Stream& waiter, const c10::Stream& producer) {
  if (waiter == producer) return;
  c10::Event event(producer.device_type());
  event.record(producer);
  event.block(waiter);
}

void DeviceStreams::wait_event(const c10::Stream& waiter, const c10::Event& event) { event.block(waiter); }

void DeviceStreams::synchronize(const c10::Stream& stream) { stream.synchronize(); }

namespace {
struct WaitTiming {
  std::mutex mu;
  bool on = false;
  std::vector<std::pair<c10::Event, c10::Event>> pending;  // (before the wait, after it) on the compute stream
};
WaitTiming& wait_timing() {
  static WaitTiming t;
  return t;
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
  // Nothing runs on the compute stream between the two events but the wait itself.
  c10::Event before(cur.device_type(), c10::EventFlag::BACKEND_DEFAULT);
  c10::Event after(cur.device_type(), c10::EventFlag::BACKEND_DEFAULT);
  before.record(cur);
  wait_stream(cur, all_gather);
  after.record(cur);
  t.pending.emplace_back(std::move(before), std::move(after));
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
  double ms = 0;
  for (auto& [before, after] : t.pending) {
    after.synchronize();
    ms += before.elapsedTime(after);
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
