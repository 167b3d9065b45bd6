"""Where FA3 fp8's error on a pipeline's inputs comes from: one input, many ways of handing it to the kernel.

    python bench/lab/check_fp8_error.py --out DIR [--captures CAPDIR] [--shape wan2.1-1.3b-480p]

For each input (random with a K channel bias, random plain, and every self-attention capture in CAPDIR), in each
memory layout a caller can hand FA3 (contiguous BHSD, and BSHD memory seen as BHSD views: what diffusers' processors
pass), the rel L2 vs fp64 on sampled heads and rows of:

* registry backends (``--backends``: ``fav3``, ``fav3_fp8`` plain and with V smoothed);
* FA3's e4m3 kernel on eagerly quantized inputs, with Q/K and V each in either layout (which operand's layout
  matters);
* ``fav3_fp8``'s log-sum-exp form over key chunks merged in fp32 (how much of the error grows with the number of
  keys one call accumulates);
* the kernel's numerics emulated with P scaled as FA3 scales it before its e4m3 cast (``Max_offset``: P in
  [0, 256]) and as the project's emulation does (P in [0, 1]).

Also, per input: the attention's sharpness on the sample (mean max probability, and the probability mass that
e4m3 P flushes to zero at each P scale). Writes DIR/fp8_error.json and prints a table; GPU only (FA3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vdbench import backends as B
from vdbench import families
from vdbench.capture import list_captures, load_capture
from vdbench.helptext import DefaultsHelpFormatter
from vdbench.measure.quality import rel_l2
from vdbench.numerics import FP8_E4M3_MAX, exact_attention, fp8_bh_inputs, quantize_fp8
from vdbench.timing import system_info

try:  # imported with the checkout on the path (the tests, a suite's PYTHONPATH)
    from bench.bench_fp8 import make_inputs, sample
except ModuleNotFoundError as e:  # run by path: the bench beside lab/ loaded from its file
    if e.name != "bench":
        raise
    import importlib.util

    _spec = importlib.util.spec_from_file_location("bench_fp8", Path(__file__).resolve().parents[1] / "bench_fp8.py")
    _bench_fp8 = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_bench_fp8)
    make_inputs, sample = _bench_fp8.make_inputs, _bench_fp8.sample

E4M3_MIN_SUBNORMAL = 2.0 ** -9


def layout(t: torch.Tensor, name: str) -> torch.Tensor:
    """The same values as a BHSD tensor: contiguous (``bhsd``) or a view of BSHD memory (``bshd``)."""
    if name == "bhsd":
        return t.contiguous()
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def fa3_module():
    from vdbench.backends.flash import _fa3_module

    return _fa3_module()


def bare_e4m3(q, k, v, qk_layout, v_layout):
    """FA3's e4m3 kernel on fp8_bh_inputs' values, Q/K in ``qk_layout`` and V in ``v_layout``."""
    x = fp8_bh_inputs(q, k, v)
    q8, k8 = layout(x.q8, qk_layout), layout(x.k8, qk_layout)
    v8 = layout(x.v8, v_layout)
    res = fa3_module().flash_attn_func(q8.transpose(1, 2), k8.transpose(1, 2), v8.transpose(1, 2),
                                       q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale)
    out = res[0] if isinstance(res, tuple) else res
    return out.transpose(1, 2)


def chunked(lse_fn, q, k, v, chunk):
    """``lse_fn`` over key chunks of ``chunk`` keys, merged exactly (fp32) by their log-sum-exps."""
    outs, lses = [], []
    for s0 in range(0, k.shape[2], chunk):
        o, lse = lse_fn(q, k[:, :, s0:s0 + chunk], v[:, :, s0:s0 + chunk])
        outs.append(o.float())
        lses.append(lse.float())
    lse_all = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(o * torch.exp(l - lse_all)[..., None] for o, l in zip(outs, lses))
    return out.to(q.dtype)


def emulate_fa3_p(q, k, v, hs, rows, p_scale):
    """FA3 fp8's numerics on the sampled heads/rows: e4m3 Q/K/V with per-(batch, head) scales (from the whole
    heads), S in fp32, P = exp(S - max) · ``p_scale`` rounded to e4m3, rowsum from the unrounded P."""
    q8, qd, _ = quantize_fp8(q[:, hs], "bh")
    k8, kd, _ = quantize_fp8(k[:, hs], "bh")
    v8, vd, _ = quantize_fp8(v[:, hs], "bh")
    qf = (q8.float() * qd)[:, :, rows]
    kf, vf = k8.float() * kd, v8.float()
    s = torch.matmul(qf, kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.exp(s - s.amax(-1, keepdim=True)) * p_scale
    den = p.sum(-1, keepdim=True)
    o = torch.matmul(p.to(torch.float8_e4m3fn).float(), vf) * vd
    return o / den


def sharpness(q, k, hs, rows):
    """Mean max probability of the sampled rows and the mass e4m3 flushes to zero with P scaled to [0, 1] and
    to [0, 256]."""
    s = torch.matmul(q[:, hs][:, :, rows].double(), k[:, hs].double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = torch.softmax(s, -1)
    rel = p / p.amax(-1, keepdim=True)
    entropy = -(p * p.clamp_min(1e-300).log2()).sum(-1)
    out = {"mean_max_p": p.amax(-1).mean().item(), "mean_entropy_bits": entropy.mean().item()}
    for name, scale in (("p1", 1.0), ("p256", 256.0)):
        out[f"flushed_mass_{name}"] = (p * (rel * scale < E4M3_MIN_SUBNORMAL / 2)).sum(-1).mean().item()
    return out


def stats(t: torch.Tensor) -> dict:
    f = t.float()
    amax_h = f.abs().amax(dim=(0, 2, 3))
    rms_h = f.pow(2).mean(dim=(0, 2, 3)).sqrt()
    ch_mean = f.mean(dim=2).abs().amax().item()
    return {"amax_over_rms_max": (amax_h / rms_h.clamp_min(1e-30)).max().item(), "rms_mean": rms_h.mean().item(),
            "channel_mean_absmax": ch_mean}


def one_input(label, q, k, v, args, device):
    hs, rows = sample(q.shape[1], q.shape[2], args.heads, args.rows, device)
    ref = exact_attention(q[:, hs][:, :, rows], k[:, hs], v[:, hs])
    rec = {"input": label, "shape": list(q.shape), "stride": list(q.stride()), "stats": {
        n: stats(t) for n, t in (("q", q), ("k", k), ("v", v))}, "sharpness": sharpness(q, k, hs, rows), "rows": []}

    def row(name, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
            cut = out[:, hs][:, :, rows] if out.shape[2] == q.shape[2] else out
            err = rel_l2(cut, ref)
            blocks = [rel_l2(cut[:, :, i:i + 128], ref[:, :, i:i + 128]) for i in range(0, cut.shape[2], 128)]
            heads_err = [rel_l2(cut[:, j], ref[:, j]) for j in range(cut.shape[1])]
            r = {"what": name, "rel_l2": err, "block_min": min(blocks), "block_max": max(blocks),
                 "head_min": min(heads_err), "head_max": max(heads_err), "finite": bool(torch.isfinite(cut).all())}
        except Exception as e:  # one way failing must not lose the others
            r = {"what": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        r["s"] = round(time.perf_counter() - t0, 2)
        rec["rows"].append(r)
        print(f"  {label:28s} {name:44s} " + (f"{r['rel_l2']:.3e}  blocks {r['block_min']:.2e}-{r['block_max']:.2e}"
                                               f"  heads {r['head_min']:.2e}-{r['head_max']:.2e}"
                                               if "rel_l2" in r else r["error"]), flush=True)

    fp8_lse = B.resolve("fav3_fp8").lse_form(device).fn
    for lay in ("bhsd", "bshd"):
        ql, kl, vl = (layout(t, lay) for t in (q, k, v))
        for name in args.backends:
            be = B.resolve(name)
            row(f"{lay}: {name}", lambda be=be: be(ql, kl, vl))
        row(f"{lay}: fav3_fp8 lse form", lambda: fp8_lse(ql, kl, vl)[0])
        for chunk in args.chunks:
            row(f"{lay}: fav3_fp8 keys in chunks of {chunk}", lambda c=chunk: chunked(fp8_lse, ql, kl, vl, c))
    for qk_l in ("bhsd", "bshd"):
        for v_l in ("bhsd", "bshd"):
            row(f"e4m3 kernel, Q/K {qk_l}, V {v_l}", lambda a=qk_l, b=v_l: bare_e4m3(q, k, v, a, b))
    for name, ps in (("P in [0,256] (FA3)", 256.0), ("P in [0,1]", 1.0), ("P x448", FP8_E4M3_MAX)):
        row(f"emulated, {name}", lambda p=ps: emulate_fa3_p(q, k, v, hs, rows, p))
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory for fp8_error.json")
    p.add_argument("--captures", default=None,
                   help="a capture directory (run_wan.py --save_inputs); self-attention only")
    p.add_argument("--shape", default="wan2.1-1.3b-480p", help="the random inputs' shape preset")
    p.add_argument("--heads", type=int, default=4, help="heads sampled")
    p.add_argument("--rows", type=int, default=1024, help="query rows sampled per head (128-row blocks)")
    p.add_argument("--chunks", default="8192,2048", help="key chunk sizes of the merged rows")
    p.add_argument("--backends", default="fav3,fav3_fp8,fav3_fp8:smooth_v=1,fav3_fp8:smooth_k=1+smooth_v=1",
                   help="registry backends run in each layout")
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    if not torch.cuda.is_available():
        print("check_fp8_error: needs a CUDA GPU (FA3)\nrun it on the GPU machine", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    presets = families.attention_presets()
    if args.shape not in presets:
        p.error(f"unknown shape {args.shape!r}; known: {sorted(presets)}")
    b, h, s, _, d = presets[args.shape]
    report = {"system": system_info(device), "command": " ".join(sys.argv), "inputs": []}
    inputs = [("random, K bias 3", dict(k_bias=3.0)), ("random", dict(k_bias=0.0))]
    for label, kw in inputs:
        q, k, v = make_inputs((b, h, s, s, d), device, **kw)
        report["inputs"].append(one_input(label, q, k, v, args, device))
    if args.captures:
        for f in list_captures(args.captures):
            q, k, v, meta = load_capture(f)
            if q.shape[2] != k.shape[2]:
                continue
            q, k, v = (t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v))
            report["inputs"].append(one_input(f"captured {f.name}", q, k, v, args, device))
    (out / "fp8_error.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out / 'fp8_error.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
