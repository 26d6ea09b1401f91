"""Per-step cost of privacy accounting over a long run.

Every optimizer step of a DP run charges the ledger and logs ε; with a ``target_epsilon`` it also asks the
budget guard whether the next step fits. This measures exactly that loop, with nothing else, over 100,000
steps (default)::

    python benchmarks/accounting_100k.py                      # q = 0.004, σ = 1.0, PLD
    python benchmarks/accounting_100k.py --accountant rdp --budget 8 --steps 20000

Prints ms/step (mean, median, p99, max), the total, the number of dp-accounting evaluations and the cost
of one exact ε at the end (what checkpoints and ``callback.epsilon()`` pay).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from lightning_dpzero.accounting import BudgetGuard, EpsilonTracker, PrivacyLedger


def run(steps: int, q: float, sigma: float, accountant: str, budget: float | None, delta: float) -> dict:
    ledger = PrivacyLedger(delta=delta, dataset_size=max(1, round(256 / q)), accountant=accountant)
    tracker = EpsilonTracker()
    guard = BudgetGuard(budget, tracker) if budget is not None else None
    times, eps, stopped_at = [], 0.0, None
    t_start = time.perf_counter()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        if guard is not None and not guard.allows_next_step(ledger, q, sigma):
            stopped_at = step - 1
            break
        ledger.charge(q, sigma)
        eps = guard.epsilon_upper_bound(ledger) if guard is not None else tracker.epsilon(ledger)
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_start
    t0 = time.perf_counter()
    exact = ledger.epsilon()
    t_exact = time.perf_counter() - t0
    times.sort()
    return {"steps": len(times), "total_s": total, "mean_ms": 1e3 * total / max(len(times), 1),
            "median_ms": 1e3 * statistics.median(times), "p99_ms": 1e3 * times[int(0.99 * (len(times) - 1))],
            "max_ms": 1e3 * times[-1], "evaluations": tracker.evaluations,
            "exact_evaluations": guard.exact_evaluations if guard is not None else 0,
            "epsilon_logged": eps, "epsilon_exact": exact, "exact_s": t_exact, "stopped_at": stopped_at}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--q", type=float, default=0.004, help="sample rate (default 0.004: B = 256 of N = 64,000)")
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--accountant", choices=["pld", "rdp"], default="pld")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--budget", type=float, default=None, help="also run the budget guard with this target ε")
    a = p.parse_args(argv)
    r = run(a.steps, a.q, a.sigma, a.accountant, a.budget, a.delta)
    print(f"accounting benchmark: {a.accountant}, q={a.q}, sigma={a.sigma}, delta={a.delta}, "
          f"budget={a.budget}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"steps:              {r['steps']}" + (f" (budget stopped it at {r['stopped_at']})"
                                                 if r["stopped_at"] is not None else ""))
    print(f"per step (charge + tracker.epsilon{' + budget check' if a.budget else ''}): "
          f"mean {r['mean_ms']:.3f} ms, median {r['median_ms']:.4f} ms, p99 {r['p99_ms']:.3f} ms, "
          f"max {r['max_ms']:.1f} ms")
    print(f"total:              {r['total_s']:.2f} s for {r['steps']} steps "
          f"({r['evaluations']} tracker evaluations, {r['exact_evaluations']} exact budget evaluations)")
    print(f"epsilon logged:     {r['epsilon_logged']:.6g}   exact: {r['epsilon_exact']:.6g} "
          f"(+{100 * (r['epsilon_logged'] / r['epsilon_exact'] - 1):.2f} %)")
    print(f"one exact epsilon:  {1e3 * r['exact_s']:.1f} ms")


if __name__ == "__main__":
    main()
