"""What correlated noise costs per optimizer step on a GPT-2 (the configuration of ``benchmarks.user_level``):
the noise pre-hook over every parameter (``noise.make_noise_pre_hook``) with DP-SGD's independent noise, with
``BandedNoiseSource`` at b = 2, 4, 16 and with ``BLTNoiseSource`` at d = 2, 4 buffers, against the private step's
forward and backward (layer-wise clipping), and the memory the noise history (or BLT state) holds.

One process, one torch thread, CPU time of the calling thread, median of ``--reps`` after ``--warmup``. Results go
to ``benchmarks/results/correlated_noise_cost.json`` (``--out``).

Usage::

    python -m benchmarks.correlated_noise_cost [--reps 10] [--bands 2 4 16] [--buffers 2 4]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from .token_major import _time

OUT = Path(__file__).resolve().parent / "results" / "correlated_noise_cost.json"


def main(argv=None) -> dict:
    import transformers as tf

    from lightning_dpzero.banded_mf import BandedNoiseSource
    from lightning_dpzero.blt import BLTNoiseSource, BLTParams
    from lightning_dpzero.noise import NoiseSource, make_noise_pre_hook
    from lightning_dpzero.per_sample import PerSampleEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bands", type=int, nargs="+", default=[2, 4, 16])
    ap.add_argument("--buffers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=512, n_embd=args.hidden, n_layer=4, n_head=4,
                                             n_positions=args.seq, bos_token_id=0, eos_token_id=0,
                                             attn_implementation="eager")).train()
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    x = torch.randint(0, 512, (args.rows, args.seq))
    engine = PerSampleEngine(model, max_grad_norm=1.0, clipping="layer-wise").attach()

    def private_step():
        model.zero_grad(set_to_none=True)
        with engine.micro_batch(batch_size=args.rows):
            F.cross_entropy(model(input_ids=x).logits.transpose(1, 2), x).backward()

    row = {"dp_forward_backward": _time(private_step, args.reps, args.warmup)}
    engine.detach()
    optimizer = torch.optim.SGD(params, lr=0.0)
    for p in params:
        p.grad = torch.zeros_like(p)
    for bands in [1, *args.bands]:
        base = NoiseSource(0, False, replicated=True, rank=0)
        source = base if bands == 1 else BandedNoiseSource(base, bands)
        hook = make_noise_pre_hook(lambda: (1.0, 1e-3), source, lambda: None)
        row[f"noise_b{bands}"] = _time(lambda: hook(optimizer, (), {}), args.reps, args.warmup)
        row[f"history_mb_b{bands}"] = (bands - 1) * numel * 4 / 2**20
    for d in args.buffers:  # the cost depends on d only: any decays and weights
        source = BLTNoiseSource(NoiseSource(0, False, replicated=True, rank=0),
                                BLTParams(tuple(0.5 + 0.4 * i / d for i in range(d)), (0.1,) * d))
        hook = make_noise_pre_hook(lambda: (1.0, 1e-3), source, lambda: None)
        row[f"noise_blt{d}"] = _time(lambda: hook(optimizer, (), {}), args.reps, args.warmup)
        row[f"state_mb_blt{d}"] = d * numel * 4 / 2**20
        row[f"step_blt{d}_over_dpsgd"] = ((row["dp_forward_backward"] + row[f"noise_blt{d}"])
                                         / (row["dp_forward_backward"] + row["noise_b1"]))
    for bands in args.bands:
        row[f"step_b{bands}_over_dpsgd"] = ((row["dp_forward_backward"] + row[f"noise_b{bands}"])
                                           / (row["dp_forward_backward"] + row["noise_b1"]))
    result = {"settings": vars(args) | {"out": str(args.out)}, "parameters": numel,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "seconds": row}
    print(json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
