"""One decoder-only transformer that covers every supported family.

The families differ only in a handful of switches (norm kind, positional scheme, MLP shape, biases, q/k norm,
sliding windows, soft-capping, extra norms), so one module with a ModelArgs describes them all; each module in
``models.families`` translates its HF config and renames its checkpoint tensors to our parameter names.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx.experimental._config as fx_config  # backed_size_oblivious (compile_decode)
import torch.nn as nn

from specdecode.layers import kernels
from specdecode.layers.activation import get_activation
from specdecode.layers.attention import Attention, ForwardBatch
from specdecode.layers.linear import Linear, row_invariant
from specdecode.layers.moe import MoEArgs, SparseMoE
from specdecode.layers.norm import LayerNorm, RMSNorm
from specdecode.layers.rotary import Rotary, apply_rotary


@dataclass
class ModelArgs:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm: str = "rms"               # "rms" | "layer"
    norm_eps: float = 1e-6
    positions: str = "rope"         # "rope" | "learned"
    position_offset: int = 0        # OPT stores learned positions shifted by 2
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    gated_mlp: bool = True
    activation: str = "silu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Gemma's switches (models.families.gemma); the defaults leave every other family as it was.
    sliding_window: int | None = None       # keys a sliding layer's query sees, itself included
    sliding_layers: tuple[bool, ...] = ()   # per layer: attends within sliding_window (empty: no layer does)
    local_rope_theta: float | None = None   # RoPE base of the sliding layers, where it differs (Gemma 3)
    attn_scale: float | None = None         # query scale; None: head_dim ** -0.5
    attn_softcap: float | None = None       # scores -> tanh(scores / cap) * cap before the softmax
    final_softcap: float | None = None      # the same on the logits
    embed_scale: float | None = None        # embeddings times this, rounded to their dtype
    sandwich_norms: bool = False            # also norm the attention and MLP outputs before the residual add
    # Phi-3, Granite and OLMo 2's switches (models.families.phi3 / granite / olmo2); the defaults change nothing.
    rotary_dim: int | None = None           # leading dims of each head RoPE rotates (partial rotary); None: all
    residual_scale: float | None = None     # attention and MLP outputs times this before the residual add
    logit_divisor: float | None = None      # logits divided by this (Granite's logits_scaling)
    pre_norms: bool = True                  # norm before attention and MLP (False: OLMo 2, only after them)
    qk_norm_whole: bool = False             # q/k norm over the whole projection, not per head (OLMo 2)
    moe: MoEArgs | None = None              # mixtures of experts (layers.moe): the MLP of its sparse layers


def _scales(cache, i: int) -> dict:
    """Layer i's int8 scales for kernels.LayerStack (key_scales / value_scales), none for a float cache."""
    scales = cache.scales(i)
    return {} if scales is None else {"key_scales": scales[0], "value_scales": scales[1]}


def _rows_dynamic(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mark the row dimension (only that one) as dynamic for torch.compile: one graph for any row count."""
    for t in ts:
        torch._dynamo.mark_dynamic(t, 0)
    return ts


class Block(nn.Module):
    def __init__(self, a: ModelArgs, index: int = 0):
        super().__init__()
        Norm = RMSNorm if a.norm == "rms" else LayerNorm
        h, d = a.hidden_size, a.head_dim
        self.a = a
        self.sliding = bool(a.sliding_layers) and a.sliding_layers[index]
        if a.pre_norms:
            self.attn_norm, self.mlp_norm = Norm(h, a.norm_eps), Norm(h, a.norm_eps)
        if a.sandwich_norms:
            self.post_attn_norm, self.post_mlp_norm = Norm(h, a.norm_eps), Norm(h, a.norm_eps)
        self.q_proj = Linear(h, a.num_heads * d, a.qkv_bias)
        self.k_proj = Linear(h, a.num_kv_heads * d, a.qkv_bias)
        self.v_proj = Linear(h, a.num_kv_heads * d, a.qkv_bias)
        self.o_proj = Linear(a.num_heads * d, h, a.out_bias)
        if a.qk_norm:
            qd, kd = (a.num_heads * d, a.num_kv_heads * d) if a.qk_norm_whole else (d, d)
            self.q_norm, self.k_norm = RMSNorm(qd, a.norm_eps), RMSNorm(kd, a.norm_eps)
        self.attn = Attention(a.num_heads, a.num_kv_heads, d, a.attn_scale or d ** -0.5,
                              a.sliding_window if self.sliding else None, a.attn_softcap)
        self.moe = SparseMoE(h, a.moe, a.activation) if a.moe is not None and a.moe.is_sparse(index) else None
        if self.moe is None:
            if a.gated_mlp:
                self.gate_proj = Linear(h, a.intermediate_size, a.mlp_bias)
            self.up_proj = Linear(h, a.intermediate_size, a.mlp_bias)
            self.down_proj = Linear(a.intermediate_size, h, a.mlp_bias)
        self.act = get_activation(a.activation)
        self.qkv_proj: Linear | None = None      # set by fuse_projections()
        self.gate_up_proj: Linear | None = None

    def fuse_projections(self) -> None:
        """Concatenate q/k/v (and gate/up) into one linear each: one kernel call (and one activation
        quantization) instead of three. Each output channel is still computed on its own, so the values
        are bitwise those of the separate projections. The loader calls this after loading the weights
        under their checkpoint names; forward() runs on the fused layout only."""
        self.qkv_proj = Linear.concat([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj
        if self.moe is not None:
            self.moe.fuse_projections()
        elif self.a.gated_mlp:
            self.gate_up_proj = Linear.concat([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def _qkv(self, y: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        """q [N, H, D], k and v [N, KV, D], with the rotary embedding applied to q and k."""
        a, n = self.a, y.shape[0]
        H, KV, D = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self.qkv_proj(y)
        v = qkv[:, (H + KV) * D:].reshape(n, KV, D)
        if not a.qk_norm:
            qk = qkv[:, :(H + KV) * D].reshape(n, H + KV, D)
            if rope is not None:  # q and k side by side: one elementwise pass for both
                qk = apply_rotary(qk, *rope)
            return qk[:, :H], qk[:, H:], v
        q, k = qkv[:, :H * D], qkv[:, H * D:(H + KV) * D]
        if a.qk_norm_whole:  # OLMo 2: before the split into heads
            q, k = self.q_norm(q).reshape(n, H, D), self.k_norm(k).reshape(n, KV, D)
        else:
            q, k = self.q_norm(q.reshape(n, H, D)), self.k_norm(k.reshape(n, KV, D))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return q, k, v

    def forward(self, x: torch.Tensor, b: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        return self.after_attention(x, self.attn(*self.before_attention(x, rope), b))

    # The layer in two pieces around the attention call, which reads the cache per request and stays eager;
    # CausalLM.compile_decode compiles these two.
    def before_attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        return self._qkv(self.attn_norm(x) if self.a.pre_norms else x, rope)

    def _residual(self, x: torch.Tensor, out: torch.Tensor, post_norm: str) -> torch.Tensor:
        a = self.a
        if a.sandwich_norms:
            out = getattr(self, post_norm)(out)
        if a.residual_scale is not None:  # Granite: HF's residual + out * multiplier
            out = out * a.residual_scale
        return x + out

    def after_attention(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        a = self.a
        x = self._residual(x, self.o_proj(att), "post_attn_norm")
        y = self.mlp_norm(x) if a.pre_norms else x
        if self.moe is not None:
            out = self.moe(y)
        elif a.gated_mlp:
            gate, up = self.gate_up_proj(y).chunk(2, dim=-1)
            out = self.down_proj(self.act(gate) * up)
        else:
            out = self.down_proj(self.act(self.up_proj(y)))
        return self._residual(x, out, "post_mlp_norm")


class CausalLM(nn.Module):
    def __init__(self, a: ModelArgs, max_model_len: int):
        super().__init__()
        if a.sliding_window is not None and a.sliding_window >= max_model_len and a.local_rope_theta is None:
            # A window as long as the context never binds (Mistral 7B v0.1: 4096): full attention, exactly, which
            # keeps the model on the C++ layer stack where it otherwise fits.
            a = replace(a, sliding_window=None, sliding_layers=())
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = self.local_rotary = None
        if a.positions == "learned":
            self.embed_positions = nn.Embedding(a.max_position_embeddings + a.position_offset, a.hidden_size)
            self.embed_positions.weight.requires_grad_(False)
        else:
            self.rotary = Rotary(a.rotary_dim or a.head_dim, max(max_model_len, 1), a.rope_theta, a.rope_scaling)
            if a.local_rope_theta is not None:  # Gemma 3's sliding layers: their own base, no scaling
                self.local_rotary = Rotary(a.head_dim, max(max_model_len, 1), a.local_rope_theta, None)
        self.layers = nn.ModuleList(Block(a, i) for i in range(a.num_layers))
        self.norm = (RMSNorm if a.norm == "rms" else LayerNorm)(a.hidden_size, a.norm_eps)
        self.lm_head = Linear(a.hidden_size, a.vocab_size, False)
        # Decode / verification rows run all layers in one C++ call where the model allows it (_layer_stack).
        self.fused_layers = True
        self._stack: tuple[list, kernels.LayerStack | None] | None = None
        self._compiled: tuple | None = None  # compile_decode()

    def param_count(self) -> int:
        n = sum(p.numel() for p in self.parameters())
        n += sum(m.packed.out_features * m.packed.in_features for m in self.modules()
                 if isinstance(m, Linear) and m.weight is None and m.packed is not None)
        return n

    def stack_family(self) -> bool:
        """Whether this architecture fits the C++ layer stack (llama-style: RMSNorm, rotary, gated SiLU, full
        causal attention at head_dim ** -0.5, nothing Gemma adds). Other models run the Python layers."""
        a = self.args
        return (a.norm == "rms" and self.rotary is not None and a.gated_mlp and a.activation in ("silu", "swish")
                and not a.sliding_layers and self.local_rotary is None and a.attn_scale is None
                and a.attn_softcap is None and a.final_softcap is None and a.embed_scale is None
                and not a.sandwich_norms and a.rotary_dim in (None, a.head_dim) and a.residual_scale is None
                and a.logit_divisor is None and a.pre_norms and not a.qk_norm_whole and a.moe is None)

    def _layer_stack(self) -> kernels.LayerStack | None:
        """The layers as one C++ call for decode / verification rows (kernels.LayerStack), or None where that
        path does not apply: other families, non-CPU or non-float32 models, or no compiled kernel. Rebuilt
        when the KV cache or the weights are replaced."""
        a, first = self.args, self.layers[0] if len(self.layers) else None
        cache = first.attn.kv_cache if first is not None else None
        if (not self.fused_layers or cache is None or not self.stack_family()
                or self.embed_tokens.weight.dtype != torch.float32 or not kernels.kernel_available()):
            return None
        if self._stack is not None and all(d.get(name) is obj for d, name, obj in self._stack[0]):
            return self._stack[1]
        checks, stack = self._stack_checks(), None
        lins = [(L.qkv_proj, L.o_proj, L.gate_up_proj, L.down_proj) for L in self.layers]
        if (all(m is not None and m.packed is not None and m.packed.device.type == "cpu" for ls in lins for m in ls)
                and cache.device.type == "cpu" and cache.dtype in kernels.KV_DTYPES
                and all(L.attn.kv_cache is cache and L.attn.layer_index == i for i, L in enumerate(self.layers))
                and self.rotary.cos.shape[0] >= cache.max_model_len
                and all(t.dtype == torch.float32 for L in self.layers for t in (L.attn_norm.weight, L.mlp_norm.weight))):
            stack = kernels.LayerStack(
                [dict(attn_norm=L.attn_norm.weight, mlp_norm=L.mlp_norm.weight,
                      q_norm=L.q_norm.weight if a.qk_norm else None, k_norm=L.k_norm.weight if a.qk_norm else None,
                      keys=cache.layer(i)[0], values=cache.layer(i)[1],
                      **_scales(cache, i),
                      qkv=(L.qkv_proj.packed, L.qkv_proj.bias), o=(L.o_proj.packed, L.o_proj.bias),
                      gate_up=(L.gate_up_proj.packed, L.gate_up_proj.bias),
                      down=(L.down_proj.packed, L.down_proj.bias)) for i, L in enumerate(self.layers)],
                hidden=a.hidden_size, heads=a.num_heads, kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                intermediate=a.intermediate_size, eps=a.norm_eps, scale=a.head_dim ** -0.5,
                cos=self.rotary.cos, sin_signed=self.rotary.sin_signed, block_table=cache.block_table,
                max_len=cache.max_model_len)
        self._stack = (checks, stack)
        return stack

    def _stack_checks(self) -> list[tuple[dict, str, Any]]:
        """(dict, name, object) for every cache and linear the C++ stack reads through raw pointers: the
        stack stays valid while each dict still holds the same object. Checked on every decode pass, so
        it reads the modules' own dicts (a tuple of ids through nn.Module attribute lookups took 0.15 ms,
        2% of a draft step)."""
        out = []
        for L in self.layers:
            attn, mods = L.attn.__dict__, L._modules
            out += [(attn, n, attn.get(n)) for n in ("kv_cache", "layer_index")]
            for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                lin = mods.get(n)
                out.append((mods, n, lin))
                if lin is not None:
                    out.append((lin.__dict__, "packed", lin.__dict__.get("packed")))
        return out

    def compile_decode(self) -> None:
        """torch.compile the layers for decode / verification rows where they run in Python (CUDA, or a
        model the C++ stack does not cover): each layer is compiled in two pieces around its attention call,
        with dynamic row counts, and the CPU linears stay opaque calls of the row-invariant kernel
        (kernels.rowinv_linear_op). Prefill stays eager."""
        self._compiled = (torch.compile(Block.before_attention), torch.compile(Block.after_attention))

    @torch.inference_mode()
    def forward(self, b: ForwardBatch) -> torch.Tensor:
        """Returns logits [len(b.logits_rows), vocab] in float32."""
        # Prefill rows too: a prompt's keys and values must not depend on how it was split into chunks or
        # which of its blocks came from the prefix cache (engine.block_pool).
        with row_invariant(True):
            x = self.embed_tokens(b.input_ids)
            if self.args.embed_scale is not None:  # HF rounds the scale to the embeddings' dtype first
                x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype)
            # Where the C++ stack runs the layers, prompt rows take it too: every position is then computed
            # exactly as a decode row is, so blocks written by decoding (a chat's previous answer) and chunks
            # that start inside a block are shared bitwise. Its prefill costs about what the Python path's does.
            stack = self._layer_stack()
            if stack is not None:
                x = stack(x.contiguous(), b.positions, b.slots)
            else:
                if self.rotary is None:
                    x = x + self.embed_positions(b.positions + self.args.position_offset)
                    rope = local = None
                else:
                    rope = self.rotary.table(b.positions, x.dtype)
                    local = self.local_rotary.table(b.positions, x.dtype) if self.local_rotary else rope
                if self._compiled is not None and not b.prefill:
                    before, after = self._compiled
                    # Size-1 inputs would otherwise get a graph of their own, which could round differently
                    # from the multi-row one; one graph for every row count keeps decode and verification
                    # rows identical.
                    with fx_config.patch(backed_size_oblivious=True):
                        _rows_dynamic(*(rope or ()), *(local if local is not rope else ()))
                        for layer in self.layers:
                            att = layer.attn(*before(layer, _rows_dynamic(x)[0], local if layer.sliding else rope), b)
                            x = after(layer, x, _rows_dynamic(att)[0])
                else:
                    for layer in self.layers:
                        x = layer(x, b, local if layer.sliding else rope)
            x = self.norm(x[b.logits_rows])
            # The logits row is always computed by the row-invariant path, also after prefill.
            with row_invariant(True):
                logits = self.lm_head(x)
            if self.args.logit_divisor is not None:  # Granite: HF divides (not multiplies by the inverse)
                logits = logits / self.args.logit_divisor
            cap = self.args.final_softcap
            if cap is not None:  # elementwise: a row's values do not depend on the other rows
                # -inf (ids a truncated draft head cannot propose) stays -inf rather than becoming -cap
                logits = torch.where(logits == float("-inf"), logits, torch.tanh(logits / cap) * cap)
            return logits.float()
