"""FSDP2 state (DTensors in the model and optimizer state dicts) moves between two 2-rank replica
groups, shard by shard, through HTTPTransport and PGTransport (fresh tensors and in place), bit for
bit: four real processes on CPU with Gloo (tests/_dtensor_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import communicate_or_interrupt

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dtensor_worker.py")


@pytest.mark.timeout(100)
def test_fsdp2_state_round_trips_bit_for_bit_through_both_transports(processes, tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = {}
    for group in (0, 1):
        for rank in (0, 1):
            out = tmp_path / f"g{group}r{rank}.json"
            procs[(group, rank)] = (out, processes.python(
                WORKER, "--group", str(group), "--rank", str(rank), "--store", f"127.0.0.1:{store.port}",
                "--out", str(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for (group, rank), (out, proc) in procs.items():
        log = communicate_or_interrupt(proc, 90)
        assert proc.returncode == 0, f"group {group} rank {rank}:\n{log[-3000:]}"
    res = {key: json.loads(out.read_text()) for key, (out, _) in procs.items()}
    assert res[(0, 0)]["kinds"] == ["DTensor"]  # FSDP2 state dict values are DTensors
    for rank in (0, 1):
        source, healer = res[(0, rank)], res[(1, rank)]
        assert healer["initial"] != source["initial"]
        assert healer["http_received"] == source["initial"]
        assert healer["after_http"] == source["initial"]
        assert healer["pg_received"] == source["initial"]
        assert healer["scrambled"] != source["initial"]
        assert healer["after_pg_in_place"] == source["initial"]
    assert res[(0, 0)]["initial"] != res[(0, 1)]["initial"]  # each rank moved its own shard, not a gathered copy
