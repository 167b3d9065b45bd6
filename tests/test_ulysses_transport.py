"""bench/lab/ulysses_micro.py's copy-engine exchange (PeerPool): its routing on CPU, the device primitives stood in for.
On GPUs the micro-bench checks it against NCCL's all-to-all bit for bit (``transport_equal``) before timing it."""

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("ulysses_micro",
                                              Path(__file__).resolve().parents[1] / "bench/lab/ulysses_micro.py")
um = importlib.util.module_from_spec(spec)
spec.loader.exec_module(um)


class _World:
    """Torch's symmetric memory across ``world`` ranks in one process: the i-th buffer each rank allocates is the
    same rendezvous (as on the device, where every rank allocates in the same order)."""

    def __init__(self, world):
        self.world, self.sets, self.barriers = world, [], 0

    def rank(self, r):
        world = self

        class T:
            rank, count = r, 0

            def __init__(self):
                self.world = world.world

            def allocate(self, shape, dtype, device):
                i, self.count = self.count, self.count + 1
                if i == len(world.sets):
                    world.sets.append([torch.full(shape, float("nan"), dtype=dtype) for _ in range(world.world)])

                def barrier():
                    world.barriers += 1

                return world.sets[i][r], world.sets[i], barrier

            def side(self, device):
                return contextlib.nullcontext("done")

            def wait(self, done, device):
                assert done == "done" and device.type == "cpu"

        return T()


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_exchange_routes_like_an_all_to_all(world):
    """Part p of each rank's send buffer lands in rank p's receive buffer at the sender's slot, as NCCL's
    all_to_all_single puts it; the next exchange of the same kind reuses the same buffers."""
    send = [torch.randn(world, 3, 2) for _ in range(world)]
    fake = _World(world)
    pools = [um.PeerPool(fake.rank(r)) for r in range(world)]
    got = [pools[r].exchange(0, send[r]) for r in range(world)]
    for r in range(world):
        recv, done = got[r]
        pools[r].wait(done)
        assert torch.equal(recv, torch.stack([send[p][r] for p in range(world)])), r
    assert fake.barriers == 2 * world  # two barriers per exchange and rank
    assert pools[0].exchange(0, send[0])[0] is got[0][0] and len(fake.sets) == 1
    pools[0].exchange(1, send[0])  # another exchange of the call: a buffer of its own
    assert len(fake.sets) == 2
