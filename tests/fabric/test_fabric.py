"""``DPFabricStrategy`` in one process: the registry, a natural loop, and every refusal of a loop that would not
release exactly one charged Poisson batch per optimizer step (before anything of that step is applied). The
invariants on 1 and 2 processes, ZeRO 0-3, are in test_fabric_invariants.py."""

import math

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dpzero  # noqa: F401  (registers the strategies)
from lightning_dpzero import DPFabricStrategy, PrivacyBudgetExceeded


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def _setup(strategy="dp_deepspeed_stage_2", **configure):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.strategy.configure(**configure)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return fabric, model, optimizer


def _setup_all(strategy=None, batch_size=8, **kw):
    strategy = strategy or DPFabricStrategy(stage=2, noise_multiplier=1.0, **kw)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=batch_size))
    return fabric, model, optimizer, loader


def _step(fabric, model, optimizer, batch):
    x, y = batch
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()


def test_the_names_are_registered_with_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for stage in (0, 1, 2, 3):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=f"dp_deepspeed_stage_{stage}")
        assert isinstance(fabric.strategy, DPFabricStrategy) and fabric.strategy.zero_stage == stage
    assert "dp_deepspeed_stage_3_offload" in STRATEGY_REGISTRY


def test_a_natural_loop_charges_one_step_per_optimizer_step_and_logs_epsilon():
    fabric, model, optimizer, loader = _setup_all()
    sampler = loader.batch_sampler
    assert type(sampler).__name__ == "DistributedPoissonBatchSampler" and sampler.sample_rate == 8 / 64
    for i, batch in enumerate(loader):
        _step(fabric, model, optimizer, batch)
        metrics = fabric.strategy.privacy_metrics
        assert metrics["dp_steps"] == i + 1 == fabric.strategy.ledger.steps
        assert 0 < metrics["epsilon"] and metrics["epsilon"] >= fabric.strategy.epsilon()
        assert metrics["noise_multiplier"] == 1.0 and metrics["sample_rate"] == 0.125
    assert fabric.strategy.ledger.steps == len(loader) == 8
    # evaluation forwards are no DP steps and need no draw
    model.eval()
    with torch.no_grad():
        model(torch.randn(3, 4))
    assert fabric.strategy.ledger.steps == 8


def test_the_string_strategy_is_configured_before_the_loader():
    fabric, model, optimizer = _setup(target_epsilon=4.0, max_epochs=2)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=8))
    plan = fabric.strategy.plan
    assert plan.planned_steps == 16 and plan.noise_multiplier > 0  # σ calibrated to ε = 4 over 2 epochs
    with pytest.raises(RuntimeError, match="configure.. after fabric.setup_dataloaders"):
        fabric.strategy.configure(target_epsilon=8.0)
    assert loader is not None


def test_a_target_without_the_loops_length_is_refused():
    fabric, model, optimizer = _setup(target_epsilon=4.0)
    with pytest.raises(ValueError, match=r"max_steps=\.\.\.\) or max_epochs"):
        fabric.setup_dataloaders(DataLoader(_data(), batch_size=8))


@pytest.mark.parametrize("mistake", ["second_forward", "second_backward", "step_without_backward",
                                     "forward_without_draw", "two_draws", "closure"])
def test_a_loop_that_is_not_one_draw_one_forward_one_backward_one_step_is_refused(mistake):
    fabric, model, optimizer, loader = _setup_all()
    it = iter(loader)
    x, y = next(it)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises((RuntimeError, ValueError)) as err:
        if mistake == "forward_without_draw":
            _step(fabric, model, optimizer, (x, y))  # the loader's draw; then a batch from elsewhere
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            x, y = next(iter(DataLoader(_data(), batch_size=8)))
        if mistake == "two_draws":
            next(it)
        if mistake == "second_forward":
            model(x)
        loss = nn.functional.cross_entropy(model(x), y)
        if mistake == "step_without_backward":
            optimizer.step()
        fabric.backward(loss)
        if mistake == "second_backward":
            fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step(closure=lambda: loss) if mistake == "closure" else optimizer.step()
    message = str(err.value)
    assert "optimizer.step()" in message or "closure" in message, message
    # refused before the charge and the update
    assert fabric.strategy.ledger.steps == (mistake == "forward_without_draw")
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_the_budget_stops_the_loop_and_refuses_a_step_beyond_it():
    fabric, model, optimizer, loader = _setup_all(DPFabricStrategy(stage=2, noise_multiplier=1.0,
                                                                   target_epsilon=3.0))
    steps = 0
    while not fabric.strategy.should_stop:
        for batch in loader:
            _step(fabric, model, optimizer, batch)
            steps += 1
            if fabric.strategy.should_stop:
                break
    eps = fabric.strategy.epsilon()
    assert 0 < eps <= 3.0 and steps == fabric.strategy.ledger.steps
    guard = fabric.strategy.steps.guard
    plan = fabric.strategy.plan
    assert guard.epsilon_after_next_step(fabric.strategy.ledger, plan.sample_rate, plan.noise_multiplier,
                                         plan.sampler_kind) > 3.0
    with pytest.raises(PrivacyBudgetExceeded, match="should_stop"):
        _step(fabric, model, optimizer, next(iter(loader)))
    assert fabric.strategy.ledger.steps == steps


def _budget_loop(worker):
    """The metrics after every step of a loop the budget stops, and the strategy."""
    fabric, model, optimizer, loader = _setup_all(DPFabricStrategy(stage=2, noise_multiplier=1.0, seed=3,
                                                                   target_epsilon=3.0, accounting_worker=worker))
    if worker == "process":  # (a loop this short would otherwise end before the child has started)
        fabric.strategy.steps._ahead._pool._ready.result(timeout=300)
    seen = []
    while not fabric.strategy.should_stop:
        for batch in loader:
            _step(fabric, model, optimizer, batch)
            seen.append(fabric.strategy.privacy_metrics)
            if fabric.strategy.should_stop:
                break
    return seen, fabric.strategy


def test_each_step_s_accounting_is_answered_ahead_by_a_worker_with_the_same_values():
    """Rank 0's ε and budget answer come from a worker (a child process by default) that computed them while
    the step ran: every step's metrics and the stop are those computed inside the step; teardown stops it."""
    from lightning_dpzero.accounting.background import _ProcessPool

    inside, _ = _budget_loop("none")
    ahead, strategy = _budget_loop("process")
    pool = strategy.steps._ahead._pool
    assert isinstance(pool, _ProcessPool) and pool.ready  # the child ran and took the questions once started
    assert ahead == inside and len(inside) == strategy.ledger.steps > 1
    assert strategy.epsilon() <= 3.0 < strategy.steps.guard.epsilon_after_next_step(
        strategy.ledger, strategy.plan.sample_rate, strategy.plan.noise_multiplier, strategy.plan.sampler_kind)
    strategy.teardown()
    assert strategy.steps._ahead is None
    with pytest.raises(ValueError, match="accounting_worker"):
        DPFabricStrategy(accounting_worker="gpu")


def test_deepspeed_accumulation_and_clipping_are_refused_at_setup():
    for config, match in (({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
                          ({"gradient_clipping": 1.0}, "gradient_clipping=1.0")):
        config = {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                  "train_micro_batch_size_per_gpu": 8, **config}
        fabric = Fabric(accelerator="cpu", devices=1, strategy=DPFabricStrategy(noise_multiplier=1.0, config=config))
        fabric.launch()
        net = nn.Linear(4, 2)
        with pytest.raises(ValueError, match=match):
            fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_fabric_clip_gradients_and_reserved_checkpoint_keys_are_refused(tmp_path):
    fabric, model, optimizer, loader = _setup_all()
    with pytest.raises(ValueError, match="noisy"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
    with pytest.raises(ValueError, match="reserved"):
        fabric.save(tmp_path / "ck", {"model": model, "global_step": 3})


def test_the_first_loader_is_the_private_one_and_later_ones_are_unchanged():
    fabric, model, optimizer, loader = _setup_all()
    val = fabric.setup_dataloaders(DataLoader(_data(16), batch_size=4))
    assert type(val.batch_sampler).__name__ == "BatchSampler" and len(val) == 4
    assert fabric.strategy.plan.dataset_size == 64


def test_a_training_forward_on_a_second_loader_s_batch_is_refused_and_evaluation_on_it_is_not():
    """A second loader is left as Fabric makes it (for evaluation). Before, a loop that drew from both and trained
    on the second's batch (of the same size, so no layer's batch check noticed) trained on examples the ledger
    does not charge, sampled at a rate it does not know."""
    fabric, model, optimizer, loader = _setup_all(DPFabricStrategy(stage=2, noise_multiplier=1.0,
                                                                   poisson_sampling=False))
    other = fabric.setup_dataloaders(DataLoader(_data(16), batch_size=8))
    _step(fabric, model, optimizer, next(iter(loader)))
    model.eval()  # evaluation between steps, drawn in eval mode: not a training draw
    with torch.no_grad():
        model(next(iter(other))[0])
    model.train()
    _step(fabric, model, optimizer, next(iter(loader)))
    before = [p.detach().clone() for p in model.parameters()]
    next(iter(loader))
    second = next(iter(other))
    with pytest.raises(RuntimeError, match="drawn, in training mode, from DataLoader #2.*ConcatDataset"):
        model(second[0])
    assert fabric.strategy.ledger.steps == 2
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_an_empty_poisson_batch_is_a_noise_only_step():
    fabric, model, optimizer, loader = _setup_all(batch_size=1)  # q = 1/64: most batches are empty
    sizes = []
    for batch in loader:
        # an empty batch reaches the loop as a one-row stand-in, which the step takes no example of
        sizes.append(0 if fabric.strategy.stand_in_batch else len(batch[0]))
        assert len(batch[0]) > 0
        _step(fabric, model, optimizer, batch)
    assert 0 in sizes and fabric.strategy.ledger.steps == len(sizes)
    assert all(math.isfinite(p.abs().sum().item()) for p in model.parameters())


def test_a_loader_set_up_before_the_model_is_refused():
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DPFabricStrategy(noise_multiplier=1.0))
    fabric.launch()
    with pytest.raises(RuntimeError, match=r"fabric.setup\(model, optimizer\) first"):
        fabric.setup_dataloaders(DataLoader(_data(), batch_size=8))


def test_an_update_without_the_noise_hook_stops_training():
    # Fabric steps DeepSpeed's optimizer itself (engine.was_step_applied() stays False): the check that the noise
    # ran must still see the step as applied
    fabric, model, optimizer, loader = _setup_all()
    fabric.strategy.mechanism._noise_handle.remove()
    with pytest.raises(RuntimeError, match="without the DP noise hook"):
        _step(fabric, model, optimizer, next(iter(loader)))


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("poisson", [False, True], ids=["shuffled", "poisson"])
@pytest.mark.parametrize("mistake", ["previous_batch", "part_of_the_batch", "fixed_batch"])
def test_a_forward_of_another_batch_than_the_one_drawn_is_refused(poisson, mistake):
    """#40.7: a loop that draws every step but trains on something else (the first batch again, a fixed batch,
    some of the rows) would release updates the ledger charges as fresh samples: refused at the forward."""
    fabric, model, optimizer, loader = _setup_all(poisson_sampling=poisson, seed=5)
    it = iter(loader)
    first = next(it)
    while len(first[0]) < 2:  # (a Poisson draw of fewer than 2 rows has no strict part)
        _step(fabric, model, optimizer, first)
        first = next(it)
    _step(fabric, model, optimizer, first)
    charged, before = fabric.strategy.ledger.steps, _params(model)
    x, y = next(it)  # this step's draw
    stale = {"previous_batch": first, "part_of_the_batch": (x[: len(x) - 1], y[: len(y) - 1]),
             "fixed_batch": (torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))}[mistake]
    if mistake == "part_of_the_batch" and len(x) < 2:
        pytest.skip("the draw has fewer than 2 rows")
    with pytest.raises(RuntimeError, match="not the batch drawn from the DP loader for this step"):
        _step(fabric, model, optimizer, stale)
    assert fabric.strategy.ledger.steps == charged
    assert all(torch.equal(before[n], p) for n, p in _params(model).items())


class _DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, batch=None, *, features=None):
        return self.lin((batch["x"] if batch is not None else features).reshape(-1, 4))


class _Dicts(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randint(0, 5, (n, 4), generator=g), torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def test_the_drawn_batch_may_be_unpacked_moved_cast_and_viewed():
    """What a loop legitimately does between the draw and the forward: unpack a dict, move to the device, cast
    (integers to float), reshape with the same rows, pass it by keyword; every step trains and is charged."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DPFabricStrategy(stage=2, noise_multiplier=1.0))
    fabric.launch()
    torch.manual_seed(0)
    net = _DictNet()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(_Dicts(), batch_size=8))
    forwards = [lambda b: model({"x": b["x"].to(fabric.device).float()}),
                lambda b: model(features=b["x"].float().view(len(b["x"]), 2, 2)),
                lambda b: model({"x": b["x"].clone().double().float()})]
    for i, batch in enumerate(loader):
        fabric.backward(nn.functional.cross_entropy(forwards[i % 3](batch), batch["y"]))
        optimizer.step()
        optimizer.zero_grad()
    assert fabric.strategy.ledger.steps == len(loader) > 3


@pytest.mark.parametrize("stage", [0, 2])
def test_the_optimizer_inside_fabrics_wrapper_cannot_update_around_the_ledger(stage):
    """#40.7: ``optimizer.optimizer.step()`` steps the optimizer DeepSpeed wraps, bypassing the strategy's charge;
    the noise hook on the base optimizer refuses it before any parameter changes."""
    fabric, model, optimizer, loader = _setup_all(DPFabricStrategy(stage=stage, noise_multiplier=1.0))
    x, y = next(iter(loader))
    before = _params(model)
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match="stepped outside the DP strategy's optimizer step"):
        optimizer.optimizer.step()
    assert fabric.strategy.ledger.steps == 0
    assert all(torch.equal(before[n], p) for n, p in _params(model).items())
