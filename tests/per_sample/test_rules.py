"""Registering rules and matching them to modules: the public ``@register_rule`` (the documented rule for a
custom layer, run as the page shows it, against the torch.func oracle), a pure ``find_rule`` whose child
ownership is worked out per engine, and rules that keep no state between engines or threads."""

from __future__ import annotations

import doctest
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dpzero.per_sample import (LayerRule, PerExampleMismatchError, PerSampleEngine, UnsupportedLayerError,
                                         check_per_example, register_rule)
from lightning_dpzero.per_sample import registry
from lightning_dpzero.per_sample.registry import find_rule
from oracle import clipped_sum, per_example_grads

DOC = Path(__file__).resolve().parents[2] / "docs" / "api" / "per-sample.md"


def _doc_blocks(section: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(section)
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)


@pytest.fixture(scope="module")
def doc_rule() -> dict:
    """The namespace after running the page's custom-rule blocks as pasted (the second runs its check)."""
    ns: dict = {"__name__": "doc_example"}
    blocks = _doc_blocks("## Writing a rule for a new layer")
    assert len(blocks) == 2
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), ns)
    return ns


@pytest.mark.parametrize("clipping", ["all-layer", "layer-wise"])
def test_documented_custom_rule_matches_the_oracle(doc_rule, clipping):
    Scale, ScaleRule = doc_rule["Scale"], doc_rule["ScaleRule"]
    assert type(find_rule(Scale(3))) is ScaleRule and ScaleRule.module_types == (Scale,)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    x, y = torch.randn(6, 2, 3), torch.randn(6, 2, 2)  # two positions per example
    loss_fn = F.mse_loss
    names = [n for n, _ in model.named_parameters()]
    groups = [[n for n in names if n.startswith(f"{k}.")] for k in range(3)] if clipping == "layer-wise" else None
    ref = clipped_sum(model, per_example_grads(model, loss_fn, x, y), 0.05, clipping, groups=groups)
    engine = PerSampleEngine(model, max_grad_norm=0.05, clipping=clipping).attach()
    assert [type(h.rule) for h in engine.hooks][1] is ScaleRule
    with engine.micro_batch(batch_size=6):
        loss_fn(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-7, msg=n)
    assert engine.stats["clipped"] > 0


def test_the_documented_check_catches_a_wrong_rule(doc_rule):
    """The page's check fails for a rule whose norms are wrong (here: squared norms doubled)."""
    Scale, ScaleRule = doc_rule["Scale"], doc_rule["ScaleRule"]

    class WrongScale(Scale):
        def forward(self, x):  # overrides forward, so the Scale rule does not apply to it by itself
            return x * self.weight

    @register_rule(WrongScale)
    class WrongRule(ScaleRule):
        def norm_sq(self, site, mask):
            return [2 * sq for sq in super().norm_sq(site, mask)]

    model = nn.Sequential(nn.Linear(3, 4), WrongScale(4), nn.Linear(4, 2))
    with pytest.raises(PerExampleMismatchError):
        check_per_example(model, torch.randn(8, 3), torch.randn(8, 2), F.mse_loss)


def test_register_rule_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(registry.register_rule, "register_rule", globs={}):
        assert test.examples
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


def test_register_rule_refuses_what_it_cannot_register():
    with pytest.raises(TypeError, match="needs the layer classes"):
        register_rule()
    with pytest.raises(TypeError, match="neither an nn.Module subclass"):
        register_rule(int)
    with pytest.raises(TypeError, match="neither an nn.Module subclass"):
        register_rule("Conv1D")  # a name needs its package
    with pytest.raises(TypeError, match="decorates a LayerRule subclass"):
        register_rule(nn.Identity)(object)


def test_a_rule_registered_by_name_matches_that_package_only():
    @register_rule("my_layers_pkg.Gate")
    class GateRule(LayerRule):
        pass

    inside = type("Gate", (nn.Module,), {"__module__": "my_layers_pkg.blocks"})
    elsewhere = type("Gate", (nn.Module,), {"__module__": "other_pkg.blocks"})
    prefix_only = type("Gate", (nn.Module,), {"__module__": "my_layers_pkg_extra"})
    assert type(find_rule(inside())) is GateRule
    assert find_rule(elsewhere()) is None and find_rule(prefix_only()) is None


def test_find_rule_is_pure_and_ownership_is_per_engine():
    """Matching an attention layer does not change how its ``out_proj`` is matched later; the engine works
    out which children a parent's rule owns, so the same projection reused as a plain head in another model
    is clipped there by the Linear rule."""
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    find_rule(mha)
    assert type(find_rule(mha.out_proj)).__name__ == "LinearRule"

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    attn = PerSampleEngine(Attn()).attach()
    assert [h.name for h in attn.hooks] == ["mha"]  # out_proj is the attention rule's, not a layer of its own
    assert attn.zero3_leaf_types == [nn.MultiheadAttention]
    attn.detach()
    head = nn.Sequential(mha.out_proj)  # the same projection, reused on its own
    engine = PerSampleEngine(head).attach()
    assert [type(h.rule).__name__ for h in engine.hooks] == ["LinearRule"] and engine.zero3_leaf_types == []
    x = torch.randn(3, 5, 4)
    with engine.micro_batch(batch_size=3):
        head(x).pow(2).mean().backward()
    assert mha.out_proj.weight.grad is not None
    engine.detach()


def test_an_owned_child_left_uncovered_is_refused_with_its_owner():
    """An attention layer whose rule cannot apply (a parameter it does not know) leaves its ``out_proj``
    uncovered: both are refused, the projection naming the layer that owns it."""
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    mha.extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(UnsupportedLayerError) as err:
        PerSampleEngine(nn.Sequential(mha)).attach()
    msg = str(err.value)
    assert "'0.extra' of MultiheadAttention" in msg and "does not know (extra)" in msg
    # one line per module, naming each of its uncovered parameters
    assert re.search(r"'0\.out_proj\.weight', '0\.out_proj\.bias' of \w+ '0\.out_proj': the rule of the layer that owns",
                     msg)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(13, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(),
                                  nn.Linear(16, 16))
        self.norm = nn.GroupNorm(4, 16)

    def forward(self, idx):
        return self.norm(self.body(idx).transpose(1, 2))  # (B, channels, T)


def _pass(model, engine, idx):
    model.zero_grad(set_to_none=True)
    with engine.micro_batch(batch_size=idx.shape[0]):
        model(idx).pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, dict(engine.last_paths)


def test_two_engines_in_two_threads_see_only_their_own_state():
    """Two models with the same layer types, clipped by two engines in two threads at once, get exactly the
    gradients and the recorded paths of running alone (the shared rules hold nothing of either)."""
    torch.manual_seed(0)
    models = [_Net(), _Net()]
    inputs = [torch.randint(0, 13, (4, 32)), torch.randint(0, 13, (6, 3))]  # reuse vs instantiate shapes
    engines = [PerSampleEngine(m, max_grad_norm=0.1, clipping=c).attach()
               for m, c in zip(models, ["layer-wise", "all-layer"])]
    alone = [_pass(m, e, x) for m, e, x in zip(models, engines, inputs)]
    assert alone[0][1] != alone[1][1]  # the two models take different paths
    results: list[list] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(k):
        try:
            start.wait()
            for _ in range(20):
                results[k].append(_pass(models[k], engines[k], inputs[k]))
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in (0, 1):
        for grads, paths in results[k]:
            assert paths == alone[k][1]
            for n, g in grads.items():
                assert torch.equal(g, alone[k][0][n]), n
    for e in engines:
        e.detach()
