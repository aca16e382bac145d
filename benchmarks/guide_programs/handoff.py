"""A guide program: 4 producer threads fill 1 MiB chunks on their own streams and hand them
to 4 consumer threads, which check them and free them on theirs (the producer/consumer
pipeline: every chunk's memory moves from a consumer's stream back to a producer's)."""

import queue
import threading

import streampool
from streampool import kernels

PAIRS = 4
CHUNKS = 1_000
SIZE = 1 << 20
mr = streampool.get_current_device_resource()
bad = []


def producer(i: int, handoff: "queue.Queue[tuple[int, int] | None]") -> None:
    stream = streampool.Stream()
    for n in range(CHUNKS):
        ptr = mr.allocate(SIZE, stream)
        kernels.fill(ptr, SIZE, i * CHUNKS + n, stream)
        stream.synchronize()  # the consumer's stream may use the chunk once this is done
        handoff.put((ptr, i * CHUNKS + n))
    handoff.put(None)


def consumer(handoff: "queue.Queue[tuple[int, int] | None]") -> None:
    stream = streampool.Stream()
    while (item := handoff.get()) is not None:
        ptr, seed = item
        if kernels.check(ptr, SIZE, seed, stream):  # synchronises the consumer's stream
            bad.append(seed)
        mr.deallocate(ptr, SIZE, stream)  # freed on the consumer's stream


queues: "list[queue.Queue[tuple[int, int] | None]]" = [queue.Queue(maxsize=4) for _ in range(PAIRS)]
threads = [threading.Thread(target=producer, args=(i, q)) for i, q in enumerate(queues)]
threads += [threading.Thread(target=consumer, args=(q,)) for q in queues]
for t in threads:
    t.start()
for t in threads:
    t.join()
if bad:
    raise SystemExit(f"handoff: {len(bad)} chunks read back wrong")
print("handoff: done")
