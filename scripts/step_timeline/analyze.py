"""Median timeline of a speculation step from the logs of sitecustomize.py: analyze.py DIR [--passes | --gpu]

For each gateway process (one per bench row), each step call (Propose, Verify) is matched with
the worker's answer to it and split into: send (gateway write -> worker read), pre (the servicer
before its engine call), hand-off in/out (to and from the engine's thread; zero for steps run on
the event loop), engine, post (the servicer after it: the response built, device results copied
to the host), return (worker write -> gateway read). ``gap before`` is the gateway's own time
between two calls (tree build, request building, the client stream).

``--passes`` is for many users, whose steps interleave: it takes each batched verify pass of the
target (of at least half the largest pass's sequences) and times, from the end of that pass
(the engine's batched call returned), its steps' answers (the servicer's call into the engine returned), the
gateways' reads of them, the gateways' next requests and the target's reads of those, and the
start of the next pass: where the GPU waits between two passes.

``--gpu`` is for speculation on one GPU: the target's and the draft's passes side by side, how
much of the time each, both and neither ran one, the draft's eager appends of feature rows and
the parts of its passes, the event loops' stalls, and a stretch of passes in order.

``--draft COMMAND`` (e.g. shaped-oracle-draft, one bench row's draft worker) keeps that draft
worker's logs only and every other record inside the span of its steps: that row alone.
"""

import bisect
import glob
import os
import statistics
import sys
from collections import defaultdict

SEGMENTS = ("send", "pre", "hand-off in", "engine", "hand-off out", "post", "return")


WINDOW: tuple[int, int] | None = None  # (t0, t1): records outside it are dropped (--draft)
DRAFT = "draft"  # the draft worker's command (--draft): its logs are DRAFT-PID.log


def read(path: str) -> list[list[str]]:
    """Its records, each [kind, ..., t0, t1] (times in ns), those inside WINDOW."""
    with open(path) as f:
        records = [line.split() for line in f]
    if WINDOW is None:
        return records
    return [r for r in records if WINDOW[0] <= int(r[-2]) and int(r[-1]) <= WINDOW[1]]


def worker_logs(folder: str, worker: str) -> list[str]:
    """Log files of ``worker`` ("target" or "draft"): the bench's random-target, random-draft,
    oracle-draft and shaped-oracle-draft as well as serve's target and draft; with --draft, that
    draft's only."""
    if worker == "draft" and DRAFT != "draft":
        return glob.glob(os.path.join(folder, f"{DRAFT}-*.log"))
    return glob.glob(os.path.join(folder, f"*{worker}-*.log"))


def worker_steps(folder: str, command: str) -> list[tuple[int, int, int, int, int, int]]:
    """(step t0, step t1, host t0, host t1, engine t0, engine t1) of every step, sorted."""
    out = []
    for path in worker_logs(folder, command):
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


def worker_records(folder: str, worker: str) -> list[list[str]]:
    """Every record of ``worker``'s processes ("target" or "draft")."""
    return [r for path in worker_logs(folder, worker) for r in read(path)]


def of_kind(records: list[list[str]], kind: str) -> list[tuple[int, int]]:
    """(t0, t1) of the records of ``kind`` ("engine", "host", "prefill"), sorted."""
    return sorted((int(r[2]), int(r[3])) for r in records if r[0] == kind)


def _pass_of(ends: list[int], starts: list[int], t0: int, t1: int) -> int | None:
    """The pass that ran inside [t0, t1] and ended last, or None."""
    k = bisect.bisect_right(ends, t1) - 1
    return k if k >= 0 and starts[k] >= t0 else None


def passes(folder: str) -> None:
    records = worker_records(folder, "target")
    engine = of_kind(records, "engine")
    starts, ends = [e[0] for e in engine], [e[1] for e in engine]
    prefills = of_kind(records, "prefill")
    steps = of_kind(records, "host")  # the servicer's call into its engine
    rpcs = [(int(r[2]), int(r[3])) for path in glob.glob(os.path.join(folder, "gateway*.log")) for r in read(path)
            if r[0] == "rpc" and r[1] == "Verify"]
    by_pass: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for kind, spans in (("target", steps), ("gateway", rpcs)):
        for t0, t1 in spans:
            k = _pass_of(ends, starts, t0, t1)
            if k is None:
                continue
            by_pass[k][f"{kind} answered"].append(t1 - ends[k])  # after the pass that ran it
            if k > 0:
                by_pass[k - 1][f"{kind} next asked"].append(t0 - ends[k - 1])  # after the pass before
    size = max((len(v["target answered"]) for v in by_pass.values()), default=0)
    rows: dict[str, list[float]] = defaultdict(list)
    for k, v in by_pass.items():
        if len(v["target answered"]) < size / 2 or k + 1 >= len(engine):
            continue
        if bisect.bisect_left(prefills, (starts[k + 1],)) > bisect.bisect_left(prefills, (ends[k],)):
            continue  # a prefill ran between the two passes
        rows["pass (engine call)"].append(ends[k] - starts[k])
        rows["next pass starts"].append(starts[k + 1] - ends[k])
        for key in ("target answered", "gateway answered", "gateway next asked", "target next asked"):
            if v[key]:
                for q, value in (("first", min(v[key])), ("median", statistics.median(v[key])), ("last", max(v[key]))):
                    rows[f"{key}, {q}"].append(value)
    span = (starts[0], ends[-1]) if engine else (0, 0)
    busy = sum(e1 - e0 for e0, e1 in engine), sum(p1 - p0 for p0, p1 in prefills if span[0] <= p0 <= span[1])
    print(f"engine thread from the first pass to the last: {(span[1] - span[0]) / 1e9:.2f} s, {100 * busy[0] / max(1, span[1] - span[0]):.0f}% "
          f"in {len(engine)} verify passes, {100 * busy[1] / max(1, span[1] - span[0]):.0f}% in {len(prefills)} prefills "
          f"(median {statistics.median([p1 - p0 for p0, p1 in prefills] or [0]) / 1e6:.2f} ms)")
    between = defaultdict(int)  # verify passes by the number of prefills run between them and the next
    for k in range(len(engine) - 1):
        between[bisect.bisect_left(prefills, (starts[k + 1],)) - bisect.bisect_left(prefills, (ends[k],))] += 1
    print(f"  gaps between passes by prefills inside: {dict(sorted(between.items()))}")
    print(f"{len(rows['pass (engine call)'])} passes of {size // 2}-{size} steps with no prefill before the next; "
          "per pass, us after the pass's end (median over passes)")
    for key, values in rows.items():
        print(f"  {key:32s} {statistics.median(values) / 1e3:9.1f}")


def _engine_passes(folder: str, worker: str) -> list[tuple[int, int, int]]:
    """(start, end, steps) of every batched engine call of ``worker``'s processes ("target" or
    "draft"), sorted; steps: the servicer calls into the engine that it answered."""
    records = worker_records(folder, worker)
    engine = of_kind(records, "engine")
    starts, ends = [e[0] for e in engine], [e[1] for e in engine]
    steps: dict[int, int] = defaultdict(int)
    for t0, t1 in of_kind(records, "host"):
        k = _pass_of(ends, starts, t0, t1)
        if k is not None:
            steps[k] += 1
    return [(s, e, steps[k]) for k, (s, e) in enumerate(engine)]


def _covered(spans: list[tuple[int, int]]) -> int:
    """ns inside the union of ``spans`` (sorted by start)."""
    total, reach = 0, None
    for s, e in spans:
        if reach is None or s > reach:
            total += e - s
            reach = e
        elif e > reach:
            total += e - reach
            reach = e
    return total


def gpu(folder: str, shown: int = 40) -> None:
    """The two workers' passes on one GPU: how many, how long, how many steps each, how much of
    the time each, both and neither ran one; then ``shown`` consecutive passes from the middle."""
    by_worker = {w: _engine_passes(folder, w) for w in ("target", "draft")}
    every = sorted((s, e, n, w) for w, ps in by_worker.items() for s, e, n in ps)
    if not every:
        print("no engine records")
        return
    span = every[-1][1] - every[0][0]
    for w, ps in by_worker.items():
        if ps:
            durations = [e - s for s, e, _ in ps]
            print(f"{w}: {len(ps)} passes, median {statistics.median(durations) / 1e6:.2f} ms, "
                  f"{statistics.fmean(n for *_, n in ps):.1f} steps a pass, busy {100 * _covered([(s, e) for s, e, _ in ps]) / span:.0f}%")
    union = _covered([(s, e) for s, e, *_ in every])
    both = sum(_covered([(s, e) for s, e, _ in ps]) for ps in by_worker.values()) - union
    print(f"over {span / 1e9:.2f} s: a pass running {100 * union / span:.0f}%, both workers' {100 * both / span:.0f}%, "
          f"neither's {100 * (span - union) / span:.0f}%")
    appends = [(int(r[1]), int(r[3]) - int(r[2])) for r in worker_records(folder, "draft") if r[0] == "context"]
    if appends:
        print(f"draft's eager appends: {len(appends)}, {statistics.median(n for n, _ in appends):.0f} rows and "
              f"{statistics.median(ns for _, ns in appends) / 1e6:.2f} ms median, {sum(ns for _, ns in appends) / 1e6:.0f} ms in all")
    parts = defaultdict(list)
    for r in worker_records(folder, "draft"):
        if r[0] == "part":
            parts[r[1]].append(int(r[3]) - int(r[2]))
    for what, lengths in sorted(parts.items()):
        print(f"draft's {what}: {len(lengths)}, median {statistics.median(lengths) / 1e6:.2f} ms, mean {statistics.fmean(lengths) / 1e6:.2f}")
    stalls = defaultdict(list)  # process kind -> stall lengths
    for path in glob.glob(os.path.join(folder, "*.log")):
        kind = os.path.basename(path).rsplit("-", 1)[0]
        stalls[kind] += [int(r[3]) - int(r[2]) for r in read(path) if r[0] == "lag"]
    for kind, lengths in sorted(stalls.items()):
        if lengths:
            print(f"{kind} event loops: {len(lengths)} stalls over 4 ms, median {statistics.median(lengths) / 1e6:.1f} ms, "
                  f"longest {max(lengths) / 1e6:.1f}, {100 * sum(lengths) / span:.0f}% of the time")
    middle = max(0, len(every) // 2 - shown // 2)
    t_zero = every[middle][0]
    print(f"{shown} passes from the middle (ms from the first shown): worker, start, length, steps")
    for s, e, n, w in every[middle:middle + shown]:
        print(f"  {w:6s} {(s - t_zero) / 1e6:8.2f} {(e - s) / 1e6:6.2f} {n:3d}")


def window_of(folder: str) -> tuple[int, int]:
    """From the first to the last step record of the (--draft) draft's logs."""
    steps = [r for r in worker_records(folder, "draft") if r[0] == "step"]
    if not steps:
        sys.exit(f"no step records in {folder}/{DRAFT}-*.log")
    return min(int(r[1]) for r in steps), max(int(r[2]) for r in steps)


if __name__ == "__main__":
    if "--draft" in sys.argv:
        DRAFT = sys.argv[sys.argv.index("--draft") + 1]
        WINDOW = window_of(sys.argv[1])
    if "--passes" in sys.argv[2:]:
        passes(sys.argv[1])
    elif "--gpu" in sys.argv[2:]:
        gpu(sys.argv[1])
    else:
        main(sys.argv[1])
