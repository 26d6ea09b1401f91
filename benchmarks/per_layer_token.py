"""The token-major rows of ``benchmarks/per_layer.py``: blocks whose layers get the examples' tokens as rows
(``per_sample/token_major.py``), each a ``(B, T, d)`` → ``(B, T, d)`` module so every method's loss is
``Σ out ⊙ R``, clipped all-layer (the references' clipping: one group over the block's layers):

* ``flat_ffn``: OPT's feed-forward, ``fc2(relu(fc1(x.reshape(-1, d))))``: the rows are a reshape of the batch
  (the Linear rule on the ``(B, T, d)`` view);
* ``moe_generic``: Hugging Face's ``MixtralSparseMoeBlock`` (router and experts as 3-D parameters): the generic
  rule, one recomputation of the router and of the experts per example on that example's rows;
* ``moe_linear``: the same routing with ``nn.Linear`` experts on the rows gathered for each
  (``hidden[token_idx]``): each expert's rows laid out per example (``token_major.Gathered``), the Linear rule on
  them. The block is tests/zoo_moe.py's, loaded from its file: the one the oracle tests prove is the one timed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("flat_ffn", "moe_generic", "moe_linear")


class FlatFFN(nn.Module):
    """OPT's feed-forward block on the tokens as rows: ``(B, T, d)`` → ``(B·T, d)`` → ``(B, T, d)``."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.reshape(-1, x.shape[-1])))).view(x.shape)


def _zoo_moe():
    path = Path(__file__).resolve().parents[1] / "tests" / "zoo_moe.py"
    spec = importlib.util.spec_from_file_location("zoo_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_token_case(case: dict, B: int) -> tuple[nn.Module, torch.Tensor]:
    """The block and its ``(B, T, d)`` input for a token-major case (``layer`` in :data:`KINDS`; ``T``, ``d``,
    ``hidden``, and for the MoEs ``experts`` and ``top_k``)."""
    kind, d = case["layer"], case["d"]
    if kind == "flat_ffn":
        layer = FlatFFN(d, case["hidden"])
    elif kind == "moe_generic":
        import transformers as tf

        config = tf.MixtralConfig(hidden_size=d, intermediate_size=case["hidden"], num_local_experts=case["experts"],
                                  num_experts_per_tok=case["top_k"])
        config._experts_implementation = "grouped_mm"  # what a model's from_pretrained/__init__ picks by default
        layer = tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
        with torch.no_grad():  # HF leaves the 3-D parameters uninitialised (its _init_weights runs in from_pretrained)
            for p in layer.parameters():
                p.normal_(0, d ** -0.5)
    elif kind == "moe_linear":
        layer = _zoo_moe().LinearExpertsMoE(d, case["hidden"], case["experts"], case["top_k"])
    else:
        raise ValueError(kind)
    return layer, torch.randn(B, case["T"], d)


def token_label(case: dict) -> str:
    what = {"flat_ffn": f"OPT FFN on B·T rows h={case['hidden']}",
            "moe_generic": f"HF Mixtral MoE block (generic rule) E={case.get('experts')} top-{case.get('top_k')}",
            "moe_linear": f"MoE of nn.Linear experts on gathered rows E={case.get('experts')} top-{case.get('top_k')}"}
    return f"{what[case['layer']]} d={case['d']} T={case['T']} (all-layer)"
