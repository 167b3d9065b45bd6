"""Multi-process rendering under ``torchrun``, one module per concern::

    torchrun --nproc_per_node=2 run_wan.py --ulysses_degree 2 --parallel_engine diffusers ...

``spec`` (the layout and every check of it), ``group`` (the process group, the context a render runs in, what the
ranks do together), ``guidance`` (the CFG split and the interleaved guidance branches), ``engines`` (xfuser's and
diffusers' context parallelism applied to a loaded pipeline), ``failure`` (a rank's failure handed to its peers, the
exit codes). Every rank checks its device and backend and the ranks agree before any rendering; only rank 0 writes
the video and the merged timing.json, which carries every rank's figures (``ranks``).
"""

from .engines import apply_engine, one_device_presented, rebuild_pipeline_as, warm_collectives
from .failure import EXIT_PEER_FAILED, FailureWatch, finish, maybe_inject_failure, set_outcome
from .group import (DistContext, OneProcess, agree, init_distributed, merge_rank_entries, share_output, shard_group,
                    shares_calls)
from .guidance import GuidanceSplit, guidance_split, interleaved, split_guidance, turn
from .spec import (ENGINE_CHOICES, ENGINES, GUIDANCE_OVERLAP_AUTO, ParallelSpec, check_backend_for_path,
                   compile_refusal, engine_check, fp8_exchange_refusal, guidance_overlap_refusal, hooks_in_place,
                   refusal_of, resolve_engine, sequence_layout, settle, settle_engine, settle_guidance_overlap)

__all__ = ["ParallelSpec", "DistContext", "OneProcess", "ENGINES", "ENGINE_CHOICES", "resolve_engine", "engine_check",
           "refusal_of", "settle", "settle_engine", "init_distributed", "check_backend_for_path", "agree", "apply_engine",
           "share_output", "sequence_layout", "merge_rank_entries", "FailureWatch", "set_outcome", "finish",
           "one_device_presented", "shares_calls", "shard_group", "hooks_in_place", "compile_refusal",
           "guidance_split", "split_guidance", "guidance_overlap_refusal", "settle_guidance_overlap",
           "GUIDANCE_OVERLAP_AUTO", "GuidanceSplit", "interleaved", "turn", "EXIT_PEER_FAILED", "maybe_inject_failure",
           "fp8_exchange_refusal", "rebuild_pipeline_as", "warm_collectives"]
