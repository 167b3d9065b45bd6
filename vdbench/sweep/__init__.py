"""Which attention backend for this model, at this size, on this machine: one command that measures and ranks.

    python sweep.py --model random:wan2.1-t2v-1.3b --height 480 --width 832 --num_frames 81 --budget_min 15
    python sweep.py --model tiny --budget_min 3                        # on a CPU: the plumbing, no speed figures
    python sweep.py --model tiny --stacks "fav3+compile" "sdpa+vae=fast"   # stacks beside the plain backends
    python -m vdbench.sweep --model tiny --budget_min 1                # the same, from an installed vdbench
    python sweep.py --model random:wan2.2-i2v-a14b --image first.png --max_gpu_mem 80 --budget_min 20
    python sweep.py --model random:wan2.1-t2v-1.3b --gpus all --nproc 4 --prompts prompts.txt --seeds 1,2

What it does, in order, everything under ``--out`` (default ``outputs/sweep``):

1. **What runs here**: every registered backend with whether it can run on this device, and why not
   (``backends.txt``).
2. **The model's real attention inputs**: one short render with ``--save_inputs`` (one denoising step), then
   the kernel bench (``vdbench.kernel_bench``, ``bench/bench_attention.py``'s command line) on those captures for
   every backend that runs here, ``default`` and the exact ``reference`` included: speed with n and spread, accuracy against exact fp64 attention (``kernels/``: its CSV,
   JSON and records). The bench takes at most ``--kernel_max_s`` (15% of the budget) before it stops starting
   captures of shapes it has already benched. Where a second GPU is visible both run on it, beside ``default``'s
   render on the renders' GPU (``--bench_beside``); the candidates and every multi-GPU render wait for them. With
   ``--layout_backends`` naming the backends (``fav3``) neither runs: those are the candidates, each render estimated
   at the slowest render so far, and a verdict short of renders has no kernel-bench ranking to fall back on (it says so).
3. **Renders**, side by side on the GPUs (``--gpus``, every visible one by default; a pool of GPUs,
   :mod:`vdbench.pool`): the one-GPU renders one a GPU at once, then each layout on its GPUs (on a CPU ``--jobs``
   at once: the plumbing); over a prompt and seed set (``--prompts FILE``, ``--seeds 1,2,3``) each candidate renders
   each (prompt, seed). The candidates -- the backends that run here, are not emulations, and stayed within
   ``--max_rel_l2`` of exact attention on the captures, fastest first, at most ``--max_candidates`` -- plus the
   pipeline's own attention (``default``, the speed baseline), the exact ``reference`` (the quality baseline) and
   every ``--stacks`` entry, same prompt, seed and size, each in its own process and folder (``runs/<name>/``).
   The budget buys them in this order: ``default``, the candidates, the stacks, the ``reference`` last (on several
   GPUs before the layouts). Each render starts on a free GPU only when its estimate (x1.2, plus its quality
   comparison) fits in what is left: default's measured
   render with the step's attention time swapped for that backend's, from the kernel bench on the captures and the
   calls a step makes (:func:`estimate_render_s`; the exact reference is slow because exact fp32 attention is, and
   is predicted so). Where the reference does not fit, the quality columns read against the fastest rendered
   exact-kernel render (:func:`quality_baseline`) and the column titles and the verdict say so. A re-run skips the
   renders already done (their records are read back) and spends what is left of the same budget
   (``progress.json``); ``--stop_after_min`` bounds one run alone (a machine lent for ten minutes at a time).
4. **The ranking** (``sweep.csv``, ``sweep.json``, ``report.html``, ``records.jsonl``): warm ms/step with p20-p80
   and n and beside it the joules per warm step (every card; a GPU's NVML counter), speed-up against ``default``,
   end-to-end seconds, one-time seconds, PSNR / SSIM against the quality baseline (``quality_vs``; over a set the
   mean with min-max and n), the allocated and reserved peaks (and each stage's), videos per GPU-hour and joules
   per video, the kernels that ran; the Pareto set on (warm step, PSNR); and the verdict line: the fastest within
   ``--psnr_tolerance_db`` of exact, and the fastest overall; then the throughput line: for N GPUs, N one-GPU
   renders side by side against the best N-GPU layout, computed from the renders' records
   (:func:`vdbench.sweep.ranking.throughput_text`). Where fewer candidates were rendered than planned, it
   says how many of how many, speaks of those, and ends with the kernel bench's predicted ranking, marked
   provisional.

``--max_gpu_mem GB`` leaves out a render whose estimated peak on a card exceeds it (:mod:`vdbench.sweep.memory`:
default's measured peaks less the weights its offload option takes off the card) and, where no one-GPU render fits,
names the offload stack to try. ``--task`` (default: the model's first: ``random:wan2.2-i2v-a14b`` is image-to-video,
``random:wan2.2-ti2v-5b`` ti2v), ``--image`` and ``--prompt`` are the render's own options; torchrun's ``--nnodes``,
``--rdzv-endpoint`` ... go to the layout renders as the batch scripts pass them.

A stack is ``<attention type>[+option...]`` (:func:`vdbench.measure.record.split_stack`): ``compile``
(``--use_torch_compile``), ``compile=<backend>[:<mode>]`` (with ``--compile_backend`` / ``--compile_mode``),
``fp8gemm`` (``--use_fp8_gemms``), ``fp8gemm=<scope>`` (``--use_fp8_gemms <scope>``: ``fp8gemm=ffn``, the
feed-forward layers only), ``bf16te`` (``--use_bf16_te_gemms``), ``eagerblock`` (``--fused_block off``: the blocks'
elementwise passes unfused, the baseline of the fused default), ``vae=<mode>`` (``--vae_decode``),
``encode=<mode>`` (``--vae_encode``), ``offload=<mode>`` (``--offload``: ``expert``, ``group``, ``model``,
``shard``), ``fp8x`` (``--ulysses_fp8_exchange on``), a step cache's spec (``--cache``: ``fbc:threshold=0.05``, or
``cache=fbc:threshold=0.05``). Its row is named by the stack's one spelling, the ``stack`` its render records
(``sagev2_fp8:gran=per_warp+compile+fp8gemm+vae=fast``). CPU figures are not
speed figures (said in the verdict and per row); emulations are never ranked on speed.
"""

from .budget import (MARGIN, OPTION_ONE_TIME_S, attention_ms_per_step, calls_per_step, default_render_s,
                     estimate_render_s, option_words, options_one_time, plan_renders, predicted_ranking, render_order)
from .candidates import (BASELINE, BASELINE_WHY, REFERENCE, REFERENCE_WHY, STACK_OPTIONS, STACK_VALUES, Candidate,
                         availability, layout_candidates, layout_flags, layouts_for, parse_layout_backends,
                         parse_stack, plan_candidates)
from .command import build_parser, main
from .ranking import (CODEC, COLUMNS, HTML_COLUMNS, RAW, Coverage, quality_baseline, quality_of, rank, row_of, verdict,
                      warm_of, write_outputs)
from .ranking import throughput_text
from .stages import KERNEL_SHARE, TIMED_OUT, Budget, Context, Ledger, render_cmd, run, run_job, side_device

__all__ = ["MARGIN", "OPTION_ONE_TIME_S", "attention_ms_per_step", "calls_per_step", "default_render_s",
           "estimate_render_s", "option_words", "options_one_time", "plan_renders", "predicted_ranking", "render_order",
           "BASELINE", "BASELINE_WHY", "REFERENCE", "REFERENCE_WHY", "STACK_OPTIONS", "STACK_VALUES", "Candidate",
           "availability", "layout_candidates", "layout_flags", "layouts_for", "parse_layout_backends", "parse_stack",
           "plan_candidates", "build_parser", "main", "CODEC", "COLUMNS", "HTML_COLUMNS", "RAW", "Coverage",
           "quality_baseline", "quality_of", "rank", "row_of", "verdict", "warm_of", "write_outputs", "throughput_text",
           "KERNEL_SHARE",
           "TIMED_OUT", "Budget", "Context", "Ledger", "render_cmd", "run", "run_job", "side_device"]
