"""Where a many-user step's time goes through the three services (issue #18).

Random weights of ``--shape`` (benchmark-only) in a random target worker. With ``--budget 0`` the
steps are AR and the draft is an OracleDrafter (the gateways need one; AR steps never ask it);
with ``--budget N`` they are DDTree rounds of N nodes proposed by a DFlash draft of the real shape
with random weights (benchmark-only: it proposes noise, so a round commits about one token, and
its time is that of a round of the real shape). For each configuration ``N:G:K`` of ``--configs``
(N clients, G gateway processes, the clients in K client processes), N clients generate at once
after a warm-up of 2N requests, and the run reports:

- aggregate tok/s and decode ms per step per sequence, as ``splitspec bench`` measures them;
- CPU microseconds per sequence step of the workers, of each gateway and of the clients
  (``/proc``): one Python event loop per process, so a process whose share of the steps costs
  more CPU than a step's wall time is what holds the step;
- from the workers' own metrics (scraped before and after): verify (and propose) passes,
  sequences and rows per pass, the mean device time of a pass, and a step's mean wait for its
  pass to start; from the gateways' metrics, the mean round trip of each worker call.

Usage: python scripts/gpu_services_split.py [--shape qwen3-8b] [--configs 1:1:1,32:2:1,32:8:4] [--budget 22]
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


def scrape(ports: list[int]) -> dict[tuple[str, str], float]:
    """Histogram sums and counts by (name, phase or rpc), and cumulative bucket counts by (name, upper
    bound), of the processes serving metrics at ``ports``, added up."""
    out: dict[tuple[str, str], float] = {}
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith(("_sum", "_count", "_bucket")):
                    label = s.labels["le"] if s.name.endswith("_bucket") else s.labels.get("phase") or s.labels.get("rpc", "")
                    key = (s.name, label)
                    out[key] = out.get(key, 0.0) + s.value
    return out


def per_pass(d: dict, name: str, label: str) -> float:
    """The mean observation of histogram ``name`` under ``label`` (a phase or an rpc) in ``d``."""
    return d.get((f"{name}_sum", label), 0.0) / max(1.0, d.get((f"{name}_count", label), 0.0))


def mean_ms(d: dict, name: str, label: str) -> float:
    return 1e3 * per_pass(d, name, label)


def client_part(args: tuple) -> tuple[int, int, float, float, float]:
    """One client process: its requests at its share of the concurrency. Returns (tokens, steps,
    decode seconds, wall seconds, CPU seconds)."""
    addresses, prompts, concurrency, max_tokens, budget = args
    spec = Spec(mode=Spec.DDTREE, budget=budget) if budget else Spec(mode=Spec.OFF)
    reqs = requests_for(prompts, spec, max_tokens)
    cpu0 = time.process_time()
    row, _ = run_batch(addresses, reqs, concurrency, "ar", 0)
    return row.completion_tokens, row.steps, row.decode_seconds, row.seconds, time.process_time() - cpu0


def run_config(pool, addresses, prompts, n: int, k: int, max_tokens: int, budget: int):
    """The requests ``prompts`` by ``n`` clients in ``k`` processes (``pool``), gateways round-robin."""
    parts = [(addresses, prompts[i::k], n // k, max_tokens, budget) for i in range(k)]
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
    ap.add_argument("--budget", type=int, default=0, help="DDTree rounds of this many nodes with a random DFlash draft (0: AR)")
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
    ports = {"target": free_port(), "draft": free_port()}
    nodes = max(1, args.budget)
    print(f"# {args.shape} {args.dtype} on {args.device}, busy polling {spin} µs, {args.max_tokens} tokens a request, "
          f"{args.prompt_len}-token prompts, " + (f"DDTree budget {args.budget}, random DFlash draft" if args.budget else "AR"), flush=True)
    ctx = multiprocessing.get_context("spawn")
    with Cluster(log_dir, spin) as workers, ctx.Pool(max(k for _, _, k in configs)) as pool:
        context = args.prompt_len + args.max_tokens + 2 * nodes + 64
        target = workers.start(
            "target", "random-target", "--model", model, "--device", args.device, "--dtype", args.dtype,
            "--max-kv-tokens", str(top * context), "--max-sequences", str(top), "--max-tree-nodes", str(nodes),
            "--draft-taps", taps, "--metrics-port", str(ports["target"]),
        )
        if args.budget:
            draft = workers.start(
                "draft", "random-draft", "--target-model", model, "--model", f"{model}-dflash", "--device", args.device,
                "--dtype", args.dtype, "--max-sequences", str(top), "--graph-sequences", str(top), "--graph-context", str(context),
                "--metrics-port", str(ports["draft"]),
            )
        else:
            draft = workers.start("draft", "oracle-draft", "--target-model", model, "--table", str(work / "oracle.jsonl"), "--corruption", "0.15")
            del ports["draft"]
        print("| clients | gateways | client procs | tok/s | ms/step | verify passes | seqs/pass | rows/pass | pass ms | queue ms "
              "| propose passes | seqs/pass | pass ms | queue ms | Verify RTT ms | Propose RTT ms "
              "| target µs/step | draft µs/step | gateway µs/step (each) | clients µs/step |", flush=True)
        print("|" + "---|" * 20, flush=True)
        results = []
        for n, g, k in configs:
            with Cluster(log_dir, spin) as gws:
                gateway_ports = [free_port() for _ in range(g)]
                addresses = [
                    gws.start(f"gateway-{n}-{g}-{i}", "gateway", "--target", target, "--draft", draft, "--tokenizer", str(tokenizer),
                              "--metrics-port", str(gateway_ports[i]))
                    for i in range(g)
                ]
                warm = list(itertools.islice(pool_prompts, 2 * n))
                run_config(pool, addresses, warm, n, k, args.max_tokens, args.budget)
                timed = list(itertools.islice(pool_prompts, args.rounds * n))
                before = {p.pid: cpu_seconds(p.pid) for p in [*workers.procs, *gws.procs]}
                m0 = scrape([*ports.values(), *gateway_ports])
                tok_s, ms_step, steps, client_cpu = run_config(pool, addresses, timed, n, k, args.max_tokens, args.budget)
                m1 = scrape([*ports.values(), *gateway_ports])
                used = {pid: cpu_seconds(pid) - t for pid, t in before.items()}
            d = {key: m1[key] - m0.get(key, 0.0) for key in m1}
            sequences = "splitspec_worker_pass_sequences"
            row = {
                "clients": n, "gateways": g, "client_processes": k, "budget": args.budget, "tok_s": tok_s, "ms_step": ms_step,
                "steps": steps,
                **{
                    f"{phase}_{key}": value
                    for phase in ("verify", "propose")
                    for key, value in (
                        ("passes", d.get((f"{sequences}_count", phase), 0.0)),
                        ("seqs_per_pass", per_pass(d, sequences, phase)),
                        ("rows_per_pass", per_pass(d, "splitspec_worker_pass_rows", phase)),
                        ("pass_ms", mean_ms(d, "splitspec_worker_forward_duration_seconds", phase)),
                        ("queue_ms", mean_ms(d, "splitspec_worker_queue_seconds", phase)),
                    )
                },
                "verify_rtt_ms": mean_ms(d, "splitspec_rpc_duration_seconds", "TargetWorker/Verify"),
                "propose_rtt_ms": mean_ms(d, "splitspec_rpc_duration_seconds", "DraftWorker/Propose"),
                "target_us": 1e6 * used[workers.procs[0].pid] / steps,
                "draft_us": 1e6 * used[workers.procs[1].pid] / steps,
                "gateway_us": [1e6 * used[p.pid] / (steps / g) for p in gws.procs],
                "clients_us": 1e6 * client_cpu / steps,
            }
            results.append(row)
            print(f"| {n} | {g} | {k} | {tok_s:,.1f} | {ms_step:.2f} | {row['verify_passes']:.0f} | {row['verify_seqs_per_pass']:.1f} "
                  f"| {row['verify_rows_per_pass']:.1f} | {row['verify_pass_ms']:.2f} | {row['verify_queue_ms']:.2f} "
                  f"| {row['propose_passes']:.0f} | {row['propose_seqs_per_pass']:.1f} | {row['propose_pass_ms']:.2f} "
                  f"| {row['propose_queue_ms']:.2f} | {row['verify_rtt_ms']:.2f} | {row['propose_rtt_ms']:.2f} "
                  f"| {row['target_us']:.0f} | {row['draft_us']:.0f} | {', '.join(f'{x:.0f}' for x in row['gateway_us'])} "
                  f"| {row['clients_us']:.0f} |", flush=True)
    print("(gateway µs/step: a gateway's CPU over the steps of its clients; the others' over all steps)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
