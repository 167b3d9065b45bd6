"""The offload modes: refusals before the load, and the expert swap's frames equal the resident render's."""

import numpy as np
import pytest
import torch

from vdbench import offload
from vdbench.pipelines import load_pipeline

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _frames(pipe, steps=4):
    out = pipe(prompt="a red fox", negative_prompt="blurry", height=32, width=32, num_frames=5,
               num_inference_steps=steps, guidance_scale=5.0, output_type="np",
               generator=torch.Generator().manual_seed(3))
    return np.asarray(out.frames[0])


@pytest.mark.parametrize("mode,kw,why", [
    ("model", dict(device=CPU, two_experts=True), "needs a CUDA device"),
    ("expert", dict(device=CUDA, two_experts=False), "this model has one denoiser"),
    ("expert", dict(device=CUDA, two_experts=True, parallel=True), "runs on one process"),
    ("expert", dict(device=CUDA, two_experts=True, compiled=True), "compiled graph"),
    ("disk", dict(device=CUDA, two_experts=True), "unknown --offload"),
])
def test_an_offload_that_cant_apply_is_refused_with_its_reason(mode, kw, why):
    with pytest.raises(offload.OffloadError, match=why):
        offload.check_offload(mode, **kw)
    offload.check_offload("none", device=CPU, two_experts=None)


def test_the_expert_swap_gives_the_resident_frames_bit_for_bit_and_swaps_inside_the_step(monkeypatch):
    """Wan 2.2 T2V-A14B's tiny model, 4 steps at its shift 12.0 (timesteps 999, 973, 923, 800): the low-noise expert
    takes the last one. With the swap, each of the high-noise expert's blocks hands its place over after its last
    call of the third step, and the low-noise expert's hand theirs back in the call's last step, for the next call;
    an offloaded weight reads as NaN on a CPU, so a call that ran a block not brought back would show in the
    frames."""
    pipe = load_pipeline("tiny:wan2.2-t2v-a14b", "t2v", "wan")
    resident = [_frames(pipe), _frames(pipe)]
    swap = offload.ExpertSwap(pipe, CPU)
    assert not any(swap.on[1])  # the low-noise expert waits off the device
    swapped = [_frames(pipe), _frames(pipe)]
    for a, b in zip(resident, swapped):
        assert np.array_equal(a, b)
    blocks = len(pipe.transformer.blocks)
    assert swap.per_step == [2, 2]  # cond + uncond forwards a step
    # each call: every unit there and back (the blocks, then the rest), inside the steps before a switch
    assert swap.swaps == 4 * (blocks + 1) and swap.late == 0
    assert all(swap.on[0]) and not any(swap.on[1])  # ready for the next call's first step


def test_the_swap_would_show_a_block_left_behind(monkeypatch):
    """The test above can fail: with the hand-over of one block skipped, its weights stay NaN in the next call."""
    pipe = load_pipeline("tiny:wan2.2-t2v-a14b", "t2v", "wan")
    swap = offload.ExpertSwap(pipe, CPU)
    real = swap._swap

    def skip_block_0(e, j):
        if j == 0 and e == 0:
            swap.on[e][j], swap.on[1 - e][j] = False, True  # marked as swapped, weights not moved
            return
        real(e, j)

    monkeypatch.setattr(swap, "_swap", skip_block_0)
    assert np.isnan(_frames(pipe)).any() or not np.isfinite(_frames(pipe)).all()


def test_an_expert_offloaded_render_equals_the_resident_one_and_records_its_swaps(tmp_path):
    """Through the render CLI: the stack names the offload, the frames are the resident render's bit for bit."""
    import json
    from pathlib import Path

    import run_wan

    base = ["--model", "tiny:wan2.2-t2v-a14b", "--height", "32", "--width", "32", "--num_frames", "5",
            "--num_inference_steps", "4", "--attention_type", "sdpa", "--save_frames", "--num_repetitions", "2",
            "--benchmark_output_directory", str(tmp_path)]
    assert run_wan.main(base) == 0
    assert run_wan.main(base + ["--offload", "expert"]) == 0
    resident, swapped = (json.loads((tmp_path / "results" / "timing.json").read_text())[i] for i in (0, 2))
    assert Path(swapped["output"]).name.endswith("_32x32_offload=expert.mp4") and swapped["stack"] == "sdpa+offload=expert"
    a, b = (np.load(Path(e["output"]).with_suffix(".npy")) for e in (resident, swapped))
    assert np.array_equal(a, b)
    assert swapped["run"]["resolved"]["offload"]["mode"] == "expert"
    assert swapped["offload"]["swapped_late"] == 0 and swapped["offload"]["units_swapped"] > 0
    buffers = swapped["offload"]["host_buffers"]  # each expert's host buffer and its parts' seconds, recorded
    assert [b["expert"] for b in buffers] == ["transformer", "transformer_2"]
    assert not any(b["pinned"] for b in buffers)
    assert all(b["bytes"] > 0 and b["allocate_fault_s"] >= 0 and b["copy_s"] >= 0 for b in buffers)
    assert sum(b["bytes"] for b in buffers) >= swapped["offload"]["host_bytes"]


def test_an_offloaded_expert_is_checked_against_the_device_it_runs_on():
    """Its weights wait on the host, yet a backend's availability is the GPU's: the target says where it runs."""
    from vdbench.patching.targets import target_of

    model = torch.nn.Linear(2, 2)
    assert target_of("transformer_2", model).device == CPU
    setattr(model, offload.EXECUTION_DEVICE, CUDA)
    assert target_of("transformer_2", model).device == CUDA


def _mixed_module():
    """Weights of several dtypes and odd sizes (none a multiple of the alignment), a 0-d one and an empty one."""
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.randn(3, 5))
    m.b = torch.nn.Parameter(torch.randn(7, dtype=torch.float64).to(torch.bfloat16))
    m.c = torch.nn.Parameter(torch.tensor(2.5))
    m.register_buffer("d", torch.arange(11, dtype=torch.int64))
    m.register_buffer("e", torch.empty(0))
    m.register_buffer("f", torch.tensor([True, False, True]))
    return m


def test_a_host_buffer_holds_each_weight_as_an_aligned_view_of_one_storage_with_its_bytes():
    from vdbench import hostmem

    weights = [*_mixed_module().parameters(), *_mixed_module().buffers()]
    offsets, size = hostmem.layout(weights)
    assert all(o % hostmem.ALIGN == 0 for o in offsets) and offsets == sorted(offsets)
    assert size == offsets[-1] + hostmem.nbytes(weights[-1])
    buffer = hostmem.HostBuffer(size, pinned=False, threads=3)
    views = buffer.fill(weights)
    storage, start = buffer.buf.untyped_storage().data_ptr(), buffer.buf.storage_offset()
    assert buffer.buf.data_ptr() % (2 << 20) == 0  # the buffer on a 2 MiB boundary (its chunks' pages its own)
    for o, v, t in zip(offsets, views, weights):
        assert v.untyped_storage().data_ptr() == storage and buffer.holds(v)
        assert v.storage_offset() * v.element_size() - start == o
        assert v.dtype == t.dtype and v.shape == t.shape
        assert bytes(v.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
            t.detach().contiguous().view(-1).view(torch.uint8).numpy())
    assert not buffer.holds(torch.zeros(3))  # another allocation
    parts = buffer.parts
    assert parts["bytes"] == size and parts["pinned"] is False and parts["register_s"] is None  # no CUDA: pageable
    assert parts["allocate_fault_s"] >= 0 and parts["copy_s"] >= 0 and parts["fault_threads"] >= 1
    with pytest.raises(ValueError, match="don't fit"):
        hostmem.HostBuffer(size - 1, pinned=False).views(weights)


def test_a_buffer_made_in_chunks_on_a_thread_takes_each_copy_once_its_chunk_is_made():
    from vdbench import hostmem

    weights = [torch.randn(300_000), torch.randn(700_000).to(torch.bfloat16), torch.arange(200_000)]  # ~4.2 MB
    size = hostmem.layout(weights)[1]
    buffer = hostmem.HostBuffer(size, pinned=False, background=True, chunk=2 << 20, threads=2)
    views = buffer.fill(weights)
    assert buffer.ready and buffer.parts["chunks"] == 3 == -(-size // (2 << 20))
    assert all(torch.equal(v, t) for v, t in zip(views, weights))
    assert buffer.parts["made_s"] >= buffer.parts["allocate_fault_s"] >= 0 and buffer.parts["waited_s"] >= 0


def test_a_pinned_buffer_is_registered_whole_once_faulted_and_unregistered_once(monkeypatch):
    """The registration's bookkeeping, on a CPU with the driver's calls recorded: faulted in chunks, then one
    registration covering the whole buffer (a copy may not span two), the buffer on a 2 MiB boundary inside it and
    the registration from the storage's first byte (what torch's ``is_pinned()`` asks the driver about); no copy
    waits on a part before it is registered; unregistered once, by close (or the buffer's collection)."""
    from vdbench import hostmem

    pinned, unpinned = [], []
    monkeypatch.setattr(hostmem, "pin", lambda b: pinned.append((b.data_ptr(), b.numel())))
    monkeypatch.setattr(hostmem, "unpin", lambda b: unpinned.append(b.data_ptr()))
    size = 5 * (2 << 20) + 12345
    buffer = hostmem.HostBuffer(size, pinned=True, chunk=2 * (2 << 20), threads=2)
    (start, n), = pinned
    assert start == buffer.buf.untyped_storage().data_ptr() and n == buffer.buf.untyped_storage().nbytes()
    assert buffer.buf.data_ptr() % (2 << 20) == 0
    assert start <= buffer.buf.data_ptr() < buffer.buf.data_ptr() + size <= start + n
    assert buffer.parts["register_s"] >= 0 and buffer.parts["chunks"] == 3 and buffer.ready
    buffer.close()
    buffer.close()
    assert unpinned == [start]
    del buffer  # collected after close: nothing unregistered twice
    assert len(unpinned) == 1


def test_fault_touches_every_page_from_several_threads():
    from vdbench import hostmem

    page = hostmem._PAGE
    buf = torch.full((5 * page + 3,), 7, dtype=torch.uint8)
    assert hostmem.fault(buf, threads=3) == 3
    assert (buf[::page] == 0).all() and (buf[1::page] == 7).all()


def test_a_buffer_made_on_a_thread_is_waited_for_and_its_wait_recorded():
    from vdbench import hostmem

    buffer = hostmem.HostBuffer(1 << 20, pinned=False, background=True)
    assert buffer.wait().numel() == 1 << 20 and buffer.ready and buffer.parts["waited_s"] >= 0


def test_the_load_moves_an_offloaded_expert_into_one_buffer_and_the_swap_takes_it_as_it_is():
    """``build_pipeline(host=...)``: the idle expert built, then moved into a host buffer made on a thread (sized on
    the meta device); its weights are the same bytes as a resident build's, and the expert swap renders its frames
    bit for bit from that buffer, recording each expert's buffer and its parts' seconds."""
    from vdbench import hostmem
    from vdbench.tiny import build_pipeline, get_variant

    variant = get_variant("wan2.2-t2v-a14b")
    resident = build_pipeline(variant)
    timings = {}
    pipe = build_pipeline(variant, timings=timings, host=("transformer_2",))
    assert {"host_buffers_started", "transformer_2"} <= set(timings)
    buffer = getattr(pipe.transformer_2, hostmem.HOST_BUFFER)
    weights = [*pipe.transformer_2.parameters(), *pipe.transformer_2.buffers()]
    assert buffer.size == hostmem.layout(weights)[1] and all(buffer.holds(t) for t in weights)
    for t, r in zip(weights, [*resident.transformer_2.parameters(), *resident.transformer_2.buffers()]):
        assert t.dtype == r.dtype and torch.equal(t, r)
    frames = _frames(resident)
    swap = offload.ExpertSwap(pipe, CPU)
    assert np.array_equal(_frames(pipe), frames)
    record = swap.as_dict()
    made = {b["expert"]: b for b in record["host_buffers"]}
    assert made["transformer_2"]["made"] == "load" and made["transformer"]["made"] == "render"
    assert made["transformer_2"]["bytes"] == buffer.size and swap.buffers[1] is buffer
    for b in made.values():
        assert b["allocate_fault_s"] >= 0 and b["copy_s"] >= 0 and b["register_s"] is None
    assert record["waited_for_host_copies"] == 0 and record["waited_for_host_copies_s"] == 0
    swap.close()


def test_a_swap_that_waits_for_the_host_copies_counts_the_wait_and_its_seconds():
    import threading
    import time

    class Late(threading.Event):  # the thread's copies still on their way at the first switch, done 0.3 s later
        def wait(self, timeout=None):
            time.sleep(0.3)
            self.set()
            return super().wait(timeout)

    pipe = load_pipeline("tiny:wan2.2-t2v-a14b", "t2v", "wan")
    swap = offload.ExpertSwap(pipe, CPU)
    swap.copied = Late()
    _frames(pipe)
    record = swap.as_dict()
    assert record["waited_for_host_copies"] == 1 and record["waited_for_host_copies_s"] >= 0.3


def test_group_offload_hands_diffusers_one_host_copy_of_each_denoiser(monkeypatch):
    """``--offload group``: the denoisers stay on the host from the load on (:data:`offload.HOST_COMPONENTS`), each in
    one flat buffer -- the load's (a random-weight build) or made by the offload from host weights (a
    ``from_pretrained`` load) -- whose views diffusers' group offload takes as its pinned copies, so it pins no
    second copy; the same bytes as the load's; weights on another device refused."""
    from vdbench import hostmem
    from vdbench.tiny import build_pipeline, get_variant

    variant = get_variant("wan2.2-t2v-a14b")
    resident = build_pipeline(variant)
    pipe = build_pipeline(variant, host=("transformer",))  # one from the load, the other still plain host tensors
    assert offload.HOST_COMPONENTS["group"] == ("transformer", "transformer_2")
    record = offload.host_buffers(pipe, pinned=False)
    assert {k: v["made"] for k, v in record.items()} == {"transformer": "load", "transformer_2": "offload"}
    for name in ("transformer", "transformer_2"):
        model, ref = getattr(pipe, name), getattr(resident, name)
        assert hostmem.held(model) is getattr(model, hostmem.HOST_BUFFER)
        assert record[name]["bytes"] == hostmem.layout(hostmem.weights(model))[1] and record[name]["pinned"] is False
        for t, r in zip(hostmem.weights(model), hostmem.weights(ref)):
            assert t.dtype == r.dtype and torch.equal(t, r)
    assert {k: v["made"] for k, v in offload.host_buffers(pipe, pinned=False).items()} == {
        "transformer": "load", "transformer_2": "load"}  # taken as they are the second time
    meta = build_pipeline(variant, module_device="meta")
    with pytest.raises(offload.OffloadError, match="weights from the host; they are on meta"):
        offload.host_buffers(meta, pinned=False)


def test_host_buffers_past_the_hosts_memory_are_refused_before_any_is_made(monkeypatch):
    """What the host must keep is checked against its available memory before a buffer is allocated -- at the load
    (the offloaded denoisers), by the expert swap (the buffers the load did not make) and by the group offload (a
    ``from_pretrained`` load's host weights): one line with the bytes asked and available, a hint on the next; past
    it the kernel's OOM killer would end the render without a word (an H200 host, A14B pinned twice)."""
    from vdbench import hostmem
    from vdbench.tiny import build_pipeline, get_variant

    variant = get_variant("wan2.2-t2v-a14b")
    made = []
    monkeypatch.setattr(hostmem.HostBuffer, "_make", lambda self: made.append(self.size))
    monkeypatch.setattr(hostmem, "available", lambda: 1000)
    refused = (r"(?s)^the load keeps 0\.\d GB of weights in host memory \(transformer_2 .*"
               r"this host has 0\.0 GB available\n")
    with pytest.raises(hostmem.HostMemoryError, match=refused + ".*more memory"):
        build_pipeline(variant, host=("transformer_2",))
    assert made == []
    pipe = build_pipeline(variant)
    with pytest.raises(hostmem.HostMemoryError, match="^--offload expert keeps .*transformer .*transformer_2 "):
        offload.ExpertSwap(pipe, CPU)
    with pytest.raises(hostmem.HostMemoryError, match=r"^--offload group keeps .*\n.*--offload model"):
        offload.host_buffers(pipe, pinned=False)
    assert made == [] and issubclass(hostmem.HostMemoryError, ValueError)  # the render's load refusals take it
    monkeypatch.setattr(hostmem, "available", lambda: None)  # a system that doesn't say: nothing refused
    hostmem.check_room({"x": 1 << 60}, "a test", "none")


def _built_into_its_buffer_as_whole(variant):
    """``transformer_2`` built into a host buffer (:func:`vdbench.tiny._make_transformer_into`), checked to be held by
    that buffer with the bytes and dtypes of a whole build; returns it."""
    from vdbench import hostmem, tiny

    whole = tiny._make_transformer(variant, "transformer_2")
    tiny._final_dtypes(whole)
    meta = tiny._meta_transformer(variant, "transformer_2")
    buffer = hostmem.HostBuffer(hostmem.layout(hostmem.weights(meta))[1], pinned=False)
    model = tiny._make_transformer_into(variant, "transformer_2", buffer, meta)
    assert hostmem.held(model) is buffer
    for t, r in zip(hostmem.weights(model), hostmem.weights(whole)):
        assert t.dtype == r.dtype and torch.equal(t, r)
    return model


def test_a_host_build_puts_every_weight_in_its_own_place_even_past_a_stray_block(monkeypatch):
    """The block-by-block build names each block by the order its class is built in; a block of that class built
    before the model's own shifts those names, and the pass over the whole model at the end moves every weight to
    its own view: the model ends in its buffer with the bytes of a whole build (only the device's peak is lost)."""
    import diffusers
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from vdbench import tiny

    variant = tiny.get_variant("wan2.2-t2v-a14b")
    cfg = variant.transformer_2
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    original = diffusers.WanTransformer3DModel.__init__

    def with_a_stray_block_first(self, *a, **k):
        WanTransformerBlock(dim, cfg["ffn_dim"], cfg["num_attention_heads"])  # built, then dropped
        original(self, *a, **k)

    monkeypatch.setattr(diffusers.WanTransformer3DModel, "__init__", with_a_stray_block_first)
    _built_into_its_buffer_as_whole(variant)


def test_a_host_build_without_a_list_of_blocks_is_built_whole_then_moved(monkeypatch):
    """A denoiser whose blocks are not in a ``blocks`` / ``transformer_blocks`` list can't be streamed: it is built
    whole, then moved into its buffer, the same bytes."""
    import diffusers

    import dataclasses

    from vdbench import tiny

    # the family's tweak reads `blocks`: left out here, on both builds
    variant = dataclasses.replace(tiny.get_variant("wan2.2-t2v-a14b"), transformer_init=None)
    original = diffusers.WanTransformer3DModel.__init__

    def blocks_elsewhere(self, *a, **k):
        original(self, *a, **k)
        self.layers = self.blocks
        del self.blocks

    monkeypatch.setattr(diffusers.WanTransformer3DModel, "__init__", blocks_elsewhere)
    assert not hasattr(_built_into_its_buffer_as_whole(variant), "blocks")


def test_model_offload_places_a_random_build_like_group_and_releases_its_buffers(monkeypatch):
    """``--offload model``: a checkpoint is read on the host and stays there; a random-weight build draws its
    denoisers on the device a block at a time into host buffers (the same bytes as a resident build: the frames are
    the resident render's), and the offload lets go of those buffers before diffusers' model offload takes over (it
    moves each component back into new host memory: the buffer would be a second host copy)."""
    from vdbench import hostmem
    from vdbench.tiny import build_pipeline, get_variant

    assert offload.load_placement("model", built=False) == (True, ())
    assert offload.load_placement("model", built=True) == (False, ("transformer", "transformer_2"))
    assert offload.load_placement("group", built=False) == (False, ("transformer", "transformer_2"))
    assert offload.load_placement("none", built=True) == (False, ())
    variant = get_variant("wan2.2-t2v-a14b")
    resident = build_pipeline(variant)
    pipe = build_pipeline(variant, host=offload.load_placement("model", built=True)[1])
    for name in ("transformer", "transformer_2"):
        assert hostmem.held(getattr(pipe, name)) is not None
        for t, r in zip(hostmem.weights(getattr(pipe, name)), hostmem.weights(getattr(resident, name))):
            assert torch.equal(t, r)
    calls = []
    monkeypatch.setattr(type(pipe), "enable_model_cpu_offload", lambda self, device=None: calls.append(device))
    record = offload.apply_offload("model", pipe, CPU)
    assert calls == [CPU] and record["load_buffers_released"] == ["transformer", "transformer_2"]
    assert all(hostmem.HOST_BUFFER not in vars(getattr(pipe, n)) for n in ("transformer", "transformer_2"))
