"""How a bag of ids becomes output rows: the one ``PoolingMode`` every layer reads.

The integer values are what the kernels take (as constexprs), what the reference and the fast
CPU path compare against, and what the native CPU kernels' ``POOL_*`` enum in
``ops/csrc/tbe_cpu.h`` must equal (``tests/ops/test_native_tables.py`` parses the header).
Modules and YAML name them in lower case (``"sum"``, ``"mean"``, ``"none"``).

This module imports nothing but the standard library: the planner, the job config and the
kernels may all read it.
"""

import enum


class PoolingMode(enum.IntEnum):
    """Pooling of one bag (FBGEMM's ``PoolingMode`` names)."""

    SUM = 0
    """Sum of the bag's rows (times their per-sample weights): ``[B, sum(D)]``."""
    MEAN = 1
    """The sum divided by the bag's length (empty bags give zeros)."""
    NONE = 2
    """No pooling (sequence embeddings): one output row per id, ``[N, max_D]``."""

    @property
    def label(self) -> str:
        """The module and YAML name: ``"sum"``, ``"mean"``, ``"none"``."""
        return self.name.lower()

    @classmethod
    def of(cls, value: "str | int | PoolingMode") -> "PoolingMode":
        """The mode named ``value`` (``"sum"``, ``"mean"``, ``"none"``, any case) or with that
        integer value; raises ``ValueError`` naming the choices."""
        if isinstance(value, str):
            found = cls.__members__.get(value.upper())
            if found is not None:
                return found
        elif isinstance(value, int) and value in cls._value2member_map_:
            return cls(value)
        raise ValueError(f"pooling: expected one of {list(LABELS)}, got {value!r}")


LABELS: tuple[str, ...] = tuple(m.label for m in PoolingMode)
"""The modules' names of the modes, in value order."""
