"""The program whose profile's first lines are short.log: threads, each on a stream of
its own, keeping 8 DeviceBuffers of 1 B to 1 MiB live (python3 program.py [THREADS])."""

import random
import sys
import threading

import streampool


def worker(i: int) -> None:
    s = streampool.Stream()
    rng = random.Random(i)
    live = []
    for _ in range(2000):
        live.append(streampool.DeviceBuffer(size=rng.randint(1, 1 << 20), stream=s))
        if len(live) > 8:
            live.pop(0)
    live.clear()
    s.synchronize()


n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("done", n)
