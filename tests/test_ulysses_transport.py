"""--ulysses_transport: the copy-engine exchange's routing on CPU (its device primitives stood in for), and where
the option is refused. The exchange on GPUs is measured by bench/suites/transport.toml (frames against one GPU)."""

import pytest
import torch

from vdbench import parallel as P
from vdbench import cli, families
from vdbench.patching.ulysses import PeerCopyExchange, PeerPool


class _World:
    """Stand-in for torch's symmetric memory across ``world`` ranks in one process: the i-th buffer each rank
    allocates is the same rendezvous (as on the device, where every rank allocates in the same order)."""

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
                import contextlib

                return contextlib.nullcontext("done")

            def wait(self, done, device):
                assert done == "done" and device.type == "cpu"

        return T()


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_exchange_routes_like_an_all_to_all(world):
    """Each rank's sequence shard of Q goes out split by heads; every rank gets the whole sequence of its heads
    (BSHD, shards in rank order), and the output comes back to the token owners with every head in order: the NCCL
    exchange's layout, so the attention and the out-projection see the same tensors."""
    s, heads, d = 3, 2 * world, 4
    x = torch.randn(1, world * s, heads, d)
    fake = _World(world)
    pools = [PeerPool(fake.rank(r)) for r in range(world)]
    ex = [PeerCopyExchange(None, world, pools[r]) for r in range(world)]
    sends = []
    for r in range(world):
        buf, dst = ex[r].send_buffer(x[:, r * s:(r + 1) * s])
        dst.copy_(x[:, r * s:(r + 1) * s].unflatten(2, dst.shape[2:4]))
        sends.append(buf)
    handles = [ex[r].start(sends[r]) for r in range(world)]
    h = heads // world
    wholes = [ex[r].whole(handles[r]) for r in range(world)]
    for r in range(world):
        assert torch.equal(wholes[r], x[:, :, r * h:(r + 1) * h]), r
    outs = [ex[r].back_start(wholes[r] * 2) for r in range(world)]  # the "attention": per token and head
    for r in range(world):
        back = ex[r].back_wait(outs[r])
        assert torch.equal(back, (x[:, r * s:(r + 1) * s] * 2).flatten(2)), r
    assert fake.barriers == 2 * 2 * world  # two barriers per exchange and rank
    # the next layer's call reuses the same receive buffers (one per exchange of the call)
    ex2 = [PeerCopyExchange(None, world, pools[r]) for r in range(world)]
    hs = [ex2[r].start(sends[r]) for r in range(world)]
    assert len(fake.sets) == 2 and torch.equal(ex2[0].whole(hs[0]), wholes[0])


def test_transport_settles_and_is_refused_where_it_cant_run():
    u2 = P.ParallelSpec("diffusers", 2, 1, async_exchange=True)
    assert P.settle_transport(u2, torch.device("cpu")).transport == P.TRANSPORT_AUTO == "nccl"
    # no exchange of ours runs: nothing to carry, nothing recorded
    assert P.settle_transport(P.ParallelSpec("diffusers", 2, 1, async_exchange=False), "cpu").transport is None
    with pytest.raises(ValueError, match="--ulysses_transport copy_engine: it copies into the peers' GPU memory"):
        P.settle_transport(P.ParallelSpec("diffusers", 2, 1, async_exchange=True, transport="copy_engine"), "cpu")
    with pytest.raises(ValueError, match="carries the exchanges of --ulysses_async"):
        P.ParallelSpec("diffusers", 2, 2, transport="copy_engine").validate()
    with pytest.raises(ValueError, match="carries the exchanges of --ulysses_async"):
        P.ParallelSpec("diffusers", 2, 1, async_exchange=False, transport="copy_engine").validate()
    # auto: the engine that runs it
    spec = P.resolve_engine(P.ParallelSpec("auto", 2, 1, transport="copy_engine"), torch.device("cpu"))
    assert spec.engine == "diffusers"


def test_cli_passes_the_transport():
    fam = families.get("wan")

    def config(*argv):
        args = cli.build_parser(fam).parse_args(["--model", "tiny", *argv])
        cli._fill_defaults(fam, args, "tiny")
        return cli.config_from_args(fam, args)

    assert config("--ulysses_transport", "copy_engine", "--ulysses_degree", "2").ulysses_transport == "copy_engine"
    assert config().ulysses_transport is None
