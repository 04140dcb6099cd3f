"""Managed tables against the hashing trick (``raw % E``) on drifting data at the same
memory: collisions and AUC of the job configs/jobs/managed.yaml.

    python -m fbtriton_dist.bench managed [--steps 300] [--scale 1.0] [--seed 0]
                                          [--dense-weight 1.0] [--out rows.json]
    python -m fbtriton_dist.bench managed --tiny          # CI: a few small steps

The job: DLRM over four tables, the drifting source (``data.synthetic.drift``: raw int64 ids,
``new_ids_per_step`` ids born per feature and step, a window of live ids per table, each id's
popularity fixed for its life). Every variant trains from the same seed on the same raw ids;
only what a table does with them differs:

- ``hash_rows``: no table managed, ids folded ``raw % E`` into the managed tables' rows E;
- ``hash_bytes``: the same, each table given the rows its managed twin's bytes buy (row +
  optimizer state + the id map's ``keys``/``counts``/``last_seen``/``sketch``, counted from
  the managed model's buffers);
- ``managed``: the job's id managers (``t_user`` LRU with ``min_count: 2``, ``t_item`` LFU,
  ``t_query`` TTL);
- ``managed_lru`` / ``managed_lfu``: every managed table that policy (admission as the job's).

``--scale`` multiplies the managed tables' capacities (and so every variant's rows);
``--dense-weight 0`` makes the labels depend on the ids alone (the dense features' part of the
hidden logit dominates otherwise, and with it the AUC). Each row:
variant, eval AUC and loss on the held-out batches of the windows right after training (the
job's last evaluation), the last train loss, the seconds it trained, and per drifting table:
its rows, the distinct ids of those eval batches, how many of them share a row with another
of them (collisions: ``% E`` puts distinct ids on one row; a managed table never does: it
sends ids without a slot to its default row, counted apart as ``default``), and a managed
table's slot hit rate over the run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
import tempfile
import time

import torch
import yaml

from fbtriton_dist.train.config import job_from_dict
from fbtriton_dist.train.env import Env
from fbtriton_dist.train.job import build, make_plan
from fbtriton_dist.train.loop import Trainer
from fbtriton_dist.train.sources import make_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "configs", "jobs", "managed.yaml")
VARIANTS = ("hash_rows", "hash_bytes", "managed", "managed_lru", "managed_lfu")


def base_job(steps: int, scale: float, tiny: bool, seed: int = 0,
             dense_weight: float = 1.0) -> dict:
    """configs/jobs/managed.yaml as a mapping, ``steps`` long, capacities times ``scale``,
    seeded by ``seed`` (weights and data), the dense part of the labels' logit scaled by
    ``dense_weight`` (``data.synthetic.drift.dense_weight``)."""
    with open(JOB, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    data["seed"] = seed
    data["data"]["synthetic"]["drift"]["dense_weight"] = dense_weight
    for t in data["tables"]:
        m = t.get("id_manager")
        if m is not None:
            m["capacity"] = max(1, round(m["capacity"] * scale * (0.2 if tiny else 1.0)))
            t["num_embeddings"] = m["capacity"] + 1
    if tiny:
        data["data"]["synthetic"]["drift"].update(window=600, new_ids_per_step=25)
    data["train"] = {"steps": steps, "batch_size": 64 if tiny else 256, "eval_every": 0,
                     "eval_batches": 2 if tiny else 32}
    data["checkpoint"] = {"enabled": False}
    data["logging"] = {"log_every": max(1, steps // 5), "progress_bar": False}
    return data


def variant_job(base: dict, variant: str, rows: dict[str, int] | None = None) -> dict:
    """The job of ``variant``; ``rows``: each hashed table's rows (``hash_bytes``)."""
    data = copy.deepcopy(base)
    for t in data["tables"]:
        m = t.get("id_manager")
        if m is None:
            continue
        if variant.startswith("hash"):
            del t["id_manager"]
            t["num_embeddings"] = (rows or {}).get(t["name"], t["num_embeddings"])
        elif variant in ("managed_lru", "managed_lfu"):
            m["eviction"] = variant.removeprefix("managed_")
            m.pop("ttl_steps", None)
    return data


def map_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Per managed table, the bytes of its id map's persistent buffers."""
    out: dict[str, int] = {}
    for name, buf in model.named_buffers():
        parts = name.split(".")
        if "_managed_collision_modules" in parts:
            table = parts[parts.index("_managed_collision_modules") + 1]
            out[table] = out.get(table, 0) + buf.numel() * buf.element_size()
    return out


def train_variant(data: dict, run_dir: str):
    """Train the job ``data`` in this process; ``(summary, model, cfg, seconds)``."""
    data = {**data, "logging": {**data["logging"], "run_dir": run_dir}}
    cfg = job_from_dict(data, JOB, os.path.dirname(JOB))
    env = Env(rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
              process_group=None)
    plan, _ = make_plan(cfg, 1, 1)
    built = build(cfg, env, plan)
    source = make_source(cfg.tables, cfg.data, batch_size=cfg.train.batch_size, seed=cfg.seed,
                         rank=0, world_size=1)
    trainer = Trainer(cfg, env, built.model, built.optimizer, built.dense_params,
                      built.embedding_fqns, source, mode="plain")
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        summary = trainer.fit()
    return summary, built.model, cfg, time.perf_counter() - t0


def _collided(ids: torch.Tensor, rows: torch.Tensor, default: int | None) -> tuple[int, int]:
    """Of the distinct ``ids`` (their ``rows``): how many share a row (not ``default``) with
    another distinct id, and how many read ``default``."""
    pairs = torch.unique(torch.stack([rows, ids]), dim=1)
    row, per_row = torch.unique(pairs[0], return_counts=True)
    shared = int(per_row[(per_row > 1) & (row != (default if default is not None else -1))].sum())
    on_default = int(per_row[row == default].sum()) if default is not None else 0
    return shared, on_default


def collisions(model, managed_cfg, cfg, steps: int) -> dict[str, dict[str, int]]:
    """Per drifting table of ``cfg``: rows, distinct ids of the eval batches after ``steps``,
    those sharing a row, those on the default row. The raw ids come from the managed job's
    source (every variant draws the same ones)."""
    raw_source = make_source(managed_cfg.tables, managed_cfg.data,
                             batch_size=cfg.train.batch_size, seed=cfg.seed, rank=0,
                             world_size=1)
    batches = raw_source.eval_batches_at(steps, cfg.train.eval_batches)
    drifting = raw_source.drifting
    managers = {}
    for m in model.modules():
        if type(m).__name__ == "ManagedCollisionCollection":
            managers.update(m.managers())
    out = {}
    for t in cfg.tables.tables:
        features = [f for f in t.features if f in drifting]
        if not features:
            continue
        ids = torch.cat([b.sparse.to_dict()[f].values() for b in batches for f in features])
        if t.name in managers:
            slots, _, _ = managers[t.name].remap(ids, update=False)
            shared, default = _collided(ids, slots, managers[t.name].config.default_row)
        else:
            shared, default = _collided(ids, torch.remainder(ids, t.num_embeddings), None)
        out[t.name] = {"rows": t.num_embeddings, "ids": int(torch.unique(ids).numel()),
                       "collided": shared, "default": default}
    return out


def run(args) -> list[dict]:
    base = base_job(args.steps, args.scale, args.tiny, args.seed, args.dense_weight)
    rows_out = []
    managed_cfg = None
    hash_rows: dict[str, int] = {}
    order = ["managed", *[v for v in args.variants if v != "managed"]]
    with tempfile.TemporaryDirectory() as tmp:
        for variant in order:
            data = variant_job(base, variant, hash_rows if variant == "hash_bytes" else None)
            summary, model, cfg, seconds = train_variant(data, os.path.join(tmp, variant))
            if variant == "managed":
                managed_cfg = cfg
                optim_bytes = 4  # rowwise_adagrad: one fp32 per row
                for t in cfg.tables.tables:
                    extra = map_bytes(model).get(t.name)
                    if extra is not None:
                        per_row = t.embedding_dim * 4 + optim_bytes
                        hash_rows[t.name] = t.num_embeddings + extra // per_row
            if variant not in args.variants:
                continue
            ids = summary.get("id_managers", {})
            tables = collisions(model, managed_cfg, cfg, args.steps)
            for name, d in tables.items():
                if name in ids:
                    d["hit_rate"] = ids[name]["hit_rate"]
            rows_out.append({"variant": variant, "eval_auc": summary["eval_auc"],
                             "eval_loss": summary["eval_loss"],
                             "train_loss": summary["train_loss"], "train_s": seconds,
                             "tables": tables})
            print(f"# {variant} done in {seconds:.1f} s", file=sys.stderr, flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fbtriton_dist.bench managed",
                                description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the managed tables' capacities (every variant's rows)")
    p.add_argument("--seed", type=int, default=0, help="the job's seed (weights and data)")
    p.add_argument("--dense-weight", type=float, default=1.0,
                   help="the dense features' share of the labels' logit (0: ids alone)")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--tiny", action="store_true", help="CI: small tables, a few steps")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: expected some of {list(VARIANTS)}, got {bad}")
    if args.tiny:
        args.steps = min(args.steps, 24)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    print(f"# configs/jobs/managed.yaml steps={args.steps} scale={args.scale} seed={args.seed} "
          f"dense_weight={args.dense_weight} tiny={args.tiny} "
          f"threads={torch.get_num_threads()} torch {torch.__version__}")
    print("# per drifting table: rows / distinct eval ids / ids sharing a row with another "
          "(collided) / ids on the default row; hit: slot hit rate over the run")
    names = list(rows[0]["tables"]) if rows else []
    head = " ".join(f"{n:>34}" for n in names)
    print(f"{'variant':12} {'eval_auc':>8} {'eval_loss':>9} {'train_s':>7} {head}")
    for r in rows:
        cells = []
        for n in names:
            d = r["tables"][n]
            hit = f" hit {d['hit_rate']:.3f}" if "hit_rate" in d else ""
            cells.append(f"{d['rows']}/{d['ids']}/{d['collided']}/{d['default']}{hit}".rjust(34))
        print(f"{r['variant']:12} {r['eval_auc']:8.4f} {r['eval_loss']:9.4f} "
              f"{r['train_s']:7.1f} {' '.join(cells)}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
