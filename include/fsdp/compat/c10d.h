#pragma once
// Every LibTorch version difference in c10d lives here, guarded by TORCH_VERSION_MAJOR/MINOR.
// Checked against Debian 12's LibTorch 1.13.1 and Debian sid's 2.14.1 (scripts/libtorch2-check.sh).
//
//  - 1.13: backends (ProcessGroupGloo, ...) derive from c10d::ProcessGroup and are used directly.
//  - 2.x : backends derive from c10d::Backend; ProcessGroup became a dispatcher. We hold the
//          backend directly (same collective method names and signatures).
//  - 2.x : TCPStoreOptions::useLibUV defaults to true and throws where LibTorch lacks libuv; the
//          C++ API does not read USE_LIBUV, so we set it from the variable (default off).
//  - 2.14: Backend gained the torchcomms names all_gather_single / all_to_all_single /
//          reduce_scatter_single; _allgather_base / alltoall_base / _reduce_scatter_base remain as
//          forwarding aliases (deprecated on ProcessGroup). Call through the helpers below.
//  - 2.x : TCPStoreOptions::masterListenFd lets the caller hand over the listening socket, so the
//          store can listen on one address (listen_only_on below). 1.13's server always listens on
//          every interface ([::] and 0.0.0.0); nothing in its options can change that.
//  - both: FileStore (c10d/FileStore.hpp), the network-free store of single-host jobs.
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef TORCH_VERSION_MAJOR
#error "torch/version.h did not define TORCH_VERSION_MAJOR"
#endif

#define FSDP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace fsdp::compat {

#if FSDP_TORCH_AT_LEAST(2, 0)
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

// TCPStore options with this LibTorch's defaults fixed up. Use it for every TCPStore (library,
// launcher and tests alike): a bare TCPStoreOptions{} throws on 2.x builds without libuv.
inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions opts;
#if FSDP_TORCH_AT_LEAST(2, 2)
  const char* uv = std::getenv("USE_LIBUV");
  opts.useLibUV = uv != nullptr && std::string(uv) == "1";
#endif
  return opts;
}

// True where a TCPStore server can listen on one address (listen_only_on below works).
template <typename O = c10d::TCPStoreOptions>
inline constexpr bool tcp_store_can_choose_address = requires(O o) { o.masterListenFd = 0; };

// A TCPStore server that listens on `addr` only, where this LibTorch allows it: binds a socket to
// addr:opts.port (port 0: a free one) and hands it to c10d through TCPStoreOptions::masterListenFd
// (2.x; c10d calls listen() and owns the socket from then on), setting opts.port to the bound port.
// Returns false, leaving `opts` untouched, where c10d has no such option (1.13: the server listens
// on every interface). Throws std::runtime_error naming the address and errno's text (e.g.
// "Address already in use") when the address cannot be bound.
// A template so that the requires-expression on a missing member is a substitution failure.
template <typename O = c10d::TCPStoreOptions>
inline bool listen_only_on(O& opts, const std::string& addr) {
  if constexpr (requires { opts.masterListenFd = 0; }) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* list = nullptr;
    const std::string port = std::to_string(opts.port);
    if (int rc = ::getaddrinfo(addr.c_str(), port.c_str(), &hints, &list); rc != 0) {
      throw std::runtime_error("cannot resolve '" + addr + "': " + ::gai_strerror(rc));
    }
    int err = 0;
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
    (void)addr;
    return false;
  }
}

// The store of a single-host job: a FileStore at `path`, which needs no network. numWorkers -1:
// no process deletes the file when it lets go of it (restarted workers reuse it); whoever made
// its folder removes it.
inline StorePtr file_store(const std::string& path, std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, -1);
  store->setTimeout(timeout);
  return store;
}

// The flat-tensor collectives under whichever name this LibTorch's Backend has. The new names
// arrived in a 2.x minor release we cannot pin from the headers we have (2.13 or 2.14), so their
// presence is tested directly (templates: a requires-expression on a missing member must be a
// substitution failure, not an error); the version guard keeps 1.13 on the old names.
template <typename B = Backend>
inline WorkPtr all_gather_single(B& backend, at::Tensor& out, at::Tensor& in,
                                 const c10d::AllgatherOptions& opts) {
#if FSDP_TORCH_AT_LEAST(2, 0)
  if constexpr (requires { backend.all_gather_single(out, in, opts); }) {
    return backend.all_gather_single(out, in, opts);
  } else {
    return backend._allgather_base(out, in, opts);
  }
#else
  return backend._allgather_base(out, in, opts);
#endif
}

template <typename B = Backend>
inline WorkPtr all_to_all_single(B& backend, at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                 std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& opts) {
#if FSDP_TORCH_AT_LEAST(2, 0)
  if constexpr (requires { backend.all_to_all_single(out, in, out_splits, in_splits, opts); }) {
    return backend.all_to_all_single(out, in, out_splits, in_splits, opts);
  } else {
    return backend.alltoall_base(out, in, out_splits, in_splits, opts);
  }
#else
  return backend.alltoall_base(out, in, out_splits, in_splits, opts);
#endif
}

template <typename B = Backend>
inline WorkPtr reduce_scatter_single(B& backend, at::Tensor& out, at::Tensor& in,
                                     const c10d::ReduceScatterOptions& opts) {
#if FSDP_TORCH_AT_LEAST(2, 0)
  if constexpr (requires { backend.reduce_scatter_single(out, in, opts); }) {
    return backend.reduce_scatter_single(out, in, opts);
  } else {
    return backend._reduce_scatter_base(out, in, opts);
  }
#else
  return backend._reduce_scatter_base(out, in, opts);
#endif
}

// What Gloo can do natively in this LibTorch. The Comm layer falls back for the rest. Each flag
// was checked by running the collective on both LibTorch versions (tests/comm covers the paths).
struct GlooCapabilities {
  // 1.13 throws "no support for _allgather_base"; 2.2+ has a native one (2.14: checked).
  static constexpr bool all_gather_base = FSDP_TORCH_AT_LEAST(2, 2);
  // Gloo's reduce-scatter (where present) is allreduce + slice: twice a ring's bytes. We always use
  // all_to_all + local sum instead, so this stays false on purpose.
  static constexpr bool reduce_scatter_base = false;
  // Upstream added BFloat16 (2.2, PR #113557) and always had Half, but which 16-bit floats a Gloo
  // build takes depends on the build, not the version: Debian 12's 1.13 takes Half but not
  // BFloat16, Debian sid's 2.14 takes neither ("Invalid scalar type", every collective), and on
  // 1.13 that error kills the process instead of failing the Work, so it cannot be probed. The
  // fallbacks move the same bytes (16-bit patterns as uint8, reductions in float32), so we only
  // go native where we checked it.
  static constexpr bool bfloat16 = false;
  static constexpr bool float16 = !FSDP_TORCH_AT_LEAST(2, 0);
  // 1.13 rejects ReduceOp::AVG (and the error kills the process); 2.x accepts it but runs SUM then
  // divides, which is what our fallback does: stays false.
  static constexpr bool avg = false;
};

}  // namespace fsdp::compat
