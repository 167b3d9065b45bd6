"""Capture files: safe format, numeric order, refusal of hostile and truncated files."""

import json
import os
import pickle

import pytest
import torch

from vdbench.capture import AttentionCapture, CaptureError, list_captures, load_capture, load_latents, save_latents
from vdbench.patching import AttentionPatch
from tests.test_patching import run, small_wan, wan_inputs


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/vdbench_pwned",))


def test_capture_during_a_real_forward(tmp_path):
    model = small_wan()
    cap = AttentionCapture(tmp_path, "sagev1_emu", rank=3, max_captures=3)
    with AttentionPatch([("transformer", model)], "sagev1_emu", observers=[cap]):
        run(model, wan_inputs())
    meta_path = cap.close()
    files = list_captures(tmp_path)
    assert [f.name for f in files] == [f"attn_sagev1_emu_rank3_{i:06d}.pt" for i in range(3)]
    q, k, v, meta = load_capture(files[1])
    assert q.shape == (1, 2, 48, 16) and k.shape == (1, 2, 512, 16)  # call 1 = cross-attention of block 0
    assert meta["kind"] == "cross" and meta["layer"] == "blocks.0.attn2" and meta["rank"] == 3
    assert meta["layout"] == "BHSD" and meta["args"]["is_causal"] is False
    summary = json.loads(meta_path.read_text())
    assert summary["total_calls"] == 4 and summary["captured"] == 3
    assert sum(s["calls"] for s in summary["unique_shapes"]) == 4 and len(summary["unique_shapes"]) == 2
    # every file loads with weights_only=True, i.e. without unpickling any object
    for f in files:
        torch.load(f, weights_only=True)


def test_numeric_order_not_lexicographic(tmp_path):
    for i in (10, 2, 1):
        torch.save({"q": torch.zeros(1, 1, 2, 4), "k": torch.zeros(1, 1, 2, 4), "v": torch.zeros(1, 1, 2, 4)},
                   tmp_path / f"attn_x_rank0_{i}.pt")
    assert [p.name for p in list_captures(tmp_path)] == ["attn_x_rank0_1.pt", "attn_x_rank0_2.pt",
                                                         "attn_x_rank0_10.pt"]


def test_bshd_captures_are_transposed(tmp_path):
    q = torch.randn(1, 5, 2, 4)  # BSHD: 5 tokens, 2 heads
    torch.save({"q": q, "k": q, "v": q, "meta": {"layout": "BSHD"}}, tmp_path / "attn_a_rank0_0.pt")
    q2, _, _, _ = load_capture(tmp_path / "attn_a_rank0_0.pt")
    assert q2.shape == (1, 2, 5, 4) and torch.equal(q2, q.transpose(1, 2))


def test_hostile_pickle_is_refused_and_not_executed(tmp_path):
    path = tmp_path / "attn_evil_rank0_000000.pt"
    with open(path, "wb") as f:
        pickle.dump({"q": Evil()}, f)
    if os.path.exists("/tmp/vdbench_pwned"):
        os.unlink("/tmp/vdbench_pwned")
    with pytest.raises(CaptureError, match="refused"):
        load_capture(path)
    with pytest.raises(CaptureError):
        load_latents(path)
    assert not os.path.exists("/tmp/vdbench_pwned")


def test_truncated_and_wrong_content(tmp_path):
    good = tmp_path / "attn_a_rank0_000000.pt"
    t = torch.randn(1, 2, 8, 4)
    torch.save({"q": t, "k": t, "v": t}, good)
    trunc = tmp_path / "attn_a_rank0_000001.pt"
    trunc.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CaptureError, match="truncated or corrupt"):
        load_capture(trunc)
    torch.save({"q": t}, tmp_path / "x.pt")
    with pytest.raises(CaptureError, match="missing tensors: k, v"):
        load_capture(tmp_path / "x.pt")
    torch.save([t], tmp_path / "y.pt")
    with pytest.raises(CaptureError, match="top level is list"):
        load_capture(tmp_path / "y.pt")
    torch.save({"q": t, "k": t[:, :, :3], "v": t}, tmp_path / "z.pt")
    with pytest.raises(CaptureError, match="inconsistent shapes"):
        load_capture(tmp_path / "z.pt")


def test_latents_round_trip(tmp_path):
    lat = torch.randn(1, 16, 3, 8, 12)
    p = save_latents(tmp_path, lat, "sdpa", rank=1, repetition=2, meta={"height": 64})
    assert p.name == "latents_sdpa_rank1_002.pt"
    back, meta = load_latents(p)
    assert torch.equal(back, lat) and meta["height"] == 64 and meta["shape"] == [1, 16, 3, 8, 12]
    assert not list(tmp_path.glob(".*tmp"))


def test_a_capture_is_checked_before_any_work(tmp_path):
    """Dense q/k/v of one call, meta that agrees, a size limit -- a few-KB file whose zero strides claim 10^6
    tokens is refused by its shapes and strides alone (nothing allocated)."""
    from vdbench.capture import check_capture

    base = torch.zeros(8)
    huge = base.as_strided((1, 1, 10**6, 8), (0, 0, 0, 1))
    torch.save({"q": huge, "k": huge, "v": huge}, tmp_path / "zero.pt")
    assert (tmp_path / "zero.pt").stat().st_size < 20_000
    with pytest.raises(CaptureError, match=r"zero.pt: not used: q \(1, 1, 1000000, 8\) is not dense \(strides "
                                           r"\(0, 0, 0, 1\), 32 bytes of storage for a shape of 30.5 MiB\)"):
        load_capture(tmp_path / "zero.pt")
    t = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 5, 16)  # grouped-query: 2 K/V heads for 4 query heads, another key length
    check_capture("ok", t, kv, kv, {"shapes": {"q": [1, 4, 8, 16], "k": [1, 2, 5, 16], "v": [1, 2, 5, 16]},
                                    "dtype": "float32", "layout": "BHSD"})
    check_capture("view", t.transpose(1, 2).contiguous().transpose(1, 2), kv, kv, {})  # a strided view is dense
    cases = [
        ((t, kv, kv, {"shapes": {"q": [1, 4, 9, 16]}}), "meta says shapes"),
        ((t, kv, kv, {"dtype": "bfloat16"}), "meta says dtype bfloat16"),
        ((t, kv, kv, {"layout": "SBHD"}), "unknown layout"),
        ((t, torch.randn(1, 3, 5, 16), torch.randn(1, 3, 5, 16), {}), "inconsistent shapes"),
        ((t, kv, torch.randn(1, 2, 6, 16), {}), "inconsistent shapes"),
        ((t.to(torch.int8), kv, kv, {}), "q is int8, not a float tensor"),
        ((t, kv.half(), kv.half(), {}), "dtypes differ"),
        ((t[0], kv, kv, {}), "q has 3 dims"),
    ]
    for (q, k, v, meta), why in cases:
        with pytest.raises(CaptureError, match=why):
            check_capture("x.pt", q, k, v, meta)
    with pytest.raises(CaptureError, match="over the 1 bytes limit"):
        check_capture("x.pt", t, kv, kv, {}, max_bytes=1)
    torch.save({"q": t, "k": t, "v": t}, tmp_path / "big.pt")
    with pytest.raises(CaptureError, match=r"big.pt: not loaded: the file is .* over the 100 bytes limit"):
        load_capture(tmp_path / "big.pt", max_bytes=100)  # refused before torch.load reads it


def test_refusals_are_one_whole_line_that_says_it_was_not_loaded(tmp_path):
    path = tmp_path / "attn_evil_rank0_000000.pt"
    torch.save({"q": Evil()}, path)
    with pytest.raises(CaptureError) as e:
        load_capture(path)
    text = str(e.value)
    assert text == (f"{path}: refused, not loaded: it holds pickled objects (posix.system) beyond tensors and "
                    "plain values, which could run code when unpickled")
    assert "weights_only" not in text and "\n" not in text and not os.path.exists("/tmp/vdbench_pwned")
