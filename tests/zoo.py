"""Tiny HuggingFace models with random weights (configs only, no hub), as users fine-tune them, and their data.

Each entry builds an ``nn.Module`` whose forward takes one batch-first tensor and returns logits laid out for
``F.cross_entropy(out, y)``: ``(B, classes)`` for classifiers, ``(B, V, T)`` for language models (so that the
mean over all tokens is the mean over examples of each example's token mean: every example has T tokens).
``build(kind)`` is what the one-process oracle tests and the multi-process worker (``models.build_model``)
use. More families (RNNs, EmbeddingBag) are added by adding an entry to ``ZOO``.
"""

from __future__ import annotations

import torch
from torch import nn

import zoo_moe
import zoo_torch

V, T, D = 32, 8, 16  # vocabulary, tokens per example, hidden size
ENC = 5  # T5: the first ENC tokens are the encoder's input, the rest the decoder's


def _decoder(family: str):
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=24, max_position_embeddings=32, attention_dropout=0.0,
                  attn_implementation="eager")
    config = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[family](**common)
    model = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
             "mistral": tf.MistralForCausalLM}[family](config)
    with torch.no_grad():  # HF initialises the norms to ones: make their gradients non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _opt():
    """OPT: its feed-forward block runs on the tokens as rows, hidden_states.reshape(-1, d) (B·T, d)."""
    import transformers as tf

    return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2, ffn_dim=24,
                                          num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=D,
                                          dropout=0.0, attention_dropout=0.0, attn_implementation="eager"))


def _moe(family: str):
    """A mixture of experts (Mixtral, Qwen2-MoE): router and experts get the tokens as rows (B·T, d); the experts
    are 3-D parameters (E, ·, ·) applied per expert to the tokens routed to it (HF's default grouped_mm)."""
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=24, num_experts_per_tok=2, max_position_embeddings=32, attention_dropout=0.0,
                  attn_implementation="eager")
    if family == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, **common))
    else:
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=12,
                                                         shared_expert_intermediate_size=12, **common))
    with torch.no_grad():  # HF initialises the norms to ones: make their gradients non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _swin():
    """Swin: window attention on (B·windows, window², C) rows from view → permute → view, every second block on
    shifted windows (torch.roll, and the window mask expanded over the batch). Each block's relative position bias
    table, a parameter used directly, indexed and added as (1, heads, N, N) to the (B·windows, heads, N, N)
    attention scores, trains per example through the scores' row map (broadcast.py)."""
    import transformers as tf

    model = tf.SwinForImageClassification(tf.SwinConfig(
        image_size=8, patch_size=1, num_channels=1, embed_dim=8, depths=[2, 2], num_heads=[2, 2], window_size=2,
        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0))
    with torch.no_grad():  # HF initialises the tables to zeros: make each entry's gradient its own
        for n, p in model.named_parameters():
            if "relative_position_bias_table" in n:
                p.normal_()
    return model


def _gpt2():
    import transformers as tf

    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=D, n_layer=2, n_head=2, n_positions=32,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                            bos_token_id=0, eos_token_id=0, attn_implementation="eager"))


def _t5():
    import transformers as tf

    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=D, d_kv=8, d_ff=24, num_layers=2,
                                                     num_heads=2, relative_attention_num_buckets=8,
                                                     dropout_rate=0.0, decoder_start_token_id=0,
                                                     attn_implementation="eager"))


def _bert():
    import transformers as tf

    return tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager"))


def _vit():
    import transformers as tf

    model = tf.ViTForImageClassification(tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager"))
    with torch.no_grad():  # HF initialises both near zero; make their gradients non-trivial
        model.vit.embeddings.cls_token.normal_()
        model.vit.embeddings.position_embeddings.normal_()
    return model


def _wav2vec2():
    """Wav2Vec2 for audio classification: raw audio (B, 40) through the convolutional feature encoder, the
    transformer encoder with its positional convolution under ``parametrizations.weight_norm`` (dim 2, as HF
    builds it), mean pooling and a head. SpecAugment masking and layer drop off (random per batch, as dropout)."""
    import transformers as tf

    return tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
        hidden_size=D, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, conv_dim=(8, 8),
        conv_kernel=(4, 3), conv_stride=(2, 2), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        feat_extract_norm="group", mask_time_prob=0.0, mask_feature_prob=0.0, layerdrop=0.0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, num_labels=3,
        classifier_proj_size=8, attn_implementation="eager"))


def _clip_vision():
    """CLIP's vision tower: its class embedding is a ``(d,)`` parameter used directly
    (``class_embedding.expand(B, 1, -1)``), next to the patch convolution and the position embedding."""
    import transformers as tf

    config = tf.CLIPVisionConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=D, intermediate_size=24,
                                 num_hidden_layers=2, num_attention_heads=2, projection_dim=8, attention_dropout=0.0,
                                 attn_implementation="eager")
    return _VisionHead(tf.CLIPVisionModel(config))


def _convnext():
    """ConvNeXt with layer scale: each block multiplies its output by a ``(C,)`` parameter used directly."""
    import transformers as tf

    model = tf.ConvNextForImageClassification(tf.ConvNextConfig(
        num_channels=1, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=8,
        layer_scale_init_value=0.5, drop_path_rate=0.0, num_labels=3))
    with torch.no_grad():  # one value per channel: make each channel's gradient its own
        for name, p in model.named_parameters():
            if "layer_scale" in name:
                p.uniform_(0.5, 1.5)
    return model


def _mamba():
    """Mamba: each mixer's ``A_log`` ``(2D, N)`` and ``D`` ``(2D,)`` are used directly in its selective scan (the
    reference PyTorch implementation on the CPU), and it reads its ``conv1d``'s and ``dt_proj``'s parameters without
    calling them (``F.conv1d(h, conv1d.weight.unsqueeze(1), conv1d.bias, groups=C)``, ``dt_proj.weight @ h``, the
    bias added to the time steps): all trained, as parameters used directly."""
    import transformers as tf

    return tf.MambaForCausalLM(tf.MambaConfig(vocab_size=V, hidden_size=D, state_size=4, num_hidden_layers=2,
                                              expand=2, conv_kernel=3, time_step_rank=4, use_mambapy=False))


class _VisionHead(nn.Module):
    """A vision tower and a linear head on its pooled output: pixels (B, 1, 8, 8) → logits (B, 3)."""

    def __init__(self, tower):
        super().__init__()
        self.tower, self.head = tower, nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.tower(pixel_values=x).pooler_output)


class NanoGPT(nn.Module):
    """nanoGPT's embedding: ``wte(ids) + wpe(torch.arange(T))``, the position embedding looked up at indices shared
    by every example and broadcast by the addition; then a pre-norm MLP block and the head."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.ln, self.mlp = nn.LayerNorm(D), nn.Sequential(nn.Linear(D, 24), nn.GELU(), nn.Linear(24, D))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        x = x + self.mlp(self.ln(x))
        return self.head(x).transpose(1, 2)


class LM(nn.Module):
    """A causal LM: token ids (B, T) → logits (B, V, T)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits.transpose(1, 2)


class Seq2Seq(nn.Module):
    """T5: ids (B, T) → the encoder reads ``ids[:, :ENC]``, the decoder ``ids[:, ENC:]``; logits (B, V, T-ENC)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids[:, :ENC], decoder_input_ids=ids[:, ENC:]).logits.transpose(1, 2)


class Classifier(nn.Module):
    """BERT on token ids, ViT on pixels, Wav2Vec2 on audio: (B, ...) → logits (B, classes)."""

    def __init__(self, model, key):
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x):
        return self.model(**{self.key: x}).logits


def _frozen_bias(model: nn.Module) -> nn.Module:
    """T5 with its relative attention bias frozen (the fixed-size ZeRO-3 launch; the bias trains on ZeRO-3 in
    test_embeddings_on_shared_indices_train_on_zero3_with_two_processes_and_match_the_replay)."""
    for n, p in model.named_parameters():
        p.requires_grad_("relative_attention_bias" not in n)
    return model


def has_mamba() -> bool:
    import transformers as tf

    return hasattr(tf, "MambaConfig")


#: kind -> (builder, input kind); inputs: "lm" (B, T) ids with (B, T) targets, "cls" ids with (B,) classes,
#: "padded" ids with trailing pads (0) and (B,) classes, "seq2seq" (B, T) ids with (B, T - ENC) targets, "image" (B, 1, 8, 8) pixels with (B,) classes, "audio" (B, 40)
#: samples with (B,) classes
ZOO = {
    "gpt2": (lambda: LM(_gpt2()), "lm"),
    "llama": (lambda: LM(_decoder("llama")), "lm"),
    "qwen2": (lambda: LM(_decoder("qwen2")), "lm"),
    "llama_checkpointed": (lambda: LM(_checkpointed(_decoder("llama"))), "lm"),
    "mistral": (lambda: LM(_decoder("mistral")), "lm"),
    "t5": (lambda: Seq2Seq(_t5()), "seq2seq"),
    "t5_frozen_bias": (lambda: _frozen_bias(Seq2Seq(_t5())), "seq2seq"),
    "bert": (lambda: Classifier(_bert(), "input_ids"), "cls"),
    "vit": (lambda: Classifier(_vit(), "pixel_values"), "image"),
    "wav2vec2": (lambda: Classifier(_wav2vec2(), "input_values"), "audio"),
    "clip_vision": (_clip_vision, "image"),
    "convnext": (lambda: Classifier(_convnext(), "pixel_values"), "image"),
    "nanogpt": (NanoGPT, "lm"),
    "mamba": (lambda: LM(_mamba()), "lm"),
    # token-major layers (per_sample/token_major.py): rows (B·m, d) whose examples the engine follows
    "opt": (lambda: LM(_opt()), "lm"),
    # OPT's decoder layer reshapes in its own forward, which HF's checkpointing recomputes without its hooks
    "opt_checkpointed": (lambda: LM(_checkpointed(_opt())), "lm"),
    "mixtral": (lambda: LM(_moe("mixtral")), "lm"),
    "qwen2_moe": (lambda: LM(_moe("qwen2_moe")), "lm"),
    "mixtral_linear": (lambda: LM(zoo_moe.mixtral_linear(V, D, 24)), "lm"),  # nn.Linear experts on gathered rows
    "swin": (lambda: Classifier(_swin(), "pixel_values"), "image"),
    # PyTorch's own Transformer modules (zoo_torch.py)
    "torch_encoder_lm": (zoo_torch.EncoderLM, "lm"),
    "torch_padded": (zoo_torch.PaddedClassifier, "padded"),
    "torch_seq2seq": (zoo_torch.EncoderDecoder, "seq2seq"),
}


def _checkpointed(model):
    """HuggingFace's non-reentrant activation checkpointing on: each decoder layer recomputes in the backward."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def build(kind: str) -> nn.Module:
    return ZOO[kind][0]()


def make_data(kind: str, n: int, seed: int = 42) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = ZOO[kind][1]
    if inputs == "image":
        return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    if inputs == "audio":
        return torch.randn(n, 40, generator=g), torch.randint(0, 3, (n,), generator=g)
    if inputs == "padded":
        return zoo_torch.padded_ids(n, g), torch.randint(0, 3, (n,), generator=g)
    x = torch.randint(1, V, (n, T), generator=g)
    if inputs == "cls":
        return x, torch.randint(0, 3, (n,), generator=g)
    return x, torch.randint(0, V, (n, T - ENC if inputs == "seq2seq" else T), generator=g)


#: peft ``target_modules`` per family, as a user would choose them: the attention's query and value projections
#: (GPT-2's fused ``c_attn``; ViT's and Swin's are ``q_proj``, ``v_proj`` since transformers 5); ConvNeXt has no attention: its pointwise ``nn.Linear`` layers; Mamba: its mixers'
#: input projection and x_proj (peft refuses ``out_proj`` and ``conv1d`` on Mamba: its CUDA kernels read them);
#: the ``nn.Linear`` experts too, whose adapters then get the rows gathered for each expert
LORA_TARGETS = {"gpt2": ["c_attn"], "t5": ["q", "v"], "bert": ["query", "value"], "convnext": ["pwconv1", "pwconv2"],
                "mamba": ["in_proj", "x_proj"], "mixtral_linear": ["q_proj", "v_proj", "w1", "w2", "w3"]}
#: the classifiers' new heads, trained next to the adapters (peft's ``modules_to_save``, as its SEQ_CLS task does);
#: CLIP's head is ours, outside the tower peft wraps, and trains as it is
LORA_HEADS = {"bert": ["classifier"], "vit": ["classifier"], "swin": ["classifier"], "convnext": ["classifier"],
              "wav2vec2": ["projector", "classifier"]}


def with_lora(model: nn.Module, kind: str) -> nn.Module:
    """LoRA adapters (peft, r = 2) on ``LORA_TARGETS[kind]`` (default ``q_proj``, ``v_proj``) of the wrapped
    HuggingFace model, and its classifier head in ``modules_to_save``; every other parameter frozen."""
    import peft

    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                             target_modules=LORA_TARGETS.get(kind, ["q_proj", "v_proj"]),
                             modules_to_save=LORA_HEADS.get(kind), fan_in_fan_out=kind == "gpt2")
    attr = "tower" if isinstance(model, _VisionHead) else "model"
    setattr(model, attr, peft.get_peft_model(getattr(model, attr), config))
    with torch.no_grad():  # peft starts B at zero: make the adapters' gradients and updates non-trivial
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model
