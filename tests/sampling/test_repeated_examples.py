"""A training dataset that reaches one example more than once through ``Subset`` and ``ConcatDataset`` (repeated
indices, the same dataset twice, overlapping Subsets, at any depth) is refused before the first update, on the
Trainer's and Fabric's path alike (``sampling/repeats.py``): the example would be drawn at a multiple of q and could add a
multiple of C to one update, while N counted it as several examples."""

import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset, TensorDataset

from lightning_dpzero.sampling.repeats import check_no_repeated_examples
from lightning_dpzero.mechanism import DPMechanism

DATA = TensorDataset(torch.arange(80.0), torch.zeros(80, dtype=torch.long))


def _private(dataset, batch_size=4):
    return DPMechanism(1.0, 1.0, seed=0).private_loader(DataLoader(dataset, batch_size=batch_size), 1)


def test_a_subset_repeating_example_0_seventeen_times_is_refused():
    """The oversampling the weighted-sampler refusal missed: 80 indices, example 0 seventeen times of them.
    Before, N = 80 and example 0 was drawn at up to 17 q, up to 17 times into one update."""
    oversampled = Subset(DATA, [0] * 17 + list(range(17, 80)))
    assert len(oversampled) == 80
    with pytest.raises(ValueError, match="reaches example 0 of the TensorDataset at dataset.dataset 17 times"):
        _private(oversampled)


@pytest.mark.parametrize("dataset, where, times", [
    # the same dataset object twice
    (ConcatDataset([DATA, DATA]), "dataset.datasets[0]", 2),
    # overlapping Subsets of one dataset (example 5 in both)
    (ConcatDataset([Subset(DATA, range(0, 6)), Subset(DATA, range(5, 10))]), "dataset.datasets[0].dataset", 2),
    # nested: a Subset of a Subset reaches DATA[3]; a Subset inside a ConcatDataset inside a Subset too
    (Subset(ConcatDataset([Subset(Subset(DATA, [3, 4]), [0]), Subset(DATA, [3, 7])]), [0, 1, 2]),
     "dataset.dataset.datasets[0].dataset.dataset", 2),
    # Python's negative indices: -80 is example 0
    (Subset(DATA, [0, -80, 1]), "dataset.dataset", 2),
])
def test_repeats_through_any_wrapper_are_refused_naming_where(dataset, where, times):
    with pytest.raises(ValueError, match=rf"of the TensorDataset at {where.replace('[', '.').replace(']', '.')} "
                                         rf"{times} times"):
        check_no_repeated_examples(dataset)


def test_distinct_examples_through_wrappers_pass():
    for dataset in (DATA, Subset(DATA, [5, 1, 3]), ConcatDataset([Subset(DATA, range(40)), Subset(DATA, range(40, 80))]),
                    Subset(ConcatDataset([DATA, TensorDataset(torch.arange(3.0))]), [0, 80, 81, 82, 79]),
                    ConcatDataset([DATA, TensorDataset(torch.arange(80.0))])):  # equal copies: another object
        check_no_repeated_examples(dataset)
    assert _private(Subset(DATA, range(0, 80, 2))).batch_sampler.num_samples == 40


def test_an_index_out_of_range_is_named():
    with pytest.raises(ValueError, match="has the index 80, outside its dataset of 80 examples"):
        check_no_repeated_examples(Subset(DATA, [0, 80]))


def test_fabric_refuses_a_repeating_subset_before_the_first_step():
    from lightning.fabric import Fabric
    from torch import nn

    from lightning_dpzero import DPFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=DPFabricStrategy(stage=2, noise_multiplier=1.0))
    fabric.launch()
    net = nn.Linear(1, 2)
    fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="reaches example 0 .* 17 times"):
        fabric.setup_dataloaders(DataLoader(Subset(DATA, [0] * 17 + list(range(17, 80))), batch_size=4))
    assert fabric.strategy.ledger is None
