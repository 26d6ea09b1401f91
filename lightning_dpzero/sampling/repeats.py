"""Training examples that a dataset reaches more than once, through torch's ``Subset`` and ``ConcatDataset``.

DP-SGD's guarantee is per example: each example joins a step with probability q and moves the update by at most
C (the sensitivity the noise is calibrated to), and the accountant counts N distinct examples. A dataset
that holds one example twice breaks both: a ``Subset`` whose indices repeat (oversampling), the same dataset
object twice in a ``ConcatDataset``, or two ``Subset`` s of one dataset that overlap. The example is then drawn
at up to m·q, can be in one update m times (m·C), and N counts it m times. (Weighted samplers, the other way to
oversample, are refused by :func:`~lightning_dpzero.sampling.check_sampler_describable`.)

:func:`check_no_repeated_examples` maps every index of the training dataset through the wrappers, nested to any
depth, to (the dataset that holds the example, its index there) and refuses a pair reached twice. Wrappers other
than ``Subset`` and ``ConcatDataset`` are taken as datasets of their own (their examples are not looked
into), and two different dataset objects holding copies of the same data are not detected.
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np
from torch.utils.data import ConcatDataset, Subset

__all__ = ["check_no_repeated_examples"]

#: (a dataset that is no Subset or ConcatDataset, where it sits in the training dataset, its indices reached)
_Piece = tuple[Any, str, Union[range, np.ndarray]]


def _pieces(dataset: Any, path: str) -> list[_Piece]:
    """Every example of ``dataset`` as (leaf dataset, its path, indices into it), in pieces (in no set order)."""
    if isinstance(dataset, ConcatDataset):
        return [p for i, d in enumerate(dataset.datasets) for p in _pieces(d, f"{path}.datasets[{i}]")]
    if isinstance(dataset, Subset):
        inner = _pieces(dataset.dataset, f"{path}.dataset")
        return _select(inner, np.asarray(dataset.indices, dtype=np.int64).reshape(-1), path)
    return [(dataset, path, range(len(dataset)))]


def _select(inner: list[_Piece], index: np.ndarray, path: str) -> list[_Piece]:
    """The pieces a Subset at ``path`` reaches with ``index`` into the concatenation of ``inner``."""
    ends = np.cumsum([len(ix) for _, _, ix in inner])
    n = int(ends[-1]) if len(ends) else 0
    index = np.where(index < 0, index + n, index)  # Python's negative indices: -1 is the last example
    if index.size and (index.min() < 0 or index.max() >= n):
        bad = int(index[(index < 0) | (index >= n)][0])
        raise ValueError(f"The training dataset's Subset at {path} has the index {bad}, outside its dataset of "
                         f"{n} examples. Give it indices in [0, {n}).")
    which = np.searchsorted(ends, index, side="right")
    out = []
    for k in np.unique(which):
        leaf, leaf_path, ix = inner[k]
        local = index[which == k] - (int(ends[k - 1]) if k else 0)
        out.append((leaf, leaf_path, local if isinstance(ix, range) else ix[local]))
    return out


def check_no_repeated_examples(dataset: Any) -> None:
    """Refuse a training dataset that reaches one example more than once (see the module docstring).

    Cost: nothing for a dataset without ``Subset``; else one sort of the indices the Subsets reach.

    Raises:
        ValueError: naming the dataset holding the repeated example, where it sits (``dataset.datasets[1]...``),
            the most repeated index and how often it is reached, and the fix.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> data = TensorDataset(torch.arange(10.0))
        >>> check_no_repeated_examples(ConcatDataset([Subset(data, [0, 1]), Subset(data, [2, 3])]))
        >>> check_no_repeated_examples(Subset(data, [0, 0, 1]))
        Traceback (most recent call last):
        ...
        ValueError: The training dataset reaches example 0 of the TensorDataset at dataset.dataset 2 times ...
    """
    if not isinstance(dataset, (Subset, ConcatDataset)):
        return
    by_leaf: dict[int, list[_Piece]] = {}
    for piece in _pieces(dataset, "dataset"):
        by_leaf.setdefault(id(piece[0]), []).append(piece)
    for pieces in by_leaf.values():
        if len(pieces) == 1 and isinstance(pieces[0][2], range):
            continue  # the whole of a dataset reached once
        index = np.sort(np.concatenate([np.asarray(ix, dtype=np.int64) for _, _, ix in pieces]))
        repeated = index[1:] == index[:-1]
        if not repeated.any():
            continue
        values, counts = np.unique(index, return_counts=True)
        worst = int(np.argmax(counts))
        leaf, path = pieces[0][0], pieces[0][1]
        raise ValueError(
            f"The training dataset reaches example {int(values[worst])} of the {type(leaf).__name__} at {path} "
            f"{int(counts[worst])} times ({int((counts > 1).sum())} of its examples more than once): a Subset with "
            "repeated indices, the same dataset twice in a ConcatDataset, or overlapping Subsets of one dataset. "
            "DP-SGD bounds what one example adds to an update by max_grad_norm and counts each example once in N; "
            "an example present m times is drawn at up to m times the rate q the ledger charges and can add m x "
            "max_grad_norm to one update, so ε would be understated. Keep each example once (e.g. "
            "Subset(data, sorted(set(indices)))). Nothing was trained.")
