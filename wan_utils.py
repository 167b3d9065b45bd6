"""Wan helpers at the top level, for scripts that `import wan_utils`; the logic lives in the vdbench package.

    from wan_utils import load_pipeline, use_backend
    pipe = load_pipeline("tiny", "t2v")                       # or a hub id / local path
    with use_backend(pipe, "sagev1_emu") as patch:            # removed again when the block ends
        pipe("a cat", num_frames=9, height=64, width=96, num_inference_steps=2)
    print(patch.stats.calls)

``install_backend(models, name)`` is vdbench.patching's installer: it installs at once and returns the patch,
to ``remove()`` after (or to use in a ``with`` block, which removes it on exit).
"""

from vdbench.api import use_backend  # noqa: F401
from vdbench.patching import install_backend  # noqa: F401
from vdbench.pipelines import check_video_size, load_pipeline, resolve_model, transformers_of  # noqa: F401
from vdbench.families import model_tag  # noqa: F401
from vdbench.families.wan import output_name as wan_output_name  # noqa: F401
from vdbench.vae.decode import decode_latents  # noqa: F401
