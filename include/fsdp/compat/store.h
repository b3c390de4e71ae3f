#pragma once
// LibTorch-version differences of the c10d stores, and the store of single-host jobs.
// Checked against Debian 12's LibTorch 1.13.1 and Debian sid's 2.14.1 (scripts/libtorch2-check.sh).
//
//  - 2.x : TCPStoreOptions::masterListenFd hands c10d an already bound socket, so a TCPStore server
//          can listen on one address (listen_only_on). c10d then calls listen() on it and owns it.
//  - 1.13: the TCPStore server always listens on every interface ([::] and 0.0.0.0); nothing in
//          its options can change that (tcp_store_can_choose_address<> is false).
//  - both: FileStore (c10d/FileStore.hpp): the store of single-host jobs, with no network at all.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#include "fsdp/compat/c10d.h"

namespace fsdp::compat {

// True where a TCPStore server can listen on one address (listen_only_on does something).
// Templates: a requires-expression on a missing member must be a substitution failure.
template <typename O = c10d::TCPStoreOptions>
inline constexpr bool tcp_store_can_choose_address = requires(O o) {
  o.masterListenFd = 0;
};

// Makes the TCPStore server of `opts` listen on `addr` only, where this LibTorch allows it: binds
// a socket to addr:opts.port (port 0: a free one), hands it over through opts.masterListenFd and
// sets opts.port to the bound port. Returns false, leaving `opts` untouched, where c10d has no
// such option (1.13). Throws std::runtime_error naming the address and errno's text (e.g.
// "Address already in use") when the address cannot be bound.
template <typename O = c10d::TCPStoreOptions>
inline bool listen_only_on(O& opts, const std::string& addr) {
  if constexpr (tcp_store_can_choose_address<O>) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* list = nullptr;
    const std::string port = std::to_string(opts.port);
    if (int rc = ::getaddrinfo(addr.c_str(), port.c_str(), &hints, &list); rc != 0) {
      throw std::runtime_error("cannot resolve '" + addr + "': " + ::gai_strerror(rc));
    }
    int err = EADDRNOTAVAIL;
    for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
      int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) {
        err = errno;
        continue;
      }
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as c10d does for its own
      sockaddr_storage bound{};
      socklen_t len = sizeof(bound);
      if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
          ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
        ::freeaddrinfo(list);
        opts.port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                      : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
        opts.masterListenFd = fd;
        return true;
      }
      err = errno;
      ::close(fd);
    }
    ::freeaddrinfo(list);
    throw std::runtime_error("cannot listen on " + addr + ":" + port + ": " + std::strerror(err));
  } else {
    (void)opts;
    (void)addr;
    return false;
  }
}

// The store of a single-host job: a FileStore at `path` (its folder must exist). numWorkers -1:
// no process deletes the file when it lets go of it (restarted workers reuse it); whoever made
// its folder removes it.
inline StorePtr file_store(const std::string& path, std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, -1);
  store->setTimeout(timeout);
  return store;
}

}  // namespace fsdp::compat
