"""``--offload shard``: each denoiser's weights sharded over the torchrun ranks by FSDP2, on a CPU over gloo.

* The refusals before the load (one process, a compile, fp8 GEMMs, a step cache under a CFG split) and the sweep's
  estimate of a sharded stack's peak.
* :func:`vdbench.offload.shard_weights` on two forked gloo ranks, each calling the whole pipeline (sharding alone,
  no layout): Wan 2.1's (fp32, and bf16 with its fp32 norms) and CogVideoX's tiny denoisers give the unsharded
  latents bit for bit, each block's weights whole inside its forward and a shard again after it, and the record's
  bytes a rank.
* The render under torchrun (slow): tiny Wan 2.1 and the tiny two-expert A14B under Ulysses-2 and CFG-2 with the
  weights sharded, frames against the one-process render bit for bit, the entry's offload section, guidance overlap
  off with its reason, the stack named ``offload=shard``; the A14B with a First Block Cache that reuses blocks under
  Ulysses-2; CogVideoX's CFG split against the unsharded one.

What only a GPU shows: the memory a rank saves and the gathers' time (bench/suites/shard.toml).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import run_wan
from vdbench import offload
from vdbench import sweep as S
from vdbench.sweep import memory as M

from tests import launch
from tests.test_render import no_load  # noqa: F401 - the fixture: any weight load fails the test

CPU = torch.device("cpu")


@pytest.mark.parametrize("kw,why", [
    (dict(), "one process has no other rank"),
    (dict(parallel=True, compiled=True), "drop the compile"),
    (dict(parallel=True, fp8_gemms=True), "drop --use_fp8_gemms"),
    (dict(parallel=True, cache=True, cfg_split=True), "each guidance half decides its step cache alone"),
])
def test_sharding_that_cant_apply_is_refused_with_its_reason(kw, why):
    with pytest.raises(offload.OffloadError, match=why) as e:
        offload.check_offload("shard", device=CPU, two_experts=None, **kw)
    assert len(str(e.value).splitlines()) == 2  # the reason, then what to do
    # on a CPU under torchrun it applies (gloo), a step cache too where the ranks share each call
    offload.check_offload("shard", device=CPU, two_experts=None, parallel=True, cache=True)


def test_a_sharded_stacks_peak_is_estimated_per_rank():
    w = M.weights("random:wan2.2-t2v-a14b", "t2v", "wan")  # two 14.3B experts, 40 blocks each (meta device)
    both, block = 2 * w["denoisers"][0] * 2, w["denoisers"][0] * 2 / 40
    c = S.parse_stack("fav3+offload=shard+u2")
    assert (c.name, c.nproc) == ("fav3+offload=shard+u2", 2) and c.flags[:2] == ["--offload", "shard"]
    est, basis = M.estimate_peak(c, None, w)
    assert est == pytest.approx(both / 2 + block) and basis.startswith("lower bound: 1/2")
    gib = M.GIB
    base = {"load": 70 * gib, "denoise": 78 * gib, "decode": 72 * gib, "bytes_per_param": 2}
    est, basis = M.estimate_peak(c, base, w)
    assert est == pytest.approx(78 * gib - both / 2 + block) and "1/2" in basis


# ----- shard_weights on two forked gloo ranks, the whole pipeline on each -----

def _latents(pipe) -> torch.Tensor:
    out = pipe(prompt="a red fox", negative_prompt="blurry", height=32, width=32, num_frames=5, num_inference_steps=2,
               guidance_scale=5.0, output_type="latent", generator=torch.Generator().manual_seed(3))
    return out.frames


def _shard_worker(rank: int, port: int, family: str, dtype: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from vdbench.pipelines import load_pipeline, transformers_of

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        pipe = load_pipeline("tiny", "t2v", family, dtype=getattr(torch, dtype), device="cpu")
        whole = _latents(pipe)
        models = transformers_of(pipe)
        record = offload.shard_weights(models, CPU)
        (name, model), = models
        blocks = list(getattr(model, "blocks", None) or model.transformer_blocks)  # Wan's, CogVideoX's
        seen = []
        for b in blocks:  # registered after FSDP's own pre-forward hook: sees what the block computes with
            b.register_forward_pre_hook(lambda m, a: seen.append(all(type(p) is not DTensor for p in m.parameters())))
        sharded = _latents(pipe)
        assert torch.equal(sharded, whole), (family, (sharded - whole).abs().max())
        assert seen and all(seen), seen  # every block ran on its gathered weights
        assert all(isinstance(p, DTensor) for p in model.parameters())  # and each is a shard again after
        r = record["denoisers"][name]
        assert record["mode"] == "shard" and record["mesh_ranks"] == 2 and r["units"] == len(blocks) + 1
        weights = r["bytes_per_rank_before"] - r["buffer_bytes"]
        assert weights == sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's: the whole
        for after in r["bytes_per_rank_after"]:  # half the parameters (an odd dimension: a row apart), the buffers
            assert abs(after - r["buffer_bytes"] - weights / 2) <= weights * 0.02, r
        assert sum(r["bytes_per_rank_after"]) - 2 * r["buffer_bytes"] == weights
    finally:
        dist.destroy_process_group()


# bf16: Wan keeps its norms and modulation tables in fp32, so a block's weights are of two dtypes
@pytest.mark.parametrize("family,dtype", [("wan", "float32"), ("wan", "bfloat16"), ("cogvideox", "float32")])
def test_sharded_denoisers_compute_the_unsharded_latents_on_gathered_weights(family, dtype):
    launch.group(_shard_worker, 2, family, dtype)


# ----- the render under torchrun -----

def _frames(out: Path) -> np.ndarray:
    (path,) = (out / "results").glob("*.npy")
    return np.load(path)


def _entry(out: Path) -> dict:
    return json.loads((out / "results" / "timing.json").read_text())[-1]


def test_sharding_in_one_process_is_refused_in_one_line_with_a_hint(tmp_path, capsys, no_load):  # noqa: F811
    assert run_wan.main(["--model", "tiny", "--offload", "shard", "--output_dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --offload shard splits each denoiser's weights over the ranks of a torchrun render; one process has "
        "no other rank", "hint: launch under torchrun with a parallel layout (--ulysses_degree 2, --use_cfg_parallel, "
        "...)"]


DIFFUSERS_U2 = ["--parallel_engine", "diffusers", "--ulysses_degree", "2"]


@pytest.mark.slow
def test_sharded_renders_under_ulysses_and_cfg_match_one_process(tmp_path):
    """Tiny Wan 2.1 and the tiny A14B (4 steps at its shift 12: three high-noise steps, one low-noise) with every
    denoiser sharded over 2 ranks under Ulysses-2 and CFG-2 (diffusers' engine): the frames are the one-process
    render's bit for bit, and the entry records the mesh and each rank's bytes of each denoiser."""
    common = ["--num_inference_steps", "4", "--attention_type", "sdpa", "--save_frames", "--height", "64", "--width",
              "64", "--num_frames", "5"]
    # the A14B in bf16, as it runs on a GPU: its fp32 norms and modulation tables beside the bf16 weights
    models = {"wan21": ["--model", "tiny"], "a14b": ["--model", "tiny:wan2.2-t2v-a14b", "--dtype", "bfloat16"]}
    layouts = {"u2": ["--ulysses_degree", "2"], "cfg2": ["--use_cfg_parallel"]}
    for model, flags in models.items():
        one = tmp_path / model / "one"
        proc = launch.render("wan", flags + common + ["--benchmark_output_directory", str(one)],
                             one.parent / "one.logs", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ref = _frames(one)
        assert ref.std() > 1.0
        denoisers = {"transformer", "transformer_2"} if model == "a14b" else {"transformer"}
        for name, layout in layouts.items():
            out = tmp_path / model / name
            proc = launch.render("wan", flags + common + layout + ["--parallel_engine", "diffusers", "--offload",
                                 "shard", "--benchmark_output_directory", str(out)], out.parent / f"{name}.logs",
                                 nproc=2, timeout=300)
            assert proc.returncode == 0, (model, name, proc.stderr[-3000:])
            assert np.array_equal(_frames(out), ref), (model, name)
            entry = _entry(out)
            assert entry["stack"] == f"sdpa+offload=shard+{name}"
            rec = entry["offload"]
            assert rec["mode"] == "shard" and rec["mesh_ranks"] == 2 and set(rec["denoisers"]) == denoisers
            for r in rec["denoisers"].values():
                assert len(r["bytes_per_rank_after"]) == 2
                assert all(r["buffer_bytes"] < a < r["bytes_per_rank_before"] for a in r["bytes_per_rank_after"])
            assert entry["run"]["resolved"]["offload"] == rec
            par = entry["parallel"]
            assert par["guidance_overlap"] is False
            if name == "u2":  # it would be on by default here
                assert "--offload shard" in par["guidance_overlap_reason"]
    # a step cache that reuses blocks (the ranks of the call decide together; a reused block's gather still runs)
    fbc = models["a14b"] + common + ["--cache", "fbc:threshold=0.5", "--num_inference_steps", "6"]
    frames = []
    for name, n, flags in (("fbc_one", 1, []), ("fbc_u2", 2, DIFFUSERS_U2 + ["--offload", "shard"])):
        out = tmp_path / "fbc" / name
        proc = launch.render("wan", fbc + flags + ["--benchmark_output_directory", str(out)],
                             out.parent / f"{name}.logs", nproc=n, timeout=300)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        frames.append(_frames(out))
    assert np.array_equal(*frames)
    assert sum(_entry(out)["cache"]["reused_blocks_per_step"]) > 0
    # CogVideoX's CFG split of one batch (each rank half of it: against the unsharded split, whose half-batch GEMMs
    # are its own), its transformer_blocks sharded
    cog = ["--model_path", "tiny", "--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps",
           "3", "--attention_type", "sdpa", "--save_frames", "--parallel_engine", "diffusers", "--use_cfg_parallel"]
    frames = []
    for name, flags in (("cfg2", []), ("cfg2_shard", ["--offload", "shard"])):
        out = tmp_path / "cog" / name
        proc = launch.render("cogvideox", cog + flags + ["--benchmark_output_directory", str(out)],
                             out.parent / f"{name}.logs", nproc=2, timeout=300)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        (path,) = out.glob("*.npy")
        frames.append(np.load(path))
    assert np.array_equal(*frames) and frames[0].std() > 1.0
    rec = json.loads((out / "timing.json").read_text())[-1]["offload"]
    assert rec["mesh_ranks"] == 2 and rec["denoisers"]["transformer"]["units"] == 3  # its 2 blocks, the rest
