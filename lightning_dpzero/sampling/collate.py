"""Collating an empty Poisson micro-batch: a batch of 0 rows with the structure, shapes and dtypes of a real one
(docs/design.md, *The mechanism*: an empty batch is a valid, noise-only step), and the one-row stand-in its
forward runs on (:func:`stand_in_batch`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate


def empty_like(batch: Any) -> Any:
    """Slice every tensor/array leaf with rows to [:0] (0-d ones, which have none, are kept), keeping tuples,
    lists, dicts and namedtuples: the batch, or a step's outputs, of no example."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0] if batch.ndim else batch
    if isinstance(batch, Mapping):
        items = {k: empty_like(v) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(empty_like(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        if all(not isinstance(v, (torch.Tensor, np.ndarray, Mapping, list, tuple)) for v in batch):
            return type(batch)()  # a per-example list of plain values (strings, ...): 0 examples
        return type(batch)(empty_like(v) for v in batch)
    return batch


class _EmptySafeCollate:
    """Picklable wrapper (DataLoader workers may be spawned); each worker caches its own template."""

    def __init__(self, collate_fn: Callable[[list], Any], dataset: Any) -> None:
        self.collate_fn, self.dataset, self._template, self._first = collate_fn, dataset, None, None
        self._stand_in_warned = False  # the stand-in could not be built: said once (stand_in_batch)

    def stand_in(self) -> Any:
        """The dataset's first example collated as a batch of one: the forward's input for an empty micro-batch
        whose model cannot run zero rows (:func:`stand_in_batch`). The example is read once, collated anew
        each time (the batch hooks may change a batch in place)."""
        if self._first is None:
            self._first = (self.dataset[0],)
        return self.collate_fn([self._first[0]])

    def __call__(self, examples: list) -> Any:
        if len(examples) > 0:
            return self.collate_fn(examples)
        if self._template is None:
            self._template = self.collate_fn([self.dataset[0]])
        return empty_like(self._template)


def empty_safe_collate(collate_fn: Callable[[list], Any] | None, dataset: Any) -> Callable[[list], Any]:
    """Wrap a collate function so an empty list of examples gives a batch with 0 rows of the right shape and
    dtype: `dataset[0]` is collated once, cached, and every tensor/array in it sliced to [:0], keeping the
    nested structure (tuples, lists, dicts, namedtuples). PyTorch's default collate raises IndexError on [].

    Example: TensorDataset(x (N, 3, 4), y (N,)) gives [x (0, 3, 4), y (0,)] with x's and y's dtypes.
    `collate_fn=None` means `default_collate`. Wrapping twice is a no-op.
    """
    if isinstance(collate_fn, _EmptySafeCollate):
        return collate_fn
    return _EmptySafeCollate(default_collate if collate_fn is None else collate_fn, dataset)


def stand_in_batch(loader: Any) -> Any:
    """A one-row batch with the structure of ``loader``'s batches, to run the forward of an empty Poisson
    micro-batch on where the model cannot run zero rows (a Hugging Face attention's ``view(B, T, -1, d)``): every
    rank then runs the same forward and backward, so ZeRO-3's gathers stay matched. Its values (the dataset's
    first example) never reach the update: the engine hands every parameter the clipped sum of no example for it
    (``PerSampleEngine.start_micro_batch``). ``None`` where the loader's collate is not the private loader's."""
    collate = getattr(loader, "collate_fn", None)
    if not isinstance(collate, _EmptySafeCollate):
        return None
    try:
        return collate.stand_in()
    except Exception as e:  # noqa: BLE001 - e.g. a dataset that opens its files in its DataLoader workers only
        if not collate._stand_in_warned:
            collate._stand_in_warned = True
            warnings.warn(f"An empty Poisson micro-batch runs on its zero rows: its one-row stand-in could not be "
                          f"built from the dataset's first example in the main process ({type(e).__name__}: {e}). "
                          "A model that cannot run zero rows fails on such a batch.", stacklevel=2)
        return None
