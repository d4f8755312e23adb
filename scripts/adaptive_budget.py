"""The adaptive tree budget against fixed budgets, through the three services at several concurrencies.

Random weights of ``--shape`` on a GPU (a ``-q4km`` shape's blocks kept quantized, as ``splitspec
bench`` serves them); the draft is the benchmark-only OracleDrafter (the target's recorded output
corrupted at ``--corruption`` per depth), so the acceptance is realistic while the budget's cost is
the target's real verify pass. For each concurrency N and each budget (fixed, and ``auto``: the
gateway's BudgetPolicy) N clients generate at once; the figure is the aggregate tok/s, beside AR's
(budget 0, which the adaptive budget may choose as well). The adaptive budget's goal: at least 95%
of the best fixed budget at each N, and above every single fixed budget over all N together (the
sum of the aggregates).

Beside each row, while every client decoded: a fixed budget's row gives the model's forecast of it
(and of 0), the auto row what the choice was made from (the expected rate at 0, at each fixed
budget and at the model's best), each gateway's mean. At debug the gateways' and the target's logs
say once a pass what budget is kept or followed against the one the figures prefer.

Usage: python scripts/adaptive_budget.py [--shape qwen3-8b] [--levels 1,8,32] [--budgets 4,8,16,22,32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from gpu_services_split import free_port, per_pass, scrape  # this folder is on the path of a script run from it
from prometheus_client.parser import text_string_to_metric_families

from splitspec.bench.random_weights import random_shape, random_target_config
from splitspec.bench.system import Cluster, measure, plan_levels, random_prompts, synthetic_tokenizer, worker_flags
from splitspec.transport import busypoll
from splitspec.v1 import gateway_pb2

Spec = gateway_pb2.Speculation


def budgets_chosen(before: dict, after: dict) -> str:
    """The budgets the drafted steps got between two scrapes of the gateways' metrics: the mean and
    each budget histogram bucket's share of the steps (``<=N``: budgets above the bucket before it, up to N)."""
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    name = "splitspec_spec_decode_budget_nodes"
    steps = delta.get((f"{name}_count", ""), 0.0)
    if not steps:
        return "no drafted steps"
    bounds = sorted((float(le), n) for (key, le), n in delta.items() if key == f"{name}_bucket" and le != "+Inf")
    shares, below = [], 0.0
    for bound, cumulative in bounds:
        if cumulative > below:
            shares.append(f"<={bound:g}: {100 * (cumulative - below) / steps:.0f}%")
        below = cumulative
    return f"budget mean {per_pass(delta, name, ''):.1f} ({', '.join(shares)})"


FORECAST = "splitspec_adaptive_budget_forecast_tokens_per_second"  # at each fixed budget requests ran, and at 0
EXPECTED = "splitspec_adaptive_budget_expected_tokens_per_second"  # at each candidate, what the adaptive choice is made from


def by_budget(ports: list[int]) -> list[dict[str, dict[int, float]]]:
    """Each gateway's rates of a sequence by budget, as its adaptive-budget model gives them:
    ``{FORECAST: {budget: tok/s}, EXPECTED: {...}}``."""
    out = []
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        rates: dict[str, dict[int, float]] = {FORECAST: {}, EXPECTED: {}}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in rates:
                    rates[sample.name][int(sample.labels["budget"])] = sample.value
        out.append(rates)
    return out


class ForecastSampler:
    """Samples the gateways' forecasts and expected rates (:func:`by_budget`) every ``period_s``
    while a row runs. The model's figures follow the load, so a row's last forecast is of its tail
    (the last requests finishing: fewer sequences a pass); :meth:`during` averages the samples
    taken while every client decoded."""

    def __init__(self, ports: list[int], period_s: float = 0.2) -> None:
        self.ports, self.period_s = ports, period_s
        self.samples: list[tuple[float, list[dict[str, dict[int, float]]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.perf_counter(), by_budget(self.ports)))

    def __enter__(self) -> ForecastSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def during(self, windows: tuple[tuple[float, float], ...], budget: int, family: str = FORECAST) -> list[float | None]:
        """The mean of ``family``'s rate at ``budget``, by gateway, over the samples inside ``windows``."""
        inside = [by_gateway for t, by_gateway in self.samples if any(lo <= t <= hi for lo, hi in windows)]
        means = []
        for g in range(len(self.ports)):
            values = [sample[g][family][budget] for sample in inside if budget in sample[g][family]]
            means.append(sum(values) / len(values) if values else None)
        return means

    def best(self, windows: tuple[tuple[float, float], ...]) -> list[tuple[int, float] | None]:
        """By gateway: the candidate of the highest mean expected rate over the samples inside
        ``windows``, and that rate."""
        out = []
        for g in range(len(self.ports)):
            candidates = {b for t, sample in self.samples if any(lo <= t <= hi for lo, hi in windows) for b in sample[g][EXPECTED]}
            means = {b: self.during(windows, b, EXPECTED)[g] for b in candidates}
            out.append(max(means.items(), key=lambda item: item[1]) if means else None)
        return out


def listed(means: list[float | None]) -> str:
    return ", ".join("none" if m is None else f"{m:.1f}" for m in means)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--levels", default="1,8,32")
    p.add_argument("--budgets", default="4,8,16,22,32")
    p.add_argument("--corruption", type=float, default=0.15)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--log-dir", default="")
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    model = f"random:{args.shape}"
    config = random_target_config(model)
    plan = plan_levels(random_prompts(config.vocab_size, args.prompt_len), levels, args.prompts)
    kv_tokens = (max(levels) + 1) * (args.prompt_len + args.max_tokens + 2 * 64 + 64)
    results: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as work:
        work_dir = Path(work)
        log_dir = Path(args.log_dir or work)
        log_dir.mkdir(parents=True, exist_ok=True)
        tokenizer = synthetic_tokenizer(config.vocab_size, work_dir / "tokenizer.json")
        table = work_dir / "oracle.jsonl"
        table.write_text("")
        spin = busypoll.spin_us_for("auto", args.device.startswith("cuda"), busypoll.usable_cpus())
        with Cluster(log_dir, spin) as c:
            keep, _ = worker_flags(random_shape(model).quantized, 0.0, 0.0, shared=True)  # a -q4km shape served quantized, as bench does
            # At debug the target's log says, once a pass, what agreed budget its board keeps against the one the votes prefer.
            target = c.start("target", "random-target", "--model", model, "--device", args.device, "--max-kv-tokens", str(kv_tokens), *keep,
                             "--log-level", "debug")
            draft = c.start("oracle", "oracle-draft", "--table", str(table), "--corruption", str(args.corruption), "--target-model", model)
            ports = [free_port() for _ in range(args.gateways)]
            gateways = [
                # At debug the gateways' logs also say, once a pass, what choice the policy keeps against the one its figures prefer.
                c.start(f"gateway{g}", "gateway", "--target", target, "--draft", draft, "--tokenizer", str(tokenizer), "--budget", "auto",
                        "--metrics-port", str(port), "--log-level", "debug")
                for g, port in enumerate(ports)
            ]
            for level in plan:
                ar, outputs = measure(gateways, level, Spec(mode=Spec.OFF), args.max_tokens, "off (AR)", "socket", "off")
                results.setdefault("AR", {})[level.concurrency] = ar.tokens_per_s
                print(f"concurrency {level.concurrency} AR: {ar.tokens_per_s:.0f} tok/s ({ar.decode_tokens_per_s:.0f} while all decode), "
                      f"{ar.ms_per_step:.2f} ms/step", flush=True)
                with table.open("a") as f:  # the oracle re-reads its table when the file changes
                    f.writelines(json.dumps({"tokens": p + out}) + "\n" for p, out in zip(level.warm + level.timed, outputs))
                for budget in [*budgets, 0]:  # 0: the request names none, the gateway's adaptive budget decides
                    name = f"b{budget}" if budget else "auto"
                    spec = Spec(mode=Spec.DDTREE, budget=budget, chain_seed=False)
                    before = scrape(ports)
                    with ForecastSampler(ports) as sampled:
                        row, _ = measure(gateways, level, spec, args.max_tokens, name, "socket", "oracle", args.corruption)
                    results.setdefault(name, {})[level.concurrency] = row.tokens_per_s
                    # A fixed budget's row beside the model's forecast of it (and of target-only steps, as
                    # the AR row ran), while all decode: per sequence, as the rate a sequence got then.
                    model, at = "", row.all_decoding_windows
                    if budget:
                        model = f"; the model's forecast of a sequence {listed(sampled.during(at, budget))} tok/s by gateway (target-only {listed(sampled.during(at, 0))})"
                    else:  # what the choice was made from, at the fixed budgets of this run and at its best
                        best = sampled.best(at)
                        model = "; the model expected of a sequence " + "; ".join(
                            f"{b}: {listed(sampled.during(at, b, EXPECTED))}" for b in [0, *budgets]
                        ) + " tok/s by gateway, its best " + ", ".join("none" if b is None else f"{b[0]} at {b[1]:.1f}" for b in best)
                    print(f"concurrency {level.concurrency} budget {name}: {row.tokens_per_s:.0f} tok/s ({row.decode_tokens_per_s:.0f} while all decode, "
                          f"{row.decode_tokens_per_s / level.concurrency:.1f} a sequence), AL {row.acceptance_length:.2f}, "
                          f"{row.ms_per_step:.2f} ms/step (oracle drafter, benchmark-only); {budgets_chosen(before, scrape(ports))}{model}", flush=True)
    fixed = [f"b{b}" for b in budgets]
    print(f"\n{args.shape} (random weights), OracleDrafter corruption {args.corruption} (benchmark-only), {args.gateways} gateways")
    print("| budget | " + " | ".join(f"c{n} tok/s" for n in levels) + " | sum |")
    print("|---|" + "---|" * (len(levels) + 1))
    for name, by_level in results.items():
        print(f"| {name} | " + " | ".join(f"{by_level[n]:.0f}" for n in levels) + f" | {sum(by_level.values()):.0f} |")
    for n in levels:
        best = max(fixed, key=lambda name: results[name][n])
        print(f"concurrency {n}: auto {results['auto'][n]:.0f} tok/s = {results['auto'][n] / results[best][n]:.3f} of the best fixed ({best}), "
              f"{results['auto'][n] / results['AR'][n]:.3f} of AR")
    total = {name: sum(by_level.values()) for name, by_level in results.items()}
    best_total = max(fixed, key=total.get)
    print(f"over all levels: auto {total['auto']:.0f} against the best single fixed budget {best_total} {total[best_total]:.0f} "
          f"({total['auto'] / total[best_total]:.3f})")


if __name__ == "__main__":
    main()
