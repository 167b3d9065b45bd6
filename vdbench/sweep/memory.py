"""What a candidate's render will hold on its card, before it is rendered (``--max_gpu_mem``), and the offload stack
to try when nothing fits.

The estimate starts from what a render measured: each render's record holds its allocated and reserved peaks per
stage (``memory``: the load -- every weight on the card --, the denoising, the decode; rank 0's card). A candidate
whose options change none of what the card holds (another attention kernel, a compile, a cache, a VAE mode) is
estimated at ``default``'s measured reserved peak: its other work is the same. The offload modes take weights off
the card, in bytes counted from the model's own configs (:func:`weights`: each denoiser's parameters, built on the
meta device, x its recorded dtype's bytes):

* ``offload=expert`` (two experts): the idle expert waits on the host, one of its blocks in flight -- the peak less
  one expert's weights, plus one block;
* ``offload=group``: every component but the VAE onloaded a block at a time (the next one prefetched) -- the
  denoising's peak less every weight of the load, plus two blocks; the decode's less the same but the VAE's;
* ``offload=shard`` (a layout of N ranks): each rank holds 1/N of every denoiser and the block it runs -- the peak
  less the rest of the denoisers' weights, plus a block;
* ``offload=model``: each component on the card while it runs -- the denoising's peak less every weight of the load,
  plus the largest denoiser.

A layout is estimated at the one-GPU peak (each card holds every weight; its activations, split over the ranks,
are not scaled down: an upper bound). Before ``default`` is rendered nothing was measured: the denoisers' weights
the card must hold (all of them; one expert and a block; two blocks; 1/N of them and a block; the largest
denoiser) are the lower bound, and a
render they already exceed is left out.
"""

from __future__ import annotations

from typing import Optional

from ..measure.record import Record, split_stack
from .candidates import Candidate

__all__ = ["GIB", "weights", "measured", "estimate_peak", "offload_advice"]

GIB = 2 ** 30

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def weights(model: str, task: Optional[str], family) -> Optional[dict]:
    """{"denoisers": [parameters of each], "blocks": [blocks of each]} of the model's denoisers from its configs
    (built on the meta device: no weight is read), or None where the configs can't be had without a download."""
    import diffusers
    from accelerate import init_empty_weights

    from ..pipelines import parse_model

    spec = parse_model(model, task, family)
    comps = spec.components or {}
    names = [n for n in comps if n.startswith("transformer")]
    if not names:
        return None
    counted: dict = {}  # two experts of one architecture are counted once
    out: dict = {"denoisers": [], "blocks": []}
    for n in names:
        cls, cfg = comps[n]
        key = (cls, repr(sorted(cfg.items())))
        if key not in counted:
            with init_empty_weights():
                m = getattr(diffusers, cls).from_config(cfg)
            counted[key] = (sum(p.numel() for p in m.parameters()),
                            len(getattr(m, "blocks", None) or getattr(m, "transformer_blocks", None) or []) or 1)
        out["denoisers"].append(counted[key][0])
        out["blocks"].append(counted[key][1])
    return out


def measured(rec: Record) -> Optional[dict]:
    """{"load", "denoise", "decode"} reserved peaks (bytes) of a render's record and its denoisers' dtype bytes;
    None where it measured none (a CPU)."""
    mem = rec.data.get("memory") or {}
    stages = {k: (v or {}).get("reserved_peak") for k, v in mem.items()}
    if not any(stages.values()):
        return None
    model = ((rec.data.get("run") or {}).get("model") or {})
    dtypes = [t.get("dtype") for t in (model.get("transformers") or {}).values()]
    return {**{k: stages.get(k) or 0 for k in ("load", "denoise", "decode")},
            "bytes_per_param": _DTYPE_BYTES.get(next((d for d in dtypes if d), "bfloat16"), 2)}


def estimate_peak(cand: Candidate, base: Optional[dict], w: Optional[dict]) -> tuple[Optional[float], str]:
    """(bytes the candidate's render will reserve on a card, what the figure rests on); (None, why) where nothing
    predicts it. ``base``: :func:`measured` of ``default``'s render (None: not rendered yet); ``w``:
    :func:`weights`."""
    offload = dict(split_stack(cand.name)[1]).get("offload") if "+" in cand.name else None
    bpp = (base or {}).get("bytes_per_param", 2)
    experts = [p * bpp for p in (w or {}).get("denoisers", [])]
    block = [e / b for e, b in zip(experts, (w or {}).get("blocks", []))]
    if base is None:  # nothing measured: what the card must hold of the denoisers' weights, a lower bound
        if not experts:
            return None, "nothing measured yet (default not rendered)"
        if offload == "expert" and len(experts) > 1:
            return experts[-1] + block[-1], "lower bound: one expert's weights and a block (default not rendered yet)"
        if offload == "group":
            return 2 * max(block), "lower bound: two blocks' weights (default not rendered yet)"
        if offload == "model":
            return float(max(experts)), "lower bound: the largest denoiser's weights (default not rendered yet)"
        if offload == "shard":
            return (sum(experts) / cand.nproc + max(block),
                    f"lower bound: 1/{cand.nproc} of its denoisers' weights and a gathered block (default not "
                    "rendered yet)")
        return float(sum(experts)), "lower bound: its denoisers' weights alone (default not rendered yet)"
    load, den, dec = base["load"], base["denoise"], base["decode"]
    peak = float(max(den, dec))
    if not offload:
        return peak, "default's measured reserved peak (" + ("a layout: each card holds every weight; activations "
                                                             "not scaled down" if cand.nproc > 1 else
                                                             "its other work is the same") + ")"
    if not experts:
        return None, f"offload={offload}: the model's denoiser configs are not at hand"
    if offload == "expert":
        if len(experts) < 2:
            return None, "offload=expert: one denoiser"
        return peak - experts[-1] + block[-1], "default's peak less one expert's weights, plus a block in flight"
    if offload == "shard":  # each rank holds 1/N of every denoiser, and the block being run gathered whole
        return (peak - sum(experts) * (1 - 1 / cand.nproc) + max(block),
                f"default's peak less all but 1/{cand.nproc} of the denoisers' weights, plus a gathered block "
                "(activations not scaled down)")
    if offload == "group":
        # two blocks in flight while denoising, and the allocator still holding their blocks' memory while the VAE
        # decodes (an H200, A14B 720p: the decode reserved 1.2 GB over the resident decode less its weights; two
        # blocks are 1.4 GB: docs/gpu_results/h200/2026-11-29_wan22d/c4)
        return (max(den - load, dec - load + max(0.0, load - sum(experts))) + 2 * max(block),
                "default's peaks less every weight of the load, plus two blocks (the VAE stays for the decode)")
    # model offload: while denoising the card holds one denoiser and the activations; while decoding none (moved off
    # when the VAE starts: an H200, A14B 720p: 38.4 GiB reserved denoising, 14.6 decoding, against the resident 66.5
    # and 70.4; docs/gpu_results/h200/2026-11-29_wan22model)
    return (max(den - load + max(experts), dec - sum(experts)),
            "default's peaks less every denoiser's weights, plus the largest one's while denoising")


def offload_advice(cand: Candidate, base: Optional[dict], w: Optional[dict], limit: float) -> str:
    """What to try when no candidate fits in ``limit`` bytes: the offload stacks of ``cand`` (``default``) that
    fit as estimated, least offloaded first (expert, group, model), each with its estimate; or why none does."""
    from .candidates import parse_stack

    tried = []
    for mode in ("expert", "group", "model"):
        c = parse_stack(f"{cand.name}+offload={mode}")
        est, _ = estimate_peak(c, base, w)
        if est is not None:
            tried.append((c.name, est))
            if est <= limit:
                bound = " at least" if base is None else ""
                return (f"nothing fits in {limit / GIB:.0f} GiB resident: try --stacks {c.name} (estimated{bound} "
                        f"{est / GIB:.1f} GiB)")
    if tried:
        return f"nothing fits in {limit / GIB:.0f} GiB, offloaded either: " + ", ".join(
            f"{n} ~{e / GIB:.1f} GiB" for n, e in tried)
    return (f"nothing fits in {limit / GIB:.0f} GiB resident: try --stacks {cand.name}+offload=group (no "
            f"estimate: the model's configs are not at hand)")
