"""fav3_fp8's pre-pass: the one-launch Q/K/V form against the per-tensor kernels and the eager path, same tensors.

Why: the pre-pass is fav3_fp8's whole overhead over FA3 fp8 on pre-quantized inputs (the goal: within 3%).
Its cost has two parts that show in different places: the GPU time of its kernels (what a pipeline pays when the
host runs ahead) and the host's launch gaps (what a synchronised call pays, as ``bench_fp8.py``'s per-call events
see it). Both are timed here for each form in one process, so a change is measured against the old form on the
same machine, not against a figure from another call:

* ``call``: CUDA events around one call, the host waiting for its end (``vdbench.timing.call_ms``);
* ``stream``: events around ``--burst`` calls issued back to back, divided by the count (the GPU's time per call
  when launches are hidden);
* ``host_us``: the host's time to issue one call (no wait for the GPU), median microseconds.

Besides the pre-pass forms, the whole ``fav3_fp8`` call (registry entry) against FA3's e4m3 kernel alone on
inputs quantized beforehand (``fa3_fp8_kernel``), where FA3 imports: their ratios per call and back to back are
the goal's two readings (``bench_fp8.py`` times per call only; a pipeline's host runs ahead, as back to back).

Also checks that the forms give the same bits (values and scales). Random bf16 inputs with a K channel bias, never
zeros, in two memory layouts (``--layouts``): ``bshd`` (diffusers' memory, BHSD views: what the pipelines pass)
and ``bhsd`` (contiguous BHSD: what ``bench_fp8.py`` passes).

    python3 bench/lab/check_prepass.py --out DIR [--shapes wan2.1-1.3b-480p,wan2.1-14b-720p,cogvideox-2b]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the plumbing only, on a CPU

import torch  # noqa: E402

from vdbench import numerics as N  # noqa: E402
from vdbench.helptext import DefaultsHelpFormatter  # noqa: E402
from vdbench.timing import burst_ms, call_ms, spread, system_info  # noqa: E402

SHAPES = {"wan2.1-1.3b-480p": (12, 32760, 128), "wan2.1-14b-720p": (40, 75600, 128), "cogvideox-2b": (30, 17776, 64),
          "tiny": (2, 200, 64)}


def _stream_ms(fn, burst: int, device) -> float:
    return burst_ms(fn, device, burst)


def _host_us(fn, device) -> float:
    """Microseconds the host takes to issue ``fn()`` (the GPU drained before, not waited for after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def inputs(h, s, d, layout, device):
    """Q, K (with a per-(head, channel) bias), V as BHSD tensors: views of BSHD memory (``bshd``) or contiguous."""
    g = torch.Generator(device=device).manual_seed(0)
    dims = (1, s, h, d) if layout == "bshd" else (1, h, s, d)
    bias = (1, 1, h, d) if layout == "bshd" else (1, h, 1, d)
    q = torch.randn(dims, generator=g, device=device)
    k = torch.randn(dims, generator=g, device=device) + 2.0 * torch.randn(bias, generator=g, device=device)
    v = torch.randn(dims, generator=g, device=device)
    out = [t.to(torch.bfloat16) for t in (q, k, v)]
    return [t.transpose(1, 2) for t in out] if layout == "bshd" else out


def attention_forms(q, k, v, device) -> tuple[dict, str]:
    """``fav3_fp8`` (the registry entry) and FA3's e4m3 kernel on the same inputs quantized beforehand, or ({}, why)
    where the entry can't run here."""
    from vdbench import backends as B

    be = B.resolve("fav3_fp8")
    ok, why = be.availability(device, q.dtype, q.shape[-1])
    if not ok:
        return {}, why
    from vdbench.backends.flash import _fa3_module

    fa3 = _fa3_module()
    x = be.bench.prepass(q, k, v)
    args = [t.transpose(1, 2) for t in x[:3]]
    kw = dict(q_descale=x.q_descale, k_descale=x.k_descale, v_descale=x.v_descale)

    def kernel():
        res = fa3.flash_attn_func(*args, **kw)
        return res[0] if isinstance(res, tuple) else res

    return {"fav3_fp8": lambda: be(q, k, v), "fa3_fp8_kernel": kernel}, ""


def check(name, shape, layout, reps, burst, device):
    from vdbench.kernels import fa3_prepass as P

    h, s, d = shape
    q, k, v = inputs(h, s, d, layout, device)
    forms = {"one_launch_qkv": lambda: P.quantize_qkv(q, k, v),
             "per_tensor": lambda: [P.quantize_bh(t) for t in (q, k, v)],
             "eager": lambda: N.fp8_bh_inputs(q, k, v)}
    attn, why = attention_forms(q, k, v, device)
    forms.update(attn)
    a, b = P.quantize_qkv(q, k, v), N.fp8_bh_inputs(q, k, v)
    same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[:3], b[:3]))
    row = dict(shape=name, layout=layout, H=h, S=s, D=d, same_bits_as_eager=same and all(torch.equal(x, y) for x, y in
                                                                           zip(a[3:6], b[3:6])),
               bytes_min=3 * q.numel() * (2 + 1), timer="CUDA events" if device.type == "cuda" else
               "host clock: not a speed figure")
    for key, fn in forms.items():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        c = spread([call_ms(fn, device) for _ in range(reps)])
        st = spread([_stream_ms(fn, burst, device) for _ in range(max(3, reps // 4))])
        hu = spread([_host_us(fn, device) for _ in range(max(3, reps // 4))])
        row[key] = dict(call_ms=c["median"], call_p20=c["p20"], call_p80=c["p80"], n=c["n"],
                        stream_ms=st["median"], stream_p20=st["p20"], stream_p80=st["p80"], stream_n=st["n"],
                        burst=burst, host_us=hu["median"], host_n=hu["n"])
    if attn:
        ker, reg = row["fa3_fp8_kernel"], row["fav3_fp8"]
        row["fav3_fp8_over_kernel"] = dict(call=reg["call_ms"] / ker["call_ms"],
                                           stream=reg["stream_ms"] / ker["stream_ms"])
    else:
        row["fav3_fp8"] = f"not timed: {why}"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for prepass.json")
    ap.add_argument("--shapes", default="wan2.1-1.3b-480p,wan2.1-14b-720p,cogvideox-2b",
                    help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--layouts", default="bshd,bhsd", help="comma list of bshd (diffusers' memory), bhsd")
    ap.add_argument("--reps", type=int, default=40, help="timed single calls per form and shape (after a warm-up)")
    ap.add_argument("--burst", type=int, default=20, help="calls per back-to-back sample")
    ap.add_argument("--device", default="cuda", help="cpu: the plumbing only (Triton's interpreter), not speed")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.shapes.split(","):
        for layout in a.layouts.split(","):
            try:
                rows.append(check(name, SHAPES[name], layout, a.reps, a.burst, device))
            except Exception as e:  # one shape failing keeps the others; the reason is the row
                rows.append(dict(shape=name, layout=layout, error=f"{type(e).__name__}: {e}"))
            print(json.dumps(rows[-1]), flush=True)
    (out / "prepass.json").write_text(json.dumps(dict(system=system_info(a.device), rows=rows), indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
