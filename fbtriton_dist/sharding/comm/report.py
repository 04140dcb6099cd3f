"""``comm_report``: the bytes one step of a sharded collection sent and received, next to
the planner's estimate. Reads the step's pooling factors from the device (a sync: not for
the hot path)."""

from fbtriton_dist.planner import CostModel, evaluate, to_table_specs


def _value(v):
    """A device tensor or number, or a function computing it (fixed shapes compute late)."""
    return v() if callable(v) else v


def comm_report(ebc) -> dict[str, dict[str, float]]:
    """Bytes rank ``ebc.rank`` sent to / received from other ranks in the last step of the
    ShardedEmbeddingBagCollection ``ebc``, per collective (``input_dist.header``,
    ``input_dist.data``, ``output_dist.*``, ``data_parallel.grad_all_gather``), next to the
    planner's estimate of what it receives (``fbtriton_dist.planner`` cost model at the
    measured batch size and pooling factors, the wire's id, length and value sizes; pooled
    values in the wire format, an 8-bit format's row scales included),
    ``output_dist.forward.inter_host`` (the part of the output dist that crossed hosts) and
    ``input_dist.dedup`` (data bytes without dedup and the bytes it saved); with replica
    groups, ``replica_sync``: the bytes sent to / received from the replica group
    (``replica_sync="step"``: the last step's lookup batches and row gradients, padded to the
    largest replica's, as all-gathers; N: the last average of weights and optimizer state,
    as a ring all-reduce moves it, and ``per_step``: that divided by N)."""
    last = ebc.last_step_stats
    if last is None:
        raise RuntimeError("comm_report: no step has run yet")
    B, sizes = last["B"], last["batch_sizes"]
    strides = last.get("strides")  # a VBE step's rows per (rank, feature)
    traffic = dict(last["traffic"]) | ebc.output_dist_.traffic(sizes, strides)
    per_feature = _value(last["per_feature"]).tolist()
    pooling = {f: n / max(B, 1)
               for f, n in zip(ebc.layout.feature_names, per_feature, strict=True)}
    specs = to_table_specs(ebc.table_configs(), pooling_factors=pooling)
    id_bytes = max(d.itemsize for d in ebc.input_dist_.id_dtype)
    fwd, bwd = ebc.output_dist_.formats
    model = CostModel.with_wire(fwd.name, bwd.name, batch_size=max(B, 1), index_bytes=id_bytes,
                                length_bytes=4)
    cost = evaluate(ebc.plan, specs, model=model).ranks[ebc.rank]
    report = {k: {"sent": float(s), "received": float(r)} for k, (s, r) in traffic.items()}
    ids_sent, ids_received = _value(last["ids"])
    report["input_dist.data"] |= {"ids_sent": float(ids_sent),
                                  "ids_received": float(ids_received)}
    raw_sent, raw_received = last["without_dedup"]
    data = report["input_dist.data"]
    report["input_dist.dedup"] = {
        "sent_without_dedup": float(raw_sent),
        "received_without_dedup": float(raw_received),
        "saved_sent": float(raw_sent - data["sent"]),
        "saved_received": float(raw_received - data["received"]),
    }
    measured_in = sum(r for k, (_, r) in traffic.items() if k.startswith("input_dist."))
    measured_out = sum(r for k, (_, r) in traffic.items() if not k.startswith("input_dist."))
    report["input_dist.total"] = {"received": float(measured_in),
                                  "planner_estimate": float(cost.input_dist_bytes)}
    report["output_dist.total"] = {"received": float(measured_out),
                                   "planner_estimate": float(cost.output_dist_bytes)}
    sent, received = ebc.output_dist_.inter_host(sizes, strides)  # a part of output_dist.forward
    report["output_dist.forward.inter_host"] = {"sent": float(sent), "received": float(received)}
    replicas = getattr(ebc, "replicas", None)
    if replicas is not None:
        traffic = ebc.replica_traffic
        entry = {"sent": float(traffic.sent), "received": float(traffic.received)}
        if replicas.sync != "step":
            entry["per_step"] = float(traffic.received) / replicas.sync
        report["replica_sync"] = entry
    return report
