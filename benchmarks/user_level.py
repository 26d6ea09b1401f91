"""User-level DP's cost on a GPT-2 step: the same micro-batch of rows clipped per example (example-level) and per
user (``privacy_unit="user"``: the rows of a user regrouped unit-first, ``per_sample/units.py``), against the
non-private step.

One process, one torch thread, CPU time of the calling thread (``time.thread_time``), median of ``--reps`` steps
after ``--warmup``. The micro-batch holds ``--rows`` rows of ``--seq`` tokens, from ``--rows / --rows-per-user``
users. Results go to ``benchmarks/results/user_level.json`` (``--out``).

Usage::

    python -m benchmarks.user_level [--reps 10] [--rows 16] [--rows-per-user 2] [--seq 64] [--hidden 128]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from .token_major import _time

OUT = Path(__file__).resolve().parent / "results" / "user_level.json"


def main(argv=None) -> dict:
    import transformers as tf

    from lightning_dpzero.per_sample import PerSampleEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rows-per-user", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=512, n_embd=args.hidden, n_layer=4, n_head=4,
                                             n_positions=args.seq, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                             attn_implementation="eager")).train()
    x = torch.randint(0, 512, (args.rows, args.seq))
    units = torch.arange(args.rows) // args.rows_per_user

    def loss():
        return F.cross_entropy(model(input_ids=x).logits.transpose(1, 2), x)

    def plain():
        model.zero_grad(set_to_none=True)
        loss().backward()

    row = {"nondp": _time(plain, args.reps, args.warmup)}
    for clipping in ("layer-wise", "all-layer"):
        engine = PerSampleEngine(model, max_grad_norm=1.0, clipping=clipping).attach()
        try:
            for name, u in (("example", None), ("user", units)):
                def dp(u=u):
                    model.zero_grad(set_to_none=True)
                    with engine.micro_batch(batch_size=args.rows, units=u):
                        loss().backward()

                row[f"{name}_{clipping}"] = _time(dp, args.reps, args.warmup)
        finally:
            engine.detach()
    for key in [k for k in row if k != "nondp"]:
        row[f"{key}_over_nondp"] = row[key] / row["nondp"]
    result = {"settings": vars(args) | {"out": str(args.out)}, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "seconds": row}
    print(json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
