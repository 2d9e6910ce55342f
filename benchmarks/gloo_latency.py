"""Latency of gloo between two local processes, the transport of every multi-rank CPU simulation.

    python benchmarks/gloo_latency.py [--tries 60]

Two ranks on this machine, one thread each: the round trip of a 2 KiB tensor, a 2-rank
all-reduce of 4 floats, and a receive posted 1 ms after the sender's ``isend`` while the sender
sleeps, runs Python, or runs torch matmuls for 5 ms (a MiMo encoder sends its activation, then
computes its backward). Prints a markdown table: what ``docs/step-overhead.md`` quotes.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

SENDER_BUSY = 0.005
"""Seconds the sender keeps busy after its isend."""


def _busy(kind: str) -> None:
    start = time.perf_counter()
    if kind == "sleeps":
        time.sleep(SENDER_BUSY)
        return
    matrix = torch.randn(128, 128)
    while time.perf_counter() - start < SENDER_BUSY:
        if kind == "runs torch":
            matrix = matrix @ matrix.T * 1e-3
        else:
            sum(range(1000))


def _measure(tries: int) -> None:
    """One rank's part; rank 1 prints the table."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    payload, small = torch.zeros(512), torch.zeros(4)
    round_trips, reductions = [], []
    for _ in range(tries * 5):
        start = time.perf_counter()
        if rank == 0:
            dist.send(payload, 1)
            dist.recv(payload, 1)
        else:
            dist.recv(payload, 0)
            dist.send(payload, 0)
        round_trips.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(small)
        reductions.append(time.perf_counter() - start)
    rows = [("round trip, 2 KiB", round_trips), ("all-reduce, 2 ranks, 4 floats", reductions)]
    for kind in ("sleeps", "runs Python", "runs torch"):
        waits = []
        for _ in range(tries):
            dist.barrier()
            if rank == 0:
                request = dist.isend(payload, 1)
                _busy(kind)
                request.wait()
            else:
                start = time.perf_counter()
                while time.perf_counter() - start < 0.001:
                    pass
                start = time.perf_counter()
                dist.recv(payload, 0)
                waits.append(time.perf_counter() - start)
        rows.append((f"receive while the sender {kind}", waits))
    if rank == 1:
        print("| gloo, 2 local ranks | median (ms) | max (ms) | over 1 ms |")
        print("| --- | ---: | ---: | ---: |")
        for name, seconds in rows:
            print(f"| {name} | {statistics.median(seconds) * 1e3:.2f} | "
                  f"{max(seconds) * 1e3:.2f} | {sum(s > 1e-3 for s in seconds)}/{len(seconds)} |")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Launch the two ranks under torchrun (or be one of them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=60, help="receives per sender behaviour")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:
        torch.set_num_threads(1)
        _measure(args.tries)
        return 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return subprocess.call(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), __file__,
         "--tries", str(args.tries)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)


if __name__ == "__main__":
    sys.exit(main())
