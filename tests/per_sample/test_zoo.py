"""The model zoo: tiny HuggingFace models with random weights (tests/zoo.py) train unchanged and match their
oracle (docs/design.md, I2 and I5).

One process: the engine's Σ_i clip(g_i) for one micro-batch against a per-example backward loop in float64,
all-layer and layer-wise, full fine-tuning and LoRA (peft) on the decoders, after the layout check passed;
parameters used directly in a forward (CLIP's class embedding, ConvNeXt's layer scale, Mamba's A_log and D,
nanoGPT's position embedding on torch.arange(T), T5's relative attention bias) train per example. Two processes (slow):
one launch trains every model (and a user's own layer through the generic rule) for a few steps on ZeRO-3 and
matches the single-process replay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_dpzero.per_sample import PerSampleEngine
from lightning_dpzero.per_sample import registry
from oracle import backward, clipped_sum, per_example_grads_loop

pytest.importorskip("transformers")
import zoo  # noqa: E402

B, C = 4, 0.5
FULL = ["gpt2", "llama", "qwen2", "mistral", "t5", "bert", "vit", "wav2vec2", "clip_vision", "convnext", "nanogpt"]
#: models with parameters used directly in the forward (or an embedding on indices shared by every example)
DIRECT = ["clip_vision", "convnext", "nanogpt", "t5", "swin"] + (["mamba"] if zoo.has_mamba() else [])
DIRECT_NAMES = ("class_embedding", "layer_scale", "A_log", "mixer.D", "dt_proj", "mixer.conv1d", "wpe",
                "relative_attention_bias", "relative_position_bias_table")
DECODERS = ["gpt2", "llama", "qwen2", "mistral"]
#: layers that get the examples' tokens as rows (B·T, d): OPT's feed-forward, the MoEs' routers and experts,
#: Swin's window attention; OPT with HuggingFace's activation checkpointing (its decoder layer's reshape recomputed
#: in the backward); Mixtral with nn.Linear experts on the rows gathered for each
TOKEN_MAJOR = ["opt", "opt_checkpointed", "mixtral", "qwen2_moe", "swin", "mixtral_linear"]
#: PyTorch's nn.TransformerEncoder / nn.TransformerDecoder (float -inf masks, is_causal, the nested-tensor path)
TORCH = ["torch_encoder_lm", "torch_padded", "torch_seq2seq"]
#: every HuggingFace family with LoRA adapters (zoo.with_lora)
LORA = (DECODERS + ["t5", "bert", "vit", "wav2vec2", "clip_vision", "convnext", "opt", "mixtral", "qwen2_moe",
                   "mixtral_linear", "swin"] + (["mamba"] if zoo.has_mamba() else []))
#: LoRA on ZeRO-3: one family of each path (a decoder with HF's Conv1D, encoder-decoder, a classifier's head in
#: modules_to_save, token-major windows, an MoE, parameters read directly), to keep the suite's time
LORA_ZERO3 = ["gpt2", "t5", "bert", "swin", "mixtral"] + (["mamba"] if zoo.has_mamba() else [])


def _loss(model, x, y):
    return lambda index: F.cross_entropy(model(x if index is None else x[index]), y if index is None else y[index])


def _engine_vs_oracle(model, x, y, clipping, C=C, mode="book-keeping"):
    """The layout check passes, then the engine's clipped sum equals the float64 per-example loop's (≤ 1e-5)."""
    ref = clipped_sum(model, per_example_grads_loop(model, F.cross_entropy, x, y), C, clipping)
    model.zero_grad(set_to_none=True)
    engine = PerSampleEngine(model, max_grad_norm=C, clipping=clipping, clipping_mode=mode).attach()
    try:
        assert engine.check_layout(_loss(model, x, y), x.shape[0])
        with engine.micro_batch(batch_size=x.shape[0]):
            backward(engine, F.cross_entropy(model(x), y))
        rules = {type(h.rule).__name__ for h in engine.hooks}
    finally:
        engine.detach()
    assert engine.stats["clipped"] > 0  # C is small enough that clipping acts
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, n
            torch.testing.assert_close(p.grad.double(), ref[n], rtol=0, atol=1e-5, msg=lambda m: f"{n}: {m}")
    return rules


@pytest.mark.parametrize("clipping,mode", [("all-layer", "book-keeping"), ("all-layer", "two-pass"),
                                           ("layer-wise", "book-keeping")])
@pytest.mark.parametrize("kind", FULL + (["mamba"] if zoo.has_mamba() else []) + TOKEN_MAJOR + TORCH)
def test_full_fine_tuning_matches_the_oracle(kind, clipping, mode):
    torch.manual_seed(0)
    model = zoo.build(kind).train()
    x, y = zoo.make_data(kind, B)
    rules = _engine_vs_oracle(model, x, y, clipping, mode=mode)
    if kind in ("llama", "qwen2", "mistral", "t5"):
        assert "HFRMSNormRule" in rules
    if kind == "wav2vec2":  # the positional convolution's weight_norm: g and v through the parametrization's vjp
        assert "ParametrizedRule" in rules


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_hf_norms_through_the_generic_rule_match_the_oracle(kind, monkeypatch):
    """Without the dedicated rule (e.g. a norm class it does not list) the generic rule covers the norms, exactly."""
    monkeypatch.setattr(registry, "NAMED_RULES", {k: r for k, r in registry.NAMED_RULES.items()
                                                  if type(r).__name__ != "HFRMSNormRule"})
    torch.manual_seed(1)
    model = zoo.build(kind).train()
    x, y = zoo.make_data(kind, B)
    assert "InstantiatedGradsRule" in _engine_vs_oracle(model, x, y, "layer-wise")


@pytest.mark.parametrize("clipping", ["all-layer", "layer-wise"])
@pytest.mark.parametrize("kind", LORA)
def test_lora_matches_the_oracle(kind, clipping):
    """peft's LoRA adapters on each family's usual targets (zoo.LORA_TARGETS), a classifier's head trained next to
    them (modules_to_save): only those train, and their clipped sum equals the float64 per-example loop's."""
    pytest.importorskip("peft")
    torch.manual_seed(2)
    model = zoo.with_lora(zoo.build(kind), kind).train()
    x, y = zoo.make_data(kind, B)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any("lora_B" in n for n in trainable)
    heads = tuple(f".{h}.modules_to_save.default." for h in zoo.LORA_HEADS.get(kind, []))
    assert all("lora_" in n or n.startswith("head.") or any(h in n for h in heads) for n in trainable), trainable
    _engine_vs_oracle(model, x, y, clipping, C=0.005)


@pytest.mark.parametrize("batch", [3, 5])  # 5 and 3: the encoder's and the decoder's length equal B
def test_t5_relative_bias_trains_when_a_sequence_length_equals_the_batch(batch):
    """The (L, L) position buckets look batch first when L == B: the layout check sees them shared, marks the
    embedding and checks again, and the bias trains per example like any other L."""
    torch.manual_seed(3)
    model = zoo.build("t5").train()
    x, y = zoo.make_data("t5", batch)
    _engine_vs_oracle(model, x, y, "layer-wise")


@pytest.mark.parametrize("kind", DIRECT)
def test_direct_parameters_are_clipped_by_their_broadcast_uses(kind):
    """Each model's directly used parameters (class embedding, layer scale, A_log and D, the position embedding on
    torch.arange(T), the relative bias) are covered by a site whose per-example copies are made where the
    forward broadcasts them, not refused and not left to another rule."""
    model = zoo.build(kind)
    engine = PerSampleEngine(model, max_grad_norm=C).attach()
    try:
        covered = {id(p): type(h.rule).__name__ for h in engine.hooks for p in h.rule.params(h.module)
                   if p is not None}
    finally:
        engine.detach()
    names = [n for n, p in model.named_parameters() if p.requires_grad and any(k in n for k in DIRECT_NAMES)]
    assert names
    for n in names:
        p = model.get_parameter(n)
        assert covered[id(p)] in ("BroadcastParameterRule", "EmbeddingRule"), n


# ---------------------------------------------------------------------------------------------- ZeRO-3, 2 processes
@pytest.mark.slow
def test_zoo_trains_on_zero3_with_two_processes_and_matches_the_replay(tmp_path):
    """One launch, every model: full fine-tuning on ZeRO-3 with 2 processes (σ = 0) for 2 steps equals the
    single-process replay from per-example gradients of the union batch (harness.expected_params), on shuffled
    fixed-size batches; and Llama on Poisson batches of one expected example per rank, of which some are empty:
    HuggingFace's attention cannot run zero rows (it reshapes with -1), so the strategy runs that forward on a
    one-row stand-in, which must add nothing to the update."""
    from harness import ZERO3_EVERY_PARAM_PARTITIONED, run_cases

    cases = [dict(name=f"zoo_{k}", model=f"zoo:{k}", stage=3, sigma=0.0, C=0.5, clipping=clip, clipping_fn="abadi",
                  poisson=False, accumulate=1, steps=2, n=24, batch_size=3, lr=0.5, oracle="loop")
             for k, clip in zip([{"t5": "t5_frozen_bias"}.get(k, k) for k in FULL if k not in ("wav2vec2", "nanogpt")],
                                ["all-layer", "layer-wise"] * 5)]
    # parameters used directly (class embedding, layer scale) on Poisson batches: micro-batches of 0, 1 or more
    # examples, the shared values' copies made per micro-batch (an embedding on shared indices stays refused here)
    for case in cases:
        if case["model"] in ("zoo:clip_vision", "zoo:convnext"):
            case.update(poisson=True, steps=3)
    # Wav2Vec2's weight_norm positional convolution on Poisson batches: ZeRO-3 gathers the parametrized layer whole,
    # its originals included, in its forward and in its backward
    cases += [dict(cases[0], name=f"zoo_wav2vec2_{clip}", model="zoo:wav2vec2", clipping=clip, poisson=True, steps=3)
              for clip in ("all-layer", "layer-wise")]
    # a user's own layer through the generic rule (torch.func oracle), in the same launch
    cases += [dict(cases[0], name=f"generic_{clip}", model="generic", clipping=clip, oracle="func")
              for clip in ("all-layer", "layer-wise")]
    # Llama with HuggingFace's non-reentrant activation checkpointing under two-pass clipping: each decoder layer
    # recomputes in both backward passes, and ZeRO-3 (every parameter partitioned, no prefetch) gathers it for each
    cases.append(dict(cases[0], name="zoo_llama_checkpointed_two_pass", model="zoo:llama_checkpointed",
                      clipping="all-layer", clipping_mode="two-pass",
                      zero_config=ZERO3_EVERY_PARAM_PARTITIONED))
    empty = [dict(cases[0], name=f"zoo_llama_empty_batches_{clip}", model="zoo:llama", clipping=clip, poisson=True,
                  batch_size=1, steps=4) for clip in ("layer-wise", "all-layer")]
    results = run_cases(cases + empty, tmp_path, world_size=2, timeout=900)
    for case in empty:
        sizes = [len(idx) for rank in results[case["name"]]["seen"] for _, idx in rank]
        assert 0 in sizes and max(sizes) > 0, (case["name"], sizes)  # empty micro-batches, and examples
    _assert_replayed(cases + empty, results)


@pytest.mark.slow
def test_lora_trains_on_zero3_with_two_processes_and_matches_the_replay(tmp_path):
    """peft's LoRA adapters (and a classifier's head, modules_to_save), the frozen weights partitioned with them,
    on ZeRO-3 with 2 processes and Poisson micro-batches of 0 to several examples (σ = 0), all-layer and layer-wise
    in turn, for one family of each path (``LORA_ZERO3``): equal to the single-process replay from per-example
    gradients."""
    pytest.importorskip("peft")
    cases = [dict(name=f"lora_{k}_{clip}", model=f"zoo_lora:{k}", stage=3, sigma=0.0, C=0.5, clipping=clip,
                  clipping_fn="abadi", poisson=True, accumulate=1, steps=3, n=24, batch_size=3, lr=0.5, oracle="loop")
             for i, k in enumerate(LORA_ZERO3) for clip in [("all-layer", "layer-wise")[i % 2]]]
    _match_the_replay(cases, tmp_path)


@pytest.mark.slow
def test_token_major_models_train_on_zero3_with_two_processes_and_match_the_replay(tmp_path):
    """OPT's feed-forward on (B·T, d) rows and Mixtral's router and experts (the generic rule, one recomputation
    per example on its rows) on ZeRO-3 with 2 processes, Poisson batches (micro-batches of 0, 1 or more examples,
    so the rows' map changes per micro-batch), σ = 0: equal to the single-process replay."""
    cases = [dict(name=f"zoo_{k}_{clip}", model=f"zoo:{k}", stage=3, sigma=0.0, C=0.5, clipping=clip,
                  clipping_fn="abadi", poisson=True, accumulate=1, steps=3, n=24, batch_size=3, lr=0.5, oracle="loop")
             for k, clip in (("opt", "all-layer"), ("mixtral", "layer-wise"))]
    _match_the_replay(cases, tmp_path)


@pytest.mark.slow
def test_swin_bias_table_and_mamba_train_on_zero3_with_two_processes_and_match_the_replay(tmp_path):
    """Swin's relative position bias table (an input-free module, its output broadcast over the (B·windows, heads,
    N, N) attention scores after its forward, when ZeRO-3 has partitioned the table) and Mamba's mixer (A_log, D,
    and its conv1d's and dt_proj's parameters read without calling them) on ZeRO-3 with 2 processes, Poisson
    micro-batches of 0 to several examples (σ = 0): all-layer with every parameter partitioned and no prefetch (the
    copies' backward gathers the parameters itself) and layer-wise with DeepSpeed's defaults, equal to the
    single-process replay from per-example gradients, each of these parameters' update included (tiny for the
    first stage's tables: compared relative to the replay's)."""
    from harness import ZERO3_EVERY_PARAM_PARTITIONED, expected_params, run_cases

    cases = [dict(name=f"zoo_{k}_{clip}", model=f"zoo:{k}", stage=3, sigma=0.0, C=0.5, clipping=clip,
                  clipping_fn="abadi", poisson=True, accumulate=1, steps=3, n=24, batch_size=3, lr=0.5, oracle="loop",
                  zero_config=config)
             for k in ["swin"] + (["mamba"] if zoo.has_mamba() else [])
             for clip, config in (("all-layer", ZERO3_EVERY_PARAM_PARTITIONED), ("layer-wise", {}))]
    results = run_cases(cases, tmp_path, world_size=2, timeout=900)
    _assert_replayed(cases, results)
    for case in cases:
        res, want = results[case["name"]], expected_params(case, results[case["name"]])
        direct = [k for k in want if any(d in k for d in DIRECT_NAMES)]
        assert direct, case["name"]
        for k in direct:  # before, ZeRO-3's hook cut the table's gradient: it did not move, within 1e-5 of the replay
            step, done = want[k].float() - res["init"][k], res["final"][k] - res["init"][k]
            assert step.abs().max() > 0, (case["name"], k)
            torch.testing.assert_close(done, step, rtol=1e-2, atol=1e-9, msg=lambda m: f"{case['name']} {k}: {m}")


@pytest.mark.slow
def test_linear_expert_moe_trains_on_zero3_with_two_processes_and_matches_the_replay(tmp_path):
    """Mixtral with nn.Linear experts on the rows gathered for each (token_major.Gathered: each expert's rows laid
    out per example, a different number per example and micro-batch, none included) on ZeRO-3 with 2 processes and
    Poisson micro-batches of 0 to several examples (σ = 0), all-layer and layer-wise: equal to the single-process
    replay. Every expert runs in every forward, on no row if none chose it, so both ranks gather the same layers."""
    cases = [dict(name=f"zoo_mixtral_linear_{clip}", model="zoo:mixtral_linear", stage=3, sigma=0.0, C=0.5,
                  clipping=clip, clipping_fn="abadi", poisson=True, accumulate=1, steps=3, n=24, batch_size=3, lr=0.5,
                  oracle="loop") for clip in ("all-layer", "layer-wise")]
    _match_the_replay(cases, tmp_path)


def _match_the_replay(cases, tmp_path):
    """Run ``cases`` on 2 processes; each ends at its step count, moved, and equal to its one-process replay."""
    from harness import run_cases

    _assert_replayed(cases, run_cases(cases, tmp_path, world_size=2, timeout=900))


def _assert_replayed(cases, results):
    """Each case ended at its step count with its ledger, moved, and equals its one-process replay."""
    from harness import expected_params

    for case in cases:
        res = results[case["name"]]
        assert res["global_step"] == case["steps"] and len(res["ledger"]["entries"]) >= 1, case["name"]
        want = expected_params(case, res)
        moved = max(float((res["final"][k] - res["init"][k]).abs().max()) for k in want)
        assert moved > 1e-4, case["name"]
        for k, v in want.items():
            torch.testing.assert_close(res["final"][k], v.float(), rtol=0, atol=1e-5,
                                       msg=lambda m: f"{case['name']} {k}: {m}")


@pytest.mark.slow
def test_torch_transformer_modules_train_on_zero3_with_two_processes_and_match_the_replay(tmp_path):
    """nn.TransformerEncoder under a float -inf causal mask with is_causal=True, on padded ids through the
    nested-tensor path (taken by forwards without gradients: the layout check's), and nn.TransformerDecoder with a
    float tgt_mask, on ZeRO-3 with 2 processes and Poisson micro-batches of 0 to several examples (σ = 0): equal to
    the single-process replay."""
    cases = [dict(name=f"zoo_{k}_{clip}", model=f"zoo:{k}", stage=3, sigma=0.0, C=0.5, clipping=clip,
                  clipping_fn="abadi", poisson=True, accumulate=1, steps=3, n=24, batch_size=3, lr=0.5, oracle="loop")
             for k, clip in (("torch_encoder_lm", "all-layer"), ("torch_padded", "layer-wise"),
                             ("torch_seq2seq", "layer-wise"))]
    _match_the_replay(cases, tmp_path)


@pytest.mark.slow
def test_embeddings_on_shared_indices_train_on_zero3_with_two_processes_and_match_the_replay(tmp_path):
    """nanoGPT's ``wpe(torch.arange(T))`` and T5's trainable relative attention bias (embeddings on indices shared by
    every example, their outputs broadcast over the batch after the layer's forward) on ZeRO-3 with 2 processes and
    Poisson micro-batches of 0 to several examples (σ = 0), all-layer and layer-wise: equal to the single-process
    replay from per-example gradients."""
    cases = [dict(name=f"zoo_{k}_{clip}", model=f"zoo:{k}", stage=3, sigma=0.0, C=0.5, clipping=clip,
                  clipping_fn="abadi", poisson=True, accumulate=1, steps=3, n=24, batch_size=3, lr=0.5, oracle="loop")
             for k, clip in (("nanogpt", "all-layer"), ("nanogpt", "layer-wise"), ("t5", "layer-wise"),
                             ("t5", "all-layer"))]
    _match_the_replay(cases, tmp_path)
