"""Per-example losses for token models: each example's loss is the mean over its own tokens.

DP-SGD bounds one example's influence by clipping its gradient, which needs a loss that is a mean (or sum) over
examples of terms that each depend on one example only. A mean over every token of the micro-batch (Hugging
Face's ``model(..., labels=labels)`` loss, ``F.cross_entropy`` over ``(B·T)`` flattened tokens) weights example
i by ``B·T_i/ΣT_j``: its gradient depends on the other examples' lengths and clipping no longer bounds it. The
strategy refuses such a loss before the update; these functions compute the per-example one instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .util.options import LossReduction, check_option

__all__ = ["causal_lm_loss", "token_loss"]


def token_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
               reduction: LossReduction = "mean") -> torch.Tensor:
    """Cross-entropy per token, averaged over each example's own labelled tokens, then over the examples.

    For sequence-to-sequence models (labels aligned with the decoder's logits) and token classification.

    Args:
        logits: ``(B, T, V)`` scores (16-bit ones are computed in float32).
        labels: ``(B, T)`` class indices; ``ignore_index`` marks tokens without a label (padding).
        ignore_index: the label of tokens that do not count (-100, what Hugging Face's collators pad with).
        reduction: ``"mean"`` over the examples (with the strategy's default ``loss_reduction="mean"``) or
            ``"sum"`` (with ``loss_reduction="sum"``).

    Returns:
        A scalar: ``mean_i`` (or ``sum_i``) of ``(1/T_i) Σ_t CE(logits[i, t], labels[i, t])`` over the ``T_i``
        labelled tokens of example i; an example without any labelled token adds 0.

    Raises:
        ValueError: ``logits`` not ``(B, T, V)`` with ``labels`` ``(B, T)``, or another ``reduction``.

    Example:
        >>> logits = torch.zeros(2, 3, 5)                       # uniform: each token costs log 5
        >>> labels = torch.tensor([[1, 2, -100], [4, -100, -100]])
        >>> round(float(token_loss(logits, labels)), 4), round(float(torch.tensor(5.0).log()), 4)
        (1.6094, 1.6094)
    """
    check_option("reduction", reduction, LossReduction)
    if logits.dim() != 3 or tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"token_loss needs logits (B, T, V) and labels (B, T); got logits {tuple(logits.shape)} and "
                         f"labels {tuple(labels.shape)}.")
    b, t, v = logits.shape
    if logits.dtype not in (torch.float32, torch.float64):  # 16-bit scores: the softmax in float32, as HF does
        logits = logits.float()
    per_token = F.cross_entropy(logits.reshape(b * t, v), labels.reshape(b * t), ignore_index=ignore_index,
                                reduction="none").view(b, t)
    counts = (labels != ignore_index).sum(1).clamp(min=1)
    per_example = per_token.sum(1) / counts
    return per_example.mean() if reduction == "mean" else per_example.sum()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                   reduction: LossReduction = "mean") -> torch.Tensor:
    """Next-token cross-entropy of a causal language model, per example: token t's logits predict label t + 1
    (the shift Hugging Face's ``ForCausalLM`` models make), averaged over each example's own labelled tokens,
    then over the examples. Use it in place of ``model(input_ids, attention_mask, labels=labels).loss``:
    ``causal_lm_loss(model(input_ids, attention_mask=attention_mask).logits, labels)``.

    Args:
        logits: ``(B, T, V)`` the model's scores at every position.
        labels: ``(B, T)`` the token ids (usually ``input_ids``), ``ignore_index`` at padding and at prompt
            tokens that should not be learnt.
        ignore_index: see :func:`token_loss` (-100).
        reduction: ``"mean"`` or ``"sum"`` over the examples, as the strategy's ``loss_reduction``.

    Returns:
        A scalar: ``mean_i`` (or ``sum_i``) of ``(1/T_i) Σ_t CE(logits[i, t], labels[i, t + 1])``.

    Raises:
        ValueError: as :func:`token_loss`.

    Example:
        >>> logits = torch.zeros(2, 4, 5)
        >>> labels = torch.tensor([[0, 1, 2, 3], [0, 4, -100, -100]])  # 3 and 1 tokens to predict
        >>> round(float(causal_lm_loss(logits, labels)), 4)
        1.6094
    """
    return token_loss(logits[:, :-1], labels[:, 1:], ignore_index, reduction)
