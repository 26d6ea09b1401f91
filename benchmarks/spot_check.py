"""What the per-micro-batch spot check costs against a private training step (docs/reliability.md).

One process, the ``PerSampleEngine`` alone (no DeepSpeed): a Llama decoder with random weights (no hub) on
padded batches of ``--batch`` sequences of ``--seq`` tokens, its loss ``lightning_dpzero.losses.causal_lm_loss``.
Times, as medians of ``--reps`` calls after one warm-up, round-robin; on the CPU the CPU time of the calling
thread with one torch thread (``time.thread_time``: time the OS gave to other jobs on a shared machine is not
counted), on a GPU wall-clock time after a synchronize:

* ``step``   one private step's forward and backward (per-example clipping, layer-wise), what the strategy runs
             for every micro-batch;
* ``spot``   the spot check that ``layout_check="every-batch"`` adds to every micro-batch after the first
             (the full micro-batch's forward and three forwards of one or two examples, without gradients);
* ``first``  the check of the first micro-batch (the layout check's two forwards and the spot check's three);
* ``forward`` one forward of the micro-batch without gradients and without the check, for scale.

Usage::

    python -m benchmarks.spot_check [--batch 16] [--seq 128] [--hidden 256] [--layers 4] [--reps 5] [--device cpu]

Measured (a shared CPU, one thread, the defaults): step 799 ms, spot 0.54 of it, first 0.89, forward 0.27
(docs/reliability.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_dpzero.losses import causal_lm_loss
from lightning_dpzero.per_sample import PerSampleEngine


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    cpu = args.device == "cpu"
    if cpu:
        torch.set_num_threads(1)
    clock = time.thread_time if cpu else time.perf_counter
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=4, intermediate_size=4 * args.hidden,
                         max_position_embeddings=args.seq)
    model = LlamaForCausalLM(config).to(args.device).train()
    ids = torch.randint(0, 1024, (args.batch, args.seq), device=args.device)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), device=args.device)
    mask = (torch.arange(args.seq, device=args.device)[None] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)

    def run(i):
        s = slice(None) if i is None else i.to(args.device)
        return causal_lm_loss(model(input_ids=ids[s], attention_mask=mask[s]).logits, labels[s])

    engine = PerSampleEngine(model, max_grad_norm=1.0).attach()

    def step():
        with engine.micro_batch(batch_size=args.batch):
            run(None).backward()
        model.zero_grad(set_to_none=True)

    def first():
        engine.layout_verified = False
        engine.check_layout(run, args.batch)

    def forward():
        with torch.no_grad():
            run(None)

    def spot():
        engine.check_layout(run, args.batch, every_batch=True)

    times: dict[str, list[float]] = {"step": [], "spot": [], "first": [], "forward": []}
    for rep in range(args.reps + 1):
        for name, fn in (("step", step), ("first", first), ("spot", spot), ("forward", forward)):
            _sync(args.device)
            start = clock()
            fn()
            _sync(args.device)
            if rep:
                times[name].append(clock() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"device={args.device} batch={args.batch} seq={args.seq} hidden={args.hidden} layers={args.layers} "
          f"threads={torch.get_num_threads()}")
    for name in ("step", "spot", "first", "forward"):
        print(f"{name:>7}: {1000 * med[name]:8.1f} ms  ({med[name] / med['step']:.2f} of a step)")


if __name__ == "__main__":
    main()
