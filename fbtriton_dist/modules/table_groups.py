"""What the unsharded collections (``EmbeddingBagCollection``, ``EmbeddingCollection``) share:
per-table parameters that are views into the flat buffer of one ``TableBatchedEmbedding`` per
group of tables, kept bound to it across ``.to()`` / ``load_state_dict(assign=True)``, and the
fused optimizer that ``apply_optimizer_in_backward`` annotations ask for."""

from collections.abc import Sequence

import torch
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.modules.tbe import TableBatchedEmbedding


class TableGroups(nn.Module):
    """Base of the collections. A subclass sets, in its ``__init__``:

    - ``_tables_attr``: the ``nn.ModuleDict`` attribute holding one module per table
      (TorchRec's name: ``embedding_bags`` / ``embeddings``), each with a ``weight``;
    - ``_table_configs``: the table configs, in config order;
    - ``_groups``: group key -> the config indices of its tables;
    - ``_tbes``: one TableBatchedEmbedding per group, in ``_groups`` order (not submodules:
      the per-table parameters are).
    """

    _tables_attr = "embedding_bags"
    _table_configs: list
    _groups: dict
    _tbes: list[TableBatchedEmbedding]

    def table_configs(self) -> list:
        """The table configs, in config order (a table's index here is its ``members`` id)."""
        return self._table_configs

    def group_params(self, members: Sequence[int]) -> list[nn.Parameter]:
        """The per-table parameters (``weight``) of the tables ``members`` (config indices)."""
        tables = getattr(self, self._tables_attr)
        return [tables[self._table_configs[t].name].weight for t in members]

    _group_params = group_params  # the name modules/ebc_op.py and ec_op.py still use

    def tbe_groups(self) -> list[tuple[TableBatchedEmbedding, list[int]]]:
        """``(tbe, members)`` per group: its TableBatchedEmbedding and the config indices of
        its tables."""
        return list(zip(self._tbes, self._groups.values(), strict=True))

    def _bind(self, tbe: TableBatchedEmbedding, params: list[nn.Parameter]) -> None:
        """Make sure the TBE reads the parameters' current storage: after ``.to()``, a
        ``load_state_dict(assign=True)`` or a ``.data`` swap, pack them into one buffer again
        and make the parameters views of it."""
        flat = tbe.weights
        esize = flat.element_size()
        bound = all(
            p.device == flat.device
            and p.dtype == flat.dtype
            and p.is_contiguous()
            and p.data_ptr() == flat.data_ptr() + a * esize
            for p, a in zip(params, tbe.table_offsets, strict=False)
        )
        if bound:
            return
        packed = torch.cat([p.detach().reshape(-1) for p in params])
        tbe.weights = nn.Parameter(packed, requires_grad=False)
        for p, view in zip(params, tbe.split_embedding_weights(), strict=True):
            p.data = view

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()``...: convert the parameters, then rebuild each
        group's buffer from them; the TBEs' own buffers (layout, optimizer state) only move."""
        super()._apply(fn, recurse)
        for tbe, members in zip(self._tbes, self._groups.values(), strict=True):
            params = self._group_params(members)
            tbe.weights = nn.Parameter(params[0].detach().new_empty(0), requires_grad=False)
            if tbe.on_meta:  # built on meta: to_empty (reset_parameters zeroes the state)
                tbe.to_empty(device=params[0].device)
            else:
                tbe.to(params[0].device)
            self._bind(tbe, params)
        self._device = self._tbes[0].weights.device
        return self

    def _fused_optimizer(self, members: Sequence[int]) -> optim.Optimizer | None:
        """The fused optimizer asked for by ``apply_optimizer_in_backward`` on this group's
        parameters (all or none of them, with one optimizer), or None."""
        params = self._group_params(members)
        specs = [optim.in_backward_annotation(p) for p in params]
        if all(s is None for s in specs):
            return None
        names = [self._table_configs[t].name for t in members]
        if any(s != specs[0] for s in specs):
            raise ValueError(
                f"tables {names}: apply_optimizer_in_backward must give tables of one group "
                f"({self._group_what}) the same optimizer (or none); got {specs}"
            )
        cls, kwargs = specs[0]
        return optim.from_torch(cls, dict(kwargs), f"tables {names}")

    _group_what = "dtype and pooling"

    def sync_optimizer(self, tbe: TableBatchedEmbedding, members: Sequence[int]):
        """Give the group's TBE the fused optimizer its parameters are annotated with."""
        fused = self._fused_optimizer(members)
        if fused != tbe.optimizer:
            tbe.set_optimizer(fused)
            tbe.weights.requires_grad_(False)  # gradients go to the per-table parameters
        return fused

    def fused_optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        """The fused optimizer's state, keyed as the sharded module's:
        ``<tables>.<table>.weight.<i>`` (rowwise Adagrad ``[E, 1]``, others ``[E, D]``) and
        ``step``. Views of the live state: torch.distributed.checkpoint loads in place."""
        out = {"step": torch.tensor(max((tbe.step for tbe in self._tbes), default=0))}
        for tbe, members in zip(self._tbes, self._groups.values(), strict=True):
            if self.sync_optimizer(tbe, members) is None:
                continue
            for t, states in zip(members, tbe.split_optimizer_states(), strict=True):
                for i, state in enumerate(states):
                    key = f"{self._tables_attr}.{self._table_configs[t].name}.weight.{i}"
                    out[key] = state.view(-1, 1) if state.dim() == 1 else state
        return out

    def load_fused_optimizer_state_dict(self, state: dict) -> None:
        """After ``fused_optimizer_state_dict()`` was loaded in place: restore the step."""
        for tbe in self._tbes:
            tbe.step = int(state["step"])

    def _reset_tables(self, init) -> None:
        """Fused optimizer states and steps to zero, then ``init(cfg, weight)`` per table."""
        if self._device.type == "meta":
            return
        for tbe in self._tbes:
            tbe.reset_optimizer_states()
        for cfg, weight in zip(self._table_configs, self._group_params(
                range(len(self._table_configs))), strict=True):
            with torch.no_grad():
                init(cfg, weight)


def refuse_data_parallel(what: str) -> None:
    """A fused optimizer under DistributedDataParallel is wrong: every rank would update its
    own full replica with its own gradients. TorchRec's DistributedModelParallel does that to a
    module it has no sharder for; say what to do instead."""
    if torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is not None:
        raise RuntimeError(
            f"fbtriton_dist.{what} with a fused optimizer "
            "(apply_optimizer_in_backward) runs inside DistributedDataParallel: every rank "
            "would replicate every table and update it with its own gradients only. TorchRec's "
            "DistributedModelParallel does this when it has no sharder for our module; pass "
            f"sharders=[fbtriton_dist.sharding.dmp.{what}Sharder()] "
            "to DistributedModelParallel, or shard the model with fbtriton_dist.shard(model, plan)"
        )
