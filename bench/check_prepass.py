"""fav3_fp8's pre-pass: the one-launch Q/K/V form against the per-tensor kernels and the eager path, same tensors.

Why: the pre-pass is fav3_fp8's whole overhead over FA3 fp8 on pre-quantized inputs (issue 20's goal: within 3%).
Its cost has two parts that show in different places: the GPU time of its kernels (what a pipeline pays when the
host runs ahead) and the host's launch gaps (what a synchronised call pays, as ``bench_fp8.py``'s per-call events
see it). Both are timed here for each form in one process, so a change is measured against the old form on the
same machine, not against a figure from another call:

* ``call``: CUDA events around one call, the host waiting for its end (``vdbench.timing.call_ms``);
* ``stream``: events around ``--burst`` calls issued back to back, divided by the count (the GPU's time per call
  when launches are hidden).

Also checks that the forms give the same bits (values and scales). Random bf16 inputs with a K channel bias in
diffusers' BSHD memory (BHSD views), never zeros.

    python3 bench/check_prepass.py --out DIR [--shapes wan2.1-1.3b-480p,wan2.1-14b-720p,cogvideox-2b]
"""

import argparse
import json
import os
import sys
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the plumbing only, on a CPU

import torch  # noqa: E402

from vdbench import numerics as N  # noqa: E402
from vdbench.helptext import DefaultsHelpFormatter  # noqa: E402
from vdbench.timing import call_ms, spread, system_info  # noqa: E402

SHAPES = {"wan2.1-1.3b-480p": (12, 32760, 128), "wan2.1-14b-720p": (40, 75600, 128), "cogvideox-2b": (30, 17776, 64),
          "tiny": (2, 200, 64)}


def _stream_ms(fn, burst: int, device) -> float:
    if device.type != "cuda":
        return call_ms(lambda: [fn() for _ in range(burst)], device) / burst
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(burst):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / burst


def check(name, shape, reps, burst, device):
    from vdbench.kernels import fa3_prepass as P

    h, s, d = shape
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn((1, s, h, d), generator=g, device=device).to(torch.bfloat16).transpose(1, 2)
    k = (torch.randn((1, s, h, d), generator=g, device=device)
         + 2.0 * torch.randn((1, 1, h, d), generator=g, device=device)).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn((1, s, h, d), generator=g, device=device).to(torch.bfloat16).transpose(1, 2)
    forms = {"one_launch_qkv": lambda: P.quantize_qkv(q, k, v),
             "per_tensor": lambda: [P.quantize_bh(t) for t in (q, k, v)],
             "eager": lambda: N.fp8_bh_inputs(q, k, v)}
    a, b = P.quantize_qkv(q, k, v), N.fp8_bh_inputs(q, k, v)
    same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[:3], b[:3]))
    row = dict(shape=name, H=h, S=s, D=d, same_bits_as_eager=same and all(torch.equal(x, y) for x, y in
                                                                           zip(a[3:6], b[3:6])),
               bytes_min=3 * q.numel() * (2 + 1), timer="CUDA events" if device.type == "cuda" else
               "host clock: not a speed figure")
    for key, fn in forms.items():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        c = spread([call_ms(fn, device) for _ in range(reps)])
        st = spread([_stream_ms(fn, burst, device) for _ in range(max(3, reps // 4))])
        row[key] = dict(call_ms=c["median"], call_p20=c["p20"], call_p80=c["p80"], n=c["n"],
                        stream_ms=st["median"], stream_p20=st["p20"], stream_p80=st["p80"], stream_n=st["n"],
                        burst=burst)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for prepass.json")
    ap.add_argument("--shapes", default="wan2.1-1.3b-480p,wan2.1-14b-720p,cogvideox-2b",
                    help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=40, help="timed single calls per form and shape (after a warm-up)")
    ap.add_argument("--burst", type=int, default=20, help="calls per back-to-back sample")
    ap.add_argument("--device", default="cuda", help="cpu: the plumbing only (Triton's interpreter), not speed")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.shapes.split(","):
        try:
            rows.append(check(name, SHAPES[name], a.reps, a.burst, device))
        except Exception as e:  # one shape failing keeps the others; the reason is the row
            rows.append(dict(shape=name, error=f"{type(e).__name__}: {e}"))
        print(json.dumps(rows[-1]), flush=True)
    (out / "prepass.json").write_text(json.dumps(dict(system=system_info(a.device), rows=rows), indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
