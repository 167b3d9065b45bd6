"""The benches of vdbench's fused kernels against diffusers' eager expressions, at the real models' shapes:
``rope`` (Wan's RoPE, ``--fused_rope``; ``bench/rope_bench.py``), ``block`` (a Wan block's elementwise passes,
``--fused_block``; ``bench/block_bench.py``) and ``rows``, what they share (options, a timed row, the end of a run)."""
