"""The aten operators a piece of code runs (for tests of how much work a backward does)."""

from torch.utils._python_dispatch import TorchDispatchMode


class AtenOps(TorchDispatchMode):
    """Records the aten operators run while active, by name (``names``: in order, repeats included)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def count(self, *names: str) -> int:
        """How many calls of any of ``names`` (``"rsqrt"`` counts ``rsqrt`` and the in-place ``rsqrt_``)."""
        return sum(n.rstrip("_") in names for n in self.names)
