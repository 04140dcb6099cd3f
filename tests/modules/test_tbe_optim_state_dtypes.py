"""``optimizer_state_dtypes`` (FBGEMM's option): fused optimizer states stored in fp16 / bf16,
the update computed in fp32 from the stored value, the new state rounded to nearest when
stored (the step uses the unrounded value, as FBGEMM's kernels). Checked against the update
formula of ``test_tbe_optim_formulas.py`` in float64 with that rounding of the stored states,
on the reference, the CPU backend (its torch step: the native C update takes fp32 states
only) and the Triton kernels (interpreted on CPU)."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.conftest import TRITON_OK
from tests.helpers import device_for, make_batch, to, upstream_grad
from tests.modules.test_tbe_optim_formulas import FTM, MAX_L, TABLES, B, row_update, table_grads

OPTS = {
    "adam": optim.Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-6),
    "partial_rowwise_adam": optim.PartialRowWiseAdam(lr=0.05, betas=(0.8, 0.95), eps=1e-6,
                                                     weight_decay=0.02),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _expected(name, opt, w0, batches, pooling, state_dtypes):
    per_row_v = name.startswith("partial_rowwise")
    weights = [w.double() for w in w0]
    m = [torch.zeros(E, D, dtype=torch.float64) for E, D in TABLES]
    v = [torch.zeros(E, 1 if per_row_v else D, dtype=torch.float64) for E, D in TABLES]
    m_dtype = DTYPES[state_dtypes.get("momentum1", "fp32")]
    v_dtype = DTYPES[state_dtypes.get("momentum2", "fp32")]
    for t_step, batch in enumerate(batches, start=1):
        grads, touched = table_grads(weights, batch, pooling)
        for t in range(len(TABLES)):
            for row in sorted(touched[t]):
                w, mm, vv = row_update(name, opt, weights[t][row], grads[t][row], t_step,
                                       m[t][row], v[t][row])
                # the step used the unrounded moments; the stored ones are rounded
                weights[t][row] = w
                m[t][row], v[t][row] = mm.to(m_dtype).double(), vv.to(v_dtype).double()
            weights[t] = weights[t].float().double()  # fp32 rows
    return weights, m, v


RUNS = [  # (optimizer, state dtypes, backend)
    ("partial_rowwise_adam", {"momentum1": "bf16"}, "reference"),
    ("partial_rowwise_adam", {"momentum1": "bf16", "momentum2": "fp16"}, "cpu"),
    ("partial_rowwise_adam", {"momentum1": torch.float16}, "triton"),
    ("adam", {"momentum1": "fp16", "momentum2": "bf16"}, "reference"),
    ("adam", {"momentum1": "fp16", "momentum2": "bf16"}, "cpu"),
    ("adam", {"momentum2": "bf16"}, "triton"),
]


def _id(run):
    name, dtypes, backend = run
    return "-".join([backend, name, *(f"{k}={optim.state_dtype_names({k: v})[k]}"
                                      for k, v in dtypes.items())])


@pytest.mark.parametrize(("name", "state_dtypes", "backend"), RUNS, ids=list(map(_id, RUNS)))
def test_matches_the_formula_with_rounded_states(name, state_dtypes, backend):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    opt = OPTS[name]
    dev = device_for(backend)
    torch.manual_seed(7)
    tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend=backend, device=dev,
                                optimizer_state_dtypes=state_dtypes)
    names = optim.state_dtype_names(state_dtypes)
    for state in optim.spec_of(opt).states:
        assert getattr(tbe, state.name).dtype == DTYPES[names.get(state.name, "fp32")]
    w0 = [w.detach().cpu().clone() for w in tbe.split_embedding_weights()]
    g = torch.Generator().manual_seed(31)
    batches = []
    for step in range(3):
        indices, offsets, psw = make_batch(TABLES, FTM, B, MAX_L, weighted=step == 1, hot=True,
                                           generator=g)
        out = tbe(*to(dev, indices, offsets, psw))
        up = upstream_grad(out, step)
        out.backward(up)
        batches.append((indices, offsets, psw, up.cpu()))
    weights, m, v = _expected(name, opt, w0, batches, "sum", names)
    for ours, theirs in zip(tbe.split_embedding_weights(), weights, strict=True):
        torch.testing.assert_close(ours.detach().cpu().double(), theirs, atol=2e-5, rtol=2e-5)
    for t, (E, D) in enumerate(TABLES):
        m_ours, v_ours = (s.cpu().double() for s in tbe.split_optimizer_states()[t])
        # a state rounded at a tie or one ulp apart from float64's path: one ulp of its dtype
        torch.testing.assert_close(m_ours.reshape(E, D), m[t], atol=1e-6, rtol=8e-3)
        torch.testing.assert_close(v_ours.reshape(v[t].shape), v[t], atol=1e-7, rtol=8e-3)


def test_state_bytes_and_rounding_differs_from_fp32():
    """The stored states take the registry's bytes (half of fp32's), and rounding them moves
    the rows away from the fp32-state run (both sides: fp32 states match it exactly)."""
    entry = optim.spec("partial_rowwise_adam")
    dtypes = {"momentum1": "bf16"}
    results = {}
    for key, given in (("fp32", None), ("fp32-named", {"momentum1": "fp32"}), ("bf16", dtypes)):
        torch.manual_seed(3)
        tbe = TableBatchedEmbedding([(10, 8)], optimizer=OPTS["partial_rowwise_adam"],
                                    backend="reference", optimizer_state_dtypes=given)
        nbytes = sum(s.numel() * s.element_size() for s in (tbe.momentum1, tbe.momentum2))
        assert nbytes == entry.state_bytes(10, 8, given)
        for step in range(3):
            out = tbe(torch.tensor([1, 2, 2, 5]), torch.tensor([0, 3, 4]))
            out.backward(upstream_grad(out, step))
        results[key] = tbe.split_embedding_weights()[0].detach().clone()
    assert entry.state_bytes(10, 8, dtypes) == 2 * 10 * 8 + 4 * 10
    assert entry.state_bytes(10, 8) == 4 * 10 * 8 + 4 * 10
    assert torch.equal(results["fp32"], results["fp32-named"])
    assert not torch.equal(results["fp32"], results["bf16"])


def test_bad_state_dtypes():
    from fbgemm_gpu.split_embedding_configs import SparseType

    assert optim.state_dtype_names({"momentum1": SparseType.FP16,
                                    "momentum2": torch.bfloat16}) == {"momentum1": "fp16",
                                                                      "momentum2": "bf16"}
    with pytest.raises(ValueError, match=r"optimizer_state_dtypes: expected keys among "
                                         r"\[momentum1, momentum2, prev_iter, row_counter\], got "
                                         r"'momentum3'"):
        TableBatchedEmbedding([(4, 4)], optimizer_state_dtypes={"momentum3": "fp16"})
    with pytest.raises(ValueError, match=r"optimizer_state_dtypes\['momentum1'\]: expected one "
                                         r"of \[fp32, fp16, bf16\], got 'int8'"):
        TableBatchedEmbedding([(4, 4)], optimizer_state_dtypes={"momentum1": "int8"})
    with pytest.raises(ValueError, match=r"expected keys among \['momentum1'\] \(the states of "
                                         r"rowwise_adagrad\), got \['momentum2'\]"):
        TableBatchedEmbedding([(4, 4)], optimizer=optim.RowWiseAdagrad(),
                              optimizer_state_dtypes={"momentum2": "fp16"})


@pytest.mark.parametrize("tier", ["cached", "file"])
def test_cached_tables_keep_their_states_dtype(tier, tmp_path):
    """The backing store keeps each state in its dtype (bf16 / fp16, as the cache's slots):
    training with evictions every step is bit for bit the device table's, states included."""
    tables, ftm = [(64, 4), (20, 3)], [0, 0, 1]
    dtypes = {"momentum1": "bf16", "momentum2": "fp16"}
    path = str(tmp_path / "rows") if tier == "file" else None

    def build(storage):
        return TableBatchedEmbedding(tables, feature_table_map=ftm, backend="cpu", seed=7,
                                     optimizer=OPTS["adam"], optimizer_state_dtypes=dtypes,
                                     storage=storage)

    device = build(None)
    tiered = build([{"tier": tier, "cache_slots": 12, "path": path}, None])
    tiered.load_state_dict(device.state_dict())
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        indices, offsets = make_batch(tables, ftm, 4, 3, generator=g)[:2]
        outs = [m(indices, offsets) for m in (device, tiered)]
        assert torch.equal(outs[0], outs[1])
        for out in outs:
            out.backward(upstream_grad(out, step))
    a, b = device.state_dict(), tiered.state_dict()
    assert b["momentum1"].dtype == torch.bfloat16 and b["momentum2"].dtype == torch.float16
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert [s.dtype for s in tiered.split_optimizer_states()[0]] == [torch.bfloat16,
                                                                      torch.float16]
    assert tiered.cache_stats()["table_0"]["evictions"] > 0
