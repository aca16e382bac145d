import sys, threading, random
import streampool

def worker(i):
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
ts = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
[t.start() for t in ts]; [t.join() for t in ts]
print("done", n)
