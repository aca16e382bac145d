"""A small program with threads and streams, for `streampool recommend -- python3 program.py`."""

import threading

import streampool


def work(seed: int) -> None:
    s = streampool.Stream()
    live = []
    for i in range(2000):
        live.append(streampool.DeviceBuffer(size=1024 * (1 + (seed * 7919 + i * 104729) % 2048), stream=s))
        if len(live) > 16:
            live.pop(0)
    s.synchronize()


threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("prog done")
