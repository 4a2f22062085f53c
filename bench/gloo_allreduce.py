"""PyTorch gloo all-reduce (average) on processes over loopback: the peer a user would pick for
CPU data-parallel training, timed as ddp-bench times burn-ddp's groups (a barrier before each
size, one calibration call, then as many calls as fit in the budget on the slowest rank, 5 to
200, median).

    python3 gloo_allreduce.py --sizes 4096,16384 --budget-ms 300 [--world-size 2]

Prints one JSON line: {"seconds": [median per size, the slowest rank's]}, or {"skipped": why}
when torch cannot be imported.
"""

import argparse
import json
import socket
import statistics
import sys
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world_size, port, sizes, budget, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
    )
    medians = []
    for size in sizes:
        buffer = torch.ones(size // 4, dtype=torch.float32)

        def one():
            started = time.perf_counter()
            dist.all_reduce(buffer)
            buffer.div_(world_size)
            return time.perf_counter() - started

        dist.barrier()
        first = max(one(), 1e-7)
        wanted = torch.tensor([min(200, max(5, int(budget / first)))])
        dist.all_reduce(wanted, op=dist.ReduceOp.MIN)
        medians.append(statistics.median(one() for _ in range(int(wanted.item()))))
    slowest = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put(slowest.tolist())
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--budget-ms", type=float, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
        import torch.multiprocessing as mp
    except Exception as e:  # noqa: BLE001 (any import failure means: no peer to measure)
        print(json.dumps({"skipped": f"python3 cannot import torch ({e})"}))
        return 0
    if not dist.is_available() or not dist.is_gloo_available():
        print(json.dumps({"skipped": "this torch has no gloo backend"}))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(
            target=rank_main,
            args=(r, args.world_size, port, sizes, args.budget_ms / 1e3, results),
        )
        for r in range(args.world_size)
    ]
    for p in ranks:
        p.start()
    try:
        # Bounded: a rank that dies (or a port taken between free_port and gloo's bind) must
        # not hold the benchmark for long.
        seconds = results.get(timeout=900)
    except Exception as e:  # noqa: BLE001 (queue.Empty or a broken queue: no result)
        for p in ranks:
            p.terminate()
        print(json.dumps({"skipped": f"gloo ranks gave no result within 900 s ({e!r})"}))
        return 0
    for p in ranks:
        p.join(timeout=60)
    print(json.dumps({"seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
