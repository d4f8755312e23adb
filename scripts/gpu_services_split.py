"""Where a many-user AR step's time goes through the three services (issue #18).

Random weights of ``--shape`` (benchmark-only) in a random target worker and an OracleDrafter
(the gateways need a draft; AR steps never ask it). For each configuration ``N:G:K`` of
``--configs`` (N clients, G gateway processes, the clients in K client processes), N clients
generate at once, AR, after a warm-up of 2N requests, and the run reports:

- aggregate tok/s and decode ms per step per sequence, as ``splitspec bench`` measures them;
- CPU microseconds per sequence step of the target worker, of each gateway and of the clients
  (``/proc``): one Python event loop per process, so a process whose share of the steps costs
  more CPU than a step's wall time is what holds the step;
- from the target's own metrics (scraped before and after): verify passes, sequences per pass,
  the mean device time of a pass, and a step's mean wait for its pass to start.

Usage: python scripts/gpu_services_split.py [--shape qwen3-8b] [--configs 1:1:1,32:2:1,32:8:4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitspec.bench.random_weights import random_draft_config, random_target_config
from splitspec.bench.system import Cluster, Spec, random_prompts, requests_for, run_batch, synthetic_tokenizer
from splitspec.transport import busypoll


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """The target's verify-phase sums and counts: pass sequences, forward seconds, queue seconds."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("phase") == "verify" and s.name.endswith(("_sum", "_count")):
                out[s.name] = s.value
    return out


def client_part(args: tuple) -> tuple[int, int, float, float, float]:
    """One client process: its requests at its share of the concurrency. Returns (tokens, steps,
    decode seconds, wall seconds, CPU seconds)."""
    addresses, prompts, concurrency, max_tokens = args
    reqs = requests_for(prompts, Spec(mode=Spec.OFF), max_tokens)
    cpu0 = time.process_time()
    row, _ = run_batch(addresses, reqs, concurrency, "ar", 0)
    return row.completion_tokens, row.steps, row.decode_seconds, row.seconds, time.process_time() - cpu0


def run_config(pool, addresses, prompts, n: int, k: int, max_tokens: int):
    """The requests ``prompts`` by ``n`` clients in ``k`` processes (``pool``), gateways round-robin."""
    parts = [(addresses, prompts[i::k], n // k, max_tokens) for i in range(k)]
    t0 = time.perf_counter()
    results = pool.map(client_part, parts) if k > 1 else [client_part(parts[0])]
    wall = time.perf_counter() - t0
    tokens, steps, decode, _, cpu = (sum(r[i] for r in results) for i in range(5))
    return tokens / wall, 1e3 * decode / max(1, steps), steps, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default="1:1:1,32:2:1,32:2:4,32:4:4,32:8:4,16:2:1,16:4:4",
                    help="comma-separated N:G:K (clients, gateway processes, client processes)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="timed requests per client")
    ap.add_argument("--busy-poll", default="auto")
    ap.add_argument("--log-dir", default="")
    args = ap.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    top = max(n for n, _, _ in configs)
    spin = busypoll.spin_us_for(args.busy_poll, args.device.startswith("cuda"), busypoll.usable_cpus())
    work = Path(tempfile.mkdtemp(prefix="services-split-"))
    log_dir = Path(args.log_dir or work)
    log_dir.mkdir(parents=True, exist_ok=True)
    model = f"random:{args.shape}"
    config = random_target_config(model)
    taps = ",".join(str(t) for t in random_draft_config(f"{model}-dflash").target_layer_ids)
    tokenizer = synthetic_tokenizer(config.vocab_size, work / "tokenizer.json")
    (work / "oracle.jsonl").write_text("")
    pool_prompts = random_prompts(config.vocab_size, args.prompt_len)
    metrics_port = free_port()
    print(f"# {args.shape} {args.dtype} on {args.device}, busy polling {spin} µs, {args.max_tokens} tokens a request, "
          f"{args.prompt_len}-token prompts", flush=True)
    ctx = multiprocessing.get_context("spawn")
    with Cluster(log_dir, spin) as workers, ctx.Pool(max(k for _, _, k in configs)) as pool:
        kv = top * (args.prompt_len + args.max_tokens + 64)
        target = workers.start(
            "target", "random-target", "--model", model, "--device", args.device, "--dtype", args.dtype,
            "--max-kv-tokens", str(kv), "--max-sequences", str(top), "--max-tree-nodes", "1", "--draft-taps", taps,
            "--metrics-port", str(metrics_port),
        )
        draft = workers.start("draft", "oracle-draft", "--target-model", model, "--table", str(work / "oracle.jsonl"), "--corruption", "0.15")
        print("| clients | gateways | client procs | tok/s | ms/step | passes | seqs/pass | pass ms (device) | queue ms "
              "| target µs/step | gateway µs/step (each) | clients µs/step |", flush=True)
        print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        results = []
        for n, g, k in configs:
            with Cluster(log_dir, spin) as gws:
                addresses = [
                    gws.start(f"gateway-{n}-{g}-{i}", "gateway", "--target", target, "--draft", draft, "--tokenizer", str(tokenizer))
                    for i in range(g)
                ]
                warm = list(itertools.islice(pool_prompts, 2 * n))
                run_config(pool, addresses, warm, n, k, args.max_tokens)
                timed = list(itertools.islice(pool_prompts, args.rounds * n))
                before = {p.pid: cpu_seconds(p.pid) for p in [*workers.procs, *gws.procs]}
                m0 = scrape(metrics_port)
                tok_s, ms_step, steps, client_cpu = run_config(pool, addresses, timed, n, k, args.max_tokens)
                m1 = scrape(metrics_port)
                used = {pid: cpu_seconds(pid) - t for pid, t in before.items()}
            d = {key: m1[key] - m0.get(key, 0.0) for key in m1}
            passes = d.get("splitspec_worker_pass_sequences_count", 0)
            row = {
                "clients": n, "gateways": g, "client_processes": k, "tok_s": tok_s, "ms_step": ms_step, "steps": steps,
                "passes": passes,
                "seqs_per_pass": d.get("splitspec_worker_pass_sequences_sum", 0) / max(1, passes),
                "pass_ms": 1e3 * d.get("splitspec_worker_forward_duration_seconds_sum", 0) / max(1, d.get("splitspec_worker_forward_duration_seconds_count", 0)),
                "queue_ms": 1e3 * d.get("splitspec_worker_queue_seconds_sum", 0) / max(1, d.get("splitspec_worker_queue_seconds_count", 0)),
                "target_us": 1e6 * used[workers.procs[0].pid] / steps,
                "gateway_us": [1e6 * used[p.pid] / (steps / g) for p in gws.procs],
                "clients_us": 1e6 * client_cpu / steps,
            }
            results.append(row)
            print(f"| {n} | {g} | {k} | {tok_s:,.1f} | {ms_step:.2f} | {passes:.0f} | {row['seqs_per_pass']:.1f} | {row['pass_ms']:.2f} "
                  f"| {row['queue_ms']:.2f} | {row['target_us']:.0f} | {', '.join(f'{x:.0f}' for x in row['gateway_us'])} "
                  f"| {row['clients_us']:.0f} |", flush=True)
    print("(gateway µs/step: a gateway's CPU over the steps of its clients; the others' over all steps)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
