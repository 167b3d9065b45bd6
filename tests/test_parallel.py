"""Multi-process rendering (vdbench.parallel): torchrun over gloo on the tiny Wan model, against one process.

Engine on CPU: ``diffusers`` (ContextParallelConfig). ``xfuser`` 0.7.0 can't run on a CPU: ``import xfuser``
itself raises NotImplementedError there (``xfuser/core/distributed/__init__.py`` calls
``envs.get_device_version()``: "No Accelerators ... available"), its ``envs.get_torch_distributed_backend()``
raises likewise, and ``layers.usp`` binds yunchang's PROCESS_GROUP only when ``torch.cuda.is_available()``. So
here it is checked to be refused with that reason before any work; its registry installation is checked against
xfuser's own lookup where xfuser imports (a GPU machine), and the GPU run is python3 bench/suite.py parallel.

Tolerances, float32 latents before the VAE, rank 0's vs the single process's:
  Ulysses-2: bit-identical (each head's attention is computed whole, on one rank);
  ring-2 and hybrid Ulysses-2 x ring-2 (4 processes): relative L2 <= 1e-5 (blocks merged through their
  log-sum-exp: fp32 rounding only; measured 9e-7 hybrid), frames within 2 levels of 255.
"""

import json
import re
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vdbench import backends as B  # noqa: E402
from vdbench import families  # noqa: E402
from vdbench import parallel as P  # noqa: E402

from tests import launch  # noqa: E402

WAN, COG = families.get("wan"), families.get("cogvideox")

SMALL = ["--model", "tiny", "--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps", "2",
         "--attention_type", "sdpa", "--save_frames", "--save_latents"]
VIDEO = "wan_result_t2v_tiny_9f_2s_attn_sdpa_64x96"  # + the layout of a torchrun render: _u2, _r2, _u2r2
# what each render's name ends with: the layout (``ucfg`` carries a step cache too, before it)
LAYOUT = {"single": "", "ulysses": "_u2", "utemplate": "_u2", "ufp8": "_u2", "ring": "_r2", "hybrid": "_u2r2", "cfg": "_cfg2",
          "ucfg": "_cache-fbc-threshold=0.001_u2cfg2"}
# FirstBlockCache with a threshold no step of these renders passes: every block computed, so the frames are the
# uncached render's, while the cache's hooks, its decision shared over the Ulysses pair and its counts run
UNSKIPPED_FBC = ["--cache", "fbc:threshold=0.001"]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env



def torchrun(args, out: Path, nproc=2, timeout=240, script="run_wan.py", **env):
    # --standalone: a free rendezvous port per launch (test files run side by side on the xdist workers)
    where = ["--benchmark_output_directory" if script == "run_wan.py" else "--output_dir", str(out)]
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(ROOT / script), *args, *where]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(**env), timeout=timeout, cwd=str(out.parent))
    return proc, time.monotonic() - t0


def _latents(out: Path, rank=0):
    from vdbench.capture import load_latents

    files = sorted((out / "captures").glob(f"latents_sdpa_rank{rank}_*.pt"))
    assert files, f"no latents under {out / 'captures'}"
    lat, meta = load_latents(files[-1])
    assert meta["rank"] == rank
    return lat.float()


# ----- units -----

def test_spec_paths_and_lse_need():
    assert P.ParallelSpec("diffusers", 2, 1).path == "ulysses" and not P.ParallelSpec("diffusers", 2, 1).needs_lse
    assert P.ParallelSpec("diffusers", 1, 2).path == "ring" and P.ParallelSpec("diffusers", 1, 2).needs_lse
    assert P.ParallelSpec("xfuser", 2, 2).path == "hybrid" and P.ParallelSpec("xfuser", 2, 2).world_size == 4
    with pytest.raises(ValueError, match="parallel_engine"):
        P.ParallelSpec("deepspeed", 2, 1).validate()


def test_degrees_must_match_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="nproc_per_node=4"):
        P.init_distributed(P.ParallelSpec("diffusers", 2, 2), "cpu")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert P.init_distributed(P.ParallelSpec("diffusers", 1, 1), "cpu") is None


def test_xfuser_refused_on_cpu_with_the_reason(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(B.BackendUnavailable) as e:
        P.init_distributed(P.ParallelSpec("xfuser", 2, 1), "cpu")
    first, _, why = str(e.value).partition("\n")
    # what to do first, xfuser's internals after it (the CLI prints them as the hint line)
    assert first == "--parallel_engine xfuser needs a CUDA GPU; on a CPU use --parallel_engine diffusers (or auto)"
    assert "get_torch_distributed_backend" in why and "PROCESS_GROUP" in why


def test_compile_under_torchrun_is_refused_for_xfuser_only():
    """diffusers' context-parallel call is one vdbench::attention op in a compiled block; xfuser's USP is not."""
    assert P.compile_refusal(P.ParallelSpec("diffusers", 2)) is None
    assert P.compile_refusal(P.ParallelSpec("xfuser", 1)) is None  # one process: no USP around the kernel
    why = P.compile_refusal(P.ParallelSpec("xfuser", 2)).splitlines()
    assert why[0].startswith("--use_torch_compile under --parallel_engine xfuser: xfuser's USP") and len(why) == 2
    assert why[1].startswith("use --parallel_engine diffusers with --use_torch_compile")


def test_auto_engine_is_xfuser_where_it_runs_else_diffusers(monkeypatch):
    import importlib.util

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    auto = P.ParallelSpec("auto", 2, 1)
    assert P.resolve_engine(auto, cpu).engine == "diffusers"
    assert P.resolve_engine(auto, cpu).as_dict()["engine_requested"] == "auto"
    assert P.resolve_engine(P.ParallelSpec("auto", 1, 1, True), cpu).engine == "diffusers"  # both split CFG
    assert P.resolve_engine(P.ParallelSpec("diffusers", 2, 1), cuda).engine == "diffusers"  # a named engine stays
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "xfuser" else real(n, *a))
    assert P.resolve_engine(auto, cuda).engine == "xfuser"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "xfuser" else real(n, *a))
    assert P.resolve_engine(auto, cuda).engine == "diffusers"
    assert P.resolve_engine(auto, cuda).engine_reason == "auto: xfuser is not installed"
    assert P.resolve_engine(auto, cpu).as_dict()["engine_reason"] == "auto: xfuser needs a CUDA GPU"
    assert P.ParallelSpec("diffusers", 2).as_dict()["engine_reason"] == "--parallel_engine diffusers"
    assert [P.ParallelSpec("auto", u, r, c).tag
            for u, r, c in ((2, 1, False), (1, 2, False), (2, 2, False), (1, 1, True), (2, 1, True))] == \
        ["u2", "r2", "u2r2", "cfg2", "u2cfg2"]


def test_auto_prefers_the_engine_measured_faster_for_the_family(monkeypatch):
    """Wan names diffusers' context parallelism (faster than xfuser's Wan wrapper, measured): auto takes it where both
    engines run, and xfuser only where diffusers refuses the request; a family naming none (CogVideoX) keeps xfuser."""
    import importlib.util

    from vdbench import families

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "xfuser" else real(n, *a))
    cuda, auto = torch.device("cuda", 0), P.ParallelSpec("auto", 2, 1)
    wan, cog = families.get("wan"), families.get("cogvideox")
    spec = P.resolve_engine(auto, cuda, lambda s: None, wan)
    assert spec.engine == "diffusers" and spec.engine_reason.startswith("auto: diffusers is the faster engine for wan")
    spec = P.resolve_engine(auto, cuda, lambda s: "no plan" if s.engine == "diffusers" else None, wan)
    assert (spec.engine, spec.engine_reason) == ("xfuser", "auto: diffusers can't serve this request (no plan)")
    assert P.resolve_engine(auto, cuda, lambda s: None, cog).engine == "xfuser"


@pytest.mark.parametrize("request_,engine,why", [
    (dict(attention_type="sdpa"), "xfuser", "auto: xfuser runs here"),
    (dict(attention_type="sdpa@kind:cross,sta"), "diffusers",
     "auto: xfuser can't serve this request (attention backend 'sta' under --parallel_engine xfuser: xfuser pads"),
    (dict(attention_type="sta"), "diffusers", "auto: xfuser can't serve this request (attention backend 'sta'"),
    (dict(attention_type="sdpa", compile=True), "diffusers",
     "auto: xfuser can't serve this request (--use_torch_compile under --parallel_engine xfuser"),
    (dict(attention_type="default"), "diffusers",  # a passthrough backend would run uncounted under xfuser
     "auto: xfuser can't serve this request (--attention_type default under --parallel_engine xfuser"),
    # refused by both (a pattern under ring attention): xfuser kept, and its refusal is the render's
    (dict(attention_type="sta", ring_degree=2), "xfuser", "auto: xfuser runs here"),
])
def test_auto_picks_the_engine_that_serves_the_request(monkeypatch, tmp_path, request_, engine, why):
    """On a GPU with xfuser, auto is xfuser unless the request is one xfuser refuses and diffusers' context
    parallelism serves (a sparse pattern or schedule, the compile, a passthrough backend): then diffusers, and
    the reason recorded. The decision is the render's engine checks run per engine (no process group needed)."""
    import importlib.util
    from dataclasses import replace

    from vdbench import pipelines
    from vdbench.patching.schedule import as_schedule, resolve_attention

    from .test_render import _cfg

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "xfuser" else real(n, *a))
    ring = request_.pop("ring_degree", 1)
    cfg = _cfg(tmp_path, **request_)
    model = pipelines.resolve(cfg.model, cfg.task, cfg.family)
    backend = resolve_attention(cfg.attention_type)
    cuda = torch.device("cuda", 0)
    schedule = as_schedule(backend)
    grid = model.family.name if model.family.grid_hooks is not None else None
    # the render's engine check (vdbench.render.plan.checked_plan), built the same way
    check = P.engine_check(cuda, schedule.members, model.family, cfg.task, model.pipeline_class, compiled=cfg.compile,
                           check_schedule=lambda s: schedule.check_plan(num_steps=cfg.num_inference_steps,
                                                                        compiled=cfg.compile, parallel=s,
                                                                        grid_family=grid))
    spec = P.resolve_engine(P.ParallelSpec("auto", 1 if ring > 1 else 2, ring), cuda, P.refusal_of(check))
    assert (spec.engine, spec.requested_engine) == (engine, "auto")
    assert spec.engine_reason.startswith(why), spec.engine_reason
    assert "\n" not in spec.engine_reason
    # resolved again once the request is known (the process group picked xfuser before it was read)
    assert P.resolve_engine(replace(spec, engine="xfuser"), cuda,
                            P.refusal_of(check)).engine == engine
    named = P.ParallelSpec("xfuser", 2)  # a named engine is kept, refused or not
    assert P.resolve_engine(named, cuda, lambda s: "refused") is named


def test_ring_refuses_backends_without_lse_and_names_those_with():
    ring = P.ParallelSpec("diffusers", 1, 2)
    for name in ("sagev1_emu", "fp8_emu", "sdpa_math", "default"):
        with pytest.raises(B.BackendUnavailable, match="log-sum-exp") as e:
            P.check_backend_for_path(ring, name, "cpu", WAN)
        assert "sdpa, sdpa_flash, reference" in str(e.value)
    P.check_backend_for_path(ring, "sdpa", "cpu", WAN)  # returns it on CPU
    P.check_backend_for_path(P.ParallelSpec("diffusers", 2, 1), "sagev1_emu", "cpu", WAN)  # Ulysses needs no LSE
    with pytest.raises(B.BackendUnavailable, match="only on cuda"):
        P.check_backend_for_path(ring, "sdpa_cudnn", "cpu", WAN)


def test_cogvideox_under_torchrun_needs_xfuser_for_a_sequence_split():
    with pytest.raises(B.BackendUnavailable, match="no _cp_plan.*--parallel_engine xfuser"):
        P.check_backend_for_path(P.ParallelSpec("diffusers", 2, 1), "sdpa", "cpu", COG)
    with pytest.raises(B.BackendUnavailable, match="no _cp_plan.*--use_cfg_parallel alone"):
        P.check_backend_for_path(P.ParallelSpec("diffusers", 2, 1, True), "sdpa", "cpu", COG)
    P.check_backend_for_path(P.ParallelSpec("diffusers", 1, 1), "sdpa", "cpu", COG)
    P.check_backend_for_path(P.ParallelSpec("diffusers", 1, 1, True), "sdpa", "cpu", COG)
    # xfuser's CogVideoX pipeline splits sequence and guidance: accepted (it runs on CUDA only, see below)
    P.check_backend_for_path(P.ParallelSpec("xfuser", 2, 1), "sdpa", "cpu", COG)
    P.check_backend_for_path(P.ParallelSpec("xfuser", 1, 1, True), "sdpa", "cpu", COG)


def test_cfg_parallel_on_both_engines_for_every_wan_task():
    for engine in ("diffusers", "xfuser", "auto"):
        P.ParallelSpec(engine, 1, 1, True).validate()
    spec = P.ParallelSpec("diffusers", 2, 1, True)
    assert spec.world_size == 4 and spec.sequence_degree == 2 and spec.path == "ulysses"
    assert spec.label == "ulysses2+cfg2" and spec.tag == "u2cfg2"
    assert P.ParallelSpec("xfuser", 1, 1, True).label == "cfg2"
    assert P.ParallelSpec("xfuser", 2, 2).label == "ulysses2xring2"
    assert P.ParallelSpec("xfuser", 1, 1, True).as_dict()["label"] == "cfg2"
    # auto no longer forces xfuser for the CFG split: on a CPU it is diffusers' engine
    assert P.resolve_engine(P.ParallelSpec("auto", 1, 1, True), torch.device("cpu")).engine == "diffusers"
    for engine in ("diffusers", "xfuser"):
        for task in ("t2v", "ti2v", "i2v"):
            P.check_backend_for_path(P.ParallelSpec(engine, 1, 1, True), "sdpa", "cpu", WAN, task)
            P.check_backend_for_path(P.ParallelSpec(engine, 2, 1, True), "sdpa", "cpu", WAN, task)
    # refused before any model load: the degrees include the 2 guidance ranks
    with pytest.raises(ValueError, match="x 2 \\(cfg\\) = 4 processes.*nproc_per_node=4"):
        import os
        os.environ["WORLD_SIZE"] = "2"
        try:
            P.init_distributed(spec, "cpu")
        finally:
            del os.environ["WORLD_SIZE"]


def test_cfg_parallel_without_guidance_is_refused_before_the_load(tmp_path, monkeypatch):
    from vdbench.render import RenderConfig, validate

    agree = P.agree
    # one rank: no process group to agree in
    monkeypatch.setattr(P, "agree", lambda ctx, err: agree(P.OneProcess(ctx.device), err))

    ctx = P.DistContext(P.ParallelSpec("diffusers", 1, 1, True), 0, 2, 0, torch.device("cpu"), "gloo")
    cfg = RenderConfig(model="tiny", task="t2v", prompt="a cat", negative_prompt="", height=64, width=96,
                       num_frames=9, num_inference_steps=2, guidance_scale=1.0, seed=0, attention_type="sdpa",
                       output_path=tmp_path / "v.mp4", timing_path=tmp_path / "t.json", family="wan",
                       use_cfg_parallel=True)
    with pytest.raises(ValueError, match="--guidance_scale 1 runs none"):
        validate(cfg, ctx)


class _Out(tuple):
    pass


def test_guidance_split_pairs_the_calls_and_refuses_a_call_that_is_not_the_twin(monkeypatch):
    """Branch 1's rank computes the unconditional pass at a step's first call (the recorded negative embeddings
    swapped in), returns the gathered conditional prediction there and the unconditional one at the second call,
    without computing; a second call with other latents or embeddings is refused, never answered wrongly."""
    pos, neg = torch.ones(1, 3, 4), torch.full((1, 3, 4), 2.0)
    seen = []

    def inner(hidden_states, encoder_hidden_states, return_dict=False):
        seen.append(float(encoder_hidden_states.mean()))
        return (hidden_states * encoder_hidden_states.mean(),)

    split = P.GuidanceSplit(group=None, index=1, batched=False)
    split.negative = neg
    # the pair's gather: [branch 0's (cond) prediction, branch 1's (this rank's, uncond)]
    monkeypatch.setattr(split, "_gather", lambda mine: [mine * 0 + 10.0, mine])
    hs = torch.ones(1, 2)
    cond = split.forward(inner, hidden_states=hs, encoder_hidden_states=pos, return_dict=False)
    uncond = split.forward(inner, hidden_states=hs, encoder_hidden_states=neg.clone(), return_dict=False)
    assert seen == [2.0], "one computation per step, on the negative embeddings"
    assert torch.equal(cond[0], torch.full((1, 2), 10.0)) and torch.equal(uncond[0], torch.full((1, 2), 2.0))
    split.forward(inner, hidden_states=hs, encoder_hidden_states=pos, return_dict=False)
    with pytest.raises(RuntimeError, match="not the first's unconditional twin"):
        split.forward(inner, hidden_states=hs.clone(), encoder_hidden_states=neg, return_dict=False)
    fresh = P.GuidanceSplit(group=None, index=0, batched=False)
    with pytest.raises(RuntimeError, match="negative prompt embeddings were not recorded"):
        fresh.forward(inner, hidden_states=hs, encoder_hidden_states=pos)


def test_guidance_split_of_a_batch_halves_every_batched_argument(monkeypatch):
    got = {}

    def inner(hidden_states, encoder_hidden_states, timestep, image_rotary_emb, return_dict=False):
        got.update(h=hidden_states, e=encoder_hidden_states, t=timestep, r=image_rotary_emb)
        return (hidden_states + 1,)

    split = P.GuidanceSplit(group=None, index=1, batched=True)
    monkeypatch.setattr(split, "_gather", lambda mine: [mine * 0, mine])
    h = torch.arange(4.0).view(4, 1)  # [uncond, uncond, cond, cond]: two prompts
    rot = torch.zeros(4, 8)  # per token, not per sample: 4 tokens, kept whole
    out = split.forward(inner, hidden_states=h, encoder_hidden_states=h * 10, timestep=torch.tensor([5, 5, 5, 5]),
                        image_rotary_emb=(rot, rot), return_dict=False)
    assert got["h"].flatten().tolist() == [2.0, 3.0] and got["e"].flatten().tolist() == [20.0, 30.0]
    assert got["t"].tolist() == [5, 5] and got["r"][0].shape == (4, 8)
    assert out[0].flatten().tolist() == [0.0, 0.0, 3.0, 4.0]
    with pytest.raises(RuntimeError, match="batch of 3 can't be split"):
        split.forward(inner, hidden_states=torch.zeros(3, 1), encoder_hidden_states=None, timestep=None,
                      image_rotary_emb=None)


def test_i2v_pipeline_rebuilds_from_its_components():
    """CFG parallel swaps the I2V pipeline for xfuser's direct subclass (same constructor); the rebuild must carry
    every module and config value (checked here with the diffusers class itself)."""
    from diffusers import WanImageToVideoPipeline
    from vdbench.pipelines import load_pipeline

    pipe = load_pipeline("tiny:wan2.2-i2v-a14b", "i2v", "wan", dtype=torch.float32, device="cpu")
    assert pipe.config.boundary_ratio is not None  # the config-only value that pipe.components drops
    pipe.set_progress_bar_config(disable=True, leave=False)
    again = P.rebuild_pipeline_as(WanImageToVideoPipeline, pipe)
    assert again._progress_bar_config == {"disable": True, "leave": False}
    for k, v in pipe.components.items():
        assert getattr(again, k) is v, k
    assert {k: v for k, v in again.config.items() if k != "_name_or_path"} == \
        {k: v for k, v in pipe.config.items() if k != "_name_or_path"}


@pytest.mark.parametrize("name", ["sdpa", "sdpa_flash", "reference"])
def test_lse_forms_match_exact_attention(name):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 70, 32, generator=g) for _ in range(3))
    form = B.resolve(name).lse_form("cpu")
    assert form.label.endswith("[lse]") and B.resolve(name).has_lse("cpu")
    out, lse = form.fn(q, k, v, scale=0.2)
    ref, ref_lse = B.exact_attention(q, k, v, scale=0.2, return_lse=True)
    assert lse.shape == (1, 3, 70) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=2e-6)


def test_xfuser_registry_install_serves_ulysses_and_ring_lookups(monkeypatch):
    """xfuser's USP gets its kernel from ATTENTION_FUNCTION_REGISTRY on both paths (the Ulysses call and the
    function it hands to torch's templated ring attention): after install, xfuser's own lookup returns our
    kernel, which gives the LSE exactly when the ring degree is > 1, and remove() restores the entry."""
    try:
        import xfuser.core.distributed as xd
    except ImportError as e:
        pytest.skip(f"xfuser not installed ({e})")
    except NotImplementedError as e:
        pytest.skip("xfuser 0.7.0 can't even be imported without a GPU: xfuser/core/distributed/__init__.py calls "
                    f"xfuser.envs.get_device_version(), which raises NotImplementedError ({e})")
    from xfuser.core.distributed.attention_backend import ATTENTION_FUNCTION_REGISTRY as reg
    from xfuser.core.distributed.attention_backend import AttentionBackendType
    from xfuser.model_executor.layers import usp
    from vdbench.patching import AttentionPatch

    class State:
        attention_backend = AttentionBackendType.SDPA

        def get_cross_attention_backend(self):
            return None

    monkeypatch.setattr(xd, "get_runtime_state", lambda: State())
    monkeypatch.setattr(usp, "get_runtime_state", lambda: State())
    ring = [2]
    monkeypatch.setattr(xd, "get_ring_parallel_world_size", lambda: ring[0])
    monkeypatch.setattr(xd, "get_ulysses_parallel_world_size", lambda: 1)

    class Proc:  # the shape of xFuserWanAttnProcessor.__call__: it calls self.attention_function
        def __init__(self):
            self.attention_function = None

        def __call__(self, attn, hidden_states, encoder_hidden_states=None):
            return self.attention_function(hidden_states)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.processor = Proc()

    original = reg[AttentionBackendType.SDPA]
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    outs = []
    for degree, label in ((2, "sdpa[flash][lse]@ring2"), (1, "sdpa[flash]")):  # the degrees are read at install
        ring[0] = degree
        patch = AttentionPatch([("transformer", Layer())], "sdpa")
        patch.install()
        try:
            assert reg[AttentionBackendType.SDPA] == patch.adapters["xfuser"].attention
            fn = usp._get_attention_function()  # what USP calls, Ulysses and ring alike
            patch.context = ("transformer", "blocks.0.attn1", "self")
            out, lse = fn(q, k, v, dropout_p=0.0, is_causal=False)
            assert (lse is not None and lse.shape == (1, 2, 16)) if degree > 1 else lse is None
            assert dict(patch.stats.calls) == {label: 1}
            outs.append(out)
        finally:
            patch.remove()
        assert reg[AttentionBackendType.SDPA] is original
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="xfuser needs CUDA + NCCL: xfuser.envs.get_torch_distributed_backend() raises "
                           "NotImplementedError without a GPU and xfuser.model_executor.layers.usp binds yunchang's "
                           "PROCESS_GROUP only when torch.cuda.is_available(); run python3 bench/suite.py parallel")
def test_xfuser_engine_on_gpus(tmp_path):
    proc, _ = torchrun(["--model", "tiny", "--height", "64", "--width", "96", "--num_frames", "9",
                        "--num_inference_steps", "2", "--attention_type", "sdpa_cudnn", "--ulysses_degree", "2"],
                       tmp_path / "x")
    assert proc.returncode == 0, proc.stderr[-3000:]


_XFUSER_CASES = {  # name: (script, args, parallel flags, expected label)
    "cogvideox_ulysses2": ("sageattn_cogvideo.py", ["--model_path", "tiny", "--height", "64", "--width", "96",
                                                     "--num_frames", "9"], ["--ulysses_degree", "2"], "ulysses2"),
    "cogvideox_cfg2": ("sageattn_cogvideo.py", ["--model_path", "tiny", "--height", "64", "--width", "96",
                                                 "--num_frames", "9"], ["--use_cfg_parallel"], "cfg2"),
    "wan_i2v_cfg2": ("run_wan.py", ["--model", "tiny", "--task", "i2v", "--height", "64", "--width", "96",
                                    "--num_frames", "9"], ["--use_cfg_parallel"], "cfg2"),
    # Wan T2V: xfuser runs diffusers' WanPipeline, split by vdbench's GuidanceSplit over xfuser's CFG group
    "wan_t2v_cfg2": ("run_wan.py", ["--model", "tiny", "--height", "64", "--width", "96", "--num_frames", "9"],
                     ["--use_cfg_parallel"], "cfg2"),
    # Wan 2.2 on xfuser: both A14B experts wrapped (the boundary at 950: of 2 steps, one each), I2V-A14B through
    # xfuser's own CFG pipeline, TI2V-5B's per-token timesteps under xfuser's Ulysses (the diffusers engine's
    # layouts: tests/test_wan22.py, on a CPU)
    **{f"wan22_a14b_{tag}": ("run_wan.py", ["--model", "tiny:wan2.2-t2v-a14b", "--height", "64", "--width", "96",
                                           "--num_frames", "9", "--boundary_ratio", "0.95"], flags, tag)
       for tag, flags in (("ulysses2", ["--ulysses_degree", "2"]), ("ring2", ["--ring_degree", "2"]),
                          ("cfg2", ["--use_cfg_parallel"]))},
    "wan22_i2v_a14b_cfg2": ("run_wan.py", ["--model", "tiny:wan2.2-i2v-a14b", "--task", "i2v", "--height", "64",
                                           "--width", "96", "--num_frames", "9", "--boundary_ratio", "0.95"],
                            ["--use_cfg_parallel"], "cfg2"),
    "wan22_ti2v_ulysses2": ("run_wan.py", ["--model", "tiny:wan2.2-ti2v-5b", "--task", "ti2v", "--height", "64",
                                           "--width", "96", "--num_frames", "9"], ["--ulysses_degree", "2"],
                            "ulysses2"),
}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="xfuser's CogVideoX "
                    "and CFG-parallel pipelines need 2 CUDA GPUs + NCCL (see test_xfuser_engine_on_gpus)")
@pytest.mark.parametrize("case", sorted(_XFUSER_CASES))
def test_xfuser_pipelines_match_one_gpu(tmp_path, case):
    """xfuser's own CogVideoX pipeline (Ulysses, CFG) and Wan I2V pipeline (CFG) against one process, fp32:
    the latents before the VAE agree to fp32 rounding (GEMMs over half the tokens or one guidance branch may
    pick other kernels), the merged timing names the layout, and every rank ran our kernel."""
    from PIL import Image

    script, args, flags, label = _XFUSER_CASES[case]
    args = args + ["--num_inference_steps", "2", "--attention_type", "sdpa", "--dtype", "fp32", "--save_latents"]
    if "i2v" in case:
        img = tmp_path / "in.png"
        Image.fromarray((np.arange(64 * 96 * 3) % 251).astype(np.uint8).reshape(64, 96, 3)).save(img)
        args += ["--img_file_path", str(img)]
    where = "--benchmark_output_directory" if script == "run_wan.py" else "--output_dir"
    single = subprocess.run([sys.executable, str(ROOT / script), *args, where, str(tmp_path / "one")],
                            capture_output=True, text=True, env=_env(CUDA_VISIBLE_DEVICES="0"), timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    proc, _ = torchrun(args + flags + ["--parallel_engine", "xfuser"], tmp_path / "two", script=script, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def lat(d):
        from vdbench.capture import load_latents

        f = sorted(d.rglob("latents_sdpa_rank0_*.pt"))
        assert f, f"no latents under {d}"
        return load_latents(f[-1])[0].float()

    a, b = lat(tmp_path / "one"), lat(tmp_path / "two")
    rel = float((a - b).norm() / a.norm())
    print(f"{case}: latent relative L2 vs one GPU {rel:.2e}")
    assert rel < 2e-3, rel
    timing = json.loads(next((tmp_path / "two").rglob("timing.json")).read_text())[-1]
    assert timing["parallel"]["label"] == label
    for r in timing["ranks"]:
        assert sum(r["attention"]["calls_by_kernel"].values()) > 0 and r["attention"]["fallback_calls"] == 0
        if "a14b" in case:  # each expert's calls on every rank
            assert set(r["attention"]["calls_by_denoiser"]) == {"transformer", "transformer_2"}, r["attention"]


# ----- end to end over gloo -----

def forked(args, out: Path, nproc=2, script="run_wan.py", timeout=240, **env):
    """``torchrun``'s render, its ranks forked from this process (tests/launch.py: no fresh interpreter's imports)."""
    where = ["--benchmark_output_directory" if script == "run_wan.py" else "--output_dir", str(out)]
    family = "wan" if script == "run_wan.py" else "cogvideox"
    return launch.render(family, [*args, *where], out.parent / f"{out.name}.logs", nproc=nproc, timeout=timeout,
                         **env)


@pytest.fixture(scope="module")
def renders(tmp_path_factory):
    if TORCHRUN is None:
        pytest.skip("torchrun not found beside the interpreter")
    base = tmp_path_factory.mktemp("par")
    out = {"single": base / "single"}
    proc = forked(SMALL, out["single"], nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Ulysses with the default engine (auto: diffusers on a CPU) under torchrun itself (a real launch: its clock
    # counts from the process start); the others with the engine named, their ranks forked
    proc, _ = torchrun(SMALL + ["--ulysses_degree", "2"], base / "ulysses")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out["ulysses"] = base / "ulysses"
    for name, flags, n in (("ring", ["--parallel_engine", "diffusers", "--ring_degree", "2"], 2),
                           ("hybrid", ["--parallel_engine", "diffusers", "--ulysses_degree", "2", "--ring_degree", "2"],
                            4),
                           ("cfg", ["--use_cfg_parallel"], 2),
                           ("utemplate", ["--parallel_engine", "diffusers", "--ulysses_degree", "2",
                                          "--ulysses_async", "off"], 2),
                           ("ucfg", ["--parallel_engine", "diffusers", "--ulysses_degree", "2", "--use_cfg_parallel",
                                     *UNSKIPPED_FBC], 4)):
        proc = forked(SMALL + flags, base / name, nproc=n)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = base / name
    # the fp8 exchange's Triton kernels run on a CPU under Triton's interpreter
    proc = forked(SMALL + ["--parallel_engine", "diffusers", "--ulysses_degree", "2", "--ulysses_fp8_exchange", "on"],
                  base / "ufp8", nproc=2, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out["ufp8"] = base / "ufp8"
    return out


def _frames(render_dir: Path) -> Path:
    """The raw frames a render in ``render_dir`` wrote (named by its identity: its timing entry says where)."""
    entry = json.loads((render_dir / "results" / "timing.json").read_text())[-1]
    return Path(entry["output"]).with_suffix(".npy")


def test_ulysses2_over_gloo_is_bit_identical(renders):
    a, b = _latents(renders["single"]), _latents(renders["ulysses"])
    assert a.shape == b.shape and torch.equal(a, b)
    fa = np.load(renders["single"] / "results" / f"{VIDEO}.npy")
    fb = np.load(renders["ulysses"] / "results" / f"{VIDEO}_u2.npy")
    assert fa.std() > 1.0 and np.array_equal(fa, fb)


def test_ulysses_async_is_bit_identical_and_says_which_path_ran(renders):
    """Ulysses by default (--ulysses_async auto) sends Q, K and V beside the projections, Q and K written by the RoPE
    into the exchange's layout, the two guidance branches interleaved (--guidance_overlap auto); --ulysses_async off
    runs diffusers' template, one branch after the other. Both give the latents and frames of one
    process; every self-attention call is labelled with the path that ran, the cross-attention calls are local."""
    one = _latents(renders["single"])
    fa = np.load(renders["single"] / "results" / f"{VIDEO}.npy")
    for name, path, settled in (("ulysses", "@ulysses2/async", True), ("utemplate", "@ulysses2", False)):
        assert torch.equal(one, _latents(renders[name])), name
        assert np.array_equal(fa, np.load(_frames(renders[name]))), name
        e = json.loads((renders[name] / "results" / "timing.json").read_text())[-1]
        assert e["parallel"]["async_exchange"] is settled and e["parallel"]["engine"] == "diffusers"
        assert e["parallel"]["v_per_rank"] is True  # the default; V made per destination where async runs
        # --guidance_overlap auto: both branches interleaved where the async processor's turns are; the same frames
        assert e["parallel"]["guidance_overlap"] is (settled and P.GUIDANCE_OVERLAP_AUTO), e["parallel"]
        if e["parallel"]["guidance_overlap"]:  # 8 hand-overs per step of 2 layers (test_guidance_overlap.py)
            assert e["parallel"]["guidance_overlap_handovers"] == 16
        else:
            assert e["parallel"]["guidance_overlap_reason"]
        for r in e["ranks"]:
            by_kernel, by_kind = r["attention"]["calls_by_kernel"], r["attention"]["calls_by_kind"]
            assert by_kernel == {f"sdpa[flash]{path}": by_kind["self"], "sdpa[flash]": by_kind["cross"]}, by_kernel
            assert r["power"] == {"source": None, "why": "not a CUDA device"}  # joules only from a GPU's counter
        assert e["power_all_ranks"] == {"source": None, "why": "not a CUDA device"}


def test_fp8_exchange_is_close_to_one_process_and_says_so(renders):
    """--ulysses_fp8_exchange on: V and the attention output cross as e4m3 rows with their scales. The latents are
    no longer one process's bit for bit but close to them (e4m3 keeps 3 mantissa bits a row); every self-attention
    call is labelled with the path that ran; the record says the exchange was fp8."""
    one, got = _latents(renders["single"]), _latents(renders["ufp8"])
    rel = ((got.float() - one.float()).norm() / one.float().norm()).item()
    assert 0 < rel < 0.05, rel
    e = json.loads((renders["ufp8"] / "results" / "timing.json").read_text())[-1]
    assert e["parallel"]["fp8_exchange"] is True and e["parallel"]["async_exchange"] is True
    for r in e["ranks"]:
        by_kernel, by_kind = r["attention"]["calls_by_kernel"], r["attention"]["calls_by_kind"]
        assert by_kernel == {"sdpa[flash]@ulysses2/async+fp8": by_kind["self"], "sdpa[flash]": by_kind["cross"]}


@pytest.mark.parametrize("name,ranks", [("cfg", 2), ("ucfg", 4)])
def test_cfg_split_over_gloo_is_bit_identical_to_one_process(renders, name, ranks):
    """Each guidance branch computed as on one process, one gather per step: the same latents on every rank and
    the same frames, alone and under Ulysses-2 (with a step cache, which counts the one branch each rank computed);
    each rank ran half the attention calls."""
    a = _latents(renders["single"])
    for r in range(ranks):
        assert torch.equal(a, _latents(renders[name], rank=r)), r
    fa = np.load(renders["single"] / "results" / f"{VIDEO}.npy")
    assert np.array_equal(fa, np.load(_frames(renders[name])))
    e = json.loads((renders[name] / "results" / "timing.json").read_text())[-1]
    assert e["parallel"]["label"] == ("cfg2" if name == "cfg" else "ulysses2+cfg2")
    assert e["parallel"]["world_size"] == ranks and e["parallel"]["engine"] == "diffusers"
    one = json.loads((renders["single"] / "results" / "timing.json").read_text())[-1]
    # every rank makes half the one-process calls: one guidance branch (a Ulysses rank calls the kernel on its heads)
    for r in e["ranks"]:
        assert sum(r["attention"]["calls_by_kernel"].values()) * 2 == one["attention"]["total_calls"], r
    if name == "ucfg":  # the step cache counts what each rank computed: one denoiser call per step, not the two
        c = e["cache"]  # calls the pipeline makes (the second answered by the split's gather); one process: 2
        assert c["guidance_split"]["this_rank_computes"] == "the conditional branch of each step", c
        assert c["computed_blocks_per_step"] == [2, 2] and c["reused_blocks_per_step"] == [0, 0], c
        for r in e["ranks"]:
            assert r["cache"]["forwards_per_step"] == [1, 1], r["cache"]
        assert c["ranks_agree"] is True and "fbc" in c["shared_decisions"]


def test_parallel_summary_table_reads_layouts_from_the_timing(renders, tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import parallel_summary as S

    group = tmp_path / "res" / "w"
    group.mkdir(parents=True)
    for name, src in (("1gpu", "single"), ("a", "ulysses"), ("b", "hybrid")):
        (group / name).symlink_to(renders[src], target_is_directory=True)
    rows = {r["config"]: r for r in S.summarize(tmp_path / "res")}
    assert set(rows) == {"1 GPU", "ulysses2 (diffusers)", "ulysses2xring2 (diffusers)"}
    u, h = rows["ulysses2 (diffusers)"], rows["ulysses2xring2 (diffusers)"]
    assert u["gpus"] == 2 and h["gpus"] == 4
    assert u["identical_frames"] and u["latent_rel_l2_vs_1gpu"] == 0.0 and u["psnr_vs_1gpu_db"] == float("inf")
    assert 0 < h["latent_rel_l2_vs_1gpu"] <= 1e-5
    assert u["speedup"] == pytest.approx(rows["1 GPU"]["warm_step_ms"] / u["warm_step_ms"])
    assert u["efficiency"] == pytest.approx(u["speedup"] / 2)
    # the warm step of the merged entry: its second step (2 steps), the first apart; a CPU figure, flagged
    assert u["warm_step_n"] == 1 and u["warm_step_ms"] == pytest.approx(u["step_times_ms"][1])
    assert u["first_step_ms"] == pytest.approx(u["step_times_ms"][0])
    assert u["speed_figure"] is False and "CPU timing" in u["why_not_speed"]
    assert "2 ranks" in u["kernels"] and "ulysses2" in u["kernels"]
    text = S.table(list(rows.values()))
    assert "ulysses2xring2 (diffusers)" in text and "warning: not a speed figure (CPU timing" in text


@pytest.mark.parametrize("name", ["ring", "hybrid"])
def test_ring2_and_hybrid_over_gloo_match_within_tolerance(renders, name):
    a, b = _latents(renders["single"]), _latents(renders[name])
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 <= rel <= 1e-5, rel
    fa = np.load(renders["single"] / "results" / f"{VIDEO}.npy").astype(int)
    fb = np.load(_frames(renders[name])).astype(int)
    assert np.abs(fa - fb).max() <= 2


@pytest.mark.parametrize("name,tag,per_rank,ranks", [
    ("ulysses", "sdpa[flash]@ulysses2/async", 8, 2),  # 8 self-attention calls (2 layers x 2 cfg x 2 steps), one each
    ("ring", "sdpa[flash][lse]@ring2", 16, 2),   # each self-attention call = 2 ring blocks, each with its LSE
    ("hybrid", "sdpa[flash][lse]@ulysses2xring2", 16, 4),  # Ulysses all-to-all, then 2 ring blocks
])
def test_rank0_writes_merged_timing_with_per_rank_counts(renders, name, tag, per_rank, ranks):
    res = renders[name] / "results"
    # the layout in the name; a named engine (not auto) is the render's identity too: its id
    (video,) = [p.name for p in res.glob("*.mp4")]
    assert re.fullmatch(re.escape(f"{VIDEO}{LAYOUT[name]}") + ("" if name == "ulysses" else r"_id-[0-9a-f]{8}")
                        + r"\.mp4", video), video
    entries = json.loads((res / "timing.json").read_text())
    assert len(entries) == 1, "only rank 0 appends (once per repetition)"
    e = entries[0]
    assert e["parallel"]["engine"] == "diffusers" and e["parallel"]["pg_backend"] == "gloo"
    assert e["parallel"]["engine_requested"] == ("auto" if name == "ulysses" else "diffusers")
    assert e["parallel"]["engine_reason"] == ("auto: xfuser needs a CUDA GPU" if name == "ulysses"
                                              else "--parallel_engine diffusers")
    assert e["parallel"]["tag"] == LAYOUT[name][1:] and e["run"]["settings"]["parallel_engine"] == \
        ("auto" if name == "ulysses" else "diffusers")
    assert [r["rank"] for r in e["ranks"]] == list(range(ranks))
    assert [r["gpu_uuid"] for r in e["ranks"]] == [None] * ranks  # each rank names its card; none on CPU
    for r in e["ranks"]:
        # cross-attention is local in diffusers' Wan CP plan: plain kernel, 8 calls per rank
        assert r["attention"]["calls_by_kernel"] == {tag: per_rank, "sdpa[flash]": 8}, r
        assert len(r["step_times"]) == 2 and all(t > 0 for t in r["step_times"])
    assert e["attention_all_ranks"]["calls_by_kernel"] == {tag: ranks * per_rank, "sdpa[flash]": 8 * ranks}
    assert e["step_times"] == [max(r["step_times"][i] for r in e["ranks"]) for i in range(2)]
    # the merged warm step is recomputed from the slowest rank's steps; each rank keeps its own
    assert e["warm_step_median"] == e["step_times"][1] and e["first_step"] == e["step_times"][0]
    assert all(r["warm_step_median"] == r["step_times"][1] for r in e["ranks"])
    assert e["speed_figure"] is False and "step_time_median" not in e
    # one-time costs from the merged steps; rank 0's wait, process start to the video on disk, adds up
    assert e["one_time"]["first_step_excess_s"] == pytest.approx(e["first_step"] - e["warm_step_median"])
    # torchrun's ranks count from their process start; forked ranks (tests/launch.py) from vdbench's import
    assert e["end_to_end"]["since"] == ("process start" if name == "ulysses" else "vdbench import")
    assert e["end_to_end"]["stages"]["startup"] > 0
    assert sum(v for v in e["end_to_end"]["stages"].values() if v is not None) + e["end_to_end"]["unaccounted"] == \
        pytest.approx(e["end_to_end_s"], abs=1e-9)
    # captures carry the rank
    caps = renders[name] / "captures"
    assert {p.name.split("_rank")[1][0] for p in caps.glob("latents_*.pt")} == {str(r) for r in range(ranks)}


@pytest.mark.slow
def test_cogvideox_cfg_split_on_diffusers_engine_matches_one_process(tmp_path):
    """CogVideoX runs guidance as one batch [uncond, cond]; each rank computes its half and the halves are gathered
    in order. Half a batch may take other GEMM kernels than the whole one, so fp32 latents agree to rounding."""
    if TORCHRUN is None:
        pytest.skip("torchrun not found")
    args = ["--model_path", "tiny", "--height", "64", "--width", "96", "--num_frames", "9", "--num_inference_steps",
            "2", "--attention_type", "sdpa", "--save_latents", "--dtype", "fp32"]
    one = forked(args, tmp_path / "one", nproc=1, script="sageattn_cogvideo.py")
    assert one.returncode == 0, one.stderr[-3000:]
    proc = forked(args + ["--use_cfg_parallel", "--parallel_engine", "diffusers"], tmp_path / "two",
                  script="sageattn_cogvideo.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from vdbench.capture import load_latents

    a, b = (load_latents(sorted((tmp_path / d).rglob("latents_sdpa_rank0_*.pt"))[-1])[0] for d in ("one", "two"))
    rel = float((a - b).norm() / a.norm())
    assert a.std() > 0 and rel < 1e-5, rel
    e = json.loads(next((tmp_path / "two").rglob("timing.json")).read_text())[-1]
    assert e["parallel"]["label"] == "cfg2" and len(e["ranks"]) == 2


def test_ring_with_a_backend_without_lse_is_refused_before_work(tmp_path):
    if TORCHRUN is None:
        pytest.skip("torchrun not found")
    args = [a if a != "sdpa" else "sagev1_emu" for a in SMALL]
    proc, _ = torchrun(args + ["--parallel_engine", "diffusers", "--ring_degree", "2"], tmp_path / "r")
    assert proc.returncode != 0
    # said once, by rank 0, for the ranks that agreed on it; one line and a hint
    assert proc.stderr.count("error: attention backend 'sagev1_emu' can't serve ring attention") == 1, proc.stderr
    assert "hint: Backends that return it here (cpu): sdpa, sdpa_flash, reference" in proc.stderr
    assert _rank_exit_codes(proc.stderr) == {0: 2, 1: 2}, proc.stderr  # every rank: bad input
    assert "Loading pipeline" not in proc.stderr  # before the model load
    assert not (tmp_path / "r" / "results").exists()


def _rank_exit_codes(stderr: str) -> dict:
    """{rank: exit code} from torchrun's failure summary (one block per failed rank)."""
    import re

    blocks = re.findall(r"^\s*rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", stderr, re.M)
    return {int(r): int(c) for r, c in blocks}


@pytest.mark.parametrize("case", ["raises inside the cache's hook", "is killed (SIGKILL)"])
def test_one_rank_failing_stops_every_rank_promptly(tmp_path, case):
    """Rank 1 raises inside FirstBlockCache's decision, rank 0 waiting in its all_reduce; or rank 1 is killed
    without a word in a step. Every rank ends within a minute of it, one line names the rank and the cause, and
    nothing is written."""
    if TORCHRUN is None:
        pytest.skip("torchrun not found")
    killed = "SIGKILL" in case
    args = SMALL + ["--parallel_engine", "diffusers", "--ulysses_degree", "2", "--num_inference_steps", "4"]
    env = dict(VDBENCH_TEST_FAIL="1:step", VDBENCH_TEST_FAIL_SIGNAL="9") if killed else dict(
        VDBENCH_TEST_FAIL="1:cache")
    if not killed:
        args += ["--cache", "fbc:threshold=0.1"]
    out = tmp_path / "f"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "run_wan.py"), *args,
           "--benchmark_output_directory", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path),
                            env=_env(VDBENCH_DIST_TIMEOUT_S="600", **env))
    lines = []
    for line in proc.stderr:  # when each line came: the failure's, then the launch's end
        lines.append((time.monotonic(), line))
    proc.wait(timeout=300)
    end, stderr = time.monotonic(), "".join(ln for _, ln in lines)
    assert proc.returncode != 0
    injected = next(t for t, ln in lines if "injected " in ln and "on rank 1" in ln)
    assert end - injected < 60, f"{end - injected:.0f} s from the failure to the end: a rank waited"
    said = [ln for _, ln in lines if ln.startswith("error: rank 0: stopping because ")]
    if killed:  # rank 0's collective broke; it names the silent rank instead of taking the failure for its own
        assert said == ["error: rank 0: stopping because rank 1 stopped without a word (no heartbeat for 3 s: "
                        "killed by a signal such as SIGKILL or the OOM killer, or its host is gone)\n"], stderr
        assert _rank_exit_codes(stderr) == {0: P.EXIT_PEER_FAILED, 1: -9}, stderr
    else:
        assert said == ["error: rank 0: stopping because rank 1 failed: RuntimeError: injected failure on rank 1 "
                        "at cache (VDBENCH_TEST_FAIL)\n"], stderr
        # the failing rank with its crash's code, the other with "another rank failed"
        assert _rank_exit_codes(stderr) == {0: P.EXIT_PEER_FAILED, 1: 1}, stderr
    assert not (out / "results").exists() or not any((out / "results").iterdir())  # no video, no timing entry


def _share_worker(rank, port, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    ctx = P.DistContext(P.ParallelSpec("xfuser", 3, 1), rank, 3, rank, torch.device("cpu"), "gloo")
    mine = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4) if rank == 2 else [None]  # xfuser: last rank only
    got = P.share_output(ctx, mine)
    same = P.share_output(ctx, got)  # already everywhere: returned as is
    torch.save({"got": got, "same_is_got": same is got}, f"{out}/r{rank}.pt")
    dist.destroy_process_group()


def test_share_output_hands_the_last_ranks_latents_to_every_rank(tmp_path):
    launch.group(_share_worker, 3, str(tmp_path))
    want = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    for r in range(3):
        d = torch.load(tmp_path / f"r{r}.pt", weights_only=True)
        assert d["got"].dtype == torch.bfloat16 and torch.equal(d["got"], want) and d["same_is_got"]
    assert P.share_output(P.OneProcess(torch.device("cpu")), [None]) == [None]  # single process: untouched


# ----- step caches under torchrun: one decision for every rank -----

def _decisions_worker(rank, port, out):
    """Two ranks holding shards that would decide differently on their own: diffusers' own hooks, with the
    decision functions vdbench.cache.share_decisions wraps."""
    import torch.distributed as dist
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, SeaCacheConfig  # noqa: F401
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook, FBCSharedBlockState
    from diffusers.hooks.hooks import CacheContext, StateManager
    from diffusers.hooks.mag_cache import MagCacheBlockHook, MagCacheState
    from diffusers.hooks.sea_cache import (SeaCacheContextState, SeaCacheLeaderBlockHook, SeaCacheSharedState,
                                           _SeaCacheForwardMetadata)

    from vdbench import cache as C

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    states = {}

    def manager(cls):
        m = StateManager(cls)
        m.set_context(CacheContext(name="cond"))
        states[cls] = m
        return m

    fbc = FBCHeadBlockHook(manager(FBCSharedBlockState), threshold=0.1)
    mag = MagCacheBlockHook(manager(MagCacheState), is_tail=True, config=MagCacheConfig(calibrate=True))
    sea = SeaCacheLeaderBlockHook(SeaCacheConfig(threshold=0.25), manager(SeaCacheContextState), SeaCacheSharedState())
    holder = torch.nn.Module()
    holder._diffusers_hook = type("Registry", (), {"hooks": {"a": fbc, "b": mag, "c": sea}})()
    shared = C.share_decisions([holder], lambda: None)  # the default group: both ranks
    got = {"shared": sorted(shared)}
    before = torch.ones(1, 4, 8)
    fbc.state_manager.get_state().head_block_residual = before
    # rank 0's change 1%, rank 1's 50% (15%): whole sequence 25.5% (8%) against threshold 10%
    got["fbc"] = [fbc._should_compute_remaining_blocks(before * (1.01 if rank == 0 else f)) for f in (1.5, 1.15)]
    state = mag.state_manager.get_state()
    state.previous_residual = before
    mag._perform_calibration_step(state, before * (rank + 1))  # ratio 1 on rank 0, 2 on rank 1
    got["mag"] = state.calibration_ratios
    gate, config = sea.shared_state.resolve_gate, SeaCacheConfig(threshold=0.25)
    st = sea.state_manager.get_state()
    st.gen_input = before
    first = gate(st, _SeaCacheForwardMetadata(0, 0.9, 6), [before], config)  # retained: computed everywhere
    again = gate(st, _SeaCacheForwardMetadata(1, 0.8, 6), [before * (1.01 if rank == 0 else 2.0)], config)
    got["sea"] = [first, again, st.accumulated_distance]
    torch.save(got, f"{out}/r{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_data_dependent_cache_decisions_are_one_for_every_rank(tmp_path):
    """FirstBlockCache compares the whole sequence's change (the sums over the ranks), MagCache's calibration
    averages over every rank's tokens, SeaCache's gate computes where any rank computes: on shards that would
    decide differently alone."""
    launch.group(_decisions_worker, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(2))
    assert r0["shared"] == ["fbc", "mag", "sea"]
    assert r0["fbc"] == r1["fbc"] == [True, False]  # alone: rank 0 would skip the first, rank 1 compute the second
    assert r0["mag"] == r1["mag"] == [pytest.approx(1.5)]
    assert r0["sea"] == r1["sea"] == [True, True, 0.0]  # alone, rank 0 would have reused (1% < 25%)


FBC = [*SMALL, "--num_inference_steps", "6", "--cache", "fbc:threshold=0.1"]  # reuses some steps of the tiny model
COMPILE = ["--use_torch_compile", "--compile_backend", "aot_eager"]  # dynamo's tracing, no inductor codegen (CPU)


def _one_process(args, out: Path):
    proc = forked(args, out, nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(out.rglob("timing.json")).read_text())[-1]


@pytest.fixture(scope="module")
def fbc_one(tmp_path_factory):
    """The one-process render with FirstBlockCache the torchrun renders are held to."""
    out = tmp_path_factory.mktemp("fbc") / "one"
    entry = _one_process(FBC, out)
    c = entry["cache"]
    assert 0 < sum(c["reused_blocks_per_step"]) < sum(c["computed_blocks_per_step"]), c  # some steps, not all
    assert c["shared_decisions"] is None
    return out, entry


def _same_blocks_as(one: dict, entry: dict) -> None:
    """``entry`` (a torchrun render's) computed and reused the blocks ``one`` did at every step, on every rank."""
    a, b = one["cache"], entry["cache"]
    for key in ("computed_blocks_per_step", "reused_blocks_per_step", "forwards_per_step"):
        assert b[key] == a[key] and all(r["cache"][key] == a[key] for r in entry["ranks"]), (key, a, entry["ranks"])
    assert b["ranks_agree"] is True and "fbc" in b["shared_decisions"]


@pytest.mark.slow
def test_first_block_cache_under_ulysses_skips_what_one_process_skips(fbc_one, tmp_path):
    """A 2-rank Ulysses render with FirstBlockCache: the same blocks computed and reused at every step as the
    one-process render of the same seed, counted on each rank alike, and the same latents (Ulysses computes each
    head whole: bit-identical)."""
    if TORCHRUN is None:
        pytest.skip("torchrun not found beside the interpreter")
    two = forked(FBC + ["--ulysses_degree", "2"], tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    _same_blocks_as(fbc_one[1], json.loads(next((tmp_path / "two").rglob("timing.json")).read_text())[-1])
    assert torch.equal(_latents(fbc_one[0]), _latents(tmp_path / "two"))


@pytest.mark.slow
def test_compiled_blocks_with_a_cache_on_one_process_and_under_ulysses(fbc_one, tmp_path):
    """--use_torch_compile beside FirstBlockCache, on one process and on 2 Ulysses ranks: each block's own forward
    compiled (fullgraph: no graph break), the cache's decision outside it, the context-parallel attention call one
    vdbench::attention op; the same blocks skipped as the eager render, and its latents."""
    if TORCHRUN is None:
        pytest.skip("torchrun not found beside the interpreter")
    one = _one_process(FBC + COMPILE, tmp_path / "one")
    two = forked(FBC + COMPILE + ["--ulysses_degree", "2"], tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    entry = json.loads(next((tmp_path / "two").rglob("timing.json")).read_text())[-1]
    eager = fbc_one[1]
    for e in (one, entry):
        assert e["run"]["resolved"]["speed_options"]["compile"]["models"]["transformer"] == {"how": "block forward",
                                                                                              "blocks": 2}
        assert e["one_time"]["compile_s"] > 0
    assert one["cache"]["computed_blocks_per_step"] == eager["cache"]["computed_blocks_per_step"]
    _same_blocks_as(eager, entry)
    for r in entry["ranks"]:  # the compiled blocks' self-attention ran our kernel on the Ulysses path
        assert r["attention"]["calls_by_kernel"].get("sdpa[flash]@ulysses2", 0) > 0, r["attention"]  # compiled: the template
    ref = _latents(fbc_one[0])
    for out in (tmp_path / "one", tmp_path / "two"):
        got = _latents(out)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.slow
def test_a_sparse_schedule_under_ulysses_matches_one_process(tmp_path):
    """A schedule switching to the sliding tile pattern under 2-rank Ulysses: each rank's attention holds the whole
    sequence for its heads, so the pattern's mask is the one-process render's (the same block pairs computed) and
    so are the latents; the tile order is taken per call, the sequence being split at the blocks' entry."""
    if TORCHRUN is None:
        pytest.skip("torchrun not found beside the interpreter")
    spec = "sdpa@steps:0,sta:window=1x3x3,tile=2x2x2,block=16"
    args = [a if a != "sdpa" else spec for a in SMALL] + ["--num_inference_steps", "3"]
    one = _one_process(args, tmp_path / "one")
    two = forked(args + ["--ulysses_degree", "2"], tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    entry = json.loads(next((tmp_path / "two").rglob("timing.json")).read_text())[-1]
    sta = "flex.sta[window=1x3x3,tile=2x2x2,block=16]"
    assert one["attention"]["block_pairs"][sta]["self"]["fraction_computed"] < 1  # sparse on this grid
    for r in entry["ranks"]:
        calls = r["attention"]
        assert calls["calls_by_kernel"][f"{sta}@ulysses2/async"] == one["attention"]["calls_by_kernel"][sta]
    assert entry["attention"]["block_pairs"][f"{sta}@ulysses2/async"] == one["attention"]["block_pairs"][sta]

    def latents(out):
        from vdbench.capture import load_latents

        return load_latents(sorted((out / "captures").glob("latents_*rank0_*.pt"))[-1])[0].float()

    a, b = latents(tmp_path / "one"), latents(tmp_path / "two")
    assert ((a - b).norm() / a.norm()).item() < 1e-5


# ----- the overlapped Ulysses: heads in chunks, each chunk's exchange beside another's attention -----

def _overlap_worker(rank, port, out):
    import torch.distributed as dist

    from vdbench.patching.ulysses import can_overlap, overlapped_ulysses

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 12, 8, generator=g) for _ in range(3))  # the whole sequence, 12 heads
    shard = slice(rank * 12, rank * 12 + 12)  # this rank's half of the sequence
    calls = []

    def attend(qc, kc, vc):  # BSHD with the whole sequence for some heads
        calls.append((tuple(qc.shape), qc.is_contiguous()))
        return torch.nn.functional.scaled_dot_product_attention(
            qc.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)).transpose(1, 2)

    got = {"can": [can_overlap(q, k, v, None, 2, c) for c in (1, 2, 3, 6, 4)]}
    for chunks in (2, 3, 6):
        calls.clear()
        got[chunks] = (overlapped_ulysses(q[:, shard], k[:, shard], v[:, shard], None, 2, chunks, attend),
                       list(calls))
    torch.save(got, f"{out}/r{rank}.pt")
    dist.destroy_process_group()


def test_overlapped_ulysses_gives_each_rank_its_shard_of_whole_attention(tmp_path):
    """Over gloo, 2 ranks, 12 heads: in 2, 3 or 6 head chunks each rank gets exactly its sequence shard of the
    attention over the whole sequence (every head computed whole by the same kernel), the kernel being called once
    per chunk with the whole sequence of 6/chunks heads, contiguous (no copy after the exchange)."""
    launch.group(_overlap_worker, 2, str(tmp_path))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 12, 8, generator=g) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                            v.transpose(1, 2)).transpose(1, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"r{rank}.pt", weights_only=True)
        assert got["can"] == [False, True, True, True, False]  # 1: nothing to overlap; 4 doesn't divide 6 heads
        for chunks in (2, 3, 6):
            out, calls = got[chunks]
            assert torch.allclose(out, want[:, rank * 12:rank * 12 + 12], atol=1e-6, rtol=0), chunks
            assert calls == [((1, 24, 6 // chunks, 8), True)] * chunks


def test_ulysses_overlap_is_refused_where_it_cant_apply():
    P.ParallelSpec("diffusers", 2, 1, head_chunks=3).validate()
    P.ParallelSpec("auto", 2, 1, True, head_chunks=2).validate()
    for spec in (P.ParallelSpec("diffusers", 1, 1, head_chunks=2), P.ParallelSpec("diffusers", 2, 2, head_chunks=2),
                 P.ParallelSpec("xfuser", 2, 1, head_chunks=2)):
        with pytest.raises(ValueError, match="--ulysses_overlap 2 overlaps the all-to-all"):
            spec.validate()
    # auto picks the engine that has it
    assert P.resolve_engine(P.ParallelSpec("auto", 2, 1, head_chunks=3), torch.device("cuda", 0)).engine == "diffusers"


def test_ulysses_async_is_refused_where_it_cant_apply():
    from vdbench import families

    P.ParallelSpec("diffusers", 2, 1, async_exchange=True).validate()
    for spec in (P.ParallelSpec("diffusers", 1, 1, async_exchange=True),
                 P.ParallelSpec("diffusers", 2, 2, async_exchange=True),
                 P.ParallelSpec("xfuser", 2, 1, async_exchange=True),
                 P.ParallelSpec("diffusers", 2, 1, head_chunks=2, async_exchange=True)):
        with pytest.raises(ValueError, match="--ulysses_async on sends Q, K and V"):
            spec.validate()
    assert P.resolve_engine(P.ParallelSpec("auto", 2, 1, async_exchange=True),
                            torch.device("cuda", 0)).engine == "diffusers"
    # a family without the exchange-layout self-attention: refused before the load, in one line and a hint
    check = P.engine_check(torch.device("cpu"), [], families.get("cogvideox"), "t2v")
    with pytest.raises(ValueError, match="--ulysses_async on: vdbench has no cogvideox self-attention"):
        check(P.ParallelSpec("diffusers", 2, 1, async_exchange=True))


def _tiny_build_worker(rank, port, cache):
    import torch.distributed as dist

    os.environ["VDBENCH_CACHE"] = cache
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:  # the rank that takes the cache's lock first builds: here rank 1, with the group initialized
        from vdbench import tiny

        tiny.build_tiny("wan2.1-t2v", Path(cache) / "built")
    dist.barrier()
    dist.destroy_process_group()


def test_a_tiny_model_built_by_rank_1_keeps_every_components_weights(tmp_path):
    """transformers writes weights on rank 0 only once a process group exists; a tiny model built by rank 1 (the
    first to take the cache's lock) must still hold its text encoder's weights, else every later load fails."""
    launch.group(_tiny_build_worker, 2, str(tmp_path))
    built = tmp_path / "built"
    for comp in ("text_encoder", "transformer", "vae"):
        assert list((built / comp).glob("*.safetensors")), comp
