"""A guide program: 16 threads, each on its own stream, allocating small buffers in a ring
(the pattern of a multi-threaded server or data loader)."""

import threading

import streampool

THREADS = 16
streams = [streampool.Stream() for _ in range(THREADS)]


def work(i: int) -> None:
    live = []
    for n in range(4_000):
        live.append(streampool.DeviceBuffer(size=(1 + (n * (i + 7)) % 31) * 2048, stream=streams[i]))
        if len(live) > 16:
            live.pop(0)
    live.clear()
    streams[i].synchronize()


threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("many_streams: done")
