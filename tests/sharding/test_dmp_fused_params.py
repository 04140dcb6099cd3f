"""TorchRec's sharder ``fused_params`` (FBGEMM's TBE options) naming the fused optimizer:
our sharder maps them (``optim_fused_params.py``) and trains as TorchRec's own sharder with
the same ``fused_params`` (FBGEMM's CPU TBE) on a one-rank DMP; every optimizer's keys map to
its config with FBGEMM's defaults; keys that do not map are refused by name."""

import copy

import pytest
import torch

from tests.sharding.test_dmp import _batch, _configs, _Model


def _dmp(model, sharder):
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan

    fused = sp.row_wise(compute_kernel="fused")  # TorchRec's sharder would pick dense first
    plan = ShardingPlan({"ebc": sp.construct_module_sharding_plan(
        model.ebc, {c.name: fused for c in model.ebc.embedding_bag_configs()},
        sharder=sharder, local_size=1, world_size=1, device_type="cpu")})
    return DistributedModelParallel(model, sharders=[sharder], plan=plan,
                                    device=torch.device("cpu"))


def test_fused_params_train_as_torchrecs_sharder(tmp_path):
    """Rowwise Adagrad by ``fused_params`` alone (no annotation): 3 steps, weights equal to
    TorchRec's. ``weight_decay`` without ``weight_decay_mode`` is FBGEMM's NONE (no decay;
    our config's own default is L2, which would differ)."""
    import torch.distributed as dist
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as Theirs

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.3,
             "eps": 0.01, "weight_decay": 0.5}
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        configs = _configs()[:2]
        torch.manual_seed(0)
        theirs = _Model(torchrec.EmbeddingBagCollection(tables=copy.deepcopy(configs)))
        ours = _Model(fbtriton_dist.EmbeddingBagCollection(tables=copy.deepcopy(configs)))
        ours.load_state_dict(theirs.state_dict())
        start = {k: v.clone() for k, v in theirs.state_dict().items()}
        sharder = EmbeddingBagCollectionSharder(local_world_size=1, fused_params=fused)
        dmps = [_dmp(ours, sharder), _dmp(theirs, Theirs(fused_params=fused))]
        for dmp in dmps:  # TorchRec's sharded tables start from their init_fn
            with torch.no_grad():
                for key, value in dmp.state_dict().items():
                    if hasattr(value, "local_shards"):
                        value.local_shards()[0].tensor.copy_(start[key])
        for step in range(3):
            for dmp in dmps:
                dmp(_batch(configs, step, 0, 8)).sum().backward()
        for key in (f"ebc.embedding_bags.{c.name}.weight" for c in configs):
            mine, ref = (dmp.state_dict()[key].local_shards()[0].tensor for dmp in dmps)
            assert not torch.equal(ref, start[key])  # it trained
            torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()


def test_every_optimizer_maps_and_unknown_keys_are_refused():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from fbtriton_dist import optim
    from fbtriton_dist.optim_fused_params import from_fused_params
    from tests.fbgemm_config import (
        EmainplaceModeDefinition,
        EnsembleModeDefinition,
        WeightDecayMode,
    )

    def mapped(name, **keys):
        return from_fused_params({"optimizer": name, **keys})[0]

    want = {  # FBGEMM's defaults where not given: lr 0.01, eps 1e-8, weight_decay_mode NONE
        "sgd": (mapped(EmbOptimType.EXACT_SGD, learning_rate=0.3), optim.SGD(lr=0.3)),
        "adagrad": (mapped("exact_adagrad"), optim.Adagrad(eps=1e-8)),
        "rowwise_adagrad": (mapped(EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.1),
                            optim.RowWiseAdagrad(weight_decay=0.1, weight_decay_mode="none")),
        "adam": (mapped(EmbOptimType.ADAM, beta2=0.99),
                 optim.Adam(lr=0.01, betas=(0.9, 0.99))),
        "partial_rowwise_adam": (mapped(EmbOptimType.PARTIAL_ROWWISE_ADAM, eps=0.1),
                                 optim.PartialRowWiseAdam(eps=0.1)),
        "lamb": (mapped(EmbOptimType.LAMB, beta1=0.8), optim.LAMB(betas=(0.8, 0.999))),
        "partial_rowwise_lamb": (mapped("PARTIAL_ROWWISE_LAMB", weight_decay=0.2),
                                 optim.PartialRowWiseLAMB(weight_decay=0.2)),
        "lars_sgd": (mapped(EmbOptimType.LARS_SGD, eta=0.01, momentum=0.5),
                     optim.LarsSGD(eta=0.01, momentum=0.5)),
        "ftrl": (mapped("ftrl", learning_rate=0.2, l1=0.1), optim.FTRL(lr=0.2, l1=0.1)),
        "emainplace_rowwise_adagrad": (
            mapped(EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD,
                   emainplace_mode=EmainplaceModeDefinition(step_ema=3, step_start=2)),
            optim.EmaInplaceRowWiseAdagrad(step_ema=3, step_start=2, weight_decay_mode="none")),
        "rowwise_rmsprop_ar": (mapped("rowwise_rmsprop_ar", ar_alpha=0.1),
                               optim.RowWiseRMSpropAR(ar_alpha=0.1)),
        "rowwise_adagrad_with_counter": (
            mapped(EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay_mode=WeightDecayMode.COUNTER),
            optim.RowWiseAdagradWithCounter(eps=1e-8, weight_decay_mode="counter")),
        "ensemble_rowwise_adagrad": (
            mapped(EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD,
                   ensemble_mode=EnsembleModeDefinition(step_ema=3, step_swap=5)),
            optim.EnsembleRowWiseAdagrad(step_ema=3, step_swap=5)),
        "rowwise_adagrad_global_decay": (
            mapped(EmbOptimType.EXACT_ROWWISE_ADAGRAD, weight_decay=0.1,
                   weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL,
                   global_weight_decay={"start_iter": 3, "lower_bound": 0.5}),
            optim.RowWiseAdagradGlobalDecay(eps=1e-8, weight_decay=0.1,
                                            global_weight_decay={"start_iter": 3,
                                                                 "lower_bound": 0.5})),
    }
    assert sorted(want) == sorted(optim.NAMES)  # every registry optimizer
    for name, (got, expected) in want.items():
        assert got == expected, name
    assert from_fused_params({"optimizer_state_dtypes": {"momentum1": "bf16"}}) == (
        None, {"momentum1": "bf16"})
    assert mapped(EmbOptimType.EXACT_ROWWISE_ADAGRAD, momentum=0.9) is not None  # its default
    with pytest.raises(ValueError, match=r"rowwise_adagrad does not read \['momentum'\]"):
        mapped(EmbOptimType.EXACT_ROWWISE_ADAGRAD, momentum=0.5)
    with pytest.raises(ValueError, match=r"fused_params\['cache_load_factor'\]: expected a key"):
        mapped(EmbOptimType.EXACT_SGD, cache_load_factor=0.2)
    with pytest.raises(ValueError, match=r"fused_params\['optimizer'\]: expected one of .*got "
                                         r"<EmbOptimType.SGD"):
        mapped(EmbOptimType.SGD)  # FBGEMM's non-exact SGD: no equivalent
    with pytest.raises(ValueError, match=r"adam does not read \['ensemble_mode'\]"):
        mapped(EmbOptimType.ADAM, ensemble_mode=EnsembleModeDefinition())


def test_sharder_refuses_a_second_optimizer():
    """``fused_params``' optimizer with ``optimizer=`` raises at once; with a different
    ``apply_optimizer_in_backward`` annotation, when the module is sharded."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist import optim
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    with pytest.raises(ValueError, match="expected one fused optimizer, got SGD"):
        EmbeddingBagCollectionSharder(fused_params=fused, optimizer=optim.SGD(lr=0.1))
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=_configs()[:1])
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.2})
    with pytest.raises(ValueError, match=r"ebc: expected one fused optimizer, got "
                                         r"SGD\(lr=0.1\) from fused_params and SGD\(lr=0.2\)"):
        EmbeddingBagCollectionSharder(fused_params=fused).shard(ebc, {}, None, None, "ebc")
