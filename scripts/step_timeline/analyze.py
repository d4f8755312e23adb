"""Median timeline of a speculation step from the logs of sitecustomize.py: analyze.py DIR

For each gateway process (one per bench row), each step call (Propose, Verify) is matched with
the worker's answer to it and split into: send (gateway write -> worker read), pre (the servicer
before its engine call), hand-off in/out (to and from the engine's thread; zero for steps run on
the event loop), engine, post (the servicer after it: the response built, device results copied
to the host), return (worker write -> gateway read). ``gap before`` is the gateway's own time
between two calls (tree build, request building, the client stream).
"""

import bisect
import glob
import os
import statistics
import sys
from collections import defaultdict

SEGMENTS = ("send", "pre", "hand-off in", "engine", "hand-off out", "post", "return")


def read(path: str) -> list[list[str]]:
    with open(path) as f:
        return [line.split() for line in f]


def worker_steps(folder: str, command: str) -> list[tuple[int, int, int, int, int, int]]:
    """(step t0, step t1, host t0, host t1, engine t0, engine t1) of every step, sorted."""
    out = []
    # The bench's workers are random-target, random-draft and oracle-draft; serve's are target and draft.
    for path in glob.glob(os.path.join(folder, f"{command}-*.log")) + glob.glob(os.path.join(folder, f"*-{command}-*.log")):
        records = read(path)
        hosts = sorted((int(r[2]), int(r[3])) for r in records if r[0] == "host")
        engines = sorted((int(r[2]), int(r[3])) for r in records if r[0] == "engine")
        for r in records:
            if r[0] != "step":
                continue
            s0, s1 = int(r[1]), int(r[2])
            i = bisect.bisect_left(hosts, (s0, 0))
            j = bisect.bisect_left(engines, (hosts[i][0], 0)) if i < len(hosts) else len(engines)
            if i < len(hosts) and hosts[i][1] <= s1 and j < len(engines) and engines[j][1] <= hosts[i][1]:
                out.append((s0, s1, *hosts[i], *engines[j]))
    return sorted(out)


def main(folder: str) -> None:
    workers = {"Propose": worker_steps(folder, "draft"), "Verify": worker_steps(folder, "target")}
    for path in sorted(glob.glob(os.path.join(folder, "gateway-*.log"))):
        times: dict[str, list[int]] = defaultdict(list)
        last_end = None
        for r in read(path):
            if r[0] in ("tree", "push"):
                times[r[0]].append(int(r[2]) - int(r[1]))
            if r[0] != "rpc":
                continue
            name, t0, t1 = r[1], int(r[2]), int(r[3])
            if last_end is not None:
                times[f"gap before {name}"].append(t0 - last_end)
            last_end = t1
            times[f"{name} round trip"].append(t1 - t0)
            steps = workers[name]
            i = bisect.bisect_left(steps, (t0,))
            if i < len(steps) and steps[i][1] <= t1:
                s0, s1, h0, h1, e0, e1 = steps[i]
                for segment, ns in zip(SEGMENTS, (s0 - t0, h0 - s0, e0 - h0, e1 - e0, h1 - e1, s1 - h1, t1 - s1)):
                    times[f"{name} {segment}"].append(ns)
        if not times:
            continue
        print(f"{os.path.basename(path)}: {len(times.get('Verify round trip', []))} verify steps; medians (means) in us")
        for key in sorted(times, key=lambda k: (k.split()[0], k)):
            values = times[key]
            print(f"  {key:24s} {statistics.median(values) / 1e3:9.1f} ({statistics.fmean(values) / 1e3:9.1f})  n={len(values)}")


if __name__ == "__main__":
    main(sys.argv[1])
