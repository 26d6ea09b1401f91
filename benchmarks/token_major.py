"""Token-major layers' cost: one training step (forward, backward) of a small MoE and OPT, plain against per-example
clipping (``per_sample/token_major.py``: the row tracker during the forward, the generic rule's recomputation per
example for the router and the experts), and a batch-first decoder of the same size (Llama) as the reference of
what clipping costs without token-major layers.

For each model, in one process: ``nondp`` (forward + backward), ``dp`` (the engine, all-layer clipping, after its
layout check; row tracking on where the check found token-major layers), and for the MoE ``dp_untracked``
(the same step with the tracker's per-op dispatch measured alone: a forward of the plain model inside
``RowTracker``). Time: median of ``--reps`` steps after ``--warmup``, CPU time of the calling thread
(``time.thread_time``), one torch thread.

Usage::

    python -m benchmarks.token_major [--reps 10] [--warmup 3] [--batch 8] [--seq 32] [--hidden 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def _models(d: int, seq: int):
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=d, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=2 * d, max_position_embeddings=max(64, seq), attention_dropout=0.0,
                  attn_implementation="eager")
    return {
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                  **common)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=256, hidden_size=d, num_hidden_layers=2,
                                                      ffn_dim=2 * d, num_attention_heads=4, word_embed_proj_dim=d,
                                                      max_position_embeddings=max(64, seq), dropout=0.0,
                                                      attention_dropout=0.0, attn_implementation="eager")),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
    }


def _time(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.thread_time()
        fn()
        out.append(time.thread_time() - t)
    return statistics.median(out)


def main(argv=None) -> dict:
    from lightning_dpzero.per_sample import PerSampleEngine
    from lightning_dpzero.per_sample.provenance import RowTracker

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for name, build in _models(args.hidden, args.seq).items():
        torch.manual_seed(0)
        model = build().train()
        x = torch.randint(0, 256, (args.batch, args.seq))
        y = torch.randint(0, 256, (args.batch, args.seq))

        def loss(ids=x, tgt=y):
            return F.cross_entropy(model(input_ids=ids).logits.transpose(1, 2), tgt)

        def plain():
            model.zero_grad(set_to_none=True)
            loss().backward()

        def tracked_forward_only():
            model.zero_grad(set_to_none=True)
            with RowTracker():
                out = loss()
            out.backward()

        row = {"nondp": _time(plain, args.reps, args.warmup)}
        if name == "mixtral":
            row["tracker_only"] = _time(tracked_forward_only, args.reps, args.warmup)
        engine = PerSampleEngine(model, max_grad_norm=1.0, clipping="all-layer").attach()
        try:
            engine.check_layout(lambda i: loss(x if i is None else x[i], y if i is None else y[i]), args.batch)

            def dp():
                model.zero_grad(set_to_none=True)
                with engine.micro_batch(batch_size=args.batch):
                    loss().backward()

            row["dp"] = _time(dp, args.reps, args.warmup)
            row["tracking"] = bool(engine.tracking.needed)
        finally:
            engine.detach()
        row["dp_over_nondp"] = row["dp"] / row["nondp"]
        results[name] = row
        print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return results


if __name__ == "__main__":
    main()
