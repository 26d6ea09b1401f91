"""One rank of the DP-GAN's Fabric loop (``gan.py``), launched by ``harness.run_cases(..., worker="gan_worker.py")``:
records what each step saw (indices, generated noise), the parameters of both models and the ledger."""

import json
import os
import sys

import torch

import lightning_dpzero  # noqa: F401  (registers the strategies)

sys.path.insert(0, os.path.dirname(__file__))
import gan  # noqa: E402
from dp_worker import main  # noqa: E402


def run_case(case, out_dir, devices):
    fabric, strategy, rec = gan.run(case, devices)
    rank, name = fabric.global_rank, case["name"]
    final = {"d": gan.gathered(rec["d"], case["stage"]), "g": gan.gathered(rec["g"], case["stage"])}
    with open(os.path.join(out_dir, f"{name}.seen{rank}.json"), "w") as f:
        json.dump([[s, idx, z.tolist()] for s, idx, z in rec["seen"]], f)
    torch.save(final, os.path.join(out_dir, f"{name}.final{rank}.pt"))
    if rank == 0:
        torch.save({"init": {"d": rec["init_d"], "g": rec["init_g"]}, "final": final,
                    "ledger": strategy.ledger.to_dict(), "plan": vars(strategy.plan), "steps": strategy.steps.taken},
                   os.path.join(out_dir, f"{name}.pt"))
    strategy.teardown()


if __name__ == "__main__":
    main(run_case)
