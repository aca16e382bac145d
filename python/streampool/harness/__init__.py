"""The harness: measure resources on your workload and be told which to use.

From the command line (``streampool bench|stress|profile|replay|recommend|plot``, see
``docs/harness.md``) or from Python::

    from streampool.harness import bench, make_resource, trace, workloads

    runs, summary = bench.measure("window", ["async", "pool(async)"], threads=[1, 4])
    candidate = make_resource("pool(async)")          # a resource from a spec string
    result = workloads.run("pipeline", candidate, threads=4)
    t = trace.read_log("app.log")                      # streampool's or RMM's CSV log
    print(trace.replay(candidate.resource, t, gap_scale=0.0))

The optional extra ``streampool[harness]`` adds rich tables and matplotlib plots; without
it the output is plain text.
"""

from __future__ import annotations

from . import bench, recommend, trace, workloads
from .specs import (
    Candidate,
    PeerMissingError,
    SpecError,
    check_spec,
    make_resource,
    resource_from_spec,
    split_specs,
)

__all__ = [
    "Candidate",
    "PeerMissingError",
    "SpecError",
    "bench",
    "check_spec",
    "make_resource",
    "recommend",
    "resource_from_spec",
    "split_specs",
    "trace",
    "workloads",
]
