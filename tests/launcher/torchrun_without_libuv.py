#!/usr/bin/env python3
"""torchrun itself (torch.distributed.run.main, unchanged) for a PyTorch built without libuv.

Debian's python3-torch 2.x is built without libuv, yet torchrun's agent creates its TCPStore with
the Python binding's default use_libuv=True, which such a build refuses ("use_libuv was requested
but PyTorch was built without libuv support") whatever USE_LIBUV says: Debian's plain `torchrun`
dies before any worker starts. This starts the same torchrun with one change: TCPStore's use_libuv
defaults to what USE_LIBUV says (unset: off). Arguments are torchrun's:

  python3 torchrun_without_libuv.py --no_python --nproc_per_node 2 build/bin/train_gpt ...
  python3 torchrun_without_libuv.py --check   # prints torch's version; exit 0 if plain torchrun
                                              # works here, 3 if it needs this, 4 if torch is 1.x
"""
import os
import sys

import torch
import torch.distributed as dist

_TCPStore = dist.TCPStore


def plain_torchrun_works():
    try:
        _TCPStore("127.0.0.1", 0, 1, True)
        return True
    except RuntimeError as e:  # DistStoreError
        if "libuv" not in str(e):
            raise
        return False


class TCPStore(_TCPStore):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("use_libuv", os.environ.get("USE_LIBUV", "0") == "1")
        super().__init__(*args, **kwargs)


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        print(torch.__version__)
        if int(torch.__version__.split(".")[0]) < 2:
            sys.exit(4)
        sys.exit(0 if plain_torchrun_works() else 3)
    dist.TCPStore = TCPStore  # before torchrun's rendezvous modules import it
    for name in ("torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
                 "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"):
        if name in sys.modules:
            sys.modules[name].TCPStore = TCPStore
    from torch.distributed.run import main

    sys.argv[0] = "torchrun"
    main()
