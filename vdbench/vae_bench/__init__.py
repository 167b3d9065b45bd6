"""The VAE bench: every decode and encode config of a VAE side by side (``python -m vdbench.vae_bench``,
``bench/bench_vae.py``; :mod:`~vdbench.vae_bench.cli` is its command line), one unit per concern: ``grammar`` (the configs' names, modifiers and
values, the ops, the environment presets of a child process), ``models`` (the VAEs, the latents and videos they are
given), ``configs`` (a config applied to the fp32 VAE: its decode / encode functions), ``measure`` (an op's timed
calls, its time keys, the frames' quality), ``profiler`` (one op under torch.profiler), ``runner`` (one config in
this process or isolated in a child, the fp32 reference then every config) and ``writer`` (the printed rows, the JSON
/ CSV output, the exit code). It sits above the VAE modes it measures (:mod:`vdbench.vae`); no module imports torch
at module level (a child must get its environment, MIOpen presets, before torch loads)."""
