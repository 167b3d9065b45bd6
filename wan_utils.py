"""Wan helpers at the top level, for scripts that `import wan_utils`; the logic lives in the vdbench package.

    from wan_utils import load_pipeline, install_backend
    pipe = load_pipeline("tiny", "t2v")                       # or a hub id / local path
    with install_backend(transformers_of(pipe), "sagev1_emu") as patch:
        pipe("a cat", num_frames=17, height=128, width=192)
    print(patch.stats.calls)
"""

from vdbench.pipelines import check_video_size, load_pipeline, resolve_model, transformers_of  # noqa: F401
from vdbench.patching import AttentionPatch as install_backend  # noqa: F401
from vdbench.render import model_tag, wan_output_name  # noqa: F401
from vdbench.decode import decode_latents  # noqa: F401
