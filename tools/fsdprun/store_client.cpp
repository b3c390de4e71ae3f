#include "store_client.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cerrno>

#include <future>
#include <thread>

#include "fsdp/compat/store.h"

namespace fsdprun {

struct StoreClient::Impl {
  fsdp::compat::StorePtr store;  // a TCPStore, or a FileStore for a single-node job
};

namespace {

std::string message_of(const std::exception& e) {
  if (auto* c10e = dynamic_cast<const c10::Error*>(&e)) return c10e->what_without_backtrace();
  return e.what();
}

c10d::TCPStoreOptions options(int port, bool server, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o = fsdp::compat::tcp_store_options();  // version differences (libuv) live there
  o.port = static_cast<std::uint16_t>(port);
  o.isServer = server;
  o.numWorkers.reset();  // workers come and go across restarts; nobody waits for a count
  o.waitWorkers = false;
  o.timeout = timeout;
  o.multiTenant = false;
  return o;
}

}  // namespace

StoreClient::StoreClient(std::shared_ptr<Impl> impl, int port, std::chrono::milliseconds op_timeout)
    : impl_(std::move(impl)), port_(port), op_timeout_(op_timeout) {}

StoreClient::~StoreClient() = default;  // a hung call's thread keeps its own reference

std::unique_ptr<StoreClient> StoreClient::host(const std::string& addr, int port,
                                               std::chrono::milliseconds op_timeout) {
  auto impl = std::make_shared<Impl>();
  int real_port = 0;
  bool bound = false;
  try {
    c10d::TCPStoreOptions opts = options(port, true, op_timeout);
    bound = fsdp::compat::listen_only_on(opts, addr);  // 2.x; 1.13 listens on every interface
    auto tcp = c10::make_intrusive<c10d::TCPStore>(addr, opts);
    real_port = tcp->getPort();
    impl->store = tcp;
  } catch (const std::exception& e) {
    throw std::runtime_error(message_of(e));
  }
  auto client = std::unique_ptr<StoreClient>(new StoreClient(std::move(impl), real_port, op_timeout));
  client->listens_everywhere_ = !bound;
  return client;
}

std::unique_ptr<StoreClient> StoreClient::file(const std::string& path, std::chrono::milliseconds op_timeout) {
  auto impl = std::make_shared<Impl>();
  try {
    impl->store = fsdp::compat::file_store(path, op_timeout);
  } catch (const std::exception& e) {
    throw std::runtime_error(message_of(e));
  }
  return std::unique_ptr<StoreClient>(new StoreClient(std::move(impl), 0, op_timeout));
}

std::unique_ptr<StoreClient> StoreClient::connect(const std::string& addr, int port,
                                                  std::chrono::milliseconds connect_timeout,
                                                  std::chrono::milliseconds op_timeout) {
  auto impl = std::make_shared<Impl>();
  try {
    impl->store = c10::make_intrusive<c10d::TCPStore>(addr, options(port, false, connect_timeout));
  } catch (const std::exception& e) {
    throw std::runtime_error(message_of(e));
  }
  return std::unique_ptr<StoreClient>(new StoreClient(std::move(impl), port, op_timeout));
}

bool StoreClient::reachable(const std::string& addr, int port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* list = nullptr;
  if (getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &list) != 0) return false;
  bool ok = false;
  for (addrinfo* ai = list; ai != nullptr && !ok; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      ok = true;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof(err);
      ok = ::poll(&p, 1, static_cast<int>(timeout.count())) == 1 &&
           getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
    close(fd);
  }
  freeaddrinfo(list);
  return ok;
}

template <class T, class F>
T StoreClient::call(const char* what, const std::string& key, F fn) {
  if (lost_) throw StoreLost("the store was lost earlier");
  auto promise = std::make_shared<std::promise<T>>();
  auto future = promise->get_future();
  // Detached on purpose: if the call never returns, the agent must still be able to go on (stop
  // its workers, exit). The thread holds its own reference to the store.
  std::thread([promise, impl = impl_, fn]() mutable {
    try {
      promise->set_value(fn(*impl->store));
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  }).detach();
  if (future.wait_for(op_timeout_) != std::future_status::ready) {
    hung_ = lost_ = true;
    throw StoreLost(std::string("store ") + what + "(" + key + ") got no answer within " +
                    std::to_string(op_timeout_.count() / 1000) + " s");
  }
  try {
    return future.get();
  } catch (const std::exception& e) {
    lost_ = true;
    throw StoreLost(std::string("store ") + what + "(" + key + ") failed: " + message_of(e));
  }
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  return call<int64_t>("add", key, [key, delta](c10d::Store& s) { return s.add(key, delta); });
}

bool StoreClient::check(const std::string& key) {
  return call<bool>("check", key, [key](c10d::Store& s) { return s.check({key}); });
}

void StoreClient::set(const std::string& key, const std::string& value) {
  call<int>("set", key, [key, value](c10d::Store& s) {
    s.set(key, std::vector<uint8_t>(value.begin(), value.end()));
    return 0;
  });
}

std::string StoreClient::get(const std::string& key) {
  return call<std::string>("get", key, [key](c10d::Store& s) {
    auto v = s.get(key);
    return std::string(v.begin(), v.end());
  });
}

}  // namespace fsdprun
