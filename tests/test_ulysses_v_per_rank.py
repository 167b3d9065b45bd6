"""V projected per destination rank (--ulysses_v_per_rank, UlyssesExchange.send_projected): every rank receives the
whole sequence of its heads, equal to the projection made whole, at an end rank and a middle rank alike."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent('''
    import os
    import torch, torch.distributed as dist
    from vdbench.patching.ulysses import UlyssesExchange
    dist.init_process_group("gloo")
    r, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    heads, d, s_loc, c = 2 * world, 8, 5, 16
    ok = True
    for bias in (True, False):
        lin = torch.nn.Linear(c, heads * d, bias=bias).to(torch.bfloat16)
        tokens = torch.randn(1, world * s_loc, c).to(torch.bfloat16)  # the whole sequence, rank-major
        mine = tokens[:, r * s_loc:(r + 1) * s_loc]
        h = heads // world
        with torch.inference_mode():
            want = lin(tokens).unflatten(2, (heads, -1))[:, :, r * h:(r + 1) * h]
            for per in (True, False):
                ex = UlyssesExchange(dist.group.WORLD, world, v_per_rank=per)
                got = ex.whole(ex.send_projected(lin, mine.contiguous(), heads))
                ok &= got.shape == want.shape and torch.equal(got, want) and got.is_contiguous()
    print(f"rank {r}: {'equal' if ok else 'DIFFERENT'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # out at once, as vdbench.cli's ranks leave: gloo's threads torn down by the interpreter's exit have aborted a
    # rank that had printed its verdict ("terminate called without an active exception")
    os._exit(0 if ok else 1)
''')


@pytest.mark.slow
def test_v_per_rank_equals_the_whole_projection_on_every_rank(tmp_path):
    """3 ranks over gloo: rank 1's slot lies between its peers' (its arrivals are placed around it), ranks 0 and 2
    receive straight into place; with and without a bias; the same values as V projected whole and sent."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           str(script)], capture_output=True, text=True, env=env, timeout=180, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # the ranks' lines share one stdout and may interleave
    assert sorted(re.findall(r"rank \d: (?:equal|DIFFERENT)", proc.stdout)) == [f"rank {r}: equal" for r in range(3)]
