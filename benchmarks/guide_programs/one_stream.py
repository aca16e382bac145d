"""A guide program: one thread on one stream, allocations of mixed sizes between steps
(the pattern of a single-GPU training or inference loop)."""

import streampool

stream = streampool.Stream()
live = []
for step in range(20_000):
    live.append(streampool.DeviceBuffer(size=(1 + step % 13) * 256 << 10, stream=stream))
    if len(live) > 24:
        live.pop(0)
live.clear()
stream.synchronize()
print("one_stream: done")
