#!/usr/bin/env python3
"""The CPU a byte costs on this host's loopback, without Gloo: two processes exchange MB megabytes
each way, REPS times (what a 2-rank all-gather or reduce-scatter does), over TCP on 127.0.0.1
(Gloo's only transport between processes on one host) and, for comparison, a Unix socket pair.
Prints each process's CPU (user + system, all threads) per MB exchanged.

    python3 scripts/loopback_cost.py [MB] [REPS]        # default 20 MB x 20

Standard library only. bench's "transport floor" line measures the same through Gloo itself
(FSDP's own collectives replayed); this script says how much of that is the kernel's.
"""
import os
import resource
import socket
import sys
import threading
import time


def exchange(sock, nbytes, reps):
    send = memoryview(bytearray(nbytes))
    recv = memoryview(bytearray(nbytes))
    for _ in range(reps):
        def receive():
            got = 0
            while got < nbytes:
                got += sock.recv_into(recv[got:])
        t = threading.Thread(target=receive)
        t.start()
        sock.sendall(send)
        t.join()


def measure(kind, mb, reps):
    nbytes = mb << 20
    if kind == "unix":
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
    pid = os.fork()
    if pid == 0:
        if kind == "unix":
            sock = child_sock
        else:
            sock = socket.create_connection(listener.getsockname())
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as Gloo sets it
        exchange(sock, nbytes, reps)
        os._exit(0)
    if kind == "unix":
        sock = parent_sock
    else:
        sock = listener.accept()[0]
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    before = resource.getrusage(resource.RUSAGE_SELF)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    exchange(sock, nbytes, reps)
    os.waitpid(pid, 0)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    theirs = (child.ru_utime - children_before.ru_utime) + (child.ru_stime - children_before.ru_stime)
    total = mb * reps
    return 1e3 * mine / total, 1e3 * theirs / total, 1e3 * wall / total


def main():
    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    print(f"loopback_cost: {mb} MB each way x {reps}, {os.cpu_count()} CPUs")
    print("| transport | CPU per MB exchanged, process 1 | process 2 | wall per MB |")
    print("|---|---|---|---|")
    for kind in ("tcp", "unix"):
        a, b, w = measure(kind, mb, reps)
        print(f"| {kind} | {a:.3f} ms | {b:.3f} ms | {w:.3f} ms |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
