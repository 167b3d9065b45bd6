"""Processors that call diffusers' attention dispatcher (Wan's ``WanAttnProcessor``): ``dispatch_attention_fn``.

The rebound ``__call__`` finds our ``dispatch_attention_fn`` in its globals instead of diffusers'; it takes and
returns BSHD tensors like the original. Under diffusers' context parallelism (``parallel_config``) diffusers'
own Ulysses / ring / unified templates still run, with our kernel as their forward op -- what a registered
diffusers backend does -- so the chosen backend serves every path.
"""

from __future__ import annotations

import torch

from ..backends import UnsupportedCall, sdpa_kernel_choice
from .adapter import Adapter, path_tag
from .calls import call_args
from .ulysses import Fp8Exchange, UlyssesExchange, can_overlap, overlapped_ulysses

__all__ = ["DispatcherAdapter"]


class DispatcherAdapter(Adapter):
    mode = "dispatcher"

    @classmethod
    def reaches(cls, names: tuple[str, ...]) -> bool:
        return "dispatch_attention_fn" in names

    def rebind(self, g: dict) -> None:
        g["dispatch_attention_fn"] = self.dispatch_attention_fn

    def op_call(self, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, parallel=False):
        return self.dispatch_attention_fn(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                          parallel_config=self._parallel_config() if parallel else None)

    def _parallel_config(self):
        """The context-parallel config of the model whose call the op runs (``patch.context``): the one diffusers'
        ``enable_parallelism`` gave the model and its processors (fixed for the run), looked up once per model."""
        model = self.patch.context[0]
        configs = self.__dict__.setdefault("_configs", {})
        if model not in configs:
            config = getattr(dict(self.patch.models).get(model), "_parallel_config", None)
            if config is None:
                raise RuntimeError(f"a context-parallel attention call of {model}, which has no diffusers parallel "
                                   "config")
            configs[model] = config
        return configs[model]

    def dispatch_attention_fn(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        """Replacement for diffusers' ``dispatch_attention_fn``: BSHD in, BSHD out."""
        patch = self.patch
        if torch.compiler.is_compiling():
            if attention_kwargs or backend is not None:
                raise UnsupportedCall("under torch.compile the patch routes attention calls without "
                                      "attention_kwargs or a named diffusers backend (got "
                                      f"{'attention_kwargs' if attention_kwargs else 'backend'})")
            # a context-parallel call (diffusers' Ulysses / ring template around our kernel) is one op as well: its
            # collectives run eagerly inside it (op_call); the config is the model's, found there
            return patch.compiled_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                       mode=self.mode, parallel=parallel_config is not None)
        if patch.passthrough:
            return self._pass_through(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                      attention_kwargs, backend, parallel_config)
        if attention_kwargs:
            raise UnsupportedCall(f"backend '{patch.backend.name}' got attention_kwargs {sorted(attention_kwargs)}")
        if parallel_config is not None:
            cp = parallel_config.context_parallel_config
            chunks = getattr(cp, "vdbench_head_chunks", 1)
            if chunks > 1 and cp.ring_degree == 1 and can_overlap(query, key, value, attn_mask, cp.ulysses_degree,
                                                                  chunks):
                return self._overlapped(query, key, value, dropout_p, is_causal, scale, enable_gqa, cp, chunks)
            # diffusers context parallelism: its own Ulysses / ring / unified templates run, with our kernel as the
            # forward op (what a registered diffusers backend does); ring asks it for the log-sum-exp.
            return self._cp_template()(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False,
                forward_op=self.cp_forward_op, backward_op=None, _parallel_config=parallel_config)
        return self._serve_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def _serve_bshd(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, tag="",
                    need_lse=False):
        """The patch's ``serve`` (BHSD) on diffusers' BSHD tensors: BSHD out (+ LSE (B, S, H) with ``need_lse``)."""
        out = self.patch.serve(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                               dropout_p, is_causal, scale, enable_gqa, need_lse=need_lse, tag=tag)
        if need_lse:
            out, lse = out
            return out.transpose(1, 2), lse.transpose(1, 2)
        return out.transpose(1, 2)

    def _overlapped(self, query, key, value, dropout_p, is_causal, scale, enable_gqa, cp, chunks):
        """Ulysses with the all-to-all beside the attention, in ``chunks`` head chunks (vdbench.patching.ulysses);
        each chunk's kernel call is labelled with the path (``@ulysses2/overlap3``)."""
        tag = f"{path_tag(cp.ulysses_degree, 1)}/overlap{chunks}"

        def attend(q, k, v):
            return self._serve_bshd(q, k, v, None, dropout_p, is_causal, scale, enable_gqa, tag=tag)

        return overlapped_ulysses(query, key, value, cp._ulysses_mesh.get_group(), cp.ulysses_degree, chunks, attend)

    def family_call(self, make, plain, proc, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                    rotary_emb=None, **kwargs):
        """A self-attention processor call by the model family's own processor: under context parallelism its
        Ulysses form (:meth:`ulysses_call`, ``make``), on one GPU its plain form (``plain``: given only under
        ``--fused_rope``, whose RoPE it runs in one kernel; the attention through this dispatcher as diffusers'
        processor calls it). ``NotImplemented`` for a call neither covers: diffusers' processor runs as it is."""
        if getattr(proc, "_parallel_config", None) is not None:
            return (NotImplemented if make is None else
                    self.ulysses_call(make, proc, attn, hidden_states, encoder_hidden_states, attention_mask,
                                      rotary_emb, **kwargs))
        if (plain is None or encoder_hidden_states is not None or attention_mask is not None or kwargs
                or getattr(attn, "add_k_proj", None) is not None):
            return NotImplemented

        def attend(q, k, v):
            return self.dispatch_attention_fn(q, k, v, None, 0.0, False, None, False)

        return plain(attn, hidden_states, rotary_emb, attend, rope=self.patch.rope)

    def ulysses_call(self, make, proc, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     rotary_emb=None, **kwargs):
        """A self-attention processor call under ``--ulysses_async``: the model family's processor
        (``Family.ulysses_self_attention``, ``make``) with Q, K and V each sent as it is made, our kernel serving
        the attention (labelled ``@ulysses2/async``). ``NotImplemented`` for a call it doesn't cover (text, a mask,
        B > 1, ring, heads not divisible, the pass-through backend): the processor runs as it is, through
        diffusers' template -- its label says so."""
        config = getattr(proc, "_parallel_config", None)
        cp = None if config is None else config.context_parallel_config
        if (cp is None or not getattr(cp, "vdbench_async", False) or encoder_hidden_states is not None
                or attention_mask is not None or kwargs or hidden_states.shape[0] != 1 or cp.ring_degree != 1
                or attn.heads % cp.ulysses_degree or self.patch.passthrough):
            return NotImplemented
        fp8 = getattr(cp, "vdbench_fp8_exchange", False)
        tag = f"{path_tag(cp.ulysses_degree, 1)}/async{'+fp8' if fp8 else ''}"

        def attend(q, k, v):
            return self._serve_bshd(q, k, v, None, 0.0, False, None, False, tag=tag)

        exchange = (Fp8Exchange if fp8 else UlyssesExchange)(cp._ulysses_mesh.get_group(), cp.ulysses_degree,
                                                             v_per_rank=getattr(cp, "vdbench_v_per_rank", True))
        return make(attn, hidden_states, rotary_emb, exchange, attend, rope=self.patch.rope)

    def _cp_template(self):
        """diffusers' templated context-parallel attention, imported on the first parallel call and kept (an import
        statement in the per-call path costs its lookup at every attention call)."""
        template = getattr(self, "_template", None)
        if template is None:
            from diffusers.models.attention_dispatch import _templated_context_parallel_attention as template

            self._template = template
        return template

    def _pass_through(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      attention_kwargs, backend, parallel_config):
        """The pipeline's own dispatcher call, counted under the diffusers backend that ran it."""
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry, dispatch_attention_fn

        name = backend if backend is not None else _AttentionBackendRegistry.get_active_backend()[0]
        name = getattr(name, "value", str(name))
        label = f"diffusers.{name}"
        if name == "native" and parallel_config is None:
            label += f"[{sdpa_kernel_choice(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p, is_causal, scale, enable_gqa)}]"

        def run():
            return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                         attention_kwargs=attention_kwargs, backend=backend,
                                         parallel_config=parallel_config)

        out = self.patch.timed(run, query)
        self.patch.record(label, query, key, value, out, bshd=True,
                          args=call_args(attn_mask, dropout_p, is_causal, scale))
        return out

    def cp_forward_op(self, ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        """diffusers' context-parallel forward op: BSHD in, BSHD out (+ LSE (B, S, H) when asked)."""
        cp = _parallel_config.context_parallel_config if _parallel_config is not None else None
        tag = path_tag(cp.ulysses_degree, cp.ring_degree) if cp is not None else ""
        return self._serve_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, tag=tag,
                                need_lse=return_lse)
