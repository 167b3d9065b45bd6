"""The VAE: how a render decodes its latents and encodes its conditioning image, apart from the model families.

- :mod:`~vdbench.vae.decode` -- the decode modes as one table (``MODES``: default, fast, parallel), checked once
  (``check_decode``) and run by ``decode_latents``; the VAE mode switch every caller goes through.
- :mod:`~vdbench.vae.encode` -- the encode modes (default, fast), the twin of ``decode`` over the same check.
- :mod:`~vdbench.vae.fast` -- the fast Wan decode's mechanics: channels_last, chunked decoder calls, the memory
  bound, which glue runs; ``prepare_latents``.
- :mod:`~vdbench.vae.lean` -- the lean decoder and encoder layers the fast decode and encode install.
- :mod:`~vdbench.vae.parallel` -- the band decode: rows split across the ranks of a process group.
- :mod:`~vdbench.vae.prewarm` -- a mode's first-call compiles, on a thread while the GPU denoises.

Callers import the module they need (``from vdbench.vae.decode import decode_latents``); the package re-exports
nothing, so that importing one mode does not load the others.
"""
