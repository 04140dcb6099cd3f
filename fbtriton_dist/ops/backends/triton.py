"""The Triton backend: the kernels of ``fbtriton_dist.kernels`` (the product, on CUDA; on CPU
tensors only in Triton's interpreter, ``TRITON_INTERPRET=1`` set before triton is imported).

Loading this module (the first ``backends.get("triton")``) imports triton.
"""

import os

from fbtriton_dist import optim
from fbtriton_dist.kernels.tbe_optim import OPTIMIZERS
from fbtriton_dist.ops.backends.base import Backend, Capabilities


class TritonBackend(Backend):
    def module(self):
        """``fbtriton_dist.kernels``, imported at the first call (an import statement per op
        costs host time at every lookup)."""
        kernels = self.__dict__.get("kernels")
        if kernels is None:
            from fbtriton_dist import kernels  # noqa: PLC0415 (triton only when asked for)

            self.kernels = kernels
        return kernels

    def check_device(self, device) -> None:
        """Triton on CPU tensors only with the interpreter on (set before triton's import)."""
        super().check_device(device)
        kind = getattr(device, "type", None) or str(device).split(":")[0]
        if kind == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' on CPU tensors runs the kernels in Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before Python starts (before triton is "
                "imported), or use backend='reference' / 'auto' on CPU"
            )

    def tbe_backward(self, *args, rows=None, prev_iter=None, row_counter=None,
                     max_counter=None, row_counter_max=None, **kwargs):
        """Rowwise Adagrad with counter: ``max_counter`` refreshed on the device (where the
        step about to be taken is due), then the kernels with ``row_counter`` as the third
        state, ``prev_iter`` as the second, its ``tbe_optim.COUNTER_FIELDS`` after the
        hyper-parameters (a host-to-device copy per step: not in a CUDA graph)."""
        optimizer = kwargs.get("optimizer")
        if not isinstance(optimizer, optim.RowWiseAdagradWithCounter):
            return self.module().tbe_backward(*args, **kwargs)
        import torch  # noqa: PLC0415

        from fbtriton_dist.kernels.tbe_optim import counter_hyper  # noqa: PLC0415 (triton)

        if row_counter is None or prev_iter is None or max_counter is None:
            raise ValueError("rowwise_adagrad_with_counter: expected the module's prev_iter, "
                             "row_counter and max_counter (ops.tbe.FusedOptimizer.counters), "
                             "got none")
        step, freq = kwargs["step"], optimizer.max_counter_update_freq
        with torch.no_grad():
            if freq > 0:  # before the update of step t = step + 1, where t % freq == 0
                top = (row_counter_max.reshape(1) if row_counter_max is not None else
                       row_counter.max().reshape(1) if row_counter.numel() else
                       torch.zeros(1, device=row_counter.device))
                max_counter.copy_(torch.where((step + 1) % freq == 0, top + 1.0, max_counter))
            base = kwargs.get("hyper")
            if base is None:
                base = torch.tensor(optim.hyper_parameters(optimizer), dtype=torch.float32)
            hyper = torch.cat([base.to(max_counter.device),
                               torch.tensor(counter_hyper(optimizer), dtype=torch.float32,
                                            device=max_counter.device), max_counter])
        kwargs.update(hyper=hyper, momentum2=prev_iter, momentum3=row_counter)
        return self.module().tbe_backward(*args, **kwargs)

    def tbe_linearize(self, *args, **kwargs):
        return self.module().tbe_linearize(*args, **kwargs)

    def tbe_backward_plan(self, *args, **kwargs):
        return self.module().tbe_backward_plan(*args, **kwargs)

    def bucketize_grid(self, sf_key, device):
        from fbtriton_dist.kernels.bucketize import by_feature  # noqa: PLC0415 (triton)

        return by_feature(sf_key).to(device)

    def bucketize_into(self, values, offsets, weights, sf_key, lo, hi, B, *outs, grid=None,
                       check=None, capacity=None):
        """The kernels check every id and bag themselves given ``check``; without it, bags past
        the values are clamped to them."""
        if check is None:
            offsets = offsets.clamp(max=values.numel())
        return self.module().bucketize_into(
            values, offsets, weights, sf_key, lo, hi, B, *outs, table=grid, check=check,
            capacity=capacity,
        )

    def segment_plan(self, counts, group_first, group_base):
        """The kernel holds the whole table in one program; bigger ones take the reference's
        torch ops (no host sync either way)."""
        from fbtriton_dist import reference  # noqa: PLC0415
        from fbtriton_dist.kernels.bucketize import plan_fits  # noqa: PLC0415 (triton)

        impl = self.module() if plan_fits(*counts.shape) else reference
        return impl.segment_plan(counts, group_first, group_base)

    def id_index(self, keys, last_seen):
        from fbtriton_dist.kernels.id_remap import HashIndex  # noqa: PLC0415 (triton)

        return HashIndex(keys, last_seen)


BACKEND = TritonBackend(
    "triton",
    Capabilities(
        devices=("cuda", "cpu"),  # cpu: in Triton's interpreter only (check_device)
        optimizers=tuple(name for name in optim.NAMES if name in OPTIMIZERS),
        capturable=True,
        bounds_check_in_kernel=True,
        plan_ahead=True,
        # host: on CUDA the kernels read and update rows in pinned host memory in place
        tiers=("device", "host", "cached", "file"),
    ),
    "fbtriton_dist.kernels",
)
