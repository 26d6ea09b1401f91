"""The one place that decides how a site's per-example weight gradients are formed: ghost norm,
instantiation, or instantiate-and-reuse, and whether a site may keep per-example tensors for its clipped sum.

For a matrix product over T rows per example (Linear, convolution as unfolded patches, HF Conv1D,
attention projections; :mod:`.maths`), three ways give the squared norm of each example's weight gradient
``G = Σ_t g_t a_tᵀ`` (p×d) and the clipped sum ``Σ_i c_i G_i``:

* **ghost + matmul**: ``‖G‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s)`` (Li et al. 2021; extra cost ``2T²(d+p)``
  flops, memory ``O(T²)``), then the clipped sum as one matmul of coefficient-scaled output gradients: the
  matmul a non-DP backward does anyway, so the norm is the only extra work;
* **instantiate + matmul**: ``‖G‖²`` from the ``(B, p, d)`` per-example tensor (an extra ``2T·p·d`` flops
  and a ``B·p·d`` tensor), then the same matmul;
* **instantiate and reuse**: the per-example ``G_i`` (their bmm costs the multiply-adds of the batch
  weight gradient it replaces) give the norm *and* the clipped sum ``Σ_i c_i G_i`` (a ``(B,)·(B, p·d)``
  product): no second matmul; the extra cost is memory traffic over ``B·p·d`` values (written once, read
  for the norm and for the sum). Only possible when the site keeps them until its clipped sum
  (:func:`may_keep`).

The choice is made per call from the shapes actually seen (:func:`choose_path`), by a cost model that
counts the extra flops of the ghost norm against the memory traffic of instantiation, with a memory cap
(the per-example tensor at most :data:`REUSE_MEMORY_FACTOR` times the layer's own input rows and output
gradients): no ``B·p·d`` tensor for a layer whose ghost norm is cheaper. Normalisation layers, whose
per-example gradients ``(B, p)`` are always instantiated, ask only :func:`may_keep`.
"""

from __future__ import annotations

import torch

#: flop-equivalents of one per-example-gradient element kept for reuse (written once, read twice, fp32),
#: by device type. CPU: fitted to ``benchmarks/per_layer.py`` (T=128: d=p=256 → ≈46, d=256 p=1024 → ≈84,
#: T=512 d=p=64 → ≈90; the prototype's measured excess over non-DP, divided by p·d). CUDA: a roofline
#: estimate, not measured (12 bytes per element at ~4 TB/s against ~800 TFLOP/s of 16-bit tensor cores, or
#: ~60 TFLOP/s in fp32): ``benchmarks/gpu.sh`` measures the per-layer paths on a GPU.
REUSE_COST = {"cpu": 64.0, "cuda": 2000.0, "cuda_fp32": 200.0}
#: reuse only when ``p·d ≤ REUSE_MEMORY_FACTOR · T·(d+p)``: the per-example gradients at most this many times
#: the layer's own rows (input and output gradient) — bounds the peak memory a layer adds in its backward
REUSE_MEMORY_FACTOR = 2.0
#: a site whose group completes later (all-layer, group-wise) keeps its per-example gradients until then only
#: when they are at most this fraction of the rows keeping them lets it drop: its output gradient and its share
#: of its input (an input read by n layers, such as q, k and v, is freed only when all n drop it), so that
#: book-keeping's memory does not grow. Normalisation layers, small convolution kernels, and a Linear whose
#: input no other layer reads with ``p·d ≤ T·(d+p)`` (a decoder's attention output projection at d = 256,
#: T = 128; measured on the benchmark GPT in one process: all-layer 1.29 → 1.26 of non-DP, the same allocator peak)
DEFERRED_KEEP_FACTOR = 1.0

#: a convolution's per-example gradients and norms are formed for part of the batch at a time, each part's
#: temporaries (unfolded rows and Gram matrices, or the grouped kernel's copies of its inputs and its per-example
#: weight gradients) within this fraction of the layer's input and output gradient: a k×k kernel's unfolded rows
#: are k² times its input, and the grouped kernel's temporaries were measured at 2-4× its output, the largest
#: tensors of a DP step of the benchmark CNN
NORM_CHUNK_FACTOR = 0.5


def use_ghost(T: int, d: int, p: int) -> bool:
    """For the norm alone: ghost when ``2T² < p·d`` (Bu et al. 2022, book-keeping layer-wise decision)."""
    return 2 * T * T < p * d


def use_reuse(T: int, d: int, p: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """Instantiate-and-reuse beats ghost + matmul (see the module docstring), where reuse is possible."""
    if T <= 1 or p * d > REUSE_MEMORY_FACTOR * T * (d + p):
        return False
    if device == "cuda":
        beta = REUSE_COST["cuda_fp32" if dtype == torch.float32 else "cuda"]
    else:
        beta = REUSE_COST.get(device, REUSE_COST["cpu"])
    return beta * p * d < 2 * T * T * (d + p) + 3 * T * T


def choose_path(T: int, d: int, p: int, reusable: bool, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> str:
    """``"reuse"``, ``"ghost"`` or ``"instantiate"`` for one call of a layer with T rows of d inputs and p
    outputs per example (per group for grouped convolutions); ``reusable``: the site may keep its
    per-example gradients until its clipped sum (:func:`may_keep`)."""
    if reusable and use_reuse(T, d, p, device, dtype):
        return "reuse"
    return "ghost" if T > 1 and use_ghost(T, d, p) else "instantiate"


def rows_path(a: torch.Tensor, g: torch.Tensor) -> str:
    """The path for the norm alone of rows ``a`` (B,T,d), ``g`` (B,T,p) that are never kept (attention)."""
    return choose_path(a.shape[1], a.shape[2], g.shape[2], reusable=False)


def fits_deferred(x, g, per_example_numel: int, readers: int = 1) -> bool:
    """May a site that does not complete its group keep ``B × per_example_numel`` values until it does, instead of
    its rows ``g`` and ``x`` (``x`` read by ``readers`` layers)?"""
    return x.shape[0] * per_example_numel <= DEFERRED_KEEP_FACTOR * (x.numel() / max(1, readers) + g.numel())


class InputReaders:
    """How many attached layers read each input in one forward pass (keyed by the input's memory), so that a
    site may count only its share of an input other layers hold too (:func:`fits_deferred`). The engine owns one
    and replaces it when a pass starts and ends.

    Example:
        >>> readers, x = InputReaders(), torch.randn(2, 3, 4)
        >>> readers.add(x); readers.add(x); readers.of(x), readers.of(torch.randn(2, 3, 4))
        (2, 1)
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[tuple, int] = {}

    @staticmethod
    def _key(x: torch.Tensor) -> tuple:
        return (x.device, x.data_ptr())

    def add(self, x) -> None:
        """One more layer reads ``x`` (a forward call; an input that is not a tensor, e.g. a packed sequence, is
        not counted)."""
        if isinstance(x, torch.Tensor):
            k = self._key(x)
            self._counts[k] = self._counts.get(k, 0) + 1

    def of(self, x) -> int:
        """The layers that read ``x`` in this pass (1 for an input never recorded)."""
        return self._counts.get(self._key(x), 1) if isinstance(x, torch.Tensor) else 1


def norm_chunk(x, g, per_example_numel: int) -> int:
    """Examples per part of a norm-only computation whose temporaries hold ``per_example_numel`` values per
    example: within :data:`NORM_CHUNK_FACTOR` of ``x`` and ``g`` together, at least one, at most the batch."""
    B = x.shape[0]
    return max(1, min(B, int(NORM_CHUNK_FACTOR * (x.numel() + g.numel())) // max(1, per_example_numel)))


def may_keep(site, per_example_numel: int) -> bool:
    """Whether ``site`` may keep ``B × per_example_numel`` per-example values for its clipped sum: always when
    that sum follows at once (``site.completes``: layer-wise), for a group completed later (all-layer,
    group-wise spanning layers) only within :data:`DEFERRED_KEEP_FACTOR` of the rows it would drop
    (:func:`fits_deferred`)."""
    if site.completes:
        return True
    return fits_deferred(site.x, site.g, per_example_numel, site.hook.engine.input_readers.of(site.x))


def weight_path(site, T: int, d: int, p: int, per_example_numel: int) -> str:
    """The path for ``site``'s weight gradient (:func:`choose_path`; reuse only for a non-empty batch the site
    may keep, :func:`may_keep`), recorded as ``site.path`` (the engine publishes it in ``last_paths``)."""
    reusable = site.x.shape[0] > 0 and may_keep(site, per_example_numel)
    site.path = choose_path(T, d, p, reusable, site.g.device.type, site.g.dtype)
    return site.path


def site_rows_path(site, a: torch.Tensor, g: torch.Tensor) -> str:
    """The path for one weight of ``site`` whose gradient is the rows ``a`` (B,T,d), ``g`` (B,T,p) (a layer with
    several such weights: an RNN's ``weight_ih``/``weight_hh``/``weight_hr`` per layer and direction):
    :func:`choose_path`, with reuse where the site completes its group or the ``(B, p, d)`` gradients fit the
    deferred budget (:data:`DEFERRED_KEEP_FACTOR` of these rows)."""
    B, T, d = a.shape
    p = g.shape[2]
    reusable = B > 0 and (site.completes or fits_deferred(a, g, d * p))
    return choose_path(T, d, p, reusable, g.device.type, g.dtype)
