import sys, time, torch
sys.path.insert(0, ".")
mode = sys.argv[1]
import flashinfer
from vdbench import backends as B
g = torch.Generator(device="cuda").manual_seed(0)
H, S, D = 2, 1024, int(sys.argv[2]) if len(sys.argv) > 2 else 64
q, k, v = (torch.randn(1, H, S, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
t = time.time()
if mode.startswith("nhd_"):
    o = flashinfer.single_prefill_with_kv_cache(*(x[0].transpose(0, 1).contiguous() for x in (q, k, v)),
                                                backend=mode[4:]).transpose(0, 1)[None]
else:
    o = B.resolve(mode)(q, k, v)
torch.cuda.synchronize()
print(mode, D, "ok, rel err", ((o.float() - ref).norm() / ref.norm()).item(), f"{time.time() - t:.1f} s (JIT incl.)")
