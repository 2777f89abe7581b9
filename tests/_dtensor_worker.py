"""One rank of a 2-rank FSDP2 replica group, for tests/test_dtensor_transport.py.

Group 0 is the source, group 1 the healer. Each rank builds an FSDP2 (`fully_shard`) model on CPU
with Gloo, takes an optimizer step (so the optimizer state holds DTensors too), then moves its
state dict (model + optimizer) to the same rank of the other group, shard by shard, through
HTTPTransport and through PGTransport (over an ft ProcessGroupGloo pairing rank r of both groups;
once into fresh tensors, once in place). It writes the sha256 of its local shards after each step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ft_core.checkpointing import HTTPTransport, PGTransport
from ft_core.process_groups import ProcessGroupGloo

TIMEOUT = timedelta(seconds=30)


def shard_digest(state: object) -> str:
    h = hashlib.sha256()

    def visit(obj: object, path: str) -> None:
        if isinstance(obj, DTensor):
            h.update(f"{path}:D{list(obj.shape)}{obj.placements}".encode())
            visit(obj.to_local(), path + ".local")
        elif isinstance(obj, torch.Tensor):
            h.update(f"{path}:{obj.dtype}{list(obj.shape)}".encode())
            t = obj.detach().contiguous().reshape(-1)
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                visit(obj[k], f"{path}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, f"{path}/{i}")
        else:
            h.update(f"{path}={obj!r}".encode())

    visit(state, "")
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--store", required=True)  # host:port of the test's TCPStore
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"group{args.group}", store), rank=args.rank,
                            world_size=2, timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(100 + args.group)  # the groups start different: the healer must get the source's bytes
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    results = {"initial": shard_digest(state())}
    if args.group == 0:
        results["kinds"] = sorted({type(v).__name__ for v in state()["model"].values()})

    # HTTP: the source serves its own shard; the healer's same rank fetches it
    with HTTPTransport(timeout=TIMEOUT, num_chunks=3) as http:
        if args.group == 0:
            http.send_checkpoint([1], 7, state(), TIMEOUT)
            store.set(f"http/{args.rank}", http.metadata())
            store.wait([f"http_done/{args.rank}"], TIMEOUT)
        else:
            store.wait([f"http/{args.rank}"], TIMEOUT)
            received = http.recv_checkpoint(0, store.get(f"http/{args.rank}").decode(), 7, TIMEOUT)
            results["http_received"] = shard_digest(received)
            model.load_state_dict(received["model"])
            opt.load_state_dict(received["optim"])
            results["after_http"] = shard_digest(state())
            store.set(f"http_done/{args.rank}", "1")

    # PG: an ft Gloo group pairing rank r of both groups (source is its rank 0)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    pg.configure(f"{args.store}/xfer/{args.rank}", f"g{args.group}", args.group, 2)
    fresh = PGTransport[dict[str, object]](pg, timeout=TIMEOUT)
    in_place = PGTransport[dict[str, object]](pg, timeout=TIMEOUT, state_dict=state)
    if args.group == 0:
        fresh.send_checkpoint([1], 8, state(), TIMEOUT)
        in_place.send_checkpoint([1], 9, state(), TIMEOUT)
    else:
        received = fresh.recv_checkpoint(0, "<n/a>", 8, TIMEOUT)
        results["pg_received"] = shard_digest(received)
        with torch.no_grad():  # scramble, then receive straight into the live shards
            for param in model.parameters():
                param.to_local().add_(1.0)
        scrambled = shard_digest(state())
        got = in_place.recv_checkpoint(0, "<n/a>", 9, TIMEOUT)
        model.load_state_dict(got["model"])
        opt.load_state_dict(got["optim"])
        results["scrambled"] = scrambled
        results["after_pg_in_place"] = shard_digest(state())
    pg.shutdown()
    with open(args.out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
